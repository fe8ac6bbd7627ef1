"""QUOKA's kept queries of one prefill chunk (``selection.quoka_query_choice`` and the gather of those queries) in one
launch per chunk and layer.

Per query head, the ``n`` queries least similar (cosine) to the chunk's mean query stand in for the chunk
(design Sec. 4). The torch reference takes eight launches (a float copy, the mean, a matmul, the norms, a clamp, a
division, a top-k and the gather); at batch 1 the prefill is bound by the host issuing them. One program per
(sequence, query head) here averages the real queries, writes each query's cosine (real queries only; padding
after every real one) to a scratch row, and takes the lowest cosine left ``n`` times (the lower index among equal
ones), so the ``n`` kept queries come out in the reference's order (lowest cosine first; the reference's top-k
leaves the order of exact ties open). Sums run in float32 in another
order than torch's, so cosines may differ from the reference's in the last bits: the kept set differs only where
two cosines at the boundary lie that close.
"""

from __future__ import annotations

import torch

from ...rules.selection import quoka_query_choice
from ..backend import HAS_TRITON, kernel_path, launcher, next_power_of_2, on_device, tl, triton

BLOCK_T = 128  # queries per step (a 512-token chunk in 4)
REGISTER_ROW = 8192  # chunks up to this many queries keep a head's cosines in registers for the n passes
# The register row is at least this wide (masked past T): a prompt's last chunk has any length below the chunk
# size, and a width per power of two of it compiled a variant per bucket in the middle of a request stream.
MIN_REGISTER_ROW = 2048
# The cosine padding queries get: above every real one (cosines are bounded by the mean's norm), below +inf (kept).
PADDING = 3.0e38

if HAS_TRITON:

    @triton.jit(do_not_specialize=["T", "n", "stride_vb"])
    def _quoka_choice_kernel(
        q_ptr, valid_ptr, cos_ptr, out_ptr,
        stride_qb, stride_qh, stride_qt, stride_qd,
        stride_vb, stride_vt,
        stride_ob, stride_oh, stride_on, stride_od,
        H, T, D, n,
        HAS_VALID: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PADDING: tl.constexpr,
        BLOCK_ALL: tl.constexpr,
    ):
        """Program (sequence x query head): the head's ``n`` kept queries, lowest cosine to the mean first."""
        i_bh = tl.program_id(0)
        i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        q_row = q_ptr + i_b * stride_qb + i_h * stride_qh
        cos_row = cos_ptr + i_bh.to(tl.int64) * T

        # the mean of the real queries (all of them without padding)
        total = tl.zeros([BLOCK_D], dtype=tl.float32)
        count = tl.zeros([BLOCK_T], dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            o_t = t0 + tl.arange(0, BLOCK_T)
            real = o_t < T
            if HAS_VALID:
                real = real & (tl.load(valid_ptr + i_b * stride_vb + o_t * stride_vt, mask=o_t < T, other=0) != 0)
            q = tl.load(q_row + o_t[:, None] * stride_qt + o_d[None, :] * stride_qd,
                        mask=real[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            total += tl.sum(q, axis=0)
            count += real.to(tl.float32)
        mean = total / tl.maximum(tl.sum(count, axis=0), 1.0)

        # each query's cosine to the mean, up to the mean's norm (one positive number per head: same ranking);
        # padding gets PADDING (finite), so that a kept query, set to +inf below, is never kept again
        for t0 in range(0, T, BLOCK_T):
            o_t = t0 + tl.arange(0, BLOCK_T)
            q = tl.load(q_row + o_t[:, None] * stride_qt + o_d[None, :] * stride_qd,
                        mask=(o_t < T)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            norm = tl.sqrt(tl.sum(q * q, axis=1))
            cos = tl.sum(q * mean[None, :], axis=1) / tl.maximum(norm, 1e-12)
            if HAS_VALID:
                real = tl.load(valid_ptr + i_b * stride_vb + o_t * stride_vt, mask=o_t < T, other=0) != 0
                cos = tl.where(real, cos, PADDING)
            tl.store(cos_row + o_t, cos, mask=o_t < T)
        tl.debug_barrier()  # the row's cosines, written by every thread, are read by every thread below

        if BLOCK_ALL > 0:
            # The whole row in registers, each cosine and its index packed into one int64 whose order is the
            # cosine's, then the index's: a pass is one reduction, where the loop below reads the row from memory
            # in BLOCK_T pieces with two reductions and a barrier each (117 us a program at 2048 queries, H200).
            o_all = tl.arange(0, BLOCK_ALL)
            c_all = tl.load(cos_row + o_all, mask=o_all < T, other=float("inf"))
            bits = c_all.to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # float order as signed integers
            key = (ordered.to(tl.int64) << 32) | o_all.to(tl.int64)
            key = tl.where(o_all < T, key, 0x7FFFFFFFFFFFFFFF)
            for r in range(0, n):
                best = tl.min(key, axis=0)
                key = tl.where(key == best, 0x7FFFFFFFFFFFFFFF, key)
                best_i = (best & 0xFFFFFFFF).to(tl.int32)
                q = tl.load(q_row + best_i * stride_qt + o_d * stride_qd, mask=m_d)
                tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + r * stride_on + o_d * stride_od, q, mask=m_d)
            return

        # n passes, each keeping the lowest cosine left (the lower index among equal ones): O(n T), not the O(T^2)
        # of ranking every query against every other, which made 2048-token chunks pay 16x per program
        for r in range(0, n):
            best_c = tl.full([], float("inf"), tl.float32)
            best_i = tl.zeros([], dtype=tl.int32) + T
            for t0 in range(0, T, BLOCK_T):
                o_t = t0 + tl.arange(0, BLOCK_T)
                c = tl.load(cos_row + o_t, mask=o_t < T, other=float("inf"))
                c_min = tl.min(c, axis=0)
                i_min = tl.min(tl.where((c == c_min) & (o_t < T), o_t, T), axis=0)
                better = (c_min < best_c) | ((c_min == best_c) & (i_min < best_i))
                best_c = tl.where(better, c_min, best_c)
                best_i = tl.where(better, i_min, best_i)
            tl.debug_barrier()  # every thread has read the row before the kept query leaves it
            tl.store(cos_row + best_i, float("inf"))
            q = tl.load(q_row + best_i * stride_qt + o_d * stride_qd, mask=m_d)
            tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + r * stride_on + o_d * stride_od, q, mask=m_d)
            tl.debug_barrier()  # the store above is seen by every thread of the next pass


def quoka_kept_queries_ref(query: torch.Tensor, n_keep: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: ``selection.quoka_query_choice`` and the gather of the chosen queries."""
    queries = query[:, :, None]  # [B, H, 1, T, D]
    real = None if valid is None else valid[:, None, None]  # [B, 1, 1, T]
    index = quoka_query_choice(queries, n_keep, real)  # [B, H, 1, n]
    return queries.gather(3, index[..., None].expand(-1, -1, -1, -1, query.shape[-1]))


def quoka_kept_queries(query: torch.Tensor, n_keep: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per query head, the chunk's ``min(n_keep, T)`` queries least similar to its mean query, lowest cosine first:
    Triton on CUDA, torch elsewhere (``HF_NOSA_KERNELS`` forces one, see ``backend.py``).

    Args:
        query: ``[B, H, T, D]`` the chunk's queries.
        valid: ``[B, T]`` bool, False for padding (None: none): padding stays out of the mean and comes after
            every real query.

    Returns:
        ``[B, H, 1, n, D]`` in the query's dtype (one chunk: the shape ``kernels.prefill.quoka_score`` takes).
    """
    if query.dim() != 4:
        raise ValueError(f"quoka_kept_queries: query must be [B, H, T, D], got shape {tuple(query.shape)}")
    B, H, T, D = query.shape
    if isinstance(n_keep, bool) or not isinstance(n_keep, int) or n_keep < 1:
        raise ValueError(f"quoka_kept_queries: n_keep must be a positive int, got {n_keep!r}")
    if valid is not None and (tuple(valid.shape) != (B, T) or valid.dtype != torch.bool):
        raise ValueError(f"quoka_kept_queries: valid must be bool [B, T] = ({B}, {T}) or None, got "
                         f"{valid.dtype} {tuple(valid.shape)}")
    if kernel_path("quoka_kept_queries", query) == "torch":
        return quoka_kept_queries_ref(query, n_keep, valid)
    n = min(n_keep, T)
    out = torch.empty(B, H, 1, n, D, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    cos = torch.empty(B * H * T, dtype=torch.float32, device=query.device)
    has_valid = valid is not None
    flags = valid.view(torch.uint8) if has_valid else cos  # any tensor: never read without HAS_VALID
    valid_strides = flags.stride() if has_valid else (0, 0)
    with on_device(query):
        launcher(_quoka_choice_kernel)[(B * H,)](
            query, flags, cos, out, *query.stride(), *valid_strides,
            out.stride(0), out.stride(1), out.stride(3), out.stride(4),
            H, T, D, n, HAS_VALID=has_valid, BLOCK_T=BLOCK_T, BLOCK_D=max(16, next_power_of_2(D)), PADDING=PADDING,
            BLOCK_ALL=max(MIN_REGISTER_ROW, next_power_of_2(T)) if T <= REGISTER_ROW else 0,
            num_warps=8 if T > MIN_REGISTER_ROW else 4,
        )
    return out
