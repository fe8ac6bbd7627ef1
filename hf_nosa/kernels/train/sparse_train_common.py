"""Triton helpers both paths of the sparse training attention share (``sparse_train_attention.py``, the union of
a tile's selections; ``sparse_train_split.py``, shared blocks and extras): the rows of a tile, the per-row
visibility of a block, the logits, the row loads. Rows are (token, query head of a GQA group) pairs, row ``r`` of a
tile of ``TOKENS`` tokens being token ``r // G``, head ``r % G`` of the group.
"""

from __future__ import annotations

import torch

from ..backend import HAS_TRITON, launcher, next_power_of_2, on_device, tl, triton, tuned_run

LOG2E = 1.4426950408889634
# Rows per program of ``row_dot``.
ROW_DOT_ROWS = 64


def held_result(held, query, compute):
    """The forward's ``(out, lse)``: ``held``'s (gradient checkpointing's rerun, ``held_forward.HeldForward``), or
    ``compute()``'s, handed to ``held`` to keep when there is one."""
    result = held.output(query.device) if held is not None else None
    if result is None:
        result = compute()
        if held is not None:
            held.keep_output(*result)
    return result


def tuned(cache, name, run, configs, query, G, P, tokens, config, interpreter_config) -> None:
    """``run(*config)``: the given configuration, the interpreter's, or the fastest of ``configs`` (timed once per
    kernel, D, G, P, tile tokens, dtype and device, kept in ``cache``). In float32 (IEEE dots: the precise path, not
    the fast one) the first that fits, untimed: compiling every configuration in IEEE precision took minutes a shape."""
    key = (name, query.shape[-1], G, P, tokens, query.dtype, query.device)
    tuned_run(run, configs, cache, key, query.device, f"sparse_train_attention ({name})", config=config,
              interpreter_config=interpreter_config, timed=query.dtype != torch.float32)


def row_dot_ref(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``[B, H, Tq, D]`` x2 -> ``[B, H, Tq]`` fp32: the backward's ``delta = rowsum(dO * O)``."""
    return (grad.float() * out.float()).sum(-1)


def row_dot(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``row_dot_ref`` in one pass (``_row_dot_kernel``): the torch form makes fp32 copies of both operands and of
    their product, 1.5 GB of traffic per layer at 64K in the 1b shape for a 8 MB result. The kernels' path only."""
    B, H, Tq, D = out.shape
    if grad.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("row_dot: grad and out must have a contiguous last dimension")
    delta = torch.empty(B, H, Tq, dtype=torch.float32, device=out.device)
    rows = B * H * Tq
    if rows:
        with on_device(out):
            launcher(_row_dot_kernel)[(triton.cdiv(Tq, ROW_DOT_ROWS), B * H)](
                grad, out, delta, H, Tq, grad.stride(0), grad.stride(1), grad.stride(2), out.stride(0), out.stride(1),
                out.stride(2), D=D, BLOCK_D=next_power_of_2(D), ROWS=ROW_DOT_ROWS)
    return delta


if HAS_TRITON:

    @triton.jit
    def _row_dot_kernel(g_ptr, o_ptr, delta_ptr, H, Tq, stride_gb, stride_gh, stride_gt, stride_ob, stride_oh,
                        stride_ot, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        i_b, i_h = i_bh // H, i_bh % H
        o_t = i_t * ROWS + tl.arange(0, ROWS)
        o_d = tl.arange(0, BLOCK_D)
        m = (o_t < Tq)[:, None] & (o_d < D)[None, :]
        b_g = tl.load(g_ptr + i_b.to(tl.int64) * stride_gb + i_h.to(tl.int64) * stride_gh
                      + o_t[:, None].to(tl.int64) * stride_gt + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_o = tl.load(o_ptr + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh
                      + o_t[:, None].to(tl.int64) * stride_ot + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(delta_ptr + i_bh.to(tl.int64) * Tq + o_t, tl.sum(b_g * b_o, 1), mask=o_t < Tq)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """``a @ b`` in fp32 (both fp32 under IEEE), else with ``a`` cast to ``b``'s dtype."""
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a.to(b.dtype), b)
        return c

    @triton.jit
    def _rows(i_t, i_s, i_hk, Tq, q_offset, off, TOKENS: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
              BLOCK_M: tl.constexpr):
        """Rows ``i_s * BLOCK_M ..`` of plan tile ``i_t``: token, query head, validity, row-relative position and
        own block (-1 for a position inside the padding)."""
        o_r = i_s * BLOCK_M + tl.arange(0, BLOCK_M)
        o_t = i_t * TOKENS + o_r // G
        o_h = i_hk * G + o_r % G
        m_r = (o_r < TOKENS * G) & (o_t < Tq)
        pos = q_offset + o_t - off
        own = tl.where(pos >= 0, tl.maximum(pos, 0) // P, -1)
        return o_t, o_h, m_r, pos, own

    @triton.jit
    def _visible(p_sel, n, o_s, m_s, m_r, pos, own):
        """``[BLOCK_M, BLOCK_N]``: which keys ``o_s`` of block ``n`` the rows see. The rows' bits for the block are
        one ``[BLOCK_M]`` load, broadcast over the keys; the own block adds its causal part."""
        b_sel = tl.load(p_sel + n, mask=m_r, other=0) != 0
        m_own = (own == n)[:, None] & (o_s[None, :] <= pos[:, None])
        return (b_sel[:, None] | m_own) & m_s[None, :] & m_r[:, None]

    @triton.jit
    def _logits(b_q, p_k, p_b, o_s, m_s, qk_scale, stride_kt, IEEE: tl.constexpr):
        """The keys of a block and the rows' logits against them (exp2 domain, bias included)."""
        b_k = tl.load(p_k + o_s[:, None].to(tl.int64) * stride_kt, mask=m_s[:, None], other=0.0)
        if IEEE:
            b_k = b_k.to(tl.float32)
        b_bias = tl.load(p_b + o_s, mask=m_s, other=0.0)
        b_s = _dot(b_q, tl.trans(b_k), IEEE) * qk_scale + b_bias[None, :] * 1.4426950408889634
        return b_k, b_s

    @triton.jit
    def _load_rows(ptr, i_b, o_h, o_t, o_d, m_r, stride_b, stride_h, stride_t, IEEE: tl.constexpr):
        """``[BLOCK_M, D]`` of a ``[B, H, Tq, D]`` tensor at the rows' (head, token)."""
        p = (ptr + i_b.to(tl.int64) * stride_b + o_h[:, None].to(tl.int64) * stride_h
             + o_t[:, None].to(tl.int64) * stride_t + o_d[None, :])
        b = tl.load(p, mask=m_r[:, None], other=0.0)
        if IEEE:
            b = b.to(tl.float32)
        return b

    @triton.jit
    def _row_tile(k_ptr, v_ptr, bias_ptr, sel_ptr, count_ptr, block_ptr, i_b, i_hk, i_t, off, o_t, o_d,
                  stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_bb, stride_bh,
                  stride_sb, stride_sh, stride_st, Hk, N, n_qt):
        """What a row tile reads across its blocks: K, V and bias from the row's first real key, the rows'
        selection bits, and the plan's visited blocks (count and list)."""
        p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh + off.to(tl.int64) * stride_kt \
            + o_d[None, :]
        p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh + off.to(tl.int64) * stride_vt \
            + o_d[None, :]
        p_b = bias_ptr + i_b.to(tl.int64) * stride_bb + i_hk.to(tl.int64) * stride_bh + off
        p_sel = sel_ptr + i_b.to(tl.int64) * stride_sb + i_hk.to(tl.int64) * stride_sh + o_t.to(tl.int64) * stride_st
        i_plan = (i_b * Hk + i_hk) * n_qt + i_t
        count = tl.load(count_ptr + i_plan)
        p_blocks = block_ptr + i_plan.to(tl.int64) * N
        return p_k, p_v, p_b, p_sel, count, p_blocks

    @triton.jit
    def _key_block(k_ptr, v_ptr, bias_ptr, i_b, i_hk, i_n, off, L, stride_kb, stride_kh, stride_kt, stride_vb,
                   stride_vh, stride_vt, stride_bb, stride_bh, D: tl.constexpr, P: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        """What a dK/dV program holds of its key block ``i_n``: the block's keys (row-relative ``o_s``, valid
        ``m_s``), K, V, the bias in the exp2 domain, and the bias's offsets (dbias shares the bias's strides)."""
        o_n, o_d = tl.arange(0, BLOCK_N), tl.arange(0, D)
        o_s = i_n * P + o_n
        m_s = (o_n < P) & (o_s < L)
        row_k = i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh \
            + (off + o_s)[:, None].to(tl.int64) * stride_kt + o_d[None, :]
        row_v = i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh \
            + (off + o_s)[:, None].to(tl.int64) * stride_vt + o_d[None, :]
        b_k = tl.load(k_ptr + row_k, mask=m_s[:, None], other=0.0)
        b_v = tl.load(v_ptr + row_v, mask=m_s[:, None], other=0.0)
        if IEEE:
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
        o_bias = i_b.to(tl.int64) * stride_bb + i_hk.to(tl.int64) * stride_bh + off + o_s
        b_bias = tl.load(bias_ptr + o_bias, mask=m_s, other=0.0) * 1.4426950408889634
        return o_n, o_d, o_s, m_s, row_k, row_v, b_k, b_v, o_bias, b_bias
