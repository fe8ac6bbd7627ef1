"""A QUOKA chunk's blocks fetched a part of the batch at a time (``pool_attention``) against fetching every row at
once (``attend.with_prefix_read``, the reference), from the parts' bookkeeping to whole prefills."""

import pytest
import torch

from hf_nosa import NosaCache
from hf_nosa.prefill import chunked as prefill_module
from hf_nosa.rules.attend import AttentionInputs, attend, with_prefix_read
from hf_nosa.kernels.backend import HAS_TRITON
from hf_nosa.attention.pool import PARTS_ENV_VAR, PoolBlocks, attend_with_pool_blocks, fetch_parts, part_bounds
from hf_nosa.rules.selection import MASK_VALUE

from .conftest import small_nosa_config
from .test_quoka import _model, _prompt
from .utils import assert_close

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.mark.parametrize("batch, parts", [(1, 4), (5, 3), (7, 7), (8, 4), (3, 10)])
def test_parts_cover_the_batch_in_order(batch, parts):
    bounds = part_bounds(batch, parts)
    assert len(bounds) == min(batch, parts)
    assert bounds[0][0] == 0 and bounds[-1][1] == batch
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_parts_from_the_environment(monkeypatch):
    assert fetch_parts(torch.device("cpu"), 8) == 1  # nothing to overlap with on the CPU
    monkeypatch.delenv(PARTS_ENV_VAR, raising=False)
    cuda = torch.device("cuda")
    assert [fetch_parts(cuda, b) for b in (1, 2, 7, 8, 12, 38)] == [1, 1, 1, 2, 3, 4]  # 4 rows a part at least
    monkeypatch.setenv(PARTS_ENV_VAR, "8")
    assert fetch_parts(cuda, 38) == 8 and fetch_parts(cuda, 16) == 4
    monkeypatch.setenv(PARTS_ENV_VAR, "1")
    assert fetch_parts(cuda, 38) == 1
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv(PARTS_ENV_VAR, bad)
        with pytest.raises(ValueError, match=PARTS_ENV_VAR):
            fetch_parts(torch.device("cuda"), 8)


KERNELS = ["sdpa", pytest.param("flash_biased", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton"))]


@pytest.mark.parametrize("parts", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_blocks_in_parts_equal_the_reference(monkeypatch, parts, dtype, kernel):
    """Random keys with extreme biases and hidden keys, GQA, 5 rows: every part split gives the reference's
    attention, and each row is fetched exactly once, in order; through the sdpa route (the CPU's) and through the
    flash_biased kernel reading the blocks in place (CUDA's; here in the Triton interpreter)."""
    if kernel == "flash_biased":
        monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(parts)
    B, H, Hk, Tq, S, D = 5, 8, 2, 12, 40, 16
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    pool_k, pool_v = torch.randn(B, Hk, S, D, generator=g).to(dtype), torch.randn(B, Hk, S, D, generator=g).to(dtype)
    pool_b = (torch.randn(B, Hk, S, generator=g) * 30).clamp(-80, 80)
    pool_b[..., 5::7] = MASK_VALUE
    k, v = torch.randn(B, Hk, Tq, D, generator=g).to(dtype), torch.randn(B, Hk, Tq, D, generator=g).to(dtype)
    b = torch.randn(B, Hk, Tq, generator=g)
    fetched = []

    def fetch(b0, b1):
        fetched.append((b0, b1))
        return pool_k[b0:b1], pool_v[b0:b1], pool_b[b0:b1]

    inputs = AttentionInputs(k, v, b, None, 0, True, blocks=PoolBlocks(fetch, parts))
    out = attend_with_pool_blocks(q, inputs, 0.25)
    assert [r for lo, hi in fetched for r in range(lo, hi)] == list(range(B))
    whole = with_prefix_read(inputs)
    assert whole.q_offset == S and whole.keys.shape[2] == S + Tq
    expected = attend(q.float(), whole._replace(keys=whole.keys.float(), values=whole.values.float()), 0.25)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert_close(out.float(), expected, **tol)


def test_head_dims_the_kernel_does_not_take_run_the_sdpa_route(monkeypatch, caplog):
    """Head dim 24 under the Triton kernels: the sdpa route, said once in the log, and still the reference."""
    from hf_nosa.kernels import backend

    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "_logged", set())
    g = torch.Generator().manual_seed(3)
    q, pk, pv = torch.randn(2, 4, 6, 24, generator=g), torch.randn(2, 2, 10, 24, generator=g), \
        torch.randn(2, 2, 10, 24, generator=g)
    k, v, b, pb = torch.randn(2, 2, 6, 24, generator=g), torch.randn(2, 2, 6, 24, generator=g), \
        torch.randn(2, 2, 6, generator=g), torch.randn(2, 2, 10, generator=g)
    inputs = AttentionInputs(k, v, b, None, 0, True, blocks=PoolBlocks(lambda b0, b1: (pk[b0:b1], pv[b0:b1],
                                                                                        pb[b0:b1]), 1))
    with caplog.at_level("WARNING", logger="hf_nosa"):
        out = attend_with_pool_blocks(q, inputs, 0.3)
    assert "head dim 24" in caplog.text
    assert_close(out, attend(q, with_prefix_read(inputs), 0.3), atol=1e-5, rtol=1e-5)


def _prefill_in_parts(monkeypatch, parts, left_pad=(0, 31, 0, 64, 7), length=300, layers=2, config=None, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(prefill_module, "fetch_parts", lambda device, batch: min(parts, batch))
    model = _model("qwen3", seed=21, num_hidden_layers=layers)
    ids, mask = _prompt(len(left_pad), length, seed=22, left_pad=left_pad)
    cfg = dict(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32, budget_tokens=96, query_tokens=16)
    cache = NosaCache(model.config, small_nosa_config(**{**cfg, **(config or {})}))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
    return logits[mask.bool()], cache.stats()


def test_quoka_prefill_in_parts_equals_one_part(monkeypatch):
    """5 rows (two left-padded), parts of 2/2/1 rows: each part's fetch reads its own rows of the host store."""
    one, one_stats = _prefill_in_parts(monkeypatch, 1)
    three, three_stats = _prefill_in_parts(monkeypatch, 3)
    assert_close(three, one, atol=1e-5, rtol=1e-5)
    assert three_stats["blocks_loaded"] == one_stats["blocks_loaded"] > 0
    assert three_stats["bytes_to_device"] == one_stats["bytes_to_device"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_quoka_prefill_in_parts_with_the_interpreted_fetch_kernel(monkeypatch, prompt_rotary_on_torch):
    """The fetch kernel's row offset (``row0``) in the Triton interpreter against the torch path in one part (one
    layer: each layer fetches alike, and every kernel of the layer runs interpreted but the prompt's rotary
    embedding, a per-token kernel bitwise its reference: tests/conftest.py ``prompt_rotary_on_torch``).

    Two rows in two parts, the second (row0 = 1) left-padded by 21; 112 tokens in 32-token chunks, a budget of 3
    blocks (sink, local, one chosen) and a 32-token dense tail, so the interpreter runs each kind of chunk once: the
    first (no blocks); one whose 2 earlier blocks all fit, fetched from the host store while the padded row's tail
    starts inside it (at its 28th query); one choosing 3 of 4 blocks, fetching some and moving the previous chunk's
    last one in, where the padded row's tail starts at its first query and the other's at its 17th; a last partial
    chunk (16) of tail queries over the prefix alone."""
    small = dict(left_pad=(0, 21), length=112, layers=1,
                 config=dict(prefill_budget_tokens=48, local_tokens=16, prefill_dense_tail_tokens=32))
    expected, expected_stats = _prefill_in_parts(monkeypatch, 1, HF_NOSA_KERNELS="torch", **small)
    actual, actual_stats = _prefill_in_parts(monkeypatch, 2, HF_NOSA_KERNELS="triton", TRITON_INTERPRET="1", **small)
    assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert actual_stats["blocks_loaded"] == expected_stats["blocks_loaded"] > 0
    assert prompt_rotary_on_torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quoka_prefill_in_parts_on_gpu(monkeypatch):
    """CUDA: 8 rows in 2 parts (the second fetched on a side stream while the first is attended to) against 1."""
    def run(parts):
        monkeypatch.setenv(PARTS_ENV_VAR, str(parts))
        model = _model("llama", seed=23).cuda()
        ids, mask = _prompt(8, 700, seed=24, left_pad=(0, 50, 0, 0, 120, 0, 3, 0))
        cache = NosaCache(model.config, small_nosa_config(prefill="quoka", prefill_budget_tokens=96,
                                                          prefill_chunk_size=64))
        with torch.no_grad():
            logits = model(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache).logits
        return logits[mask.cuda().bool()], cache.stats()

    one, one_stats = run(1)
    four, four_stats = run(4)  # 8 rows: 2 parts of 4
    assert_close(four, one, atol=1e-3, rtol=1e-3)
    assert four_stats["blocks_loaded"] == one_stats["blocks_loaded"] > 0


@pytest.mark.parametrize("parts", [1, 3])
def test_last_quoka_chunk_attends_before_the_pool_is_settled(monkeypatch, parts):
    """Without a dense tail the prompt's last chunk is a QUOKA chunk; its blocks are fetched before the prompt is
    settled (which empties the pool but for each row's partial block in slot 0, where decoding goes on writing):
    afterwards slot 0 still holds that block and nothing else is held. (Fetched lazily, after settling, the blocks
    would land in slot 0 over the partial block.)"""
    monkeypatch.setattr(prefill_module, "fetch_parts", lambda device, batch: min(parts, batch))
    model = _model("llama", seed=31)
    ids, mask = _prompt(3, 301, seed=32, left_pad=(0, 20, 5))
    cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32,
                            prefill_dense_tail_tokens=0)
    cache = NosaCache(model.config, cfg)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
    for layer in cache.layers:
        rows = layer.row_lengths().to(layer.slot_block.device)
        partial_rows = rows % 16 != 0
        assert bool(partial_rows.any())
        held = layer.slot_block[:, :, 0]
        assert torch.equal(held[partial_rows], (rows // 16)[partial_rows, None].expand_as(held[partial_rows]))
        assert int((layer.slot_block[:, :, 1:] >= 0).sum()) == 0  # the rest of the pool is empty after settling
    assert torch.isfinite(logits).all()
