"""A decode step run a part of the batch at a time (hf_nosa.cache.decode_parts) against the whole-batch step.

On CPU the device kernels run in the Triton interpreter, the parts one after the other; on a GPU the parts run on
their own streams inside one captured graph. Either way every token, logit and counter must equal the whole-batch
step's: rows share nothing in a decode step.
"""

from __future__ import annotations

import pytest
import torch

import hf_nosa
from hf_nosa import NosaCache
from hf_nosa.cache.decode_parts import CacheRows, decode_parts, forward_by_parts, stagger_fetches
from hf_nosa.modeling.cuda_graph import DecodeGraph, cache_keyword, stock_forward
from hf_nosa.kernels.decode.fetch import SlotPool, StepCounters, fetch_step
from hf_nosa.modeling import randomize_eviction_heads
from tests.conftest import small_nosa_config, tiny_model
from tests.utils import assert_close

STAT_KEYS = ("seen_tokens", "host_tokens", "device_tokens", "blocks_loaded", "bytes_to_device", "decode_steps")


def nosa_model(device="cpu", dtype=torch.float32, seed=0, host_dtype="auto", **overrides):
    model = tiny_model("llama", seed=seed, **overrides)
    cfg = small_nosa_config(budget_tokens=64, query_tokens=16, local_tokens=16, sink_tokens=16, prefill="dense",
                            host_dtype=host_dtype)
    hf_nosa.to_nosa(model, cfg)
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 1))
    return model.to(device=device, dtype=dtype).eval()


def model_forward(model):
    def forward(input_ids, position_ids, cache):
        with stock_forward():
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **{cache_keyword(model): cache})
        return out.logits[:, -1]

    return forward


def prefilled(model, ids, monkeypatch, mask=None):
    """A NosaCache holding the prompt ``ids``, prefilled on the torch path; the kernel path is back on after.

    The prompt is not what these tests look at, and the interpreter would take seconds over it (the prefill
    kernels are tests/test_padding.py's and tests/test_host_dtype.py's subject)."""
    cache = NosaCache(model.config)
    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    return cache, logits


def decode(model, ids, mask, steps, parts, monkeypatch):
    """Prefill ``ids``, then ``steps`` greedy decode steps on the device-kernel path, by ``parts`` of the batch.

    The prompt goes in on the torch path (``prefilled``): both runs start from the same cache, and the prefill
    kernels are other tests' subject (tests/test_host_dtype.py and tests/test_padding.py run them on this store and
    on padded rows); interpreted, this batch's prompt took about 12 s per run."""
    cache, prompt_logits = prefilled(model, ids, monkeypatch, mask)
    token = prompt_logits[:, -1].argmax(-1, keepdim=True)
    with torch.no_grad():
        forward = model_forward(model)
        logits = []
        loaded = []
        for _ in range(steps):
            t = cache.get_seq_length()
            pos = torch.full_like(token, t)
            # parts == 1: the model's own whole-batch step (NosaLayer._decode_fused), the reference
            out = forward(token, pos, cache) if parts == 1 else forward_by_parts(forward, cache, token, pos, parts)
            # the host-side bookkeeping went with the step: one token further, device and host alike
            assert cache.get_seq_length() == t + 1
            assert all(int(layer.step) == layer.seen == t + 1 for layer in cache.layers)
            logits.append(out)
            loaded.append(cache.stats()["blocks_loaded"])
            token = out.argmax(-1, keepdim=True)
    return torch.stack(logits), cache.stats(), cache, loaded


def test_parts_equal_the_whole_batch_interpreted(interpret, monkeypatch):
    # The quantized store: its fetch reads scales and writes the tail by row too (the GPU test covers both stores).
    # Parts of rows 0 | 1 | 2-3: a first, a middle (neither starts nor ends the layer's step) and a last part of two
    # rows at row offset 2. Two decode steps of an 80-token prompt hold every event of a longer decode: row 0's
    # prompt ends on a block boundary (its pool holds no partial block, and its first step opens block 5), row 2
    # (pad 1) completes block 4 in step 1 and opens block 5 in step 2, a mid-decode tail move; step 1 fetches every
    # selection from the store, step 2 some blocks into slots freed among kept ones (the loads are asserted below).
    # Rows 1 and 3 are left-padded (9 and 70 tokens): the rows' offsets differ between parts.
    parts = 3
    model = nosa_model(num_hidden_layers=1, host_dtype="float8_e4m3fn")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 97, (4, 80), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :1] = 0
    mask[3, :70] = 0
    whole, whole_stats, whole_cache, whole_loaded = decode(model, ids, mask, 2, 1, monkeypatch)
    split, split_stats, split_cache, split_loaded = decode(model, ids, mask, 2, parts, monkeypatch)
    assert 0 < whole_loaded[0] < whole_loaded[1]  # the steps above: a first fetch, then a partial one
    assert split_loaded == whole_loaded
    assert_close(split, whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(split.argmax(-1), whole.argmax(-1))
    for key in STAT_KEYS:
        assert split_stats[key] == whole_stats[key], key
    assert split_stats["locality"] == pytest.approx(whole_stats["locality"], abs=1e-6)
    for a, b in zip(split_cache.layers, whole_cache.layers):
        assert int(a.step) == int(b.step) == a.seen  # advanced once per step, not once per part
        assert torch.equal(a.slot_block, b.slot_block)
        assert torch.equal(a.tail_slot, b.tail_slot)
        # the keys come out of GEMMs over fewer rows: equal up to their rounding
        assert_close(a.compressed.keys, b.compressed.keys, atol=1e-5, rtol=1e-5)


def test_cache_rows_view_the_layers(interpret, monkeypatch):
    model = nosa_model(num_hidden_layers=1)
    cache, _ = prefilled(model, torch.randint(3, 97, (4, 40)), monkeypatch)
    rows = CacheRows(cache, 1, 3)
    assert isinstance(rows, NosaCache) and rows.get_seq_length() == cache.get_seq_length() == 40
    assert rows.layers[0].layer is cache.layers[0] and (rows.layers[0].b0, rows.layers[0].b1) == (1, 3)
    with pytest.raises(ValueError, match="one decode token of its 2 rows"):
        k = torch.zeros(4, 2, 1, cache.layers[0].head_dim)
        rows.update(k, k, 0, query=torch.zeros(4, 4, 1, k.shape[-1]), bias=torch.zeros(4, 2, 1))


def test_decode_parts_setting(monkeypatch):
    model = nosa_model(num_hidden_layers=1)
    cache = NosaCache(model.config)
    monkeypatch.delenv("HF_NOSA_DECODE_PARTS", raising=False)
    assert decode_parts(cache, 64) == 1
    monkeypatch.setenv("HF_NOSA_DECODE_PARTS", "4")
    assert decode_parts(cache, 64) == 4
    assert decode_parts(cache, 9) == 2  # at least 4 rows a part
    assert decode_parts(cache, 3) == 1
    assert decode_parts(NosaCache(model.config, selector=object()), 64) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("HF_NOSA_DECODE_PARTS", bad)
        with pytest.raises(ValueError, match="HF_NOSA_DECODE_PARTS"):
            decode_parts(cache, 64)
    monkeypatch.delenv("HF_NOSA_DECODE_PARTS_STAGGER", raising=False)
    assert stagger_fetches()
    monkeypatch.setenv("HF_NOSA_DECODE_PARTS_STAGGER", "0")
    assert not stagger_fetches()
    monkeypatch.setenv("HF_NOSA_DECODE_PARTS_STAGGER", "yes")
    with pytest.raises(ValueError, match="HF_NOSA_DECODE_PARTS_STAGGER='yes' is invalid"):
        stagger_fetches()


def test_fetch_step_rejects_a_bad_part(interpret, monkeypatch):
    model = nosa_model(num_hidden_layers=1)
    cache, _ = prefilled(model, torch.randint(3, 97, (4, 40)), monkeypatch)
    layer = cache.layers[0]
    rows = slice(2, 4)
    pool = SlotPool(layer.slot_k[rows], layer.slot_v[rows], layer.slot_b[rows], layer.slot_block[rows],
                    layer.tail_slot[rows])
    k = torch.randn(2, layer.kv_heads, 1, layer.head_dim)
    b = torch.randn(2, layer.kv_heads, 1)
    selected = torch.full((2, layer.kv_heads, 1), -1, dtype=torch.long)
    counters = StepCounters.zeros(torch.device("cpu"))
    with pytest.raises(ValueError, match="not a part of a batch of step_rows=3"):
        fetch_step(selected, pool, layer.host, k, k, b, layer.step, counters, count_locality=False, row0=2,
                   step_rows=3)
    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    with pytest.raises(ValueError, match="device kernels only"):
        fetch_step(selected, pool, layer.host, k, k, b, layer.step, counters, count_locality=False, row0=2,
                   step_rows=4)


@pytest.mark.gpu
@pytest.mark.parametrize("host_dtype,stagger", [("auto", "1"), ("float8_e4m3fn", "1"), ("auto", "0")])
def test_graph_by_parts_equals_eager_parts_gpu(monkeypatch, host_dtype, stagger):
    """The parts on their own streams inside one graph, staggered or free, give the tokens and counters of the same
    parts run eagerly one after the other (same rows per GEMM, so the same rounding; the CPU test compares parts with
    the whole batch)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    monkeypatch.setenv("HF_NOSA_DECODE_PARTS", "3")
    monkeypatch.setenv("HF_NOSA_DECODE_PARTS_STAGGER", stagger)
    model = nosa_model(device="cuda", dtype=torch.bfloat16, host_dtype=host_dtype, hidden_size=256,
                       num_attention_heads=8, num_key_value_heads=2, intermediate_size=512)
    ids = torch.randint(3, 97, (12, 250), generator=torch.Generator().manual_seed(4)).cuda()
    forward = model_forward(model)
    tokens, stats, graphs = [], [], []
    for use_graph in (False, True):
        cache = NosaCache(model.config, max_cache_len=300)  # sized once: no buffer moves, so one capture
        with torch.no_grad():
            token = model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
            step = DecodeGraph(model, cache) if use_graph else None
            fed = []
            for _ in range(40):
                pos = torch.full_like(token, cache.get_seq_length())
                fed.append(token)
                logits = step(token, pos) if step is not None else forward_by_parts(forward, cache, token, pos, 3)
                token = logits.argmax(-1, keepdim=True)
        tokens.append(torch.cat(fed, 1))
        stats.append(cache.stats())
        graphs.append(step)
    assert torch.equal(tokens[1], tokens[0])
    for key in STAT_KEYS:
        assert stats[1][key] == stats[0][key], key
    # the second step's graph and, beside it, the first step's (which counts no locality)
    assert graphs[1].captures == 2 and graphs[1].replays >= 37 and not graphs[1].recaptures


def test_graph_key_changes_are_named(interpret, monkeypatch):
    """DecodeGraph records why it recaptured (benchmarks report it): each key entry has its name."""
    from hf_nosa.cache.nosa_cache import NosaLayer
    from hf_nosa.modeling.cuda_graph import _key_change

    model = nosa_model(num_hidden_layers=2)
    cache, _ = prefilled(model, torch.randint(3, 97, (2, 40)), monkeypatch)
    layer_keys = tuple(layer.fused_graph_key() for layer in cache.layers)
    assert all(len(k) == len(NosaLayer.FUSED_GRAPH_KEY_NAMES) for k in layer_keys)
    old = ((2, 1), layer_keys, 1, False)
    assert _key_change(old, old) is None
    moved = list(layer_keys[1])
    moved[7] = (moved[7][0] + 64, moved[7][1])
    assert _key_change(old, ((2, 1), (layer_keys[0], tuple(moved)), 1, False)).startswith("layer 1: compressed.keys")
    assert _key_change(old, ((3, 1), layer_keys, 1, False)).startswith("input shape")
    assert _key_change(old, ((2, 1), layer_keys, 2, True)).startswith("decode parts")


def test_a_first_steps_key_differs_only_in_warm(interpret, monkeypatch):
    """DecodeGraph captures a request's first decode step (no locality counted) beside its second: the key it
    captures is the second step's with every layer's ``warm`` False, nothing else changed."""
    from hf_nosa.modeling.cuda_graph import _key_change, first_step_key

    model = nosa_model(num_hidden_layers=2)
    cache, _ = prefilled(model, torch.randint(3, 97, (2, 40)), monkeypatch)
    for layer in cache.layers:
        layer.warm = True
    warm = ((2, 1), tuple(layer.fused_graph_key() for layer in cache.layers), 1, False)
    for layer in cache.layers:
        layer.warm = False
    cold = ((2, 1), tuple(layer.fused_graph_key() for layer in cache.layers), 1, False)
    assert warm != cold and first_step_key(warm) == cold and first_step_key(cold) == cold
    assert _key_change(warm, cold) == "layer 0: warm True -> False"
