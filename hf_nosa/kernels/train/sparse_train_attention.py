"""Block-sparse attention with the per-token NOSA rule inside, forward and backward: the training attention
(``training.nosa_training_attention``, backend ``"sparse"``) as Triton kernels.

Query token ``t`` (position ``q_offset + t``) sees key ``j`` when the block of ``j`` is selected for ``t`` in the
bitmap, or ``j`` lies in ``t``'s own block and ``j <= position``; its logit is ``scale * q . k_j + b_j``. With left
padding (``offsets``) positions and blocks are row-relative and keys inside the padding are never seen.

Why a kernel of our own: FlexAttention's ``mask_mod`` reads the bitmap once per (query, key) element, which made a
visited tile cost about 11x a dense one on an H200. Here the mask of a (row tile, key block) pair is the rows'
bits for that block, read once as a ``[BLOCK_M]`` vector and broadcast over the block's keys, and the own-block
causal rule. On an H200 at 32K (1b heads, forward + backward) the kernels take about 2.2x dense sdpa where the
rows' selections cover every causal tile (iid inputs) and 1.2x where they cover 73% (smooth ones), against 11x
with FlexAttention (benchmarks/train_step.py).

Two paths compute it. The default (``SPLIT``, ``split=True``; ``sparse_train_split.py``) splits each tile's keys
into the blocks every token of the tile selected, visited whole with no bitmap, and each token's extras, visited in
small tiles, and merges the two by log-sum-exp: at 32K on an H200 it took 46.9 ms forward + backward against the
union path's 77.8 (iid inputs; dense sdpa 35.8), before its plan moved to Triton. The union path below, one pass
over the union of a tile's selections, stays for comparison.

Layout: rows are (token, query head of a GQA group) pairs, so one program reads each key block once for its
group's G heads; key tiles are single NOSA blocks (``BLOCK_N = max(16, P)``, rows of a block past P masked). The
plan (``sparse_train_plan.py``) lists the blocks each tile of ``tile`` rows visits; a program takes ``BLOCK_M``
rows of a plan tile and its list. Forward: an online softmax in the exp2 domain (``log2(e)`` folded into the scale
and the bias), fp32 accumulation, out and the log-sum-exp stored. Backward as FlashAttention-2: ``delta =
rowsum(dO * O)``; one program per (sequence, KV head, key block) sums dK, dV and the bias gradient over the tiles
visiting the block (the plan's transposed lists); one per row tile sums dQ over its blocks. No atomics.

Hidden logits are -inf against a running max that starts at a finite floor, so a row that sees no key (a padding
query) comes out 0, with a finite log-sum-exp, and takes no part in any gradient.

The torch reference ``sparse_train_attention_ref`` is the per-token mask as an additive mask on ``attend.attend``;
``tests/kernels/test_sparse_train_attention.py`` holds the kernels to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ...rules.attend import AttentionInputs, attend
from ...rules.selection import MASK_VALUE
from ..backend import HAS_TRITON, interpreting, kernel_path, launcher, next_power_of_2, on_device, tl, triton
from .sparse_train_common import (LOG2E, _dot, _key_block, _load_rows, _logits, _row_tile, _rows, _visible,
                                  held_result, row_dot, tuned)
from .sparse_train_plan import EXTRA_ROWS, TILE_ROWS, SparsePlan, sparse_train_plan
from .sparse_train_split import SplitTrainAttention

# The path the kernels take when ``split`` is not given: True, each tile's keys split in the blocks all its tokens
# share (whole tiles, no bitmap) and each token's extras (small tiles), merged by log-sum-exp
# (``sparse_train_split.py``); False, the union of the tile's selections in one pass, kept for comparison
# (benchmarks/train_step.py times both).
SPLIT = True
# (BLOCK_M, num_warps, num_stages) per kernel; on a GPU the launcher picks the fastest per (kernel, head dim, group,
# block size, tile, dtype) on the first call. Fixed under the interpreter (autotuning there would run them all).
FWD_CONFIGS = [(128, 8, 3), (128, 4, 3), (128, 8, 2), (64, 4, 3), (64, 4, 2)]
DKDV_CONFIGS = [(64, 4, 2), (64, 8, 2), (32, 4, 2), (128, 8, 2), (64, 4, 3)]
DQ_CONFIGS = [(64, 4, 2), (128, 8, 2), (64, 8, 2), (32, 4, 2), (128, 4, 2)]
INTERPRETER_CONFIG = (16, 4, 1)
# Most fp32 logits one query chunk of the reference holds.
_REF_CHUNK_ELEMENTS = 1 << 24

if HAS_TRITON:

    @triton.jit
    def _sparse_fwd_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, block_ptr, out_ptr, lse_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_ob, stride_oh, stride_ot, stride_lb, stride_lh,
        Hk, Tq, T, N, n_qt, n_sub, q_offset, qk_scale,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr,
        FLOOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        i_m, i_bh = tl.program_id(0), tl.program_id(1)
        i_t, i_s = i_m // n_sub, i_m % n_sub
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off  # keys of the row from its first real one
        o_t, o_h, m_r, pos, own = _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
        o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
        b_q = _load_rows(q_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt, IEEE)
        p_k, p_v, p_b, p_sel, count, p_blocks = _row_tile(
            k_ptr, v_ptr, bias_ptr, sel_ptr, count_ptr, block_ptr, i_b, i_hk, i_t, off, o_t, o_d,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bb, stride_bh,
            stride_sb, stride_sh, stride_st, Hk, N, n_qt)

        m_i = tl.full([BLOCK_M], FLOOR, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for i in range(0, count):
            n = tl.load(p_blocks + i).to(tl.int32)
            o_s = n * P + o_n  # row-relative keys of the block
            m_s = (o_n < P) & (o_s < L)
            b_k, b_s = _logits(b_q, p_k, p_b, o_s, m_s, qk_scale, stride_kt, IEEE)
            b_s = tl.where(_visible(p_sel, n, o_s, m_s, m_r, pos, own), b_s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            b_p = tl.math.exp2(b_s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(b_p, 1)
            b_v = tl.load(p_v + o_s[:, None].to(tl.int64) * stride_vt, mask=m_s[:, None], other=0.0)
            if IEEE:
                b_v = b_v.to(tl.float32)
            acc = acc * alpha[:, None] + _dot(b_p, b_v, IEEE)
            m_i = m_new

        b_o = acc / tl.maximum(l_i, 1e-30)[:, None]
        p_o = (out_ptr + i_b.to(tl.int64) * stride_ob + o_h[:, None].to(tl.int64) * stride_oh
               + o_t[:, None].to(tl.int64) * stride_ot + o_d[None, :])
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_r[:, None])
        p_l = lse_ptr + i_b.to(tl.int64) * stride_lb + o_h.to(tl.int64) * stride_lh + o_t
        tl.store(p_l, (m_i + tl.math.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453, mask=m_r)

    @triton.jit
    def _sparse_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, tile_ptr, do_ptr, lse_ptr, delta_ptr,
        dk_ptr, dv_ptr, db_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_ob, stride_oh, stride_ot, stride_lb, stride_lh,
        Hk, Tq, T, N, n_qt, n_sub, q_offset, qk_scale, scale,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """dK, dV and the bias gradient of key block ``i_n``; dK, dV and dbias share the strides of K, V and the
        bias, dO takes the ``stride_o*`` slots, delta shares lse's strides."""
        i_n, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off
        o_n, o_d, o_s, m_s, row_k, row_v, b_k, b_v, o_bias, b_bias = _key_block(
            k_ptr, v_ptr, bias_ptr, i_b, i_hk, i_n, off, L, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
            stride_vt, stride_bb, stride_bh, D, P, IEEE, BLOCK_N)
        p_sel0 = sel_ptr + i_b.to(tl.int64) * stride_sb + i_hk.to(tl.int64) * stride_sh
        i_plan = (i_b * Hk + i_hk) * N + i_n
        count = tl.load(count_ptr + i_plan)
        p_tiles = tile_ptr + i_plan.to(tl.int64) * n_qt

        b_dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        b_dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        b_db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in range(0, count):
            i_t = tl.load(p_tiles + i).to(tl.int32)
            for i_s in range(0, n_sub):
                o_t, o_h, m_r, pos, own = _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
                b_q = _load_rows(q_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt, IEEE)
                b_do = _load_rows(do_ptr, i_b, o_h, o_t, o_d, m_r, stride_ob, stride_oh, stride_ot, IEEE)
                o_l = i_b.to(tl.int64) * stride_lb + o_h.to(tl.int64) * stride_lh + o_t
                b_lse = tl.load(lse_ptr + o_l, mask=m_r, other=0.0) * 1.4426950408889634
                b_delta = tl.load(delta_ptr + o_l, mask=m_r, other=0.0)
                b_s = _dot(b_q, tl.trans(b_k), IEEE) * qk_scale + b_bias[None, :]
                visible = _visible(p_sel0 + o_t.to(tl.int64) * stride_st, i_n, o_s, m_s, m_r, pos, own)
                b_p = tl.math.exp2(tl.where(visible, b_s, float("-inf")) - b_lse[:, None])
                b_dv += _dot(tl.trans(b_p), b_do, IEEE)
                b_ds = b_p * (_dot(b_do, tl.trans(b_v), IEEE) - b_delta[:, None])
                b_dk += _dot(tl.trans(b_ds), b_q, IEEE)
                b_db += tl.sum(b_ds, 0)
        tl.store(dk_ptr + row_k, (b_dk * scale).to(dk_ptr.dtype.element_ty), mask=m_s[:, None])
        tl.store(dv_ptr + row_v, b_dv.to(dv_ptr.dtype.element_ty), mask=m_s[:, None])
        tl.store(db_ptr + o_bias, b_db, mask=m_s)

    @triton.jit
    def _sparse_dq_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, sel_ptr, off_ptr, count_ptr, block_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_sb, stride_sh, stride_st, stride_ob, stride_oh, stride_ot, stride_lb, stride_lh,
        Hk, Tq, T, N, n_qt, n_sub, q_offset, qk_scale, scale,
        D: tl.constexpr, P: tl.constexpr, G: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """dQ of ``BLOCK_M`` rows over the blocks of their plan tile; dQ shares the strides of Q, dO those of out,
        delta those of lse."""
        i_m, i_bh = tl.program_id(0), tl.program_id(1)
        i_t, i_s = i_m // n_sub, i_m % n_sub
        i_b, i_hk = i_bh // Hk, i_bh % Hk
        off = tl.load(off_ptr + i_b)
        L = T - off
        o_t, o_h, m_r, pos, own = _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS, G, P, BLOCK_M)
        o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
        b_q = _load_rows(q_ptr, i_b, o_h, o_t, o_d, m_r, stride_qb, stride_qh, stride_qt, IEEE)
        b_do = _load_rows(do_ptr, i_b, o_h, o_t, o_d, m_r, stride_ob, stride_oh, stride_ot, IEEE)
        o_l = i_b.to(tl.int64) * stride_lb + o_h.to(tl.int64) * stride_lh + o_t
        b_lse = tl.load(lse_ptr + o_l, mask=m_r, other=0.0) * 1.4426950408889634
        b_delta = tl.load(delta_ptr + o_l, mask=m_r, other=0.0)
        p_k, p_v, p_b, p_sel, count, p_blocks = _row_tile(
            k_ptr, v_ptr, bias_ptr, sel_ptr, count_ptr, block_ptr, i_b, i_hk, i_t, off, o_t, o_d,
            stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bb, stride_bh,
            stride_sb, stride_sh, stride_st, Hk, N, n_qt)

        b_dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for i in range(0, count):
            n = tl.load(p_blocks + i).to(tl.int32)
            o_s = n * P + o_n
            m_s = (o_n < P) & (o_s < L)
            b_k, b_s = _logits(b_q, p_k, p_b, o_s, m_s, qk_scale, stride_kt, IEEE)
            visible = _visible(p_sel, n, o_s, m_s, m_r, pos, own)
            b_p = tl.math.exp2(tl.where(visible, b_s, float("-inf")) - b_lse[:, None])
            b_v = tl.load(p_v + o_s[:, None].to(tl.int64) * stride_vt, mask=m_s[:, None], other=0.0)
            if IEEE:
                b_v = b_v.to(tl.float32)
            b_ds = b_p * (_dot(b_do, tl.trans(b_v), IEEE) - b_delta[:, None])
            b_dq += _dot(b_ds, b_k, IEEE)
        p_dq = (dq_ptr + i_b.to(tl.int64) * stride_qb + o_h[:, None].to(tl.int64) * stride_qh
                + o_t[:, None].to(tl.int64) * stride_qt + o_d[None, :])
        tl.store(p_dq, (b_dq * scale).to(dq_ptr.dtype.element_ty), mask=m_r[:, None])


_BEST: dict[tuple, tuple] = {}  # (kernel, D, G, P, tokens, dtype, device) -> the fastest of its configs, timed once


def _tuned(name, run, configs, query, G, P, tokens, config) -> None:
    tuned(_BEST, name, run, configs, query, G, P, tokens, config, INTERPRETER_CONFIG)


def _common(query, key, value, bias, bitmap, plan, block_size):
    """Arguments every kernel takes: the shared tensors' strides, the sizes and the constexprs."""
    B, H, Tq, D = query.shape
    Hk, T, N = key.shape[1], key.shape[2], bitmap.shape[3]
    ieee = query.dtype == torch.float32 or interpreting()  # the interpreter's bf16 tl.dot is wrong: it casts
    strides = (query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
               value.stride(0), value.stride(1), value.stride(2), bias.stride(0), bias.stride(1),
               bitmap.stride(0), bitmap.stride(1), bitmap.stride(2))
    constexprs = dict(D=D, P=block_size, G=H // Hk, TOKENS=plan.tokens, IEEE=ieee,
                      BLOCK_N=max(16, next_power_of_2(block_size)))
    return strides, (Hk, Tq, T, N, plan.counts.shape[2]), constexprs


def _forward(query, key, value, bias, bitmap, offsets, plan, scale, q_offset, block_size, config):
    B, H, Tq, D = query.shape
    out = torch.empty_like(query)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=query.device)
    strides, sizes, constexprs = _common(query, key, value, bias, bitmap, plan, block_size)
    G, rows = constexprs["G"], plan.tokens * constexprs["G"]

    def run(block_m, warps, stages):
        n_sub = triton.cdiv(rows, block_m)
        with on_device(query):
            launcher(_sparse_fwd_kernel)[(sizes[4] * n_sub, B * sizes[0])](
                query, key, value, bias, bitmap, offsets, plan.counts, plan.blocks, out, lse,
                *strides, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                *sizes, n_sub, q_offset, scale * LOG2E, FLOOR=MASK_VALUE * LOG2E,
                BLOCK_M=block_m, num_warps=warps, num_stages=stages, **constexprs,
            )

    _tuned("fwd", run, FWD_CONFIGS, query, G, block_size, plan.tokens, config)
    return out, lse


def _backward(grad, query, key, value, bias, bitmap, offsets, out, lse, plan, scale, q_offset, block_size, config,
              needs):
    B, H, Tq, D = query.shape
    delta = row_dot(grad, out)  # [B, H, Tq], lse's layout
    strides, sizes, constexprs = _common(query, key, value, bias, bitmap, plan, block_size)
    G, rows, N = constexprs["G"], plan.tokens * constexprs["G"], sizes[3]
    tail = (grad.stride(0), grad.stride(1), grad.stride(2), lse.stride(0), lse.stride(1))
    dq = dk = dv = dbias = None
    if needs[1] or needs[2] or needs[3]:
        # keys inside a row's padding belong to no block: their gradients stay 0
        dk, dv, dbias = torch.zeros_like(key), torch.zeros_like(value), torch.zeros_like(bias)

        def run_dkdv(block_m, warps, stages):
            with on_device(query):
                launcher(_sparse_dkdv_kernel)[(N, B * sizes[0])](
                    query, key, value, bias, bitmap, offsets, plan.tile_counts, plan.tiles, grad, lse, delta,
                    dk, dv, dbias, *strides, *tail, *sizes, triton.cdiv(rows, block_m), q_offset, scale * LOG2E,
                    scale, BLOCK_M=block_m, num_warps=warps, num_stages=stages, **constexprs,
                )

        _tuned("dkdv", run_dkdv, DKDV_CONFIGS, query, G, block_size, plan.tokens, config)
    if needs[0]:
        dq = torch.empty_like(query)

        def run_dq(block_m, warps, stages):
            n_sub = triton.cdiv(rows, block_m)
            with on_device(query):
                launcher(_sparse_dq_kernel)[(sizes[4] * n_sub, B * sizes[0])](
                    query, key, value, bias, bitmap, offsets, plan.counts, plan.blocks, grad, lse, delta, dq,
                    *strides, *tail, *sizes, n_sub, q_offset, scale * LOG2E, scale,
                    BLOCK_M=block_m, num_warps=warps, num_stages=stages, **constexprs,
                )

        _tuned("dq", run_dq, DQ_CONFIGS, query, G, block_size, plan.tokens, config)
    return dq, dk, dv, dbias


class _SparseTrainAttention(torch.autograd.Function):
    """The kernels with their backward; the plan is built in the forward and kept for the backward."""

    @staticmethod
    def forward(ctx, query, key, value, bias, bitmap, offsets, padded, scale, block_size, q_offset, tile, config, held):
        plan = sparse_train_plan(bitmap, heads=query.shape[1], block_size=block_size, q_offset=q_offset,
                                 offsets=offsets if padded else None, tile=tile)
        bits = bitmap.view(torch.uint8)
        out, lse = held_result(held, query, lambda: _forward(query, key, value, bias, bits, offsets, plan, scale,
                                                             q_offset, block_size, config))
        ctx.save_for_backward(query, key, value, bias, bits, offsets, out, lse, *plan[1:])
        ctx.settings = (plan.tokens, scale, q_offset, block_size, config)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        query, key, value, bias, bits, offsets, out, lse, *lists = ctx.saved_tensors
        tokens, scale, q_offset, block_size, config = ctx.settings
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        plan = SparsePlan(tokens, *lists)
        dq, dk, dv, dbias = _backward(grad, query, key, value, bias, bits, offsets, out, lse, plan, scale, q_offset,
                                      block_size, config, ctx.needs_input_grad[:4])
        return dq, dk, dv, dbias, None, None, None, None, None, None, None, None, None


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy unless it is dense with a contiguous last dim (an expanded tensor overlaps
    itself): the backward writes gradients with ``t``'s strides into ``zeros_like(t)`` / ``empty_like(t)``."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride != expected:
            return t.contiguous()
        expected *= size
    return t if t.stride(-1) == 1 else t.contiguous()


def sparse_train_attention_ref(query, key, value, bias, bitmap, scale, *, block_size, q_offset=0, offsets=None):
    """The torch reference: the rule's per-token mask, additive on ``attend.attend``, in chunks of queries; rows
    that see no key are 0, as in the kernel."""
    B, H, Tq, _ = query.shape
    Hk, T, P = key.shape[1], key.shape[2], block_size
    device = query.device
    off = torch.zeros(B, dtype=torch.long, device=device) if offsets is None else offsets.to(device).long()
    keys = torch.arange(T, device=device)[None, :] - off[:, None]  # [B, T] row-relative; negative: padding
    real = keys >= 0
    blocks = keys.clamp(min=0) // P
    chunk = max(1, _REF_CHUNK_ELEMENTS // max(1, B * H * T))
    outs = []
    for lo in range(0, Tq, chunk):
        hi = min(Tq, lo + chunk)
        pos = q_offset + torch.arange(lo, hi, device=device)[None, :] - off[:, None]  # [B, c]
        own = (blocks[:, None, :] == pos.clamp(min=0)[..., None] // P) & (keys[:, None, :] <= pos[..., None])
        selected = bitmap[:, :, lo:hi].gather(-1, blocks[:, None, None, :].expand(B, Hk, hi - lo, T))
        mask = (selected | own[:, None]) & real[:, None, None, :]  # [B, Hk, c, T]
        inputs = AttentionInputs(key, value, bias, torch.where(mask, 0.0, MASK_VALUE), q_offset + lo, causal=False)
        out = attend(query[:, :, lo:hi], inputs, scale)
        seen = mask.any(-1).repeat_interleave(H // Hk, dim=1)[..., None]
        outs.append(torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=device)))
    return torch.cat(outs, dim=2)


def sparse_train_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                           bitmap: torch.Tensor, scale: float, *, block_size: int, q_offset: int = 0,
                           offsets: torch.Tensor | None = None, tile: int | None = None, config: tuple | None = None,
                           split: bool | None = None, extra_tile: int | None = None, held=None) -> torch.Tensor:
    """NOSA attention of every query token over its selected blocks and its own block, with gradients: Triton where
    the kernels run (CUDA, or the interpreter), the torch reference elsewhere (``backend.kernel_path``).

    Args:
        query: ``[B, H, Tq, D]`` post-RoPE queries at positions ``q_offset ..``.
        key, value: ``[B, Hk, T, D]`` in the query's dtype, ``T = q_offset + Tq``, H a multiple of Hk.
        bias: ``[B, Hk, T]`` float32 eviction bias, added to the logits unscaled (``MASK_VALUE`` hides a key);
            gradients flow to it.
        bitmap: ``[B, Hk, Tq, N]`` bool, ``N = ceil(T / P)``: True where query ``t`` selected block ``n``.
        scale: the logits' scale.
        block_size: P, keys per block.
        q_offset: position of the first query.
        offsets: ``[B]`` integer left padding of each row, or None: positions and blocks are then row-relative
            (block n of row b holds keys ``offsets[b] + n * P ..``) and keys inside the padding are never seen.
        tile: query rows per tile of the plan (``sparse_train_plan``; default ``TILE_ROWS``).
        config: ``(BLOCK_M, num_warps, num_stages)`` for every kernel (the split path's extras kernels take the
            warps and stages, their rows being ``extra_tile``'s); None: the fastest of each kernel's configs, timed
            once (fixed under the interpreter).
        split: each tile's keys in the blocks all its tokens share and each token's extras, merged by log-sum-exp
            (``sparse_train_split.py``), or the union of the tile's selections in one pass (False); None: ``SPLIT``.
        extra_tile: split path: query rows per extras tile (default ``sparse_train_plan.EXTRA_ROWS``).
        held: the output of this very forward computed before, for gradient checkpointing's rerun
            (``held_forward.HeldForward``): ``held.output(device)`` gives ``(out, lse)`` or None, and a forward that
            computes them hands them to ``held.keep_output(out, lse)``. The kernels' path only; None: compute.

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype; 0 in rows that see no key (queries inside the padding).

    Example:
        >>> q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
        >>> bitmap = torch.zeros(1, 2, 40, 3, dtype=torch.bool)
        >>> bitmap[:, :, 16:, 0] = True  # queries past the first block also see block 0
        >>> b = torch.randn(1, 2, 40)
        >>> out = sparse_train_attention(q, k, v, b, bitmap, 0.25, block_size=16)
        >>> out.shape
        torch.Size([1, 4, 40, 16])
        >>> torch.allclose(out, sparse_train_attention_ref(q, k, v, b, bitmap, 0.25, block_size=16), atol=1e-5)
        True
    """
    name = "sparse_train_attention"
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(f"{name}: query must be [B, H, Tq, D] and key/value [B, Hk, T, D]; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    B, H, Tq, D = query.shape
    Hk, T = key.shape[1], key.shape[2]
    if key.shape[0] != B or key.shape[3] != D or H % Hk:
        raise ValueError(f"{name}: key {tuple(key.shape)} does not fit query {tuple(query.shape)} (need [B, Hk, T, "
                         "D] with H % Hk == 0)")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"{name}: query, key and value must share a dtype; got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    if T != q_offset + Tq or q_offset < 0:
        raise ValueError(f"{name}: q_offset={q_offset} is invalid: key holds T={T} tokens, so q_offset must be T - "
                         f"Tq = {T - Tq}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"{name}: block_size={block_size} is invalid: it must be a power of two")
    if tuple(bias.shape) != (B, Hk, T) or bias.dtype != torch.float32:
        raise ValueError(f"{name}: bias must be float32 [B, Hk, T] = {(B, Hk, T)}; got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    N = -(-T // block_size)
    if tuple(bitmap.shape) != (B, Hk, Tq, N) or bitmap.dtype != torch.bool:
        raise ValueError(f"{name}: bitmap must be bool [B, Hk, Tq, N] = {(B, Hk, Tq, N)} (N = ceil(T / "
                         f"block_size)); got {bitmap.dtype} {tuple(bitmap.shape)}")
    if offsets is not None and (tuple(offsets.shape) != (B,) or offsets.dtype.is_floating_point
                                or offsets.dtype == torch.bool):
        raise ValueError(f"{name}: offsets must be an integer tensor [B] = [{B}] or None; got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    if tile is not None and tile < 1:
        raise ValueError(f"{name}: tile={tile} is invalid: it must be a positive number of rows")
    if extra_tile is not None and extra_tile < 1:
        raise ValueError(f"{name}: extra_tile={extra_tile} is invalid: it must be a positive number of rows")
    if config is not None and (len(config) != 3 or config[0] < 16 or config[0] & (config[0] - 1)):
        raise ValueError(f"{name}: config={config} is invalid: it must be (BLOCK_M, num_warps, num_stages) with "
                         "BLOCK_M a power of two >= 16")
    if Tq == 0 or kernel_path(name, query) == "torch":
        return sparse_train_attention_ref(query, key, value, bias, bitmap, scale, block_size=block_size,
                                          q_offset=q_offset, offsets=offsets)
    if D > 256:
        raise ValueError(f"{name}: the Triton kernels take a head dim up to 256; got query with D={D} (use "
                         "nosa_training_attention's explicit backend)")
    width = max(16, next_power_of_2(D))
    if width != D:  # zero columns change no dot product; the output's are cut off again
        query, key, value = (F.pad(t, (0, width - D)) for t in (query, key, value))
    query, key, value = (_dense(t) for t in (query, key, value))
    bias, bitmap = bias.contiguous(), bitmap.contiguous()
    # the plan takes the general path (tokens inside a row's padding) only where there is padding to count out: on a
    # tensor of zeros it costs a 0.5 GB elementwise pass per layer at 64K
    padded = offsets is not None
    offsets = (torch.zeros(B, dtype=torch.int32, device=query.device) if offsets is None
               else offsets.to(device=query.device, dtype=torch.int32))
    tile = TILE_ROWS if tile is None else int(tile)
    if SPLIT if split is None else split:
        out = SplitTrainAttention.apply(query, key, value, bias, bitmap, offsets, padded, float(scale), int(block_size),
                                        int(q_offset), tile, EXTRA_ROWS if extra_tile is None else int(extra_tile),
                                        config, held)
    else:
        out = _SparseTrainAttention.apply(query, key, value, bias, bitmap, offsets, padded, float(scale),
                                          int(block_size), int(q_offset), tile, config, held)
    return out[..., :D] if width != D else out
