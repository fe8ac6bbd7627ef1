"""Training's selection kernels (``kernels/train_select.py``) against ``selection.py``.

The block scores must match ``query_block_scores``; the choice must be exactly ``select_blocks`` with
``eviction_block_scores`` on the same scores (it only compares, so nothing rounds), ties included; and
``training.selected_block_indices`` through the kernels must pick the torch path's blocks. CPU cases run the kernels
in the Triton interpreter (the ``interpret`` fixture) at small sizes; ``gpu`` cases run them compiled at the 1b
training shape.
"""

from __future__ import annotations

import pytest
import torch

import hf_nosa.attention.training as training
from hf_nosa import NosaConfig
from hf_nosa.kernels.train.train_select import (
    dynamic_blocks,
    train_block_scores,
    train_select_blocks,
    train_select_blocks_ref,
)
from hf_nosa.rules.selection import (
    MASK_VALUE,
    compress_keys,
    eviction_block_scores,
    num_windows,
    pool_windows_to_blocks,
    query_block_scores,
    window_offsets,
    windows_available,
)

from ..conftest import SPARSE, small_nosa_config
from ..utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = small_nosa_config()  # block 16, windows 8 / 4 (window 4n - 1 shared with block n - 1), K 8
NARROW = small_nosa_config(compress_kernel=2, compress_stride=1)  # 17 windows a block; block c - 1 always complete
FLUSH = small_nosa_config(compress_kernel=4, compress_stride=4)  # windows inside blocks: no block moves
NO_LOCAL = small_nosa_config(local_tokens=0)  # block c - 1 is not forced: its moving eviction score matters
ONE_LOCAL = small_nosa_config(**SPARSE)
WIDE = small_nosa_config(compress_kernel=16, compress_stride=8, local_tokens=0)  # windows as long as a block


def _inputs(B, H, Hk, T, D, seed, dtype=torch.float32, pads=()):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, T, D, generator=g).to(dtype)
    bias = torch.randn(B, Hk, T, generator=g)
    for row, pad in enumerate(pads):
        bias[row, :, :pad] = MASK_VALUE  # padding folded in, as the training path does
    return q, k, bias


def _rows(T, pads, q_offset=0):
    """Row-relative positions ``[B, Tq]`` of a left-padded batch (negative inside the padding)."""
    return torch.arange(q_offset, T)[None, :] - torch.tensor(pads)[:, None]


@pytest.mark.parametrize("block", [1, 2, 4, 16, 64])
def test_only_the_dynamic_blocks_miss_a_window(block):
    """The claim the choice kernel rests on, for every allowed geometry (stride <= kernel <= block, powers of two):
    at any token of block c, every window of the blocks before ``c - dynamic_blocks`` is complete, and where
    ``dynamic_blocks`` is 1, block c - 1 does miss one at the block's first token (the count is tight)."""
    stride = 1
    while stride <= block:
        for kernel in range(stride, block + 1, stride):
            cfg = NosaConfig(block_size=block, budget_tokens=block, query_tokens=0, sink_tokens=0, local_tokens=0,
                             compress_kernel=kernel, compress_stride=stride)
            R, offsets = window_offsets(cfg)
            dyn = dynamic_blocks(cfg)
            assert dyn in (0, 1)
            for c in range(1, 6):
                t = torch.arange(c * block, (c + 1) * block)
                available = windows_available(t, cfg)  # [P]
                for n in range(c):
                    windows = n * R + offsets
                    complete = bool((windows[windows >= 0][None, :] < available[:, None]).all())
                    if n < c - dyn:
                        assert complete, (block, stride, kernel, c, n)
                    else:
                        assert not complete, (block, stride, kernel, c, n)
        stride *= 2


@pytest.mark.parametrize("cfg", [SMALL, WIDE, NARROW])
def test_static_eviction_scores_hold_before_the_dynamic_blocks(cfg):
    """``eviction_block_scores`` per token equals the one static row (pooled over all windows) on every candidate
    before the dynamic blocks, and differs from it on block c - 1 somewhere when that block is dynamic."""
    T, P = 300, cfg.block_size
    cb = compress_keys(torch.randn(2, 3, T, generator=torch.Generator().manual_seed(1)), cfg)
    N = -(-T // P)
    per_token = eviction_block_scores(cb, torch.arange(T), N, cfg)  # [B, Hk, T, N]
    static = pool_windows_to_blocks(cb, N, cfg, fill=float("-inf"))  # [B, Hk, N]
    dyn = dynamic_blocks(cfg)
    moved = False
    for t in range(T):
        c = t // P
        assert torch.equal(per_token[:, :, t, : max(0, c - dyn)], static[:, :, : max(0, c - dyn)]), t
        if dyn and c >= 1:
            moved |= not torch.equal(per_token[:, :, t, c - 1], static[:, :, c - 1])
    assert moved == bool(dyn)


@pytest.mark.parametrize(
    "B,H,Hk,T,D,q_offset,pads,cfg",
    [(1, 1, 1, 20, 16, 0, (), SMALL),  # a few windows, fewer blocks than a tile
     (2, 8, 2, 150, 16, 0, (0, 37), SMALL),  # GQA 4, a padded row
     (2, 6, 2, 97, 24, 30, (), SMALL),  # group of 3 (padded to 4 rows), D 24, q_offset
     (1, 4, 1, 300, 16, 0, (), NARROW),  # 17 windows a block, two block tiles
     (1, 2, 2, 130, 64, 0, (0,), WIDE)],
)
def test_block_scores_match_query_block_scores(interpret, B, H, Hk, T, D, q_offset, pads, cfg):
    q, k, bias = _inputs(B, H, Hk, T, D, T + H, pads=pads)
    q = q[:, :, q_offset:]
    ck, cb = compress_keys(k, cfg), compress_keys(bias, cfg)
    N = -(-T // cfg.block_size)
    positions = torch.arange(q_offset, T)
    actual = train_block_scores(q, ck, positions, N, cfg, 0.25, compressed_bias=cb if pads else None)
    expected = query_block_scores(q, ck, positions, N, cfg, 0.25, compressed_bias=cb if pads else None)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    if window_offsets(cfg)[1][0] < 0:  # windows shared by neighbouring blocks
        assert_shared_windows_tie(actual, expected)


def assert_shared_windows_tie(actual, expected, allowed=0.0):
    """Where a window shared by blocks n and n + 1 is both blocks' maximum, the reference gives them bitwise equal
    scores and the choice breaks the tie by index; the kernel's scores must tie there too, or it picks another
    block than the decode path (on an H200, when each block computed the shared window itself, 2.5% of the ties
    broke). ``allowed``: the fraction that may break where the kernel rounds otherwise than the reference (a
    coincidental tie of two windows, or another window of one block within an ulp of the shared one)."""
    ties = (expected[..., 1:] == expected[..., :-1]) & (expected[..., 1:] > 0)
    assert ties.any(), "no shared-window ties to check"
    broken = int((actual[..., 1:] != actual[..., :-1])[ties].sum())
    assert broken <= allowed * int(ties.sum()), f"{broken} of {int(ties.sum())} exact ties broken"


def test_block_scores_at_row_positions(interpret):
    """``positions [B, Tq]``: rows of a left-padded batch at their row-relative positions, one with no window yet."""
    q, k, bias = _inputs(3, 4, 2, 90, 16, 11, pads=(0, 13, 85))
    ck, cb = compress_keys(k, SMALL), compress_keys(bias, SMALL)
    positions = _rows(90, (0, 13, 85))
    actual = train_block_scores(q, ck, positions, 6, SMALL, 0.25, compressed_bias=cb)
    assert_close(actual, query_block_scores(q, ck, positions, 6, SMALL, 0.25, compressed_bias=cb), atol=1e-6,
                 rtol=1e-5)


def test_block_scores_from_bf16_inputs(interpret):
    q, k, _ = _inputs(1, 4, 2, 80, 16, 3, dtype=torch.bfloat16)
    ck = compress_keys(k, SMALL)
    positions = torch.arange(80)
    actual = train_block_scores(q, ck, positions, 5, SMALL, 0.25)
    assert_close(actual, query_block_scores(q, ck, positions, 5, SMALL, 0.25), atol=1e-5, rtol=1e-4)


def _scores(B, Hk, Tq, N, seed, ties):
    """Query scores in [0, 1]: on a coarse grid (many exact ties, zeros among them) or continuous."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        return torch.randint(0, 5, (B, Hk, Tq, N), generator=g).float() / 4
    return torch.rand(B, Hk, Tq, N, generator=g)


def _bias(B, Hk, W, seed, ties, padding_windows=0):
    """Window means of the eviction scores, on a coarse grid or continuous; a padded row's first windows."""
    g = torch.Generator().manual_seed(seed)
    cb = torch.randint(-2, 3, (B, Hk, W), generator=g).float() / 2 if ties else torch.randn(B, Hk, W, generator=g)
    cb[-1, :, :padding_windows] = MASK_VALUE / 4
    return cb


@pytest.mark.parametrize(
    "cfg,B,Hk,T,q_offset,budget",
    [(SMALL, 2, 1, 150, 0, None), (NO_LOCAL, 1, 2, 200, 70, None), (ONE_LOCAL, 1, 1, 130, 0, None),
     (NARROW, 1, 1, 140, 0, None), (FLUSH, 1, 1, 120, 10, None), (WIDE, 1, 1, 170, 0, None),
     (SMALL, 1, 1, 100, 0, 2)],  # budget 2 < sink + local + query: the forced blocks tie for it
)
@pytest.mark.parametrize("ties", [True, False])
def test_choice_is_exactly_select_blocks(interpret, cfg, B, Hk, T, q_offset, budget, ties):
    N = -(-T // cfg.block_size)
    W = num_windows(T, cfg)
    qs = _scores(B, Hk, T - q_offset, N, T, ties)
    cb = _bias(B, Hk, W, T, ties, padding_windows=3)
    positions = torch.arange(q_offset, T)
    K = cfg.budget_blocks if budget is None else budget
    actual = train_select_blocks(qs, cb, positions, cfg, budget_blocks=budget)
    expected = train_select_blocks_ref(qs, cb, positions, cfg, K)
    assert actual.dtype == expected.dtype == torch.int16
    assert torch.equal(actual, expected)
    assert (actual == N).any() and (actual < N).any()  # short prefixes leave slots empty; later tokens fill them


@pytest.mark.parametrize("cfg", [SMALL, ONE_LOCAL, NARROW])
def test_choice_with_signed_zeros_and_padded_windows(interpret, cfg):
    """Eviction scores of -1, -0.0 and +0.0 (blocks tying across the sign of zero) and a row whose first windows are
    padding: the threshold search picks exactly the reference's blocks."""
    T, q_offset = 170, 20
    N, W = -(-T // cfg.block_size), num_windows(T, cfg)
    g = torch.Generator().manual_seed(3)
    cb = torch.tensor([-1.0, -0.0, 0.0])[torch.randint(0, 3, (2, 2, W), generator=g)]
    cb[1, :, :5] = MASK_VALUE / 4  # a padded row's first windows
    qs = _scores(2, 2, T - q_offset, N, 5, ties=True)
    positions = torch.arange(q_offset, T)
    static = pool_windows_to_blocks(cb, N, cfg, fill=float("-inf"))
    assert bool((static == 0).any()) and bool(torch.signbit(static[static == 0]).any())
    actual = train_select_blocks(qs, cb, positions, cfg)
    assert torch.equal(actual, train_select_blocks_ref(qs, cb, positions, cfg, cfg.budget_blocks))


@pytest.mark.parametrize("cfg", [NO_LOCAL, WIDE])
def test_choice_reads_block_c_minus_1_at_the_token(interpret, cfg):
    """Block c - 1 (not forced here) may miss its last window for a few tokens into block c: the choice must take its
    eviction score at the token, not the static one. Spikes on windows ``n * R + R - 1`` for odd n (block n's last
    window, also even block n + 1's first) make every complete block score high, and block c - 1 low for even c
    until its last window completes."""
    T, P = 200, cfg.block_size
    R, _ = window_offsets(cfg)
    N, W = -(-T // P), num_windows(T, cfg)
    spikes = ((torch.arange(W) + 1) % (2 * R) == 0).float()
    cb = torch.randn(1, 1, W, generator=torch.Generator().manual_seed(7)) + 10 * spikes
    qs = torch.zeros(1, 1, T, N)
    qs[..., : N // 2] = 1.0  # Q: the sink and the most recent early blocks, never block c - 1
    positions = torch.arange(T)
    actual = train_select_blocks(qs, cb, positions, cfg)
    assert torch.equal(actual, train_select_blocks_ref(qs, cb, positions, cfg, cfg.budget_blocks))
    c = positions // P
    chose_previous = (actual[0, 0] == (c - 1)[:, None].to(actual.dtype)).any(-1)
    contested = (c % 2 == 0) & (c > cfg.budget_blocks)  # more candidates than the budget
    assert not bool(chose_previous[contested & (positions % P == 0)].any())  # its last window is missing yet
    assert bool(chose_previous[contested & (positions % P == P - 1)].all())  # complete: it scores high


def test_choice_from_the_candidates_scores_only(interpret):
    """Scores of the first blocks only (every candidate's; the training path scores no more): the same choice, with
    the sequence's N for none."""
    T, q_offset = 150, 60
    N, W = -(-T // 16), num_windows(T, SMALL)
    qs = _scores(1, 2, T - q_offset, N, 8, ties=False)
    cb = _bias(1, 2, W, 9, ties=False)
    positions = torch.arange(q_offset, T)
    full = train_select_blocks(qs, cb, positions, SMALL)
    scored = (T - 1) // 16
    assert torch.equal(train_select_blocks(qs[..., :scored], cb, positions, SMALL, n_blocks=N), full)
    with pytest.raises(ValueError, match="n_blocks"):
        train_select_blocks(qs, cb, positions, SMALL, n_blocks=N - 1)


def test_choice_with_the_static_scores_pooled_once_by_its_caller(interpret):
    """A caller choosing chunk by chunk pools the static eviction scores once over all N blocks; each chunk's choice
    reads the first blocks it scored of them, on row-relative positions sliced from the caller's int32 ones."""
    T, pads = 150, (0, 37)
    N, W = -(-T // 16), num_windows(T, SMALL)
    qs = _scores(2, 2, T, N, 10, ties=True)
    cb = _bias(2, 2, W, 11, ties=True)
    positions = _rows(T, pads).to(torch.int32)
    static = pool_windows_to_blocks(cb, N, SMALL, fill=float("-inf"))
    for lo, hi in [(0, 64), (64, 150)]:
        scored = (hi - 1) // 16
        chunk = qs[:, :, lo:hi, :scored]
        expected = train_select_blocks_ref(chunk, cb, positions[:, lo:hi].long(), SMALL, SMALL.budget_blocks, N)
        actual = train_select_blocks(chunk, cb, positions[:, lo:hi], SMALL, n_blocks=N, static_scores=static)
        assert torch.equal(actual, expected)
        assert torch.equal(actual, train_select_blocks(chunk, cb, positions[:, lo:hi], SMALL, n_blocks=N))
    with pytest.raises(ValueError, match="static_scores"):
        train_select_blocks(qs, cb, positions, SMALL, static_scores=static[..., : N - 1])


def test_bad_static_scores_are_refused_on_the_torch_path_too():
    qs, cb = _scores(1, 2, 40, 3, 1, ties=False), _bias(1, 2, 8, 2, ties=False)
    with pytest.raises(ValueError, match="static_scores must be"):
        train_select_blocks(qs, cb, torch.arange(40), SMALL, static_scores=torch.zeros(1, 1, 3))


def test_choice_at_row_positions(interpret):
    """Left padding: row-relative positions ``[B, Tq]``, negative inside the padding (nothing selected there)."""
    T, pads = 120, (0, 21, 119)
    N, W = -(-T // 16), (T - 8) // 4 + 1
    qs = _scores(3, 1, T, N, 5, ties=True)
    cb = _bias(3, 1, W, 6, ties=False)
    positions = _rows(T, pads)
    actual = train_select_blocks(qs, cb, positions, SMALL)
    assert torch.equal(actual, train_select_blocks_ref(qs, cb, positions, SMALL, SMALL.budget_blocks))
    assert bool((actual[2] == N).all()) and bool((actual[1, :, :21] == N).all())


@pytest.mark.parametrize("cfg", [SMALL, NO_LOCAL])
@pytest.mark.parametrize("q_offset,pads,chunk", [(0, None, None), (37, None, 40), (0, (0, 37), 64)])
def test_selected_block_indices_through_the_kernels(interpret, monkeypatch, cfg, q_offset, pads, chunk):
    """The training selection through the kernels picks the torch path's blocks, in the same (ascending) order."""
    q, k, bias = _inputs(2, 8, 2, 150, 16, 12, pads=pads or ())
    q = q[:, :, q_offset:]
    offsets = None if pads is None else torch.tensor(pads)
    monkeypatch.setattr(training, "SELECTION_KERNEL", False)
    expected = training.selected_block_indices(q, k, bias, cfg, 0.25, q_offset=q_offset, offsets=offsets)
    monkeypatch.setattr(training, "SELECTION_KERNEL", True)
    actual = training.selected_block_indices(q, k, bias, cfg, 0.25, q_offset=q_offset, chunk_size=chunk,
                                             offsets=offsets)
    assert torch.equal(actual, expected)


def test_ties_go_to_the_most_recent_block(interpret, monkeypatch):
    """Keys repeating every block and a constant eviction bias: every complete block has the same windows, so query
    and eviction scores tie exactly (on a grid fp32 holds exactly) and the rule keeps the most recent blocks."""
    cfg = small_nosa_config(**SPARSE)
    g = torch.Generator().manual_seed(3)
    period = torch.randint(-1, 2, (1, 2, cfg.block_size, 16), generator=g).float()
    k = period.repeat(1, 1, 8, 1)  # [1, 2, 128, 16]
    q = torch.randint(-1, 2, (1, 4, 128, 16), generator=g).float()
    bias = torch.full((1, 2, 128), 0.5)
    monkeypatch.setattr(training, "SELECTION_KERNEL", False)
    expected = training.selected_block_indices(q, k, bias, cfg, 0.25)
    monkeypatch.setattr(training, "SELECTION_KERNEL", True)
    actual = training.selected_block_indices(q, k, bias, cfg, 0.25)
    assert torch.equal(actual, expected)
    # the last token (block 7): sink 0 and local 6 forced, then the most recent of the tied rest: 5, then 4
    assert actual[0, 0, -1].tolist() == [0, 4, 5, 6]


def test_torch_path_is_the_reference():
    q, k, bias = _inputs(1, 4, 2, 100, 16, 2)
    ck, cb = compress_keys(k, SMALL), compress_keys(bias, SMALL)
    positions = torch.arange(100)
    qs = train_block_scores(q, ck, positions, 7, SMALL, 0.25, compressed_bias=cb)
    assert torch.equal(qs, query_block_scores(q, ck, positions, 7, SMALL, 0.25, compressed_bias=cb))
    assert torch.equal(train_select_blocks(qs, cb, positions, SMALL),
                       train_select_blocks_ref(qs, cb, positions, SMALL, SMALL.budget_blocks))


def test_bad_inputs_name_the_field():
    q, k, bias = _inputs(1, 4, 2, 60, 16, 4)
    ck, cb = compress_keys(k, SMALL), compress_keys(bias, SMALL)
    positions = torch.arange(60)
    with pytest.raises(ValueError, match="H % Hk"):
        train_block_scores(q[:, :3], ck, positions, 4, SMALL, 0.25)
    with pytest.raises(ValueError, match="positions"):
        train_block_scores(q, ck, positions[:-1], 4, SMALL, 0.25)
    with pytest.raises(ValueError, match="compressed_bias"):
        train_block_scores(q, ck, positions, 4, SMALL, 0.25, compressed_bias=cb[:, :1])
    qs = torch.rand(1, 2, 60, 4)
    with pytest.raises(ValueError, match="budget_blocks"):
        train_select_blocks(qs, cb, positions, SMALL, budget_blocks=0)
    with pytest.raises(ValueError, match="query_scores"):
        train_select_blocks(qs[0], cb, positions, SMALL)
    with pytest.raises(ValueError, match="compressed_bias"):
        train_select_blocks(qs, cb[:, :, None], positions, SMALL)
    with pytest.raises(ValueError, match="positions"):
        train_select_blocks(qs, cb, positions.float(), SMALL)


@pytest.mark.gpu
@pytest.mark.parametrize("pads", [None, (0, 700)])
def test_kernels_at_the_1b_training_shape(monkeypatch, pads):
    """Compiled, at the 1b shape (H 32, Hk 8, D 64, bf16) and the paper's rule (block 64, windows 32 / 16, K 64):
    the scores match the reference's, the choice is exactly the reference's on the kernel's scores, and the whole
    selection differs from the torch path's in at most a near-tie of a few tokens."""
    from hf_nosa.rules.padding import to_rows

    cfg = NosaConfig()
    B, T = (1, 8192) if pads is None else (2, 4096)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, h, T, 64, generator=g).to("cuda", torch.bfloat16) for h in (32, 8))
    bias = 0.1 * torch.randn(B, 8, T, generator=g).cuda()
    offsets = None if pads is None else torch.tensor(pads, device="cuda")
    keys, row_bias = (k, bias) if offsets is None else (to_rows(k, offsets), to_rows(bias, offsets, fill=MASK_VALUE))
    ck, cb = compress_keys(keys, cfg), compress_keys(row_bias, cfg)
    N = T // cfg.block_size
    lo = T - 1024  # the last tokens: the most windows and blocks
    positions = torch.arange(lo, T, device="cuda")
    if offsets is not None:
        positions = positions - offsets[:, None]
    scale = 64**-0.5
    qs = train_block_scores(q[:, :, lo:], ck, positions, N, cfg, scale, compressed_bias=cb)
    expected_qs = query_block_scores(q[:, :, lo:], ck, positions, N, cfg, scale, compressed_bias=cb)
    assert_close(qs, expected_qs, atol=1e-5, rtol=1e-4)
    assert_shared_windows_tie(qs, expected_qs, allowed=1e-4)  # 1 of 104,865 at 4e446fe
    assert torch.equal(train_select_blocks(qs, cb, positions, cfg),
                       train_select_blocks_ref(qs, cb, positions, cfg, cfg.budget_blocks))
    monkeypatch.setattr(training, "SELECTION_KERNEL", True)
    actual = training.selected_block_indices(q, k, bias, cfg, scale, offsets=offsets)
    monkeypatch.setattr(training, "SELECTION_KERNEL", False)
    expected = training.selected_block_indices(q, k, bias, cfg, scale, offsets=offsets)
    differing = (actual != expected).any(-1).float().mean().item()
    assert differing <= 1e-3, differing
