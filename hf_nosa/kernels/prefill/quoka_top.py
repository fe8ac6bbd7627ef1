"""QUOKA's top blocks of one prefill chunk (``selection.quoka_select_blocks`` with one shared first block) in one
launch per chunk and layer.

The torch reference forces the sink and local blocks (a copy and three fills) and takes the top K with ties to the
most recent block (``selection.topk_recent_first``: flip, stable sort, index arithmetic, a gather and a where):
eleven launches, at batch 1 most of the selection's host time. Here a block's place in the order is its rank,
counted directly: the blocks scored higher, or scored the same and more recent, come before it. One program per
(row, tile of blocks) counts its blocks' ranks over all blocks and writes each block ranked below K to its place
(-1 for a block that is no candidate, as the reference's -inf). The ranks are a permutation, so every place gets
exactly one write, with no sort and no synchronisation between programs; the work is N^2 comparisons per row (N
blocks before the chunk: 1024 at 64K), spread over N / BLOCK_I programs.
"""

from __future__ import annotations

import torch

from ...config import NosaConfig
from ...rules.selection import quoka_select_blocks
from ..backend import HAS_TRITON, kernel_path, launcher, on_device, tl, triton

BLOCK_I = 64  # blocks ranked per program
BLOCK_J = 128  # blocks compared against per step

if HAS_TRITON:

    @triton.jit
    def _forced_scores(s_ptr, o, N, M, current, sink, local):
        """The scores of blocks ``o`` as the selection sees them: sink and local blocks +inf, blocks from
        ``current`` on (and past N, up to M: the padding to K) -inf."""
        s = tl.load(s_ptr + o, mask=o < N, other=float("-inf")).to(tl.float32)
        forced = (o < sink) | (o >= current - local)
        s = tl.where(forced, float("inf"), s)
        return tl.where((o >= current) | (o >= N), float("-inf"), s)

    @triton.jit(do_not_specialize=["N", "M", "K", "current", "stride_sr", "stride_or"])
    def _quoka_top_kernel(
        s_ptr, out_ptr, stride_sr, stride_or, N, M, K, current, sink, local,
        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
    ):
        """Program (row, tile of blocks): the ranks of blocks ``tile * BLOCK_I ..`` among the M; those below K
        written to their place."""
        i_row, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1)
        row = s_ptr + i_row * stride_sr
        o_i = i_t * BLOCK_I + tl.arange(0, BLOCK_I)
        s_i = _forced_scores(row, o_i, N, M, current, sink, local)
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, M, BLOCK_J):
            o_j = j0 + tl.arange(0, BLOCK_J)
            s_j = _forced_scores(row, o_j, N, M, current, sink, local)
            ahead = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (o_j[None, :] > o_i[:, None]))
            rank += tl.sum((ahead & (o_j < M)[None, :]).to(tl.int32), axis=1)
        block = tl.where(s_i == float("-inf"), -1, o_i).to(tl.int64)
        tl.store(out_ptr + i_row * stride_or + rank, block, mask=(rank < K) & (o_i < M))


def quoka_top_blocks_ref(scores: torch.Tensor, current_block: int, cfg: NosaConfig, budget_blocks: int) -> torch.Tensor:
    """The torch reference: ``selection.quoka_select_blocks`` with one shared first block."""
    return quoka_select_blocks(scores, current_block, cfg, budget_blocks=budget_blocks)


def quoka_top_blocks(scores: torch.Tensor, current_block: int, cfg: NosaConfig, budget_blocks: int) -> torch.Tensor:
    """Sink + local + the top-scored blocks before ``current_block``, ``budget_blocks`` (K) in all, ties to the most
    recent block: Triton on CUDA, torch elsewhere (``HF_NOSA_KERNELS`` forces one, see ``backend.py``).

    Args:
        scores: ``[B, Hk, R, N]`` block scores (``kernels.prefill.quoka_score``; NaN-free), of R chunks sharing their
        first
            block ``current_block``.

    Returns:
        ``[B, Hk, R, K]`` long block indices, -1 where fewer than K candidates exist.
    """
    if scores.dim() != 4:
        raise ValueError(f"quoka_top_blocks: scores must be [B, Hk, R, N], got shape {tuple(scores.shape)}")
    if isinstance(current_block, bool) or not isinstance(current_block, int) or current_block < 0:
        raise ValueError(f"quoka_top_blocks: current_block must be a non-negative int, got {current_block!r}")
    if isinstance(budget_blocks, bool) or not isinstance(budget_blocks, int) or budget_blocks < 0:
        raise ValueError(f"quoka_top_blocks: budget_blocks must be a non-negative int, got {budget_blocks!r}")
    if kernel_path("quoka_top_blocks", scores) == "torch":
        return quoka_top_blocks_ref(scores, current_block, cfg, budget_blocks)
    B, Hk, R, N = scores.shape
    K = budget_blocks
    out = torch.empty(B, Hk, R, K, dtype=torch.long, device=scores.device)
    M = max(N, K)  # the reference pads the scores to K with -inf
    if out.numel() == 0:
        return out
    flat = scores.reshape(B * Hk * R, N)
    with on_device(scores):
        launcher(_quoka_top_kernel)[(B * Hk * R, -(-M // BLOCK_I))](
            flat, out, flat.stride(0), K, N, M, K, current_block, cfg.sink_blocks, cfg.local_blocks,
            BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J,
        )
    return out
