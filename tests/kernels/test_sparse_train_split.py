"""The split path of the sparse training attention (``sparse_train_split.py``) and its plan.

Bitmaps here are NOSA-like: a sink, a local window, a set of blocks every token of a sequence selected and random
per-token extras, so both parts of a tile have work (the random bitmaps of ``test_sparse_train_attention.py``
leave the shared part empty). Forward and the gradients of query, key, value and bias against the torch reference,
under the Triton interpreter at small sizes; the plan against a brute-force count of what each token sees; the
``gpu`` cases at training-like sizes with the real selection.
"""

import importlib
import math

import pytest
import torch

from hf_nosa.rules.selection import MASK_VALUE

from ..utils import assert_close

sparse_module = importlib.import_module("hf_nosa.kernels.train.sparse_train_attention")
plan_module = importlib.import_module("hf_nosa.kernels.train.sparse_train_plan")
needs_triton = pytest.mark.skipif(not sparse_module.HAS_TRITON, reason="needs the triton package")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _nosa_bitmap(B, Hk, Tq, N, P, q_offset, offsets, g, common=2, extra=0.15, window=2):
    """Per token: sink (block 0), the ``window`` blocks before its own, ``common`` blocks per (row, KV head) chosen
    for all tokens, and random extras; blocks row-relative with ``offsets``."""
    off = torch.zeros(B, dtype=torch.long) if offsets is None else offsets
    pos = q_offset + torch.arange(Tq)[None, :] - off[:, None]  # [B, Tq]
    own = torch.where(pos >= 0, pos, 0) // P
    n = torch.arange(N)
    past = n[None, None, :] < own[..., None]  # [B, Tq, N]
    local = past & (n[None, None, :] >= own[..., None] - window)
    bitmap = (local | (past & (n == 0)))[:, None].expand(B, Hk, Tq, N).clone()
    chosen = torch.zeros(B, Hk, 1, N, dtype=torch.bool)
    chosen.scatter_(-1, torch.randint(0, N, (B, Hk, 1, common), generator=g), True)
    bitmap |= chosen & past[:, None]
    bitmap |= (torch.rand(B, Hk, Tq, N, generator=g) < extra) & past[:, None]
    return bitmap & (pos >= 0)[:, None, :, None]


def _inputs(B, H, Hk, T, q_offset, D, P, dtype=torch.float32, seed=0, pads=None, **bitmap_kwargs):
    g = torch.Generator().manual_seed(seed)
    Tq, N = T - q_offset, math.ceil(T / P)
    q = torch.randn(B, H, Tq, D, generator=g)
    k, v = torch.randn(B, Hk, T, D, generator=g), torch.randn(B, Hk, T, D, generator=g)
    bias = torch.randn(B, Hk, T, generator=g)
    offsets = None
    if pads is not None:
        offsets = torch.tensor(pads)
        for row, pad in enumerate(pads):
            bias[row, :, :pad] = MASK_VALUE
    bitmap = _nosa_bitmap(B, Hk, Tq, N, P, q_offset, offsets, g, **bitmap_kwargs)
    return (*(t.to(dtype) for t in (q, k, v)), bias, bitmap, offsets)


def _run(fn, q, k, v, bias, bitmap, upstream, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    out = fn(*leaves, bitmap, 0.3, **kwargs)
    (out.float() * upstream).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _compare(q, k, v, bias, bitmap, offsets, q_offset, P, tol, **kwargs):
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    common = dict(block_size=P, q_offset=q_offset, offsets=offsets)
    got = _run(sparse_module.sparse_train_attention, q, k, v, bias, bitmap, upstream, **common, **kwargs)
    want = _run(sparse_module.sparse_train_attention_ref, q.float(), k.float(), v.float(), bias, bitmap, upstream,
                **common)
    for name, actual, expected in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert actual.shape == expected.shape, name
        assert expected.abs().sum() > 0, f"{name} is zero: the comparison would prove nothing"
        assert_close(actual, expected, atol=tol, rtol=tol, msg=name)
    return got


CASES = [
    # B, H, Hk, T, q_offset, D, P, pads, tile, extra_tile, config
    (1, 8, 2, 80, 0, 16, 16, None, 32, 16, None),  # GQA 4: tiles of 8 tokens, extras tiles of 4
    (1, 4, 4, 70, 20, 16, 16, None, 16, 16, (32, 4, 1)),  # no GQA, 16-token extras tiles, 2 gathered in dK/dV
    (2, 4, 2, 72, 0, 16, 8, (11, 40), 32, 16, None),  # left padding not a whole block, blocks of 8
    (2, 4, 2, 90, 30, 16, 16, (5, 40), 32, 8, (64, 4, 1)),  # row 1's queries 30 .. 39 in the padding; 4-token extras
    (1, 6, 2, 80, 5, 24, 16, None, 32, 16, None),  # GQA 3 (tiles of 10 tokens, extras of 5), head dim 24
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:10])))
def test_split_matches_reference_with_gradients_interpreted(interpret, case):
    B, H, Hk, T, q_offset, D, P, pads, tile, extra_tile, config = case
    q, k, v, bias, bitmap, offsets = _inputs(B, H, Hk, T, q_offset, D, P, seed=T + H, pads=pads)
    plan = plan_module.split_plan(bitmap, heads=H, block_size=P, q_offset=q_offset, offsets=offsets, tile=tile,
                                  extra_tile=extra_tile)
    assert plan.counts.sum() > 0 and plan.extra_counts.sum() > 0  # both parts have work
    got = _compare(q, k, v, bias, bitmap, offsets, q_offset, P, 1e-4, tile=tile, extra_tile=extra_tile,
                   config=config, split=True)
    if pads is not None:  # keys inside the padding take no part
        for row, pad in enumerate(pads):
            assert got[2][row, :, :pad].abs().sum() == 0 and got[4][row, :, :pad].abs().sum() == 0


@needs_triton
def test_split_bf16_matches_reference_interpreted(interpret):
    q, k, v, bias, bitmap, offsets = _inputs(2, 8, 2, 64, 16, 32, 16, dtype=torch.bfloat16, seed=3, pads=(0, 21))
    got = _compare(q, k, v, bias, bitmap, offsets, 16, 16, 3e-2, tile=32, split=True)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16 and got[4].dtype == torch.float32


@needs_triton
@pytest.mark.parametrize("part", ["shared only", "extras only"])
def test_one_part_empty_interpreted(interpret, part):
    """Every token selecting the same blocks leaves the extras empty; sparse random selections leave the shared
    part (but for the own blocks) empty. Rows with nothing in one part merge by its -inf log-sum-exp."""
    B, H, Hk, T, P = 1, 4, 2, 64, 16
    q, k, v, bias, _, _ = _inputs(B, H, Hk, T, 0, 16, P, seed=7)
    if part == "shared only":
        bitmap = torch.zeros(B, Hk, T, 4, dtype=torch.bool)
        bitmap[..., [0, 2]] = True  # past and future blocks alike: the rule is what the bitmap says
    else:
        bitmap = torch.rand(B, Hk, T, 4, generator=torch.Generator().manual_seed(2)) < 0.3
    plan = plan_module.split_plan(bitmap, heads=H, block_size=P, tile=16)
    empty = plan.extra_counts if part == "shared only" else plan.counts
    assert empty.sum() == 0
    _compare(q, k, v, bias, bitmap, None, 0, P, 1e-4, tile=16, split=True)


@needs_triton
def test_union_path_still_matches_interpreted(interpret):
    q, k, v, bias, bitmap, offsets = _inputs(2, 4, 2, 70, 6, 16, 16, seed=5, pads=(0, 9))
    _compare(q, k, v, bias, bitmap, offsets, 6, 16, 1e-4, tile=32, split=False)


def _seen_by_plan(plan, bitmap, P, q_offset, offsets, T):
    """``[B, Hk, Tq, T]`` int: how many times each (query token, key) is visited by the plan's two parts."""
    B, Hk, Tq, N = bitmap.shape
    off = torch.zeros(B, dtype=torch.long) if offsets is None else offsets
    count = torch.zeros(B, Hk, Tq, T, dtype=torch.long)
    for b in range(B):
        keys = torch.arange(T) - off[b]  # row-relative
        real = keys >= 0
        block = torch.where(real, keys, 0) // P
        for t in range(Tq):
            pos = q_offset + t - int(off[b])
            i_t = t // plan.tokens
            first = q_offset + i_t * plan.tokens - int(off[b])
            last = q_offset + min(Tq, (i_t + 1) * plan.tokens) - 1 - int(off[b])
            own = set(range(max(first, 0) // P, last // P + 1)) if last >= 0 else set()
            i_e, bit = t // plan.extra_tokens, t % plan.extra_tokens
            for hk in range(Hk):
                whole = set(plan.blocks[b, hk, i_t, :int(plan.counts[b, hk, i_t])].tolist()) if pos >= 0 else set()
                extras = {int(n) for n, w in zip(plan.extra_blocks[b, hk, i_e, :int(plan.extra_counts[b, hk, i_e])],
                                                 plan.extra_bits[b, hk, i_e]) if (int(w) >> bit) & 1}
                for j in range(T):
                    if not real[j]:
                        continue
                    n = int(block[j])
                    seen = (n in whole) + (n in extras)
                    if n in own:
                        seen += bool(bitmap[b, hk, t, n]) or (pos >= 0 and n == pos // P and keys[j] <= pos)
                    count[b, hk, t, j] = seen
    return count


@pytest.mark.parametrize("G,tile,extra_tile,q_offset,pads", [(4, 16, 8, 0, None), (1, 8, 4, 13, None),
                                                             (3, 12, 6, 20, (0, 11)), (2, 16, 16, 0, (7, 30))])
def test_split_plan_covers_each_visible_key_once(G, tile, extra_tile, q_offset, pads):
    """Every key a token sees by the rule is visited exactly once over the two parts, and no other key."""
    from hf_nosa.attention.training import _positions, _token_mask

    B, Hk, P, T = 2, 2, 8, 48
    Tq, N = T - q_offset, math.ceil(T / P)
    offsets = torch.tensor(pads) if pads is not None else None
    g = torch.Generator().manual_seed(G + tile)
    bitmap = _nosa_bitmap(B, Hk, Tq, N, P, q_offset, offsets, g, extra=0.2)
    bitmap |= torch.rand(B, Hk, Tq, N, generator=g) < 0.05  # a few own, future and padding-query selections too
    plan = plan_module.split_plan(bitmap, heads=G * Hk, block_size=P, q_offset=q_offset, offsets=offsets, tile=tile,
                                  extra_tile=extra_tile)
    rule = _token_mask(bitmap, _positions(q_offset, T, offsets, "cpu"), T, P, offsets)
    if offsets is not None:  # keys inside the padding are never seen
        rule &= (torch.arange(T)[None, :] >= offsets[:, None])[:, None, None, :]
    assert torch.equal(_seen_by_plan(plan, bitmap, P, q_offset, offsets, T), rule.long())


@needs_triton
@pytest.mark.parametrize("G,tile,extra_tile,q_offset,pads,P", [
    (4, 32, 16, 0, None, 8), (3, 32, 16, 30, (5, 50), 8), (1, 16, 8, 0, None, 8), (1, 64, 32, 9, (0, 13), 8),
    (2, 32, 4, 3, (0, 2), 1),  # N = 70 blocks, 34 extras tiles: more than one words program along each
    (1, 2, 1, 5, (0, 3), 1),  # 33 shared tiles of 2 tokens: more than one shared-blocks program along each axis
])
def test_plan_kernels_equal_the_torch_plan_interpreted(interpret, G, tile, extra_tile, q_offset, pads, P):
    _check_plan_kernels(G, tile, extra_tile, q_offset, pads, P)


@needs_triton
def test_plan_kernels_across_program_boundaries_interpreted(interpret, monkeypatch):
    """Programs of 4 tiles x 32 blocks: several along both axes of the shared blocks and the extras words."""
    monkeypatch.setattr(plan_module, "SHARED_TILES", 4)
    monkeypatch.setattr(plan_module, "SHARED_BLOCKS", 32)
    monkeypatch.setattr(plan_module, "EXTRA_WORD_TILES", 4)
    monkeypatch.setattr(plan_module, "EXTRA_WORD_BLOCKS", 32)
    _check_plan_kernels(2, 16, 4, 3, (0, 2), 1)


@needs_triton
def test_a_tile_with_padding_shares_what_its_real_tokens_share_interpreted(interpret):
    """Every real token selects the last block and the padding selects nothing: a tile holding both shares the last
    block (its padding counts as having selected everything), a tile of padding shares nothing."""
    B, Hk, G, P, Tq, tokens = 2, 1, 2, 4, 24, 4
    offsets = torch.tensor([0, 10])  # row 1: tokens 0-9 padding, tile 2 (tokens 8-11) holds both
    real = torch.arange(Tq)[None, :] >= offsets[:, None]
    bitmap = torch.zeros(B, Hk, Tq, Tq // P, dtype=torch.bool)
    bitmap[..., -1] = real[:, None, :]
    kwargs = dict(heads=G * Hk, block_size=P, offsets=offsets, tile=tokens * G, extra_tile=2 * G)
    for kernels in (False, True):
        plan = plan_module.split_plan(bitmap, kernels=kernels, **kwargs)
        assert plan.counts[1, 0].tolist() == [0, 0, 1, 1, 1, 1], kernels  # blocks row-relative: none is own
        assert plan.blocks[1, 0, 2, 0] == Tq // P - 1 and int(plan.extra_counts[1].sum()) == 0
        assert plan.counts[0, 0].tolist() == [1, 1, 1, 1, 1, 0]  # row 0's last tile: the last block is its own


def _check_plan_kernels(G, tile, extra_tile, q_offset, pads, P):
    B, Hk, T = 2, 2, 70
    Tq, N = T - q_offset, math.ceil(T / P)
    offsets = torch.tensor(pads) if pads is not None else None
    g = torch.Generator().manual_seed(G)
    bitmap = _nosa_bitmap(B, Hk, Tq, N, P, q_offset, offsets, g) | (torch.rand(B, Hk, Tq, N, generator=g) < 0.05)
    kwargs = dict(heads=G * Hk, block_size=P, q_offset=q_offset, offsets=offsets, tile=tile, extra_tile=extra_tile)
    want = plan_module.split_plan(bitmap, kernels=False, **kwargs)
    got = plan_module.split_plan(bitmap, kernels=True, **kwargs)
    assert (got.tokens, got.extra_tokens) == (want.tokens, want.extra_tokens)
    for counts, lists in (("counts", ("blocks",)), ("tile_counts", ("tiles",)),
                          ("extra_counts", ("extra_blocks", "extra_bits")),
                          ("extra_tile_counts", ("extra_tiles", "extra_tile_bits"))):
        assert torch.equal(getattr(got, counts), getattr(want, counts)), counts
        listed = torch.arange(getattr(want, lists[0]).shape[-1]) < getattr(want, counts)[..., None]
        for name in lists:  # entries past a count are unspecified with the kernels
            assert torch.equal(getattr(got, name)[listed].long(), getattr(want, name)[listed].long()), name


def test_split_work_of_a_causal_selection():
    """Every token selecting every block before its own is causal attention: no extras, and the shared part's tiles
    (counted whole) cover the causal count."""
    B, Hk, G, P, T = 1, 2, 4, 16, 128
    N = T // P
    own = torch.arange(T) // P
    bitmap = (torch.arange(N)[None, :] < own[:, None]).expand(B, Hk, T, N).contiguous()
    plan = plan_module.split_plan(bitmap, heads=G * Hk, block_size=P, tile=64)  # 16 tokens: inside one block
    work = plan_module.split_work(plan, heads=G * Hk, block_size=P, queries=T)
    assert work["extra_tiles"] == 0 and work["extra_share"] == 0 and work["extra_blocks_per_token"] == 0
    causal = sum(int(o) + 1 for o in own) * Hk * G
    assert work["causal_row_blocks"] == causal
    assert work["shared_tiles"] == Hk * sum(int(o) + 1 for o in own[::16])  # blocks before the tile's, and its own
    assert work["shared_row_blocks"] >= causal and 1 <= work["shared_share"] < 1.2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_matches_reference_on_gpu(dtype):
    """The 1b shape's heads with the real selection (blocks of 64, a 1024-token budget), padded and not."""
    from hf_nosa import NosaConfig
    from hf_nosa.attention.training import selected_blocks

    cfg = NosaConfig(block_size=64, budget_tokens=1024, query_tokens=256, sink_tokens=64, local_tokens=256,
                     compress_kernel=32, compress_stride=16)
    for B, H, Hk, T, q_offset, pads in ((1, 32, 8, 4000, 0, None), (2, 8, 2, 3000, 700, (0, 333))):
        g = torch.Generator().manual_seed(T)
        q_all = torch.randn(B, H, T, 64, generator=g).to("cuda", dtype)
        k, v = (torch.randn(B, Hk, T, 64, generator=g).to("cuda", dtype) for _ in range(2))
        bias = torch.randn(B, Hk, T, generator=g).cuda()
        offsets = torch.tensor(pads).cuda() if pads is not None else None
        for row, pad in enumerate(pads or ()):
            bias[row, :, :pad] = MASK_VALUE
        bitmap = selected_blocks(q_all, k, bias, cfg, 0.125, offsets=offsets)[:, :, q_offset:]
        q = q_all[:, :, q_offset:]
        upstream = torch.randn(q.shape, generator=g).cuda()
        kwargs = dict(block_size=64, q_offset=q_offset, offsets=offsets)
        got = _run(sparse_module.sparse_train_attention, q, k, v, bias, bitmap, upstream, split=True, **kwargs)
        want = _run(sparse_module.sparse_train_attention_ref, q.float(), k.float(), v.float(), bias, bitmap,
                    upstream, **kwargs)
        for name, actual, expected in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
            error = float((actual.float() - expected).norm() / expected.norm())
            assert error < (1e-4 if dtype == torch.float32 else 1e-2), f"{name} T={T} {dtype}: {error:.2e}"
