"""NOSA under transformers' continuous batching (``hf_nosa.serving``): generate_batch and the manager's add / cancel /
stream give each request the tokens of NOSA ``generate`` on it alone, at a sparse budget, with prompts split across
steps and interleaved with other requests' decoding; at a budget covering the context they equal stock continuous
batching; admission counts host memory, and a request that cannot fit is refused while the others finish."""

import gc
import time
import weakref

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_nosa import to_nosa
from hf_nosa.modeling import randomize_eviction_heads
from hf_nosa.serving import MIN_TRANSFORMERS

if Version(Version(transformers.__version__).base_version) < MIN_TRANSFORMERS:  # the GPU machine's 5.17
    pytest.skip(f"serving needs transformers >= {MIN_TRANSFORMERS}", allow_module_level=True)

from hf_nosa.serving import ServingBudget, enable, init_continuous_batching  # noqa: E402
from hf_nosa.serving.attention import chunk_edges  # noqa: E402

from .conftest import SPARSE, small_nosa_config, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 12
CHUNK = 64  # QUOKA's chunks; max_batch_tokens below splits the longer prompts across steps


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def _sparse_model(family, seed=0):
    model = to_nosa(tiny_model(family, seed=seed), small_nosa_config(**SPARSE, prefill_chunk_size=CHUNK))
    return randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 1))


def _generation_config(new_tokens=NEW_TOKENS):
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _alone(model, prompt, new_tokens=NEW_TOKENS):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                         pad_token_id=0, cache_implementation="nosa")
    return out[0, len(prompt):].tolist()


def _record_plans(model):
    """The plan of every step, as layer 0 sees it."""
    plans = []

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        plans.append([entry for entry in cache.nosa_requests.plan if entry[2] > 0])

    model.model.layers[0].self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return plans


def test_chunk_edges_follow_the_grid_from_the_first_token():
    assert chunk_edges(0, 150, 150, 64, whole=False) == [(0, 64), (64, 128), (128, 150)]
    assert chunk_edges(64, 86, 150, 64, whole=False) == [(0, 64), (64, 86)]
    assert chunk_edges(0, 150, 150, 64, whole=True) == [(0, 150)]
    assert chunk_edges(150, 1, 150, 64, whole=False) == [(0, 1)]  # decoding


def test_generate_batch_equals_generate_alone_at_a_sparse_budget(family):
    """Prompts of 40, 150 and 300 tokens under a 128-token step: the long ones arrive in chunk-aligned pieces beside
    the others' decode tokens, and each request gets the tokens NOSA generate gives it alone."""
    model = _sparse_model(family)
    prompts = _prompts((40, 150, 300))
    expected = [_alone(model, p) for p in prompts]
    enable(model)
    plans = _record_plans(model)
    out = model.generate_batch(prompts, generation_config=_generation_config(),
                               continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128))
    assert model.config._attn_implementation == "sdpa"  # the session's "nosa_paged" is switched back
    got = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert all(out[f"req_{i}"].error is None for i in range(len(prompts)))
    assert got == expected
    pieces = [(rid, past, n) for plan in plans for rid, past, n in plan if n > 1]
    assert any(past > 0 for _, past, _ in pieces), "a prompt should have been split across steps"
    assert all(past % CHUNK == 0 for _, past, _ in pieces), pieces  # every piece starts on the chunk grid
    assert any(len(plan) > 1 and any(n == 1 for _, _, n in plan) and any(n > 1 for _, _, n in plan) for plan in plans)


def test_the_prefill_first_scheduler_keeps_the_grid_and_the_answers():
    model = _sparse_model("qwen2", seed=13)
    prompts = _prompts((200, 70, 330), seed=13)
    expected = [_alone(model, p) for p in prompts]
    enable(model)
    plans = _record_plans(model)
    config = ContinuousBatchingConfig(max_batch_tokens=128, scheduler_type="prefill_first")
    out = model.generate_batch(prompts, generation_config=_generation_config(), continuous_batching_config=config)
    assert [out[f"req_{i}"].generated_tokens for i in range(len(prompts))] == expected
    assert all(past % CHUNK == 0 for plan in plans for _, past, n in plan if n > 1)


def test_the_default_step_carries_whole_chunks_beside_its_decode_tokens(monkeypatch):
    """With ``max_batch_tokens`` left unset a step holds transformers' default in whole chunks plus a token per
    decode row, so a prompt arriving while others decode still takes whole chunks of that default each step (cut at
    the default alone, the grid would leave a chunk's worth of every such step unused); the answers stay those of
    generate alone."""
    from hf_nosa.serving import manager as serving_manager

    monkeypatch.setattr(serving_manager, "DEFAULT_MAX_BATCH_TOKENS", 4 * CHUNK)  # small enough to fill here
    model = _sparse_model("llama", seed=17)
    prompts = _prompts((40, 60, 700), seed=17)
    expected = [_alone(model, p) for p in prompts]
    enable(model, budget=ServingBudget(decode_rows=3))
    plans = _record_plans(model)
    out = model.generate_batch(prompts, generation_config=_generation_config(), persistent_manager=True)
    try:
        assert model._cached_continuous_batching_manager.continuous_batching_config.max_batch_tokens == 4 * CHUNK + 3
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert [out[f"req_{i}"].generated_tokens for i in range(len(prompts))] == expected
    # steps where the long prompt went on beside decode tokens: four whole chunks of it in each, but its last piece
    mixed = [plan for plan in plans if any(n == 1 for _, _, n in plan) and any(n > 1 for _, _, n in plan)]
    pieces = [n for plan in mixed for rid, past, n in plan if n > 1 and past + n < 700]
    assert pieces and all(n == 4 * CHUNK for n in pieces), pieces


def test_a_persistent_manager_serves_a_second_batch_from_empty_caches():
    model = enable(_sparse_model("llama", seed=15))
    prompts = _prompts((45, 160), seed=15)
    expected = [_alone(model, p) for p in prompts]
    config = ContinuousBatchingConfig(max_batch_tokens=128)
    try:
        first = model.generate_batch(prompts, generation_config=_generation_config(),
                                     continuous_batching_config=config, persistent_manager=True)
        manager = model._cached_continuous_batching_manager
        assert manager.nosa_requests.entries == {} and manager.nosa_requests.host_reserved == 0
        pool = manager.nosa_requests.host_pool
        allocated = pool.allocated_bytes
        assert allocated > 0 and pool.held == {} and pool.free_bytes() == allocated  # every store given back
        second = model.generate_batch(prompts[::-1], generation_config=_generation_config(),
                                      continuous_batching_config=config, persistent_manager=True)
        assert model._cached_continuous_batching_manager is manager
        assert pool.allocated_bytes == allocated  # the second batch's host stores are the first's, reused
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert [first["req_0"].generated_tokens, first["req_1"].generated_tokens] == expected
    assert [second["req_3"].generated_tokens, second["req_2"].generated_tokens] == expected


def test_what_serving_does_not_take_yet_is_refused_by_name():
    model = _sparse_model("llama", seed=14)
    config = _generation_config()
    config.num_return_sequences = 2
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        init_continuous_batching(model, config)
    with pytest.raises(ValueError, match="max_batch_tokens=32 is smaller than NosaConfig.prefill_chunk_size=64"):
        init_continuous_batching(model, _generation_config(), ContinuousBatchingConfig(max_batch_tokens=32))
    with pytest.raises(ValueError, match="needs a NOSA model"):
        enable(tiny_model("llama"))


def test_full_budget_equals_stock_continuous_batching(family):
    """A budget covering every context and fresh eviction heads (A = 0): the tokens of stock continuous batching."""
    prompts = _prompts((30, 90, 200), seed=3)
    config = ContinuousBatchingConfig(max_batch_tokens=128, num_blocks=64)
    stock = tiny_model(family, seed=4).generate_batch(prompts, generation_config=_generation_config(),
                                                      continuous_batching_config=config)
    model = enable(to_nosa(tiny_model(family, seed=4), small_nosa_config(budget_tokens=512, prefill_chunk_size=CHUNK)))
    nosa = model.generate_batch(prompts, generation_config=_generation_config(), continuous_batching_config=config)
    for i in range(len(prompts)):
        assert nosa[f"req_{i}"].generated_tokens == stock[f"req_{i}"].generated_tokens


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the manager did not get there in time")
        time.sleep(0.01)


def test_requests_join_while_others_decode_and_a_cancelled_one_frees_its_caches():
    """add_request while another request decodes (streamed), then a cancel: the others equal generate alone, the
    cancelled one's host reservation and NosaCache are gone at once, and nothing is held at the end."""
    model = _sparse_model("llama", seed=5)
    long_run = 40
    first, second, cancelled = _prompts((100, 170, 260), seed=6)
    expected_first = _alone(model, first, long_run)
    expected_second = _alone(model, second)
    manager = init_continuous_batching(model, _generation_config(),
                                       ContinuousBatchingConfig(max_batch_tokens=128, num_blocks=64))
    requests = manager.nosa_requests
    manager.start()
    try:
        manager.add_request(first, request_id="first", max_new_tokens=long_run, streaming=True)
        streamed = []
        for output in manager.request_id_iter("first"):
            streamed.append(list(output.generated_tokens))
            if len(output.generated_tokens) >= 3:
                break
        manager.add_request(second, request_id="second")
        manager.add_request(cancelled, request_id="cancelled", max_new_tokens=200)
        _wait_for(lambda: "cancelled" in requests.entries and requests.entries["cancelled"].cache is not None)
        held = requests.host_reserved
        cache = weakref.ref(requests.entries["cancelled"].cache)
        manager.cancel_request("cancelled")
        _wait_for(lambda: "cancelled" not in requests.entries)
        assert requests.host_reserved < held
        gc.collect()
        assert cache() is None  # its host store, compressed keys and slot pool with it
        results = {}
        _wait_for(lambda: results.update({r.request_id: r for r in [manager.get_result(timeout=0.05)] if r
                                          and r.is_finished()}) or {"first", "second"} <= set(results), timeout=60)
    finally:
        manager.stop(block=True, timeout=10)
    assert streamed[0] and all(a == b[:len(a)] for a, b in zip(streamed, streamed[1:]))
    assert results["first"].generated_tokens == expected_first
    assert results["second"].generated_tokens == expected_second
    assert requests.entries == {} and requests.host_reserved == 0
    assert requests.device_in_use() == requests.rows.bank_bytes()  # no request holds buffers of its own


def test_a_request_too_big_for_the_host_budget_is_refused_and_the_others_finish():
    """A host budget that holds one small request at a time: the small ones run one after another (admission counts
    host bytes) and equal generate alone; one that could not fit even alone fails at once with a clear error."""
    model = _sparse_model("qwen2", seed=7)
    small_a, huge, small_b = _prompts((60, 900, 80), seed=8)
    expected = [_alone(model, p) for p in (small_a, small_b)]
    budget = int(1.5 * model_host_bytes(model, 80 + NEW_TOKENS))
    enable(model, budget=ServingBudget(host_bytes=budget))
    plans = _record_plans(model)
    out = model.generate_batch([small_a, huge, small_b], generation_config=_generation_config(),
                               continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128,
                                                                                   num_blocks=64))
    assert out["req_1"].error is not None and "host" in out["req_1"].error and "budget" in out["req_1"].error
    assert out["req_1"].generated_tokens == []
    assert [out["req_0"].generated_tokens, out["req_2"].generated_tokens] == expected
    assert max(len(plan) for plan in plans) == 1  # never two requests admitted at once


def test_a_converted_model_serves_nosa_without_a_call_to_enable():
    """to_nosa binds init_continuous_batching (what generate_batch and transformers serve start from), importing
    hf_nosa.serving on first use: generate_batch runs NOSA, each request as generate gives it alone."""
    model = _sparse_model("llama", seed=9)
    prompts = _prompts((20, 130), seed=9)
    expected = [_alone(model, p) for p in prompts]
    out = model.generate_batch(prompts, generation_config=_generation_config(),
                               continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128))
    assert [out[f"req_{i}"].error for i in range(2)] == [None, None]
    assert [out[f"req_{i}"].generated_tokens for i in range(2)] == expected


def test_transformers_own_manager_on_a_nosa_model_names_enable():
    """transformers' own init_continuous_batching (the binding removed): a clear error, not an AttributeError from
    deep inside the attention."""
    model = _sparse_model("llama", seed=9)
    del model.init_continuous_batching  # the binding to_nosa made: transformers' own method again
    out = model.generate_batch(_prompts((20, 30), seed=9), generation_config=_generation_config(),
                               continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128,
                                                                                   num_blocks=16))
    assert all("hf_nosa.serving.enable(model)" in (output.error or "") for output in out.values()), out


def test_the_ledger_holds_what_the_host_budget_admits():
    """transformers' block ledger is re-sized to the tokens the host budget admits, so it never starves (and makes
    transformers offload or re-prefill) a request the budget took."""
    model = _sparse_model("llama", seed=10)
    budget = ServingBudget(host_bytes=model_host_bytes(model, 10_000))
    manager = init_continuous_batching(model, _generation_config(), ContinuousBatchingConfig(max_batch_tokens=128),
                                       budget=budget)
    cache = manager._create_batch_processor().cache
    assert 10_000 <= cache.max_tokens_read < 10_000 + cache.tokens_per_sector
    assert cache.cache_tensor.numel() < 10_000  # a nominal byte per page and layer: no K/V on the device


def test_the_calls_transformers_serve_makes():
    """``transformers serve`` (5.25, cli/serving/utils.py) starts its manager with
    ``model.init_continuous_batching(continuous_batching_config=..., workload_hints=...)``, per-request processors,
    ``warmup()`` and ``start()``, and reads ``cache.compute_free_capacity()``: the same calls on an enabled model."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = enable(_sparse_model("qwen3", seed=12))
    model.generation_config = _generation_config()
    prompts = _prompts((50, 140), seed=12)
    expected = [_alone(model, p) for p in prompts]
    config = ContinuousBatchingConfig(max_batch_tokens=128)
    config.per_request_processors = True
    manager = model.init_continuous_batching(continuous_batching_config=config,
                                             workload_hints=WorkloadHints(max_prompt_length=4096))
    manager.warmup()
    manager.start()
    try:
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"chat-{i}", max_new_tokens=NEW_TOKENS)
        results = {}
        _wait_for(lambda: results.update({r.request_id: r for r in [manager.get_result(timeout=0.05)] if r
                                          and r.is_finished()}) or len(results) == 2, timeout=60)
        assert 0.0 <= 1 - manager.batch_processor.cache.compute_free_capacity() <= 1.0
    finally:
        manager.stop(block=True, timeout=10)
    assert [results[f"chat-{i}"].generated_tokens for i in range(2)] == expected


def test_a_budget_left_unset_is_read_from_the_host_and_the_device(monkeypatch):
    from hf_nosa.serving import requests

    monkeypatch.setattr(requests, "available_host_memory", lambda: 64 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 << 30)  # 2 GiB cached, free to reuse
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # what "cuda" without an index means
    assert ServingBudget().resolved("cpu") == ServingBudget(host_bytes=64 << 30, device_bytes=None)
    assert ServingBudget().resolved("cuda") == ServingBudget(host_bytes=64 << 30, device_bytes=6 << 30)
    # a per-process cap (24 GB of 80: mem_get_info does not see it) bounds the working sets: (0.1 x 80 - 2) / 2
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.1)
    assert ServingBudget().resolved("cuda") == ServingBudget(host_bytes=64 << 30, device_bytes=3 << 30)
    assert ServingBudget(host_bytes=1, device_bytes=2).resolved("cuda") == ServingBudget(1, 2)
    with pytest.raises(ValueError, match="host_bytes"):
        ServingBudget(host_bytes=0)


def test_an_older_transformers_is_named_with_the_version_serving_needs(monkeypatch):
    import transformers

    import hf_nosa.serving

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ImportError, match=r"transformers >= 5\.18.*found 5\.17\.0"):
        hf_nosa.serving.check_transformers_version()


def model_host_bytes(model, tokens):
    from hf_nosa.serving import RequestCaches

    return RequestCaches(model.config, dtype=model.dtype).host_bytes(tokens)



def test_non_finite_eviction_heads_are_refused_when_serving_starts():
    model = _sparse_model("llama", seed=13)
    with torch.no_grad():
        model.model.layers[1].self_attn.eviction_head.A[0] = float("nan")
    with pytest.raises(ValueError, match="layer 1: eviction_head.A holds NaN or inf"):
        model.generate_batch(_prompts((20,), seed=13), generation_config=_generation_config(),
                             continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128))


def test_an_exported_architecture_is_found_where_transformers_serve_looks(monkeypatch):
    """``transformers serve`` loads a model by ``getattr(transformers, config.architectures[0])``; loading the NOSA
    remote classes names them there, also in a ``transformers`` module object another module still holds (importing a
    model file can put a new one in sys.modules)."""
    import sys
    import types

    from hf_nosa.modeling import remote

    stale = types.ModuleType("transformers")
    holder = types.ModuleType("serving_holder_for_test")
    holder.transformers = stale
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    remote.expose_to_transformers()
    for name in ("NosaLlamaForCausalLM", "NosaQwen2ForCausalLM", "NosaQwen3ForCausalLM", "NosaLlamaConfig"):
        assert getattr(stale, name) is getattr(remote, name)
        assert getattr(sys.modules["transformers"], name) is getattr(remote, name)
    assert sys.modules["transformers"].LlamaForCausalLM is transformers.LlamaForCausalLM  # its own names untouched


@pytest.mark.slow
def test_transformers_serve_answers_with_nosa_on_an_exported_checkpoint(tmp_path):
    """``transformers serve <exported NOSA checkpoint> --trust-remote-code --continuous-batching`` runs: a completion
    equals NOSA generate on that prompt alone (greedy), through hf_nosa's manager."""
    import json
    import os
    import pathlib
    import shutil
    import socket
    import subprocess
    import sys
    import urllib.request

    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.skip("transformers serve needs fastapi, uvicorn and openai (the test extra installs them)")
    cli = pathlib.Path(sys.executable).with_name("transformers")
    if not cli.exists():
        pytest.skip("the transformers command is not installed beside this interpreter")
    folder = tmp_path / "demo"
    shutil.copytree(pathlib.Path(__file__).resolve().parents[1] / "hf_nosa" / "assets" / "demo_model", folder)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    prompt = "The pass key is 18843. Remember it. The grass is green. What is the pass key?"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
    server = subprocess.Popen([str(cli), "serve", str(folder), "--trust-remote-code", "--continuous-batching",
                               "--device", "cpu", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://localhost:{port}"
        for _ in range(600):  # until it answers (it loads the model first), or it exits
            if server.poll() is not None:
                pytest.fail(f"transformers serve exited:\n{server.stdout.read()[-3000:]}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps(dict(model=str(folder), prompt=prompt, max_tokens=12, temperature=0)).encode()
        request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        served = json.load(urllib.request.urlopen(request, timeout=300))["choices"][0]["text"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="nosa")
    assert served == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert type(model.init_continuous_batching()).__name__ == "NosaBatchingManager"


def test_the_host_pool_reuses_a_given_back_buffer_best_fit_and_keeps_owners_apart():
    from hf_nosa.serving.host_pool import MIN_BUFFER_BYTES, HostPool, RequestWorkspace, rounded_bytes

    assert rounded_bytes(1) == MIN_BUFFER_BYTES
    assert rounded_bytes(3 << 20) == 4 << 20 and rounded_bytes(4 << 20) == 4 << 20
    pool = HostPool()
    a = pool.take("a", (1, 2, 1000, 64), torch.float32, pin=False)  # 512,000 bytes
    b = pool.take("b", (3 << 20,), torch.uint8, pin=False)  # 3 MiB: a 4 MiB buffer
    first = rounded_bytes(512_000)
    assert pool.allocated_bytes == first + (4 << 20)
    assert a.data_ptr() != b.data_ptr() and pool.held_bytes("a") == first
    pool.give_back("b")
    pool.give_back("a")
    small = pool.take("c", (100, 64), torch.bfloat16, pin=False)  # both fit: the smaller buffer is taken
    assert small.data_ptr() == a.data_ptr() and pool.allocated_bytes == first + (4 << 20)
    large = pool.take("c", (2 << 20,), torch.uint8, pin=False)
    assert large.data_ptr() == b.data_ptr() and pool.free == []
    pool.take("d", (10,), torch.uint8, pin=False)  # nothing free: a new buffer
    assert pool.allocated_bytes == first + (4 << 20) + MIN_BUFFER_BYTES
    workspace = RequestWorkspace(pool, "e")
    host = workspace.take((0, "host_k_0"), (1, 2, 16, 4), torch.float32, "cpu")
    device = workspace.take((0, "slot_k"), (1, 2, 3), torch.float32, "meta")
    assert pool.held_bytes("e") == MIN_BUFFER_BYTES and host.shape == (1, 2, 16, 4) and device.device.type == "meta"


def test_the_host_pool_picks_what_a_scan_of_every_free_buffer_would():
    """The free buffers are kept sorted (a persistent manager holds thousands): over random takes and give-backs of
    many owners, each take returns the buffer a scan of every free buffer picks (the smallest that fits, the one
    given back first among equals, pinned and pageable apart), and the free bytes stay the free buffers' sum."""
    import random

    from hf_nosa.serving.host_pool import HostPool

    rng = random.Random(7)
    pool, free = HostPool(), []  # free: the reference, buffers in the order they were given back
    owners = [f"r{i}" for i in range(12)]
    for _ in range(600):
        owner = rng.choice(owners)
        if rng.random() < 0.25 and owner in pool.held:
            given = pool.held[owner]
            pool.give_back(owner)
            free += given
        else:
            nbytes = rng.choice([1, 100, 70_000, 65_536, 131_073, 300_000, 1 << 20])
            fits = [b for b in free if b.numel() >= nbytes]  # pin=False here; pinned needs CUDA
            want = min(fits, key=lambda b: b.numel()) if fits else None
            got = pool.take(owner, (nbytes,), torch.uint8, pin=False)
            if want is None:
                assert all(got.data_ptr() != b.data_ptr() for b in free)
            else:
                assert got.data_ptr() == want.data_ptr()
                free = [b for b in free if b is not want]
        assert pool.free_bytes() == sum(b.numel() for b in free)
        assert sorted(b.data_ptr() for b in pool.free) == sorted(b.data_ptr() for b in free)


def test_the_manager_counts_what_its_requests_moved_as_their_caches_do_alone():
    """``RequestCaches.stats``: bytes moved to the device and locality over every request (released ones kept),
    equal to the sums of NOSA generate on each request alone with its own NosaCache."""
    from hf_nosa import NosaCache

    model = enable(_sparse_model("llama", seed=17))
    prompts = _prompts((45, 160, 300), seed=17)
    alone = []
    for prompt in prompts:
        cache = NosaCache(model.config)
        ids = torch.tensor([prompt])
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                       generation_config=_generation_config())
        alone.append(cache.stats())
    try:
        model.generate_batch(prompts, generation_config=_generation_config(),
                             continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128),
                             persistent_manager=True)
        stats = model._cached_continuous_batching_manager.nosa_requests.stats()
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert stats["bytes_to_device"] == sum(s["bytes_to_device"] for s in alone) > 0
    assert stats["blocks_loaded"] == sum(s["blocks_loaded"] for s in alone)
    assert 0.0 <= stats["locality"] <= 1.0


def test_a_tensor_parallel_rank_admits_by_the_kv_heads_it_holds():
    """Under tensor parallelism a rank's caches hold its share of the KV heads: the manager sizes requests by that
    share (host and device bytes halve on one of two ranks), so admitted concurrency grows with the ranks."""
    from hf_nosa.modeling.tensor_parallel import KVHeadShard
    from hf_nosa.serving import RequestCaches

    model = enable(_sparse_model("llama", seed=19))
    whole = RequestCaches(model.config, dtype=torch.float32)
    half = RequestCaches(model.config, dtype=torch.float32, rank_kv_heads=whole.kv_heads // 2)
    assert whole.kv_heads == model.config.num_key_value_heads == 2
    assert half.host_bytes(4096) * 2 == whole.host_bytes(4096)
    assert half.device_bytes(4096) * 2 == whole.device_bytes(4096)
    head = model.model.layers[0].self_attn.eviction_head
    head.tensor_parallel = KVHeadShard(None, 0, 2, 0, 1, model.config.head_dim)  # as shard_eviction_heads sets it
    try:
        manager = init_continuous_batching(model)
        assert manager.nosa_requests.kv_heads == 1
    finally:
        head.tensor_parallel = None
