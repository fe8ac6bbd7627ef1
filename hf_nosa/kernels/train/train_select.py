"""Training's block selection for every query token on the device: block scores, then the choice (design Sec. 3.3,
3.4).

``training.selected_block_indices`` applies the decode rule of ``rules/selection.py`` to every query token of a
sequence. In torch that materialises per-token window scores (``[B, H, Tq, W]`` logits, ``[B, Hk, Tq, W]`` eviction
scores), gathers them to blocks and sorts every token's N blocks twice; at 32K tokens that cost more than dense
attention's forward and backward. Two kernels instead, neither of which writes anything per window:

1. ``_block_scores_kernel``, one program per (sequence, KV head, tile of query tokens): the query-aware block score
   of ``selection.query_block_scores``. The G query heads of the group are rows of one tile (row = (token, head)).
   Pass 1 runs an online softmax over each row's complete windows that are not padding windows. Pass 2, per tile
   of blocks and per offset j < R, one dot with the keys of windows ``n * R + j`` (those starting in block n): the
   probabilities are summed over the group and max-pooled into the block at once. Block n also overlaps the last
   -OFF0 windows of block n - 1 (``selection.window_offsets``: for P=64, kernel 32, stride 16, windows 4n-1 .. 4n+3);
   their max moves one block to the right by a gather, so that a window shared by two blocks gives both bitwise
   the same value, as in the reference, whose exact ties the choice breaks by index. Out: ``[B, Hk, Tq, Ns]`` fp32
   (the first Ns blocks), 0 where the reference has 0.
2. ``_choice_kernel``, one program per (sequence, KV head, tile of query tokens): ``selection.select_blocks`` for
   each token, with the exact threshold top-k of ``block_scores._top_mask`` per row (bisection over
   order-preserving integer keys, then the most recent of the ties) instead of sorting. Out: ``[B, Hk, Tq, K]``
   block indices in ascending order, N after them (the order of ``block_scores``; consumers use the set). Its
   work grows with the blocks scored, so the training path scores only its chunk's candidates. Filling the budget
   after Q by walking the eviction scores' static order instead of a second threshold search was tried and
   measured 2.6x slower per layer at 64K on an H200 (46 ms against 18 ms:
   ``docs/results/2026-12-04_selection_tiles_64k_beaec9d.json``).

The eviction block score (``selection.eviction_block_scores``: per block, the max of its windows' mean b over the
windows complete at the token) is query-agnostic wherever a block's windows are all complete. At any token of block
c the windows of block n are all complete for ``n <= c - 1 - DYN`` with ``DYN = ceil((P - stride + kernel - 1) /
P) - 1`` (``dynamic_blocks``), which the config's constraints (stride <= kernel <= block_size, powers of two) keep
at 0 or 1: only block c - 1 can still miss its last window (for P=64, kernel 32, stride 16: window 4c-1 completes
at token 64c + 15). So the choice reads one static ``[B, Hk, N]`` row (pooled over all windows) and recomputes
block c - 1 per token from the window means.

The torch references are ``selection.query_block_scores`` and ``train_select_blocks_ref`` (``select_blocks`` in
this output format). Both kernels compute in fp32 from bf16 or fp32 inputs; only the block scores round (summation
order), so the choice is bit-exact given the same scores, and against the reference's own scores differs at most
where two blocks' scores are within rounding of each other.
"""

from __future__ import annotations

import math

import torch

from ...config import NosaConfig
from ...rules.selection import (
    PADDING_WINDOW_BIAS,
    eviction_block_scores,
    pool_windows_to_blocks,
    query_block_scores,
    select_blocks,
    window_offsets,
)
from ..backend import HAS_TRITON, interpreting, kernel_path, launcher, next_power_of_2, on_device, tl, triton

# GPU tiles, from a sweep on an H200 at the 1b shape and 32K tokens. Block scores: (token, head) rows, windows
# (pass 1) and blocks (pass 2) per tile; 1.23 ms for the last 8K tokens, as fast as the best of 7 tiles tried (to 1.66).
# Choice: CHOICE_WARP_SCORES scores (tokens x blocks scored, padded to a power of two) per warp, a program's tokens
# together: one token per warp keeps each row's counts inside a warp, 0.69 ms for the last 8K tokens against 1.82 ms
# with 8 tokens on 4 warps.
SCORES_ROWS, SCORES_BLOCK_W, SCORES_BLOCK_N, SCORES_WARPS = 64, 128, 32, 4
CHOICE_WARP_SCORES = 512

if HAS_TRITON:

    @triton.jit
    def _window_logits(b_q, p_k, p_c, o_w, m_w, n_r, o_d, m_d, stride_kw, scale,
                       HAS_PAD: tl.constexpr, PAD_BIAS: tl.constexpr, IEEE: tl.constexpr):
        """Logits ``[rows, windows]`` of the windows ``o_w`` (``m_w``: those that exist), and which of them count for
        each row: complete at the row's token (``< n_r``) and not padding windows."""
        b_k = tl.load(p_k + o_w[:, None] * stride_kw + o_d[None, :], mask=m_w[:, None] & m_d[None, :], other=0.0)
        if HAS_PAD:
            b_c = tl.load(p_c + o_w, mask=m_w, other=0.0)
            m_w = m_w & (b_c >= PAD_BIAS)
        ok = m_w[None, :] & (o_w[None, :] < n_r[:, None])
        if IEEE:
            b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        return b_s * scale, ok

    @triton.jit
    def _block_scores_kernel(
        q_ptr, ck_ptr, cb_ptr, pos_ptr, out_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kw, stride_cb, stride_ch, stride_pb,
        stride_ob, stride_oh, stride_ot,
        Tq, N, scale,
        HK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
        R: tl.constexpr, OFF0: tl.constexpr, KER: tl.constexpr, STRIDE: tl.constexpr,
        HAS_PAD: tl.constexpr, PAD_BIAS: tl.constexpr, IEEE: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_t = tl.program_id(1)
        i_b = i_bh // HK
        i_h = i_bh % HK
        ROWS: tl.constexpr = BLOCK_T * G_PAD
        # Row r is token r // G_PAD and head r % G_PAD of the group: one dot covers the group, and the sum over
        # the group is a reshape.
        o_r = tl.arange(0, ROWS)
        r_t = i_t * BLOCK_T + o_r // G_PAD
        r_g = o_r % G_PAD
        m_r = (r_t < Tq) & (r_g < G)
        o_d = tl.arange(0, D_PAD)
        m_d = o_d < D
        pos = tl.load(pos_ptr + i_b * stride_pb + r_t, mask=m_r, other=-1)
        # complete windows at each row's token (selection.windows_available); none on padded rows, so they add 0
        n_r = tl.where(m_r & (pos + 1 >= KER), (pos + 1 - KER) // STRIDE + 1, 0)
        w_hi = tl.max(n_r, axis=0)
        p_q = (q_ptr + i_b.to(tl.int64) * stride_qb + (i_h * G + r_g)[:, None] * stride_qh
               + r_t[:, None].to(tl.int64) * stride_qt + o_d[None, :])
        b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
        if IEEE:
            b_q = b_q.to(tl.float32)
        p_k = ck_ptr + i_b.to(tl.int64) * stride_kb + i_h * stride_kh
        p_c = cb_ptr + i_b.to(tl.int64) * stride_cb + i_h * stride_ch

        # Pass 1: softmax statistics per row over its counted windows.
        b_m = tl.full([ROWS], float("-inf"), tl.float32)
        b_l = tl.zeros([ROWS], tl.float32)
        for w0 in range(0, w_hi, BLOCK_W):
            o_w = w0 + tl.arange(0, BLOCK_W)
            b_s, ok = _window_logits(b_q, p_k, p_c, o_w, o_w < w_hi, n_r, o_d, m_d, stride_kw, scale,
                                     HAS_PAD, PAD_BIAS, IEEE)
            b_s = tl.where(ok, b_s, float("-inf"))
            m_new = tl.maximum(b_m, tl.max(b_s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            b_l = b_l * tl.exp(b_m - m_use) + tl.sum(tl.exp(b_s - m_use[:, None]), 1)
            b_m = m_new
        # a row without a counted window gives 0 everywhere (the reference's nan_to_num)
        b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
        b_inv = 1.0 / tl.where(b_l > 0, b_l, 1.0)  # a product per window, not a division (rounds alike to an ulp)

        # Pass 2: per block, the max over its windows of the group's summed probability; 0 for missing windows
        # (pool_windows_to_blocks' fill) and for blocks past every window of the tile. Each window is computed
        # once, by the block it starts in (offsets 0 .. R - 1); the last -OFF0 of them also overlap the next block,
        # which takes their max (the tail) one column to the right, from the previous tile for the first column.
        # Computing a shared window twice, once per block, gave its two blocks values an ulp apart on an H200 and
        # broke the reference's exact ties (about 2% of them, so other blocks than the decode path's).
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
        n_hi = (w_hi - OFF0 + R - 1) // R  # blocks with a window before w_hi
        p_o = out_ptr + i_b.to(tl.int64) * stride_ob + i_h * stride_oh + o_t[:, None].to(tl.int64) * stride_ot
        o_c = tl.arange(0, BLOCK_N)
        previous = tl.broadcast_to(tl.maximum(o_c - 1, 0)[None, :], [BLOCK_T, BLOCK_N])
        b_carry = tl.zeros([BLOCK_T], tl.float32)  # the tail of the block before the tile (none before block 0)
        for n0 in range(0, N, BLOCK_N):
            o_n = n0 + o_c
            b_acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            if n0 < n_hi:
                b_tail = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
                for j in range(R):
                    o_w = o_n * R + j
                    b_s, ok = _window_logits(b_q, p_k, p_c, o_w, o_w < w_hi, n_r, o_d, m_d,
                                             stride_kw, scale, HAS_PAD, PAD_BIAS, IEEE)
                    b_p = tl.exp(tl.where(ok, b_s, float("-inf")) - b_m[:, None]) * b_inv[:, None]
                    b_g = tl.sum(tl.reshape(b_p, [BLOCK_T, G_PAD, BLOCK_N]), 1)
                    b_acc = tl.maximum(b_acc, b_g)
                    if j >= R + OFF0:
                        b_tail = tl.maximum(b_tail, b_g)
                b_left = tl.where(o_c[None, :] == 0, b_carry[:, None], tl.gather(b_tail, previous, 1))
                b_acc = tl.maximum(b_acc, b_left)
                b_carry = tl.max(tl.where(o_c[None, :] == BLOCK_N - 1, b_tail, 0.0), 1)
            tl.store(p_o + o_n[None, :], b_acc, mask=(o_t < Tq)[:, None] & (o_n < N)[None, :])

    @triton.jit
    def _top_rows(x, k: tl.constexpr):
        """Per row of ``x [rows, n]``, the mask of its k largest entries, ties to the highest index; -inf never.

        ``block_scores._top_mask`` row by row: bisection over order-preserving integer keys for a threshold v, the
        k-th largest key or any v with exactly k keys >= v (found first where the k-th and the next differ by more
        than rounding: about 15 halvings instead of 32 on real scores), then the most recent entries tied at it.
        """
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are one value, as in torch.sort
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # integer order == float order
        real = x != float("-inf")
        n_real = tl.sum(real.to(tl.int32), 1)
        bottom = tl.min(key, 1)
        # invariant: at least k keys >= lo, and the threshold <= hi; a row with at most k real entries takes them all
        lo = tl.where(n_real > k, tl.min(tl.where(real, key, 2147483647), 1), bottom).to(tl.int64)
        hi = tl.where(n_real > k, tl.max(key, 1), bottom).to(tl.int64)
        while tl.max(hi - lo, 0) > 0:
            mid = lo + (hi - lo + 1) // 2
            count = tl.sum((key >= mid.to(tl.int32)[:, None]).to(tl.int32), 1)
            enough = count >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(count == k, mid, tl.where(enough, hi, mid - 1))
        threshold = lo.to(tl.int32)[:, None]
        above = key > threshold
        tied = (key == threshold).to(tl.int32)
        need = k - tl.sum(above.to(tl.int32), 1)
        later_ties = tl.sum(tied, 1)[:, None] - tl.cumsum(tied, 1)  # tied entries with a higher index
        chosen = above | ((tied > 0) & (later_ties < need[:, None]))
        return chosen & real

    @triton.jit
    def _choice_kernel(
        qs_ptr, es_ptr, cb_ptr, pos_ptr, out_ptr,
        stride_qb, stride_qh, stride_qt, stride_eb, stride_eh, stride_cb, stride_ch, stride_pb,
        stride_ob, stride_oh, stride_ot,
        Tq, N, NONE,
        HK: tl.constexpr, BLOCK_T: tl.constexpr, N_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
        N_Q: tl.constexpr, P: tl.constexpr, SINK: tl.constexpr, LOCAL: tl.constexpr, R: tl.constexpr,
        OFF0: tl.constexpr, M: tl.constexpr, KER: tl.constexpr, STRIDE: tl.constexpr, DYN: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_t = tl.program_id(1)
        i_b = i_bh // HK
        i_h = i_bh % HK
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < Tq
        pos = tl.load(pos_ptr + i_b * stride_pb + o_t, mask=m_t, other=-1)
        c = tl.where(pos >= 0, pos // P, -1)  # the token's own block; candidates are the blocks before it
        n_av = tl.where(pos + 1 >= KER, (pos + 1 - KER) // STRIDE + 1, 0)
        o_n = tl.arange(0, N_PAD)
        valid = (o_n[None, :] < c[:, None]) & (o_n < N)[None, :]

        # Q: the sink blocks and the local window (+inf), then the best query scores; N_Q in all
        p_qs = (qs_ptr + i_b.to(tl.int64) * stride_qb + i_h * stride_qh + o_t[:, None].to(tl.int64) * stride_qt
                + o_n[None, :])
        qs = tl.load(p_qs, mask=valid, other=0.0)
        forced = valid & ((o_n[None, :] < SINK) | (o_n[None, :] >= (c - LOCAL)[:, None]))
        qs = tl.where(valid, tl.where(forced, float("inf"), qs), float("-inf"))
        in_q = _top_rows(qs, N_Q)

        # eviction scores: the static row, and the blocks whose windows may not all be complete yet per token
        es_row = tl.load(es_ptr + i_b.to(tl.int64) * stride_eb + i_h * stride_eh + o_n, mask=o_n < N,
                         other=float("-inf"))
        es = tl.where(valid, es_row[None, :], float("-inf"))
        p_c = cb_ptr + i_b.to(tl.int64) * stride_cb + i_h * stride_ch
        for i in tl.static_range(DYN):
            n_i = c - 1 - i
            b_e = tl.full([BLOCK_T], float("-inf"), tl.float32)
            for j in range(M):
                w = n_i * R + (OFF0 + j)
                ok = m_t & (n_i >= 0) & (w >= 0) & (w < n_av)
                b_e = tl.maximum(b_e, tl.load(p_c + w, mask=ok, other=float("-inf")))
            es = tl.where(valid & (o_n[None, :] == n_i[:, None]), b_e[:, None], es)
        es = tl.where(in_q, float("inf"), es)
        chosen = _top_rows(es, K)

        # ascending block indices, NONE after them
        p_o = out_ptr + i_b.to(tl.int64) * stride_ob + i_h * stride_oh + o_t[:, None].to(tl.int64) * stride_ot
        picked = chosen.to(tl.int32)
        rank = tl.cumsum(picked, 1) - 1
        blocks = o_n[None, :] + tl.zeros([BLOCK_T, N_PAD], tl.int32)
        tl.store(p_o + rank, blocks.to(out_ptr.dtype.element_ty), mask=chosen & m_t[:, None])
        o_k = tl.arange(0, K_PAD)
        n_chosen = tl.sum(picked, 1)
        none = (NONE + tl.zeros([BLOCK_T, K_PAD], tl.int32)).to(out_ptr.dtype.element_ty)
        tl.store(p_o + o_k[None, :], none, mask=(o_k[None, :] >= n_chosen[:, None]) & (o_k < K)[None, :] & m_t[:, None])


def _geometry(cfg: NosaConfig) -> tuple[int, int, int]:
    """(R, OFF0, M): block n overlaps windows ``n * R + OFF0 .. n * R + OFF0 + M - 1`` (``window_offsets``)."""
    per_block, offsets = window_offsets(cfg)
    return per_block, int(offsets[0]), int(offsets.numel())


def dynamic_blocks(cfg: NosaConfig) -> int:
    """How many candidate blocks next to a token's own block (c - 1, c - 2, ..) may still miss a window at some
    token of block c; blocks before them have every window complete, so their eviction score is query-agnostic.

    Block n's last window, ``(n + 1) * P / stride - 1``, is complete at token t when ``(n + 1) * P - stride +
    kernel <= t + 1``; at the first token of block c that holds for ``n <= c - ceil((P - stride + kernel - 1) / P)``.
    """
    P, s, ker = cfg.block_size, cfg.compress_stride, cfg.compress_kernel
    return max(0, math.ceil((P - s + ker - 1) / P) - 1)


def index_dtype(n_blocks: int) -> torch.dtype:
    """The dtype of block indices over ``n_blocks`` blocks (``n_blocks`` itself meaning none): int16 while it fits."""
    return torch.int16 if n_blocks < 2**15 - 1 else torch.int32


def _positions_i32(positions: torch.Tensor, device) -> tuple[torch.Tensor, int]:
    """int32 positions and their row stride; a chunk's slice of a caller's int32 positions as it is (no launch)."""
    positions = positions.to(device=device, dtype=torch.int32)
    if positions.stride(-1) != 1:
        positions = positions.contiguous()
    return positions, positions.stride(0) if positions.dim() == 2 else 0


def _launch_scores(query, compressed_keys, compressed_bias, positions, n_blocks, cfg, scale):
    B, H, Tq, D = query.shape
    Hk = compressed_keys.shape[1]
    G = H // Hk
    out = torch.empty(B, Hk, Tq, n_blocks, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    if compressed_keys.shape[2] == 0:
        return out.zero_()
    query = query.contiguous() if query.stride(-1) != 1 else query
    ck = compressed_keys.contiguous()
    has_pad = compressed_bias is not None
    cb = compressed_bias.float().contiguous() if has_pad else ck
    pos, stride_pb = _positions_i32(positions, query.device)
    R, off0, _ = _geometry(cfg)
    G_PAD = next_power_of_2(G)
    # fp32 dots where either side is fp32 (as the reference's); bf16 / fp16 operands multiply exactly in the MMA
    ieee = interpreting() or query.dtype == torch.float32 or ck.dtype != query.dtype
    if interpreting():  # tiles the tests' sizes span several of, few enough programs for the interpreter
        block_t, block_w, block_n = max(1, 128 // G_PAD), 16, 16
    else:
        block_t, block_w, block_n = max(1, SCORES_ROWS // G_PAD), SCORES_BLOCK_W, SCORES_BLOCK_N
    grid = (B * Hk, triton.cdiv(Tq, block_t))
    with on_device(query):
        launcher(_block_scores_kernel)[grid](
            query, ck, cb, pos, out,
            query.stride(0), query.stride(1), query.stride(2), ck.stride(0), ck.stride(1), ck.stride(2),
            cb.stride(0) if has_pad else 0, cb.stride(1) if has_pad else 0, stride_pb,
            out.stride(0), out.stride(1), out.stride(2),
            Tq, n_blocks, float(scale),
            HK=Hk, G=G, G_PAD=G_PAD, D=D, D_PAD=max(16, next_power_of_2(D)), BLOCK_T=block_t, BLOCK_W=block_w,
            BLOCK_N=block_n, R=R, OFF0=off0, KER=cfg.compress_kernel, STRIDE=cfg.compress_stride,
            HAS_PAD=has_pad, PAD_BIAS=PADDING_WINDOW_BIAS, IEEE=ieee, num_warps=SCORES_WARPS,
        )
    return out


def _launch_choice(query_scores, compressed_bias, positions, cfg, K, n_blocks, static_scores=None):
    B, Hk, Tq, N = query_scores.shape  # N: the blocks scored, n_blocks: the index meaning none
    out = torch.empty(B, Hk, Tq, K, dtype=index_dtype(n_blocks), device=query_scores.device)
    if out.numel() == 0:
        return out
    qs = query_scores if query_scores.stride(-1) == 1 else query_scores.contiguous()
    cb = compressed_bias.float().contiguous()
    # the blocks whose windows are all complete at every candidate token: one row per (sequence, KV head)
    if static_scores is None:
        static_scores = pool_windows_to_blocks(cb, N, cfg, fill=float("-inf"))
    static = static_scores[..., :N]  # [B, Hk, N]
    if static.stride(-1) != 1:
        static = static.contiguous()
    if cb.shape[2] == 0:
        cb = static  # never read: no window exists, so no window is complete
    pos, stride_pb = _positions_i32(positions, qs.device)
    R, off0, M = _geometry(cfg)
    N_PAD = next_power_of_2(max(N, K, 16))
    block_t = 64 if interpreting() else max(1, CHOICE_WARP_SCORES // N_PAD)
    warps = min(8, max(1, block_t * N_PAD // CHOICE_WARP_SCORES))
    n_q = min(cfg.sink_blocks + cfg.local_blocks + cfg.query_blocks, K)
    grid = (B * Hk, triton.cdiv(Tq, block_t))
    with on_device(qs):
        launcher(_choice_kernel)[grid](
            qs, static, cb, pos, out,
            qs.stride(0), qs.stride(1), qs.stride(2), static.stride(0), static.stride(1), cb.stride(0),
            cb.stride(1), stride_pb, out.stride(0), out.stride(1), out.stride(2),
            Tq, N, n_blocks,
            HK=Hk, BLOCK_T=block_t, N_PAD=N_PAD, K=K, K_PAD=next_power_of_2(K), N_Q=n_q, P=cfg.block_size,
            SINK=cfg.sink_blocks, LOCAL=cfg.local_blocks, R=R, OFF0=off0, M=M, KER=cfg.compress_kernel,
            STRIDE=cfg.compress_stride, DYN=dynamic_blocks(cfg), num_warps=warps,
        )
    return out


# ----- torch references -----


def as_indices(chosen: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``select_blocks``' ``[..., K]`` (by score, -1 for none) in the training format: ascending, ``n_blocks`` for
    none, ``index_dtype(n_blocks)``."""
    return torch.where(chosen < 0, n_blocks, chosen).sort(-1).values.to(index_dtype(n_blocks))


def train_select_blocks_ref(query_scores, compressed_bias, positions, cfg: NosaConfig, budget_blocks: int,
                            n_blocks: int | None = None):
    """``selection.select_blocks`` with the eviction scores of ``eviction_block_scores``, in the training format."""
    N = query_scores.shape[-1]
    positions = positions.to(query_scores.device)
    es = eviction_block_scores(compressed_bias, positions, N, cfg)
    chosen = select_blocks(query_scores, es, positions.div(cfg.block_size, rounding_mode="floor"), cfg, budget_blocks)
    return as_indices(chosen, N if n_blocks is None else n_blocks)


# ----- public -----


def _check_positions(positions: torch.Tensor, B: int, Tq: int, caller: str) -> None:
    if tuple(positions.shape) not in ((Tq,), (B, Tq)) or positions.dtype.is_floating_point:
        raise ValueError(f"{caller}: positions must be integer [Tq] = [{Tq}] or [B, Tq] = [{B}, {Tq}]; got "
                         f"{positions.dtype} {tuple(positions.shape)}")


def train_block_scores(
    query: torch.Tensor,
    compressed_keys: torch.Tensor,
    positions: torch.Tensor,
    n_blocks: int,
    cfg: NosaConfig,
    scale: float,
    *,
    compressed_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``selection.query_block_scores`` for many query tokens: per token and KV head, the softmax over its complete
    windows (padding windows left out) summed over the GQA group, max-pooled to blocks.

    Args:
        query: ``[B, H, Tq, D]``; compressed_keys: ``[B, Hk, W, D]``.
        positions: ``[Tq]`` index of each query token, or ``[B, Tq]`` row-relative (negative inside the padding).
        n_blocks: N, blocks scored.
        compressed_bias: ``[B, Hk, W]`` window means of the eviction scores, which mark the padding windows
            (``selection.PADDING_WINDOW_BIAS``); None when there is no padding.

    Returns:
        ``[B, Hk, Tq, N]`` float32 in ``[0, G]``; 0 for a block without a counted window.

    Example:
        >>> cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
        ...                  compress_kernel=8, compress_stride=4)
        >>> q, ck = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 9, 16)
        >>> train_block_scores(q, ck, torch.arange(40), 3, cfg, 0.25).shape
        torch.Size([1, 2, 40, 3])
    """
    if query.dim() != 4 or compressed_keys.dim() != 4 or query.shape[1] % compressed_keys.shape[1]:
        raise ValueError(f"train_block_scores: query must be [B, H, Tq, D] and compressed_keys [B, Hk, W, D] with "
                         f"H % Hk == 0; got {tuple(query.shape)} and {tuple(compressed_keys.shape)}")
    B, H, Tq, D = query.shape
    if compressed_keys.shape[0] != B or compressed_keys.shape[3] != D:
        raise ValueError(f"train_block_scores: compressed_keys must be [B={B}, Hk, W, D={D}]; got "
                         f"{tuple(compressed_keys.shape)}")
    _check_positions(positions, B, Tq, "train_block_scores")
    if compressed_bias is not None and tuple(compressed_bias.shape) != tuple(compressed_keys.shape[:3]):
        raise ValueError(f"train_block_scores: compressed_bias must be [B, Hk, W] = "
                         f"{tuple(compressed_keys.shape[:3])}; got {tuple(compressed_bias.shape)}")
    if kernel_path("train_block_scores", query) == "triton":
        return _launch_scores(query, compressed_keys, compressed_bias, positions, n_blocks, cfg, scale)
    return query_block_scores(query, compressed_keys, positions.to(query.device), n_blocks, cfg, scale,
                              compressed_bias=compressed_bias)


def train_select_blocks(
    query_scores: torch.Tensor,
    compressed_bias: torch.Tensor,
    positions: torch.Tensor,
    cfg: NosaConfig,
    *,
    budget_blocks: int | None = None,
    n_blocks: int | None = None,
    static_scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """``selection.select_blocks`` for many query tokens, with the eviction scores of ``eviction_block_scores``.

    Candidates of the token at position t are the blocks before its own, ``t // block_size``; Q = the sink blocks,
    the local window and the best query scores (``sink + local + query`` blocks, at most K); then the best eviction
    scores fill the budget. Ties go to the most recent block.

    Args:
        query_scores: ``[B, Hk, Tq, Ns]`` (``train_block_scores``), the scores of the first Ns blocks: all of them,
            or (cheaper) the candidates of every token, ``Ns >= max(positions) // block_size``.
        compressed_bias: ``[B, Hk, W]`` window means of the eviction scores (padding folded in).
        positions: ``[Tq]``, or ``[B, Tq]`` row-relative (negative inside the padding: no candidate).
        budget_blocks: K, default ``cfg.budget_blocks``.
        n_blocks: N, the sequence's blocks: the index that means none; default Ns.
        static_scores: ``[B, Hk, >= Ns]`` float32, ``pool_windows_to_blocks(compressed_bias, ., cfg, fill=-inf)``
            (block n's depends on the windows, not on how many blocks are pooled): a caller choosing chunk by chunk
            pools once. Default: pooled here.

    Returns:
        ``[B, Hk, Tq, K]`` ``index_dtype(N)`` block indices in ascending order, N where fewer than K were chosen.

    Example:
        >>> cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
        ...                  compress_kernel=8, compress_stride=4)
        >>> qs = torch.tensor([0.0, 0.1, 0.9, 0.2, 0.3, 0.0, 0.0]).expand(1, 2, 100, 7)  # block 2 draws the query
        >>> cb = torch.zeros(1, 2, 24)  # eviction scores tie: the most recent block left wins
        >>> train_select_blocks(qs, cb, torch.arange(100), cfg)[0, 0, -1]  # sink 0, local 5, query 2, eviction 4
        tensor([0, 2, 4, 5], dtype=torch.int16)
    """
    K = cfg.budget_blocks if budget_blocks is None else budget_blocks
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"train_select_blocks: budget_blocks must be a positive int; got {budget_blocks!r}")
    if query_scores.dim() != 4:
        raise ValueError(f"train_select_blocks: query_scores must be [B, Hk, Tq, N]; got {tuple(query_scores.shape)}")
    B, Hk, Tq, _ = query_scores.shape
    if compressed_bias.dim() != 3 or tuple(compressed_bias.shape[:2]) != (B, Hk):
        raise ValueError(f"train_select_blocks: compressed_bias must be [B, Hk, W] with B, Hk = {B}, {Hk}; got "
                         f"{tuple(compressed_bias.shape)}")
    _check_positions(positions, B, Tq, "train_select_blocks")
    N = query_scores.shape[3] if n_blocks is None else n_blocks
    if N < query_scores.shape[3]:
        raise ValueError(f"train_select_blocks: n_blocks={n_blocks} is below the {query_scores.shape[3]} blocks "
                         f"scored; it must be at least that many (or None)")
    if static_scores is not None and (static_scores.dim() != 3 or tuple(static_scores.shape[:2]) != (B, Hk)
                                      or static_scores.shape[2] < query_scores.shape[3]):
        raise ValueError(f"train_select_blocks: static_scores must be [B, Hk, >= {query_scores.shape[3]}] with "
                         f"B, Hk = {B}, {Hk}; got {tuple(static_scores.shape)}")
    if kernel_path("train_select_blocks", query_scores) == "triton":
        return _launch_choice(query_scores, compressed_bias, positions, cfg, K, N, static_scores)
    return train_select_blocks_ref(query_scores, compressed_bias, positions, cfg, K, N)
