"""The QUOKA top-blocks kernel against its torch reference (``selection.quoka_select_blocks``).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` case runs the
compiled kernel at a 64K prompt's sizes.
"""

import importlib

import pytest
import torch

from hf_nosa.rules.selection import QUOKA_PADDING_SCORE

from ..conftest import small_nosa_config

top_module = importlib.import_module("hf_nosa.kernels.prefill.quoka_top")


def _scores(B, Hk, R, N, seed, device="cpu"):
    """Random scores with what the score kernel gives besides: ties (a coarse grid), -inf (no window) and the
    padding score."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (B, Hk, R, N), generator=g).float() / 4
    scores[torch.rand(B, Hk, R, N, generator=g) < 0.15] = float("-inf")
    scores[torch.rand(B, Hk, R, N, generator=g) < 0.1] = QUOKA_PADDING_SCORE
    return scores.to(device)


@pytest.mark.parametrize(
    "B,Hk,R,N,current,K",
    [
        (1, 1, 1, 10, 10, 6),  # fewer blocks than one tile
        (2, 3, 1, 150, 150, 40),  # several tiles of blocks and of comparisons
        (1, 2, 2, 300, 300, 24),  # two chunks sharing the first block
        (2, 2, 1, 20, 20, 30),  # fewer candidates than the budget: -1 padding
        (1, 2, 1, 90, 60, 20),  # scores past the first block: never chosen
        (1, 1, 1, 0, 0, 4),  # nothing to choose
    ],
)
def test_kernel_matches_reference(interpret, B, Hk, R, N, current, K):
    cfg = small_nosa_config()
    scores = _scores(B, Hk, R, N, seed=N + K)
    expected = top_module.quoka_top_blocks_ref(scores, current, cfg, K)
    actual = top_module.quoka_top_blocks(scores, current, cfg, K)
    assert actual.dtype == torch.long and actual.shape == (B, Hk, R, K)
    assert torch.equal(actual, expected)


def test_reference_forces_sink_and_local_and_breaks_ties_to_recent_blocks():
    """The reference's contract by hand: sink and local first (most recent first), then the top scores, ties to
    the more recent block, no block from the chunk's first on."""
    cfg = small_nosa_config()
    sink, local = cfg.sink_blocks, cfg.local_blocks
    N = sink + local + 6
    scores = torch.zeros(1, 1, 1, N + 2)
    rest = list(range(sink, N - local))
    scores[..., rest] = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.9, 0.2])
    scores[..., N:] = 5.0  # the chunk's own blocks: never candidates
    chosen = top_module.quoka_top_blocks_ref(scores, N, cfg, sink + local + 4)[0, 0, 0].tolist()
    forced = list(range(N - 1, N - local - 1, -1)) + list(range(sink - 1, -1, -1))
    assert chosen == forced + [rest[4], rest[1], rest[2], rest[0]]


def test_bad_arguments_are_value_errors():
    cfg = small_nosa_config()
    with pytest.raises(ValueError, match="scores must be"):
        top_module.quoka_top_blocks(torch.zeros(2, 3, 4), 2, cfg, 2)
    with pytest.raises(ValueError, match="current_block"):
        top_module.quoka_top_blocks(torch.zeros(1, 1, 1, 4), -1, cfg, 2)
    with pytest.raises(ValueError, match="budget_blocks"):
        top_module.quoka_top_blocks(torch.zeros(1, 1, 1, 4), 2, cfg, 2.0)


@pytest.mark.gpu
def test_kernel_matches_reference_gpu():
    from hf_nosa import NosaConfig

    cfg = NosaConfig()
    scores = _scores(4, 8, 1, 1016, seed=5, device="cuda")
    expected = top_module.quoka_top_blocks_ref(scores, 1016, cfg, cfg.prefill_budget_blocks)
    actual = top_module.quoka_top_blocks(scores, 1016, cfg, cfg.prefill_budget_blocks)
    assert torch.equal(actual, expected)
