"""The selection as a bitmap: ``[B, Hk, Tq, K]`` block indices -> ``[B, Hk, Tq, N]`` bool, True at each index.

The training attention holds each token's selection as indices (``training.selected_block_indices``: K entries,
``N`` where fewer than K blocks exist) and its plan and kernels read it as a bitmap. At 64K in the 1b shape the
bitmap is 0.5 GB per layer, built twice a step (the forward and gradient checkpointing's rerun). In torch that is a
zeroed ``N + 1``-column tensor, an int64 copy of the indices for ``scatter_``, and a copy of the first N columns:
about 1.8 ms a layer on an H200. Here the bitmap is zeroed by one memset and the kernel sets the bits of the
indices read as they are (no int64 copy, no column cut): a pass over the bitmap and one over the indices.

``selection_bitmap_ref`` is the torch reference; ``tests/kernels/test_selection_bitmap.py`` holds the kernel to it.
"""

from __future__ import annotations

import torch

from ..backend import HAS_TRITON, kernel_path, launcher, next_power_of_2, on_device, tl, triton

# Rows (query tokens of one sequence and KV head) per program.
ROWS = 32

if HAS_TRITON:

    @triton.jit(do_not_specialize=["rows", "N"])
    def _bitmap_kernel(idx_ptr, out_ptr, rows, N, K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
        """Set the bits of ``ROWS`` rows' indices in a zeroed bitmap (entries outside ``0 .. N - 1``: none)."""
        i = tl.program_id(0)
        o_r = i * ROWS + tl.arange(0, ROWS)
        o_k = tl.arange(0, BLOCK_K)
        m_k = (o_r < rows)[:, None] & (o_k < K)[None, :]
        b_idx = tl.load(idx_ptr + o_r.to(tl.int64)[:, None] * K + o_k[None, :], mask=m_k, other=0).to(tl.int32)
        tl.store(out_ptr + o_r.to(tl.int64)[:, None] * N + b_idx, tl.full([ROWS, BLOCK_K], 1, dtype=tl.int8),
                 mask=m_k & (b_idx >= 0) & (b_idx < N))


def selection_bitmap_ref(indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``[..., K]`` integer block indices (``n_blocks`` or more, or negative: none) -> ``[..., n_blocks]`` bool."""
    bitmap = torch.zeros(*indices.shape[:-1], n_blocks + 1, dtype=torch.bool, device=indices.device)
    index = indices.long()
    index = torch.where((index >= 0) & (index < n_blocks), index, n_blocks)
    return bitmap.scatter_(-1, index, True)[..., :n_blocks].contiguous()


def selection_bitmap(indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``selection_bitmap_ref`` through ``_bitmap_kernel`` on CUDA (``kernels/backend.py`` picks the path).

    Args:
        indices: ``[..., K]`` int16/int32/int64 block indices; entries outside ``0 .. n_blocks - 1`` select nothing.
        n_blocks: N, the bitmap's last dimension.

    Returns:
        ``[..., N]`` contiguous bool.

    Example:
        >>> selection_bitmap(torch.tensor([[0, 2, 3]]), 3).tolist()
        [[True, False, True]]
    """
    if n_blocks < 0:
        raise ValueError(f"selection_bitmap: n_blocks={n_blocks} is invalid: it must be >= 0")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.dim() < 1:
        raise ValueError(f"selection_bitmap: indices must be an integer tensor [..., K]; got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if kernel_path("selection_bitmap", indices) == "torch":
        return selection_bitmap_ref(indices, n_blocks)
    K = indices.shape[-1]
    indices = indices.contiguous()
    out = torch.zeros(*indices.shape[:-1], n_blocks, dtype=torch.bool, device=indices.device)
    rows = out.numel() // max(1, n_blocks)
    if rows and n_blocks and K:
        with on_device(indices):
            launcher(_bitmap_kernel)[(triton.cdiv(rows, ROWS),)](
                indices, out.view(torch.int8), rows, n_blocks, K=K, BLOCK_K=max(2, next_power_of_2(K)), ROWS=ROWS)
    return out
