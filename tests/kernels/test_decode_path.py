"""The whole decode step on the kernel path (NosaLayer._decode_fused) against the torch path, end to end.

On CPU the kernels run in the Triton interpreter (tiny model, few steps); on a GPU the compiled kernels, with
greedy generation token for token equal to the torch path (fp32: logits within 1e-4; bf16: teacher-forced
logits within 5e-2), and CUDA-graph replay equal to eager decoding.
"""

from __future__ import annotations

import pytest
import torch

import hf_nosa
from hf_nosa import NosaCache, NosaConfig
from hf_nosa.cache.nosa_cache import NosaLayer
from hf_nosa.kernels.decode.block_scores import block_select
from hf_nosa.modeling.cuda_graph import DecodeGraph, greedy_decode
from hf_nosa.modeling import randomize_eviction_heads
from tests.conftest import small_nosa_config, tiny_model
from tests.utils import assert_close

STAT_KEYS = ("seen_tokens", "host_tokens", "device_tokens", "blocks_loaded", "bytes_to_device", "decode_steps")


def nosa_model(family="llama", device="cpu", dtype=torch.float32, seed=0, budget=64, **overrides):
    model = tiny_model(family, seed=seed, **overrides)
    cfg = small_nosa_config(budget_tokens=budget, query_tokens=16, local_tokens=16, sink_tokens=16, prefill="dense")
    hf_nosa.to_nosa(model, cfg)
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 1))
    return model.to(device=device, dtype=dtype)


def generate(model, ids, path, monkeypatch, new_tokens, **cache_kwargs):
    monkeypatch.setenv("HF_NOSA_KERNELS", path)
    cache = NosaCache(model.config, **cache_kwargs)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores), cache.stats()


class KernelQueryOnly:
    """Query-aware selection alone (InfLLMv2-style) through block_select: the NOSA rule with the whole budget
    given to the query-aware part, reading the token index from the device like the default rule."""

    name = "query_only_kernel"

    def observe(self, layer, keys, bias, start):
        pass

    def select(self, layer, query, t, scale):
        cfg = layer.cfg
        cfg = cfg.replace(query_tokens=cfg.budget_tokens - cfg.sink_tokens - cfg.local_tokens)
        step = layer.step if hasattr(layer, "step") and layer._step_value == t else torch.tensor([t], device=query.device)
        return block_select(query, layer.compressed.keys, layer.compressed.bias, step, cfg, scale)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_kernel_path_equals_torch_path_interpreted(interpret, monkeypatch):
    # 78 tokens, 4 decode steps (each costs the interpreter about a second): the first fetches every selected block,
    # the second (token 79) completes a compressed window and block 4, the third opens block 5, and the fourth
    # fetches blocks the new selection adds (its locality is below 1; a longer decode repeats these steps).
    model = nosa_model(num_hidden_layers=1)
    ids = torch.randint(3, 97, (2, 78), generator=torch.Generator().manual_seed(0))
    seq_t, scores_t, stats_t = generate(model, ids, "torch", monkeypatch, 5)
    seq_k, scores_k, stats_k = generate(model, ids, "triton", monkeypatch, 5)
    assert stats_t["locality"] < 1
    assert torch.equal(seq_k, seq_t)
    assert_close(scores_k, scores_t, atol=1e-4, rtol=1e-4)
    for key in STAT_KEYS:
        assert stats_k[key] == stats_t[key], key
    assert abs(stats_k["locality"] - stats_t["locality"]) < 1e-6


def test_resident_margin_kernel_path_equals_torch_path_interpreted(interpret, prompt_rotary_on_torch, monkeypatch):
    """``resident_margin`` on both decode paths: the same tokens and traffic, and more blocks kept than without.
    The prompt's rotary embedding runs its torch reference (bitwise the per-token kernel, ``prompt_rotary_on_torch``
    in tests/conftest.py; test_kernel_path_equals_torch_path_interpreted runs it), the decode steps' the kernel."""
    # 113 tokens (7 complete blocks against a budget of 6) and 3 decode steps: with the margin a step after the first
    # still fetches a block, without it the steps fetch more (28 blocks against 26); the last completes a window.
    model = nosa_model(num_hidden_layers=1, budget=96, seed=2)
    ids = torch.randint(3, 97, (2, 113), generator=torch.Generator().manual_seed(4))
    cfg = NosaConfig.from_dict(model.config.nosa, resident_margin=1.0)
    seq_t, scores_t, stats_t = generate(model, ids, "torch", monkeypatch, 4, nosa_config=cfg)
    seq_k, scores_k, stats_k = generate(model, ids, "triton", monkeypatch, 4, nosa_config=cfg)
    assert prompt_rotary_on_torch == [113]  # the prompt alone
    assert torch.equal(seq_k, seq_t)
    assert_close(scores_k, scores_t, atol=1e-4, rtol=1e-4)
    for key in STAT_KEYS:
        assert stats_k[key] == stats_t[key], key
    assert stats_t["locality"] < 1  # the margin did not freeze the selection
    *_, stats_0 = generate(model, ids, "torch", monkeypatch, 4, nosa_config=cfg.replace(resident_margin=0.0))
    assert stats_0["locality"] < stats_t["locality"], (stats_0["locality"], stats_t["locality"])
    assert stats_0["blocks_loaded"] > stats_t["blocks_loaded"]


def test_kernel_path_with_a_selector_interpreted(interpret, prompt_rotary_on_torch, monkeypatch):
    # The prompt's rotary embedding on its torch reference (as in the resident-margin test above).
    # 79 tokens and 4 decode steps: a window and block 4 complete, block 5 opens, and the selection changes in the
    # last two steps (fetching 2 blocks, then 2 more).
    model = nosa_model(num_hidden_layers=1, seed=3)
    ids = torch.randint(3, 97, (1, 79), generator=torch.Generator().manual_seed(1))
    seq_t, scores_t, stats_t = generate(model, ids, "torch", monkeypatch, 5, selector=KernelQueryOnly())
    seq_k, scores_k, stats_k = generate(model, ids, "triton", monkeypatch, 5, selector=KernelQueryOnly())
    assert prompt_rotary_on_torch == [79]
    assert torch.equal(seq_k, seq_t)
    assert_close(scores_k, scores_t, atol=1e-4, rtol=1e-4)
    assert stats_k["blocks_loaded"] == stats_t["blocks_loaded"] and stats_t["locality"] < 1


def test_cpu_default_is_the_torch_path(monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    monkeypatch.setattr(NosaLayer, "_decode_fused", lambda *a, **k: pytest.fail("kernel path taken on CPU"))
    model = nosa_model(num_hidden_layers=1)
    model.generate(torch.randint(3, 97, (1, 20)), past_key_values=NosaCache(model.config), max_new_tokens=3,
                   do_sample=False)


# ----- GPU -----


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_generate_equals_torch_path_gpu_fp32(compiled, monkeypatch, family):
    overrides = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512)
    if family == "qwen3":
        overrides["head_dim"] = 64
    model = nosa_model(family, device="cuda", **overrides)
    ids = torch.randint(3, 97, (3, 300), generator=torch.Generator().manual_seed(2)).cuda()
    seq_t, scores_t, stats_t = generate(model, ids, "torch", monkeypatch, 40)
    seq_k, scores_k, stats_k = generate(model, ids, "triton", monkeypatch, 40)
    assert torch.equal(seq_k, seq_t)
    assert_close(scores_k, scores_t, atol=1e-4, rtol=1e-4)
    for key in STAT_KEYS:
        assert stats_k[key] == stats_t[key], key


@pytest.mark.gpu
def test_teacher_forced_logits_gpu_bf16(compiled, monkeypatch):
    """bf16 numerics of the kernels (fp32 accumulation, probabilities rounded to bf16 before P.V) against the
    fp32-accumulating torch path. The budget covers the context, so both attend to the same tokens: in bf16 a
    near-tie between two block scores may break differently, which the fp32 test above covers instead."""
    model = nosa_model(device="cuda", dtype=torch.bfloat16, budget=448, hidden_size=512, num_attention_heads=8,
                       num_key_value_heads=2, intermediate_size=1024)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 97, (4, 400), generator=gen).cuda()
    follow = torch.randint(3, 97, (4, 30), generator=gen).cuda()
    logits = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv("HF_NOSA_KERNELS", path)
        cache = NosaCache(model.config)
        with torch.no_grad():
            out = [model(ids, past_key_values=cache).logits[:, -1]]
            for i in range(follow.shape[1]):
                out.append(model(follow[:, i : i + 1], past_key_values=cache).logits[:, -1])
        logits[path] = torch.stack(out).float()
    assert_close(logits["triton"], logits["torch"], atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_gpu(compiled, monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    model = nosa_model(device="cuda", dtype=torch.bfloat16, hidden_size=256, num_attention_heads=8,
                       num_key_value_heads=2, intermediate_size=512)
    ids = torch.randint(3, 97, (2, 250), generator=torch.Generator().manual_seed(4)).cuda()
    tokens, stats = [], []
    for use_graph in (False, True):
        cache = NosaCache(model.config)
        with torch.no_grad():
            first = model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(greedy_decode(model, cache, first, 60, use_graph=use_graph))
        stats.append(cache.stats())
    assert torch.equal(tokens[1], tokens[0])
    for key in STAT_KEYS:
        assert stats[1][key] == stats[0][key], key
    # capture happened and replays did the work
    cache = NosaCache(model.config)
    with torch.no_grad():
        first = model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        step = DecodeGraph(model, cache)
        token = first
        for _ in range(10):
            pos = torch.full_like(token, cache.get_seq_length())
            token = step(token, pos).argmax(-1, keepdim=True)
    assert step.captures == 2 and step.replays >= 7  # the second step's graph, and the first step's beside it


def test_query_only_kernel_selector_equals_the_baseline(interpret, monkeypatch):
    """The query-only rule on block_select (used by the throughput benchmark) picks what baselines.py picks."""
    baselines = pytest.importorskip("hf_nosa.eval.baselines")
    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    model = nosa_model(num_hidden_layers=1, seed=5)
    cache = NosaCache(model.config)
    ids = torch.randint(3, 97, (2, 150), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(6)
    t = 150  # the token after the prompt; its window set is already complete
    for trial in range(3):
        query = torch.randn(2, 4, 1, 16, generator=g)
        layer.step.fill_(t)
        layer._step_value = t
        expected = baselines.QueryOnlySelector().select(layer, query, t, 0.25)
        monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
        got = KernelQueryOnly().select(layer, query, t, 0.25)
        monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
        big = torch.iinfo(torch.long).max
        expected = torch.where(expected < 0, big, expected).sort(-1).values
        expected[expected == big] = -1
        assert torch.equal(got, expected), trial


def test_benchmark_fill_matches_a_dense_prefill():
    """decode_throughput.py fills NosaCache layers directly; the state must be what a dense prefill leaves."""
    from benchmarks.decode_throughput import build_model, fill_nosa, nosa_config
    from hf_nosa.rules.selection import num_windows

    model = build_model("smoke", "cpu", torch.float32)
    ncfg = nosa_config(smoke=True)
    hf_nosa.to_nosa(model, ncfg)
    randomize_eviction_heads(model, scale=0.1, generator=torch.Generator().manual_seed(0))
    for context in (256, 200):
        cache = fill_nosa(model, NosaCache(model.config, ncfg, max_cache_len=context + 10), 2, context, 10,
                          torch.device("cpu"), torch.float32, piece=64)
        ref = NosaCache(model.config, ncfg, max_cache_len=context + 10)
        for i, layer in enumerate(cache.layers):
            k, v, b = layer.host.read(0, context, "cpu")
            ref.update(k, v, i, query=torch.zeros(2, 4, context, 16), bias=b)
            r, n = ref.layers[i], num_windows(context, ncfg)
            assert layer.seen == r.seen == context and layer.compressed.n == r.compressed.n == n
            assert_close(layer.compressed.keys[:, :, :n], r.compressed.keys[:, :, :n])
            assert_close(layer.compressed.bias[:, :, :n], r.compressed.bias[:, :, :n])
            assert torch.equal(layer.compressed.ring_k, r.compressed.ring_k)
            assert torch.equal(layer.compressed.ring_b, r.compressed.ring_b)
            assert torch.equal(layer.slot_block, r.slot_block) and torch.equal(layer.tail_slot, r.tail_slot)
            assert torch.equal(layer.slot_k[:, :, 0], r.slot_k[:, :, 0])


def test_crop_and_beam_search_on_the_kernel_path_interpreted(interpret, prompt_rotary_on_torch, monkeypatch):
    """The device-side step counter follows the cache through crop (assisted decoding) and beam reordering (the
    prompt's rotary embedding on its torch reference, ``prompt_rotary_on_torch``; the steps' on the kernel)."""
    model = nosa_model(num_hidden_layers=1, seed=7)
    ids = torch.randint(3, 97, (1, 44), generator=torch.Generator().manual_seed(7))
    logits = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv("HF_NOSA_KERNELS", path)
        cache = NosaCache(model.config)
        out = []
        with torch.no_grad():
            token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
            for _ in range(3):
                out.append(model(token, past_key_values=cache).logits[:, -1])
                token = out[-1][:, None].argmax(-1)
            cache.crop(-2)
            for _ in range(2):
                out.append(model(token, past_key_values=cache).logits[:, -1])
                token = out[-1][:, None].argmax(-1)
            cache.batch_repeat_interleave(2)
            cache.reorder_cache(torch.tensor([1, 0]))
            out.append(model(token.repeat(2, 1), past_key_values=cache).logits[:, -1][:1])
        logits[path] = torch.stack(out)
        assert cache.get_seq_length() == 44 + 3 - 2 + 2 + 1
    assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    assert prompt_rotary_on_torch == [44]
