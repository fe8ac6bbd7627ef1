"""The sparse training attention with each tile's keys split in two disjoint parts, merged by log-sum-exp: the
default path of ``sparse_train_attention`` (``split=True``).

Why: the plan of ``sparse_train_plan`` lets a tile of 32 tokens visit the union of their selections (81% of the
causal tiles at 32K on iid queries), and every visited block pays the per-row selection bits. Yet the tokens of a
tile mostly agree: sink, local window and the top of the eviction order are common to all of them. So
(``sparse_train_plan.split_plan``):

- shared part, per tile of ``tile`` rows: the blocks every token of the tile selected, visited whole (only the
  row and key validity masks: no bitmap), then the tile's own blocks with the per-row rule, as in the union path.
- extras part, per tile of ``extra_tile`` rows (16: 4 tokens of a group of 4 heads): each token's other selected
  blocks, with one bit per token and block in the plan's list, read once per visited block.

Forward: the shared kernel stores its normalised output and log-sum-exp (fp32); the extras kernel runs its online
softmax and merges the two in its epilogue, ``o = (o1 2^lse1 + o2 2^lse2) / (2^lse1 + 2^lse2)`` against the larger
of the two (a part a row has nothing in has ``lse = -inf``, weight 0). Backward: with the global log-sum-exp and
``delta = rowsum(dO * O)``, ``P_ij = exp(s_ij - lse_i)`` is exact in each part alone, so each part's gradients are
computed by itself and summed: one dK/dV/dbias program per key block runs over the shared tiles holding it whole,
the tiles whose own block it is, and the extras tiles listing it (``BLOCK_M // extra_tile`` of them gathered into one
row tile); dQ of the shared part goes to an fp32 buffer that
the extras kernel adds its own to. No atomics; every launch is idempotent (the autotuner reruns them).

The plan is built once in the forward (torch, on the device, no host sync) and kept for the backward. The helpers
``_rows``, ``_visible``, ``_logits`` and ``_load_rows`` are shared with the union path (``sparse_train_common.py``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...rules.selection import MASK_VALUE
from ..backend import HAS_TRITON, interpreting, launcher, next_power_of_2, on_device, tl, triton
from .sparse_train_common import (LOG2E, _dot, _key_block, _load_rows, _logits, _row_tile, _rows, _visible,
                                  held_result, row_dot, tuned)
from .sparse_train_plan import SplitPlan, split_plan

if HAS_TRITON:
    from .sparse_train_plan import _own_range

# Shared kernels: (BLOCK_M, num_warps, num_stages); extras kernels: (num_warps, num_stages), their rows being the
# extras tile's. On a GPU the fastest of each list is timed once per (kernel, D, G, P, tile tokens, dtype); fixed
# under the interpreter.
SHARED_FWD_CONFIGS = [(128, 8, 3), (128, 4, 3), (128, 8, 2), (64, 4, 3), (64, 4, 2)]
EXTRA_FWD_CONFIGS = [(4, 2), (4, 3), (2, 2), (2, 3), (4, 4)]
DKDV_CONFIGS = [(64, 4, 2), (64, 8, 2), (128, 8, 2), (64, 4, 3), (32, 4, 2)]
SHARED_DQ_CONFIGS = [(64, 4, 2), (128, 8, 2), (64, 8, 2), (128, 4, 2), (128, 8, 3)]
EXTRA_DQ_CONFIGS = [(4, 2), (2, 2), (4, 3), (2, 3)]
INTERPRETER_CONFIG = (16, 4, 1)

if HAS_TRITON:

    @triton.jit
    def _load_block(p, o_s, m_s, stride_t, IEEE: tl.constexpr):
        """``[BLOCK_N, D]`` rows ``o_s`` of a key-side tensor."""
        b = tl.load(p + o_s[:, None].to(tl.int64) * stride_t, mask=m_s[:, None], other=0.0)
        if IEEE:
            b = b.to(tl.float32)
        return b

    @triton.jit
    def _softmax_step(b_s, b_v, m_i, l_i, acc, IEEE: tl.constexpr):
        """One key block of the online softmax (exp2 domain)."""
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        b_p = tl.math.exp2(b_s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = acc * alpha[:, None] + _dot(b_p, b_v, IEEE)
        return m_new, l_i, acc

    @triton.jit
    def _row_bits(w, BLOCK_M: tl.constexpr, G: tl.constexpr):
        """``[BLOCK_M]``: the rows whose token's bit is set in the plan word ``w`` (row r is token r // G)."""
        return ((w.to(tl.int32) >> (tl.arange(0, BLOCK_M) // G)) & 1) != 0

    @triton.jit
    def _shared_fwd_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, block_ptr, o1_ptr, lse1_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_pb, stride_ph, stride_pt, stride_lb, stride_lh,
        Hk, Tq, T, N, n_qt, n_sub, q_offset, qk_scale,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr,
        FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """The shared part of ``BLOCK_M`` rows: normalised output (fp32) and log-sum-exp (log2, -inf if empty)."""
        i_m, i_bh = tl.program_id(0), tl.program_id(1)
        i_t, i_s = i_m // n_sub, i_m % n_sub
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off
        o_t, o_h, m_r, pos, own = _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
        m_p = m_r & (pos >= 0)  # rows whose token takes part in the shared blocks
        o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
        b_q = _load_rows(q_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt, IEEE)
        p_k, p_v, p_b, p_sel, count, p_blocks = _row_tile(
            k_ptr, v_ptr, bias_ptr, sel_ptr, count_ptr, block_ptr, i_b, i_hk, i_t, off, o_t, o_d,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bb, stride_bh,
            stride_sb, stride_sh, stride_st, Hk, N, n_qt)
        m_i = tl.full([BLOCK_M], FLOOR, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for i in range(0, count):  # blocks every token selected: whole
            n = tl.load(p_blocks + i).to(tl.int32)
            o_s = n * P + o_n
            m_s = (o_n < P) & (o_s < L)
            b_k, b_s = _logits(b_q, p_k, p_b, o_s, m_s, qk_scale, stride_kt, IEEE)
            b_s = tl.where(m_p[:, None] & m_s[None, :], b_s, float("-inf"))
            b_v = _load_block(p_v, o_s, m_s, stride_vt, IEEE)
            m_i, l_i, acc = _softmax_step(b_s, b_v, m_i, l_i, acc, IEEE)
        lo, hi = _own_range(i_t, Tq, q_offset, off, TOKENS, P)
        for n in range(lo, hi + 1):  # own blocks: causal, plus whatever a row selected of them
            o_s = n * P + o_n
            m_s = (o_n < P) & (o_s < L)
            b_k, b_s = _logits(b_q, p_k, p_b, o_s, m_s, qk_scale, stride_kt, IEEE)
            b_s = tl.where(_visible(p_sel, n, o_s, m_s, m_r, pos, own), b_s, float("-inf"))
            b_v = _load_block(p_v, o_s, m_s, stride_vt, IEEE)
            m_i, l_i, acc = _softmax_step(b_s, b_v, m_i, l_i, acc, IEEE)
        p_o = (o1_ptr + i_b.to(tl.int64) * stride_pb + o_h[:, None].to(tl.int64) * stride_ph
               + o_t[:, None].to(tl.int64) * stride_pt + o_d[None, :])
        tl.store(p_o, acc / tl.maximum(l_i, 1e-30)[:, None], mask=m_r[:, None])
        p_l = lse1_ptr + i_b.to(tl.int64) * stride_lb + o_h.to(tl.int64) * stride_lh + o_t
        tl.store(p_l, tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf")), mask=m_r)

    @triton.jit
    def _extra_fwd_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, block_ptr, bits_ptr, o1_ptr, lse1_ptr, out_ptr,
        lse_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_pb, stride_ph, stride_pt, stride_lb, stride_lh,
        stride_ob, stride_oh, stride_ot,
        Hk, Tq, T, N, n_et, q_offset, qk_scale,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr,
        FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """The extras part of one extras tile, merged with the shared part's (``o1``, ``lse1``) into out and the
        log-sum-exp (natural log; finite in a row that sees nothing, whose output is 0)."""
        i_e, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off
        o_t, o_h, m_r, pos, own = _rows(i_e, 0, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
        o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
        b_q = _load_rows(q_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt, IEEE)
        p_k, p_v, p_b, p_sel, count, p_blocks = _row_tile(
            k_ptr, v_ptr, bias_ptr, sel_ptr, count_ptr, block_ptr, i_b, i_hk, i_e, off, o_t, o_d,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bb, stride_bh,
            stride_sb, stride_sh, stride_st, Hk, N, n_et)
        p_bits = bits_ptr + ((i_b * Hk + i_hk) * n_et + i_e).to(tl.int64) * N
        m_i = tl.full([BLOCK_M], FLOOR, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for i in range(0, count):
            n = tl.load(p_blocks + i).to(tl.int32)
            m_e = _row_bits(tl.load(p_bits + i), BLOCK_M, G) & m_r
            o_s = n * P + o_n
            m_s = (o_n < P) & (o_s < L)
            b_k, b_s = _logits(b_q, p_k, p_b, o_s, m_s, qk_scale, stride_kt, IEEE)
            b_s = tl.where(m_e[:, None] & m_s[None, :], b_s, float("-inf"))
            b_v = _load_block(p_v, o_s, m_s, stride_vt, IEEE)
            m_i, l_i, acc = _softmax_step(b_s, b_v, m_i, l_i, acc, IEEE)
        # the merge, against the larger of the two log-sum-exps
        lse2 = tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        o_l = i_b.to(tl.int64) * stride_lb + o_h.to(tl.int64) * stride_lh + o_t
        lse1 = tl.load(lse1_ptr + o_l, mask=m_r, other=float("-inf"))
        p_o1 = (o1_ptr + i_b.to(tl.int64) * stride_pb + o_h[:, None].to(tl.int64) * stride_ph
                + o_t[:, None].to(tl.int64) * stride_pt + o_d[None, :])
        b_o1 = tl.load(p_o1, mask=m_r[:, None], other=0.0)
        top = tl.maximum(lse1, lse2)
        empty = top == float("-inf")
        top = tl.where(empty, 0.0, top)
        w1, w2 = tl.math.exp2(lse1 - top), tl.math.exp2(lse2 - top)
        w = tl.where(empty, 1.0, w1 + w2)
        b_o = (b_o1 * w1[:, None] + acc * (w2 / tl.maximum(l_i, 1e-30))[:, None]) / w[:, None]
        p_o = (out_ptr + i_b.to(tl.int64) * stride_ob + o_h[:, None].to(tl.int64) * stride_oh
               + o_t[:, None].to(tl.int64) * stride_ot + o_d[None, :])
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_r[:, None])
        lse = tl.where(empty, FLOOR, top + tl.math.log2(w)) * 0.6931471805599453
        tl.store(lse_ptr + o_l, lse, mask=m_r)

    @triton.jit
    def _grad_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt,
                   stride_ob, stride_oh, stride_ot, stride_lb, stride_lh, IEEE: tl.constexpr):
        """What the backward reads of its rows: Q, dO, the log-sum-exp (log2) and delta."""
        b_q = _load_rows(q_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt, IEEE)
        b_do = _load_rows(do_ptr, i_b, o_h, o_t, o_d, m_r, stride_ob, stride_oh, stride_ot, IEEE)
        o_l = i_b.to(tl.int64) * stride_lb + o_h.to(tl.int64) * stride_lh + o_t
        b_lse = tl.load(lse_ptr + o_l, mask=m_r, other=0.0) * 1.4426950408889634
        b_delta = tl.load(delta_ptr + o_l, mask=m_r, other=0.0)
        return b_q, b_do, b_lse, b_delta

    @triton.jit
    def _dkdv_step(b_q, b_do, b_lse, b_delta, b_k, b_v, b_bias, visible, b_dk, b_dv, b_db, qk_scale,
                   IEEE: tl.constexpr):
        """One row tile's share of a key block's dK, dV and bias gradient."""
        b_s = _dot(b_q, tl.trans(b_k), IEEE) * qk_scale + b_bias[None, :]
        b_p = tl.math.exp2(tl.where(visible, b_s, float("-inf")) - b_lse[:, None])
        b_dv += _dot(tl.trans(b_p), b_do, IEEE)
        b_ds = b_p * (_dot(b_do, tl.trans(b_v), IEEE) - b_delta[:, None])
        b_dk += _dot(tl.trans(b_ds), b_q, IEEE)
        b_db += tl.sum(b_ds, 0)
        return b_dk, b_dv, b_db

    @triton.jit
    def _split_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, tile_ptr, ecount_ptr, etile_ptr, ebits_ptr,
        do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, db_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_ob, stride_oh, stride_ot, stride_lb, stride_lh,
        Hk, Tq, T, N, n_qt, n_et, n_sub, q_offset, qk_scale, scale, B_HK,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, ETOKENS: tl.constexpr,
        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_X: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """dK, dV and the bias gradient of key block ``i_n`` over both parts (dK, dV, dbias share the strides of K, V
        and the bias; dO takes the ``stride_o*`` slots, delta shares the log-sum-exp's)."""
        # Programs go block by block, every (sequence, KV head) of a block together: an early block is in more
        # tiles (more tokens come after it; the sink and the eviction head's favourites are in nearly all), so the
        # longest programs start first and the short ones fill in after (launched head by head, the last head's
        # long programs started last and left the GPU to a few of them: about 1.2x the balanced time at 32K).
        i_bh, i_n = tl.program_id(0) % B_HK, tl.program_id(0) // B_HK
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off
        o_n, o_d, o_s, m_s, row_k, row_v, b_k, b_v, o_bias, b_bias = _key_block(
            k_ptr, v_ptr, bias_ptr, i_b, i_hk, i_n, off, L, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
            stride_vt, stride_bb, stride_bh, D, P, IEEE, BLOCK_N)
        p_sel0 = sel_ptr + i_b.to(tl.int64) * stride_sb + i_hk.to(tl.int64) * stride_sh
        i_plan = (i_b * Hk + i_hk) * N + i_n
        b_dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        b_dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        b_db = tl.zeros([BLOCK_N], dtype=tl.float32)
        count = tl.load(count_ptr + i_plan)
        p_tiles = tile_ptr + i_plan.to(tl.int64) * n_qt
        for i in range(0, count):  # shared tiles holding the block whole
            i_t = tl.load(p_tiles + i).to(tl.int32)
            for i_s in range(0, n_sub):
                o_t, o_h, m_r, pos, own = _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
                b_q, b_do, b_lse, b_delta = _grad_rows(
                    q_ptr, do_ptr, lse_ptr, delta_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt,
                    stride_ob, stride_oh, stride_ot, stride_lb, stride_lh, IEEE)
                visible = (m_r & (pos >= 0))[:, None] & m_s[None, :]
                b_dk, b_dv, b_db = _dkdv_step(b_q, b_do, b_lse, b_delta, b_k, b_v, b_bias, visible, b_dk, b_dv,
                                              b_db, qk_scale, IEEE)
        # shared tiles whose own block this is: those holding a token at positions i_n * P .. i_n * P + P - 1
        t_lo = tl.maximum(i_n * P + off - q_offset, 0)
        t_hi = tl.minimum(i_n * P + P - 1 + off - q_offset, Tq - 1)
        last = tl.where(t_lo <= t_hi, tl.maximum(t_hi, 0) // TOKENS, t_lo // TOKENS - 1)
        for i_t in range(t_lo // TOKENS, last + 1):
            for i_s in range(0, n_sub):
                o_t, o_h, m_r, pos, own = _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
                b_q, b_do, b_lse, b_delta = _grad_rows(
                    q_ptr, do_ptr, lse_ptr, delta_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt,
                    stride_ob, stride_oh, stride_ot, stride_lb, stride_lh, IEEE)
                visible = _visible(p_sel0 + o_t.to(tl.int64) * stride_st, i_n, o_s, m_s, m_r, pos, own)
                b_dk, b_dv, b_db = _dkdv_step(b_q, b_do, b_lse, b_delta, b_k, b_v, b_bias, visible, b_dk, b_dv,
                                              b_db, qk_scale, IEEE)
        count = tl.load(ecount_ptr + i_plan)
        p_tiles = etile_ptr + i_plan.to(tl.int64) * n_et
        p_bits = ebits_ptr + i_plan.to(tl.int64) * n_et
        # extras tiles listing the block, BLOCK_X // BLOCK_E of them gathered into one row tile: an extras tile has
        # few rows, and the matrix units want many
        o_x = tl.arange(0, BLOCK_X)
        o_r = o_x % BLOCK_E  # row inside its extras tile
        for i in range(0, count, BLOCK_X // BLOCK_E):
            o_i = i + o_x // BLOCK_E
            m_i = o_i < count
            i_e = tl.load(p_tiles + o_i, mask=m_i, other=0).to(tl.int32)
            w = tl.load(p_bits + o_i, mask=m_i, other=0).to(tl.int32)
            o_t = i_e * ETOKENS + o_r // G
            o_h = i_hk * G + o_r % G
            m_r = m_i & (o_r < ETOKENS * G) & (o_t < Tq)
            m_e = (((w >> (o_r // G)) & 1) != 0) & m_r
            b_q, b_do, b_lse, b_delta = _grad_rows(
                q_ptr, do_ptr, lse_ptr, delta_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt,
                stride_ob, stride_oh, stride_ot, stride_lb, stride_lh, IEEE)
            b_dk, b_dv, b_db = _dkdv_step(b_q, b_do, b_lse, b_delta, b_k, b_v, b_bias, m_e[:, None] & m_s[None, :],
                                          b_dk, b_dv, b_db, qk_scale, IEEE)
        tl.store(dk_ptr + row_k, (b_dk * scale).to(dk_ptr.dtype.element_ty), mask=m_s[:, None])
        tl.store(dv_ptr + row_v, b_dv.to(dv_ptr.dtype.element_ty), mask=m_s[:, None])
        tl.store(db_ptr + o_bias, b_db, mask=m_s)

    @triton.jit
    def _dq_step(b_q, b_do, b_lse, b_delta, p_k, p_v, p_b, o_s, m_s, visible, b_dq, qk_scale, stride_kt, stride_vt,
                 IEEE: tl.constexpr):
        """One key block's share of the rows' dQ."""
        b_k, b_s = _logits(b_q, p_k, p_b, o_s, m_s, qk_scale, stride_kt, IEEE)
        b_p = tl.math.exp2(tl.where(visible, b_s, float("-inf")) - b_lse[:, None])
        b_v = _load_block(p_v, o_s, m_s, stride_vt, IEEE)
        b_ds = b_p * (_dot(b_do, tl.trans(b_v), IEEE) - b_delta[:, None])
        return b_dq + _dot(b_ds, b_k, IEEE)

    @triton.jit
    def _shared_dq_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, block_ptr, do_ptr, lse_ptr, delta_ptr, dq1_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_ob, stride_oh, stride_ot, stride_lb, stride_lh,
        stride_pb, stride_ph, stride_pt,
        Hk, Tq, T, N, n_qt, n_sub, q_offset, qk_scale, scale,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """dQ of the shared part of ``BLOCK_M`` rows, into the fp32 buffer ``dq1`` (``stride_p*``)."""
        i_m, i_bh = tl.program_id(0), tl.program_id(1)
        i_t, i_s = i_m // n_sub, i_m % n_sub
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off
        o_t, o_h, m_r, pos, own = _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
        m_p = m_r & (pos >= 0)
        o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
        b_q, b_do, b_lse, b_delta = _grad_rows(
            q_ptr, do_ptr, lse_ptr, delta_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt,
            stride_ob, stride_oh, stride_ot, stride_lb, stride_lh, IEEE)
        p_k, p_v, p_b, p_sel, count, p_blocks = _row_tile(
            k_ptr, v_ptr, bias_ptr, sel_ptr, count_ptr, block_ptr, i_b, i_hk, i_t, off, o_t, o_d,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bb, stride_bh,
            stride_sb, stride_sh, stride_st, Hk, N, n_qt)
        b_dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for i in range(0, count):
            n = tl.load(p_blocks + i).to(tl.int32)
            o_s = n * P + o_n
            m_s = (o_n < P) & (o_s < L)
            b_dq = _dq_step(b_q, b_do, b_lse, b_delta, p_k, p_v, p_b, o_s, m_s, m_p[:, None] & m_s[None, :], b_dq,
                            qk_scale, stride_kt, stride_vt, IEEE)
        lo, hi = _own_range(i_t, Tq, q_offset, off, TOKENS, P)
        for n in range(lo, hi + 1):
            o_s = n * P + o_n
            m_s = (o_n < P) & (o_s < L)
            b_dq = _dq_step(b_q, b_do, b_lse, b_delta, p_k, p_v, p_b, o_s, m_s,
                            _visible(p_sel, n, o_s, m_s, m_r, pos, own), b_dq, qk_scale, stride_kt, stride_vt, IEEE)
        p_dq = (dq1_ptr + i_b.to(tl.int64) * stride_pb + o_h[:, None].to(tl.int64) * stride_ph
                + o_t[:, None].to(tl.int64) * stride_pt + o_d[None, :])
        tl.store(p_dq, b_dq * scale, mask=m_r[:, None])

    @triton.jit
    def _extra_dq_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, block_ptr, bits_ptr, do_ptr, lse_ptr, delta_ptr,
        dq1_ptr, dq_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_ob, stride_oh, stride_ot, stride_lb, stride_lh,
        stride_pb, stride_ph, stride_pt,
        Hk, Tq, T, N, n_et, q_offset, qk_scale, scale,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """dQ of the extras part of one extras tile plus the shared part's (``dq1``), into dQ (Q's strides)."""
        i_e, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off
        o_t, o_h, m_r, pos, own = _rows(i_e, 0, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
        o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
        b_q, b_do, b_lse, b_delta = _grad_rows(
            q_ptr, do_ptr, lse_ptr, delta_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt,
            stride_ob, stride_oh, stride_ot, stride_lb, stride_lh, IEEE)
        p_k, p_v, p_b, p_sel, count, p_blocks = _row_tile(
            k_ptr, v_ptr, bias_ptr, sel_ptr, count_ptr, block_ptr, i_b, i_hk, i_e, off, o_t, o_d,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bb, stride_bh,
            stride_sb, stride_sh, stride_st, Hk, N, n_et)
        p_bits = bits_ptr + ((i_b * Hk + i_hk) * n_et + i_e).to(tl.int64) * N
        b_dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for i in range(0, count):
            n = tl.load(p_blocks + i).to(tl.int32)
            m_e = _row_bits(tl.load(p_bits + i), BLOCK_M, G) & m_r
            o_s = n * P + o_n
            m_s = (o_n < P) & (o_s < L)
            b_dq = _dq_step(b_q, b_do, b_lse, b_delta, p_k, p_v, p_b, o_s, m_s, m_e[:, None] & m_s[None, :], b_dq,
                            qk_scale, stride_kt, stride_vt, IEEE)
        p_dq1 = (dq1_ptr + i_b.to(tl.int64) * stride_pb + o_h[:, None].to(tl.int64) * stride_ph
                 + o_t[:, None].to(tl.int64) * stride_pt + o_d[None, :])
        b_dq = b_dq * scale + tl.load(p_dq1, mask=m_r[:, None], other=0.0)
        p_dq = (dq_ptr + i_b.to(tl.int64) * stride_qb + o_h[:, None].to(tl.int64) * stride_qh
                + o_t[:, None].to(tl.int64) * stride_qt + o_d[None, :])
        tl.store(p_dq, b_dq.to(dq_ptr.dtype.element_ty), mask=m_r[:, None])


_BEST: dict[tuple, tuple] = {}  # (kernel, D, G, P, tile tokens, dtype, device) -> the fastest of its configs


def _tuned(name, run, configs, query, G, P, tokens, config) -> None:
    interpreter_config = INTERPRETER_CONFIG if len(configs[0]) == 3 else INTERPRETER_CONFIG[1:]
    tuned(_BEST, name, run, configs, query, G, P, tokens, config, interpreter_config)


def _common(query, key, value, bias, bitmap, plan: SplitPlan, block_size):
    """Arguments every kernel takes: the input strides, the sizes and the constexprs."""
    B, H, Tq, D = query.shape
    Hk, T, N = key.shape[1], key.shape[2], bitmap.shape[3]
    G = H // Hk
    ieee = query.dtype == torch.float32 or interpreting()  # the interpreter's bf16 tl.dot is wrong: it casts
    strides = (query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
               value.stride(0), value.stride(1), value.stride(2), bias.stride(0), bias.stride(1),
               bitmap.stride(0), bitmap.stride(1), bitmap.stride(2))
    constexprs = dict(D=D, P=block_size, G=G, IEEE=ieee, BLOCK_N=max(16, next_power_of_2(block_size)))
    sizes = (Hk, Tq, T, N)
    return strides, sizes, constexprs, plan.counts.shape[2], plan.extra_counts.shape[2], \
        max(16, next_power_of_2(plan.extra_tokens * G))


def _split_config(config):
    """The shared kernels' and the extras kernels' parts of a user's ``(BLOCK_M, num_warps, num_stages)``."""
    return (None, None) if config is None else (config, config[1:])


def _forward(query, key, value, bias, bitmap, offsets, plan, scale, q_offset, block_size, config):
    B, H, Tq, D = query.shape
    out = torch.empty_like(query)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=query.device)
    o1 = torch.empty(B, H, Tq, D, dtype=torch.float32, device=query.device)
    lse1 = torch.empty_like(lse)
    strides, sizes, cx, n_qt, n_et, block_e = _common(query, key, value, bias, bitmap, plan, block_size)
    G, rows = cx["G"], plan.tokens * cx["G"]
    floor = MASK_VALUE * LOG2E
    tail = (o1.stride(0), o1.stride(1), o1.stride(2), lse.stride(0), lse.stride(1))
    shared_config, extra_config = _split_config(config)

    def run_shared(block_m, warps, stages):
        n_sub = triton.cdiv(rows, block_m)
        with on_device(query):
            launcher(_shared_fwd_kernel)[(n_qt * n_sub, B * sizes[0])](
                query, key, value, bias, bitmap, offsets, plan.counts, plan.blocks, o1, lse1, *strides, *tail,
                *sizes, n_qt, n_sub, q_offset, scale * LOG2E, TOKENS=plan.tokens, FLOOR=floor, BLOCK_M=block_m,
                num_warps=warps, num_stages=stages, **cx)

    def run_extra(warps, stages):
        with on_device(query):
            launcher(_extra_fwd_kernel)[(n_et, B * sizes[0])](
                query, key, value, bias, bitmap, offsets, plan.extra_counts, plan.extra_blocks, plan.extra_bits, o1,
                lse1, out, lse, *strides, *tail, out.stride(0), out.stride(1), out.stride(2), *sizes, n_et, q_offset,
                scale * LOG2E, TOKENS=plan.extra_tokens, FLOOR=floor, BLOCK_M=block_e, num_warps=warps,
                num_stages=stages, **cx)

    _tuned("split fwd shared", run_shared, SHARED_FWD_CONFIGS, query, G, block_size, plan.tokens, shared_config)
    _tuned("split fwd extras", run_extra, EXTRA_FWD_CONFIGS, query, G, block_size, plan.extra_tokens, extra_config)
    return out, lse


def _backward(grad, query, key, value, bias, bitmap, offsets, out, lse, plan, scale, q_offset, block_size, config,
              needs):
    B, H, Tq, D = query.shape
    delta = row_dot(grad, out)  # [B, H, Tq], lse's layout
    strides, sizes, cx, n_qt, n_et, block_e = _common(query, key, value, bias, bitmap, plan, block_size)
    G, rows = cx["G"], plan.tokens * cx["G"]
    tail = (grad.stride(0), grad.stride(1), grad.stride(2), lse.stride(0), lse.stride(1))
    shared_config, extra_config = _split_config(config)
    dq = dk = dv = dbias = None
    if needs[1] or needs[2] or needs[3]:
        # keys inside a row's padding belong to no block: their gradients stay 0
        dk, dv, dbias = torch.zeros_like(key), torch.zeros_like(value), torch.zeros_like(bias)

        def run_dkdv(block_m, warps, stages):
            with on_device(query):
                launcher(_split_dkdv_kernel)[(sizes[3] * B * sizes[0],)](
                    query, key, value, bias, bitmap, offsets, plan.tile_counts, plan.tiles, plan.extra_tile_counts,
                    plan.extra_tiles, plan.extra_tile_bits, grad, lse, delta, dk, dv, dbias, *strides, *tail, *sizes,
                    n_qt, n_et, triton.cdiv(rows, block_m), q_offset, scale * LOG2E, scale, B * sizes[0],
                    TOKENS=plan.tokens,
                    ETOKENS=plan.extra_tokens, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_X=max(block_m, block_e),
                    num_warps=warps, num_stages=stages, **cx)

        _tuned("split dkdv", run_dkdv, DKDV_CONFIGS, query, G, block_size, plan.tokens, shared_config)
    if needs[0]:
        dq = torch.empty_like(query)
        dq1 = torch.empty(B, H, Tq, D, dtype=torch.float32, device=query.device)
        scratch = (dq1.stride(0), dq1.stride(1), dq1.stride(2))

        def run_shared(block_m, warps, stages):
            n_sub = triton.cdiv(rows, block_m)
            with on_device(query):
                launcher(_shared_dq_kernel)[(n_qt * n_sub, B * sizes[0])](
                    query, key, value, bias, bitmap, offsets, plan.counts, plan.blocks, grad, lse, delta, dq1,
                    *strides, *tail, *scratch, *sizes, n_qt, n_sub, q_offset, scale * LOG2E, scale,
                    TOKENS=plan.tokens, BLOCK_M=block_m, num_warps=warps, num_stages=stages, **cx)

        def run_extra(warps, stages):
            with on_device(query):
                launcher(_extra_dq_kernel)[(n_et, B * sizes[0])](
                    query, key, value, bias, bitmap, offsets, plan.extra_counts, plan.extra_blocks, plan.extra_bits,
                    grad, lse, delta, dq1, dq, *strides, *tail, *scratch, *sizes, n_et, q_offset, scale * LOG2E,
                    scale, TOKENS=plan.extra_tokens, BLOCK_M=block_e, num_warps=warps, num_stages=stages, **cx)

        _tuned("split dq shared", run_shared, SHARED_DQ_CONFIGS, query, G, block_size, plan.tokens, shared_config)
        _tuned("split dq extras", run_extra, EXTRA_DQ_CONFIGS, query, G, block_size, plan.extra_tokens, extra_config)
    return dq, dk, dv, dbias


class SplitTrainAttention(torch.autograd.Function):
    """The split kernels with their backward; the plan is built in the forward and kept for the backward."""

    @staticmethod
    def forward(ctx, query, key, value, bias, bitmap, offsets, padded, scale, block_size, q_offset, tile, extra_tile,
                config, held):
        plan = split_plan(bitmap, heads=query.shape[1], block_size=block_size, q_offset=q_offset,
                          offsets=offsets if padded else None, tile=tile, extra_tile=extra_tile)
        bits = bitmap.view(torch.uint8)
        out, lse = held_result(held, query, lambda: _forward(query, key, value, bias, bits, offsets, plan, scale,
                                                             q_offset, block_size, config))
        ctx.save_for_backward(query, key, value, bias, bits, offsets, out, lse, *plan[2:])
        ctx.settings = (plan.tokens, plan.extra_tokens, scale, q_offset, block_size, config)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        query, key, value, bias, bits, offsets, out, lse, *lists = ctx.saved_tensors
        tokens, extra_tokens, scale, q_offset, block_size, config = ctx.settings
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        plan = SplitPlan(tokens, extra_tokens, *lists)
        dq, dk, dv, dbias = _backward(grad, query, key, value, bias, bits, offsets, out, lse, plan, scale, q_offset,
                                      block_size, config, ctx.needs_input_grad[:4])
        return dq, dk, dv, dbias, None, None, None, None, None, None, None, None, None, None
