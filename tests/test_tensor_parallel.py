"""Tensor parallelism on the CPU: two ranks (gloo) of a model sharded by transformers' ``tp_plan="auto"``, each
holding one of the tiny models' two KV heads, decode exactly what the unsharded model decodes.

Each test starts ``torch.distributed.run --nproc-per-node 2 tests/tensor_parallel_worker.py`` (transformers creates
the process group and the CPU device mesh itself) and compares, per budget (a sparse one and one covering the
context): greedy tokens equal, every step's logits and a plain forward's logits within 1e-5 (fp32), each rank's
NosaCache holding one KV head, and the ranks' blocks loaded and bytes moved summing to the unsharded cache's (the
selection is per KV head, so the ranks split it exactly). Two routes: ``to_nosa`` on a stock model loaded with
``tp_plan`` (generating on a NosaCache passed in), and an exported NOSA checkpoint loaded with ``tp_plan`` and
``trust_remote_code`` (generating with ``cache_implementation="nosa"``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_nosa
from hf_nosa.modeling.attention import EvictionHead
from hf_nosa.hub import export
from hf_nosa.modeling import eviction_heads, randomize_eviction_heads
from hf_nosa.modeling.tensor_parallel import shard_eviction_heads

from .conftest import SPARSE, small_nosa_config, tiny_model
from .test_hub import fresh_env

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = "tests.tensor_parallel_worker"
PROMPT, NEW, SEED = 200, 4, 7
VOCAB = 96  # transformers 5.17 shards lm_head only when the vocabulary divides by the TP size (5.25 need not)
# chunks of 64 tokens: QUOKA's chunked prefill selects too; 256 tokens cover the 204 the cache will hold
CASES = {"sparse": dict(SPARSE, prefill_chunk_size=64), "full": dict(budget_tokens=256, prefill_chunk_size=64)}
ADDITIVE_STATS = ("blocks_loaded", "bytes_to_device", "host_bytes", "full_kv_bytes", "device_kv_bytes")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def nosa_reference(family: str, folder: Path, path: str, nosa: dict) -> torch.nn.Module:
    """The unsharded NOSA model; saves what the ranks load (a stock model, or the NOSA model exported)."""
    model = tiny_model(family, seed=0, vocab_size=VOCAB)
    if path == "to_nosa":
        model.save_pretrained(folder)
    hf_nosa.to_nosa(model, hf_nosa.NosaConfig.from_dict(nosa))
    randomize_eviction_heads(model, scale=2.0, generator=torch.Generator().manual_seed(SEED))
    if path == "checkpoint":
        export(model, folder)
    return model


def test_unsharded_model_keeps_whole_eviction_heads():
    model = hf_nosa.to_nosa(tiny_model("llama"), small_nosa_config())
    assert shard_eviction_heads(model) == 0
    assert all(head.tensor_parallel is None for head in eviction_heads(model).values())


def test_eviction_head_names_values_of_another_width():
    """A model sharded after its conversion (to_nosa not run again on the ranks) fails by name, not in a matmul."""
    head = EvictionHead(kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"delta reads Hk \* D = 32 .*hf_nosa.to_nosa\(model\)"):
        head(torch.zeros(1, 3, 16))


def run_ranks(spec: dict, tmp_path: Path) -> list[dict]:
    env = fresh_env(tmp_path)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # CPU ranks, gloo, whatever the machine has
    if os.environ.get("PYTHONPATH"):  # the ranks import what this process imports (e.g. another transformers)
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    # as a module from the repository root: a script's folder (tests/) would put tests/kernels before the kernels
    # package transformers imports
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", WORKER,
           json.dumps(spec)]
    result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return torch.load(spec["out"], weights_only=False)


@pytest.mark.parametrize("path", ["to_nosa", "checkpoint"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sharded_decode_equals_unsharded(family, path, tmp_path):
    cases = {name: small_nosa_config(**fields).to_dict() for name, fields in CASES.items()}
    model = nosa_reference(family, tmp_path / "model", path, cases["sparse"])
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    spec = dict(folder=str(tmp_path / "model"), path=path, nosa=cases["sparse"], seed=SEED, cases=cases,
                prompt=ids[0].tolist(), new=NEW, cache="nosa" if path == "checkpoint" else "explicit",
                out=str(tmp_path / "ranks.pt"))
    ranks = run_ranks(spec, tmp_path)

    if path == "checkpoint":  # the checkpoint's own remote-code class, as a Hub user gets it
        assert all(r["model_class"].startswith("transformers_modules.") for r in ranks), ranks[0]["model_class"]
    kv_heads = model.config.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    assert [r["shards"] for r in ranks] == [{i: (0, 1) for i in range(2)}, {i: (1, 2) for i in range(2)}]
    assert all(r["v_proj_rows"] == head_dim * kv_heads // 2 for r in ranks)
    with torch.no_grad():
        forward = model(ids).logits
        for r in ranks:
            torch.testing.assert_close(r["forward_logits"], forward, atol=1e-5, rtol=0)
        logits = {}
        for name, fields in cases.items():
            cache = hf_nosa.NosaCache(model.config, hf_nosa.NosaConfig.from_dict(fields))
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, past_key_values=cache, return_dict_in_generate=True,
                                 output_logits=True)
            stats = cache.stats()
            assert stats["decode_steps"] == NEW - 1 and stats["blocks_loaded"] > 0, stats  # fetched from the host
            logits[name] = torch.stack(out.logits, 1)
            for r in ranks:
                got = r[name]
                assert torch.equal(got["tokens"], out.sequences), (name, r["rank"])
                torch.testing.assert_close(got["logits"], logits[name], atol=1e-5, rtol=0)
                assert got["kv_heads"] == 1 and got["slot_k"][1] == 1  # this rank's KV head only
                assert got["stats"]["seen_tokens"] == stats["seen_tokens"]
            for key in ADDITIVE_STATS:  # per KV head: the ranks split the unsharded cache's work exactly
                assert sum(r[name]["stats"][key] for r in ranks) == stats[key], (name, key)
    # the sparse budget bites: selection and the eviction heads change what is attended, so the answer
    assert (logits["sparse"] - logits["full"]).abs().max() > 1e-3


def test_continuous_batching_sharded_equals_generate_alone(tmp_path):
    """transformers' continuous batching (``hf_nosa.serving``) on two ranks, rank 0 scheduling: prompts of 40, 150
    and 300 tokens under a 128-token step, at a sparse budget, each get the tokens unsharded ``generate`` gives them
    alone."""
    try:
        import hf_nosa.serving.manager  # noqa: F401
    except ImportError as error:  # transformers before 5.18 lacks what the serving path builds on
        pytest.skip(f"hf_nosa.serving does not import here: {error}")
    nosa = small_nosa_config(**CASES["sparse"]).to_dict()
    model = nosa_reference("llama", tmp_path / "model", "to_nosa", nosa)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (40, 150, 300)]
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=-1,
                                   pad_token_id=0, cache_implementation="nosa")[0, len(p):].tolist() for p in prompts]
    spec = dict(folder=str(tmp_path / "model"), path="to_nosa", nosa=nosa, seed=SEED, cases={},
                prompt=prompts[0], new=NEW, cache="explicit", out=str(tmp_path / "ranks.pt"),
                serving=dict(prompts=prompts, new=8, max_batch_tokens=128))
    ranks = run_ranks(spec, tmp_path)
    assert [r["serving"]["tokens"] for r in ranks] == [expected, expected]
    assert [r["serving"]["decode_rows"] for r in ranks] == [3, 3]  # the caller's rows survive the ranks' agreement


@pytest.mark.slow
def test_the_tensor_parallel_benchmark_runs_on_two_cpu_ranks(tmp_path):
    """benchmarks/tensor_parallel.py (the GPU run of 1 GPU against 2) at the smoke shape on two gloo ranks: generate
    at two batches and continuous batching, every request answered."""
    env = fresh_env(tmp_path)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "benchmarks/tensor_parallel.py", "--shape", "smoke", "--context", "200", "--new-tokens", "3",
           "--batches", "1", "2", "--requests", "3", "--max-batch-tokens", "128", "--folder", str(tmp_path / "ckpt"),
           "--out", str(out)]
    result = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and [row["batch"] for row in report["generate"]] == [1, 2]
    assert all({"first_token_s", "total_s", "decode_tok_s"} <= set(row) for row in report["generate"])  # no timing
    served = report["continuous_batching"]
    assert served["errors"] == [] and served["generated_tokens"] == 3 * 3
