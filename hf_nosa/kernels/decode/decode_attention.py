"""Sparse decode attention over the device slot pool: ``softmax(q . k * scale + b) . v`` for one query token.

GQA-aware: one program serves all G query heads of a KV head, so every resident K/V token is read once per KV
head. The slots are split across programs (flash-decoding) when there are too few (sequence, KV head) pairs to
fill the GPU; a second small kernel merges the splits. bf16/fp16 inputs, fp32 accumulation; the bias (eviction
score, or ``MASK_VALUE`` for empty slot positions) is added after the scaling, as in ``attend``.
"""

from __future__ import annotations

import torch

from ...rules.attend import AttentionInputs, attend
from ..backend import HAS_TRITON, interpreting, kernel_path, launcher, next_power_of_2, on_device, sm_count, tl, triton

BLOCK_S = 64  # keys per inner step: one 64-token block
MIN_SPLIT = 512  # keys per program at least, so splitting never costs more than it saves


def _empty(*shape, dtype, device) -> torch.Tensor:
    """Every buffer a launch allocates (outputs and scratch); tests swap it for one that poisons them."""
    return torch.empty(*shape, dtype=dtype, device=device)


if HAS_TRITON:

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_bb, stride_bh, stride_ob, stride_oh,
        S, split_len, scale,
        HK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_sp = tl.program_id(1)
        i_b = i_bh // HK
        i_h = i_bh % HK
        o_g = tl.arange(0, G_PAD)
        o_d = tl.arange(0, D_PAD)
        m_g = o_g < G
        m_d = o_d < D

        p_q = q_ptr + i_b * stride_qb + (i_h * G + o_g)[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
        if IEEE:
            b_q = b_q.to(tl.float32)
        p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_h * stride_kh
        p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_h * stride_vh
        p_bias = bias_ptr + i_b.to(tl.int64) * stride_bb + i_h * stride_bh

        s_lo = i_sp * split_len
        s_hi = tl.minimum(S, s_lo + split_len)
        b_m = tl.full([G_PAD], float("-inf"), tl.float32)
        b_l = tl.zeros([G_PAD], tl.float32)
        b_acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for s0 in range(s_lo, s_hi, BLOCK):
            o_s = s0 + tl.arange(0, BLOCK)
            m_s = o_s < s_hi
            m_kv = m_s[:, None] & m_d[None, :]
            b_k = tl.load(p_k + o_s[:, None] * stride_ks + o_d[None, :], mask=m_kv, other=0.0)
            b_bias = tl.load(p_bias + o_s, mask=m_s, other=float("-inf"))
            if IEEE:
                b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee")
            else:
                b_s = tl.dot(b_q, tl.trans(b_k))
            b_s = b_s * scale + b_bias[None, :]
            # Every step holds at least one in-range key, whose logit is finite (MASK_VALUE at worst).
            m_new = tl.maximum(b_m, tl.max(b_s, 1))
            alpha = tl.exp(b_m - m_new)
            b_p = tl.exp(b_s - m_new[:, None])
            b_l = b_l * alpha + tl.sum(b_p, 1)
            b_v = tl.load(p_v + o_s[:, None] * stride_vs + o_d[None, :], mask=m_kv, other=0.0)
            if IEEE:
                b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
            else:
                b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
            b_acc = b_acc * alpha[:, None] + b_pv
            b_m = m_new

        if NUM_SPLITS == 1:
            b_o = b_acc / b_l[:, None]
            p_o = out_ptr + i_b * stride_ob + (i_h * G + o_g)[:, None] * stride_oh + o_d[None, :]
            tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])
        else:
            row = (i_bh * NUM_SPLITS + i_sp) * G + o_g  # [G_PAD] rows of the partials
            tl.store(part_acc_ptr + row[:, None] * D_PAD + o_d[None, :], b_acc, mask=m_g[:, None])
            tl.store(part_ml_ptr + row * 2, b_m, mask=m_g)
            tl.store(part_ml_ptr + row * 2 + 1, b_l, mask=m_g)

    @triton.jit
    def _combine_splits_kernel(
        part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
        H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        i = tl.program_id(0)  # one program per (sequence, query head)
        i_b = i // H
        i_q = i % H
        i_bh = i_b * (H // G) + i_q // G
        o_n = tl.arange(0, SPLITS_PAD)
        o_d = tl.arange(0, D_PAD)
        m_n = o_n < NUM_SPLITS
        row = (i_bh * NUM_SPLITS + o_n) * G + i_q % G
        b_m = tl.load(part_ml_ptr + row * 2, mask=m_n, other=float("-inf"))
        b_l = tl.load(part_ml_ptr + row * 2 + 1, mask=m_n, other=0.0)
        b_w = tl.where(m_n, tl.exp(b_m - tl.max(b_m, 0)), 0.0)
        b_acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + o_d[None, :], mask=m_n[:, None], other=0.0)
        b_o = tl.sum(b_acc * b_w[:, None], 0) / tl.sum(b_l * b_w, 0)
        tl.store(out_ptr + i_b * stride_ob + i_q * stride_oh + o_d, b_o.to(out_ptr.dtype.element_ty), mask=o_d < D)


def _decode_attention_triton(query, keys, values, key_bias, scale: float, num_splits: int | None) -> torch.Tensor:
    B, H, _, D = query.shape
    Hk, S = keys.shape[1], keys.shape[2]
    G = H // Hk
    if num_splits is None:
        # Enough programs for two waves over the GPU, never less than MIN_SPLIT keys per program.
        want = triton.cdiv(2 * sm_count(query.device), B * Hk)
        num_splits = max(1, min(want, triton.cdiv(S, MIN_SPLIT)))
    split_len = triton.cdiv(triton.cdiv(S, num_splits), BLOCK_S) * BLOCK_S
    num_splits = triton.cdiv(S, split_len)
    D_PAD = next_power_of_2(max(D, 16))
    out = _empty(B, H, 1, D, dtype=query.dtype, device=query.device)
    if num_splits > 1:
        part_acc = _empty(B * Hk * num_splits * G, D_PAD, dtype=torch.float32, device=query.device)
        part_ml = _empty(B * Hk * num_splits * G, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out
    # fp32 inputs keep full precision; the interpreter computes tl.dot on bf16 wrongly, so it casts too.
    ieee = query.dtype == torch.float32 or keys.dtype == torch.float32 or interpreting()
    with on_device(query):
        launcher(_decode_attention_kernel)[(B * Hk, num_splits)](
            query, keys, values, key_bias, out, part_acc, part_ml,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), key_bias.stride(0), key_bias.stride(1),
            out.stride(0), out.stride(1),
            S, split_len, float(scale),
            HK=Hk, G=G, G_PAD=max(16, next_power_of_2(G)), D=D, D_PAD=D_PAD,
            BLOCK=BLOCK_S, NUM_SPLITS=num_splits, IEEE=ieee,
            num_warps=4, num_stages=2,
        )
        if num_splits > 1:
            launcher(_combine_splits_kernel)[(B * H,)](
                part_acc, part_ml, out, out.stride(0), out.stride(1),
                H=H, G=G, D=D, D_PAD=D_PAD, NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits),
                num_warps=4,
            )
    return out


def decode_attention_ref(query, keys, values, key_bias, scale: float) -> torch.Tensor:
    """Torch reference: ``attend`` with one query token, no mask, the bias on every key."""
    return attend(query, AttentionInputs(keys, values, key_bias, None, 0, causal=False), scale)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_bias: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token over ``S`` keys with a per-key bias, GQA-aware.

    Args:
        query: ``[B, H, 1, D]``.
        keys, values: ``[B, Hk, S, D]`` with H a multiple of Hk (views of the slot pool are fine: only the last
            dim must be contiguous).
        key_bias: ``[B, Hk, S]`` float32 added to the scaled logits (``MASK_VALUE`` hides a key).
        scale: multiplies ``q . k`` before the bias is added.
        num_splits: programs per (sequence, KV head) over S; default: enough to fill the GPU.

    Returns:
        ``[B, H, 1, D]`` in the query's dtype.

    Example:
        >>> q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 64, 16)
        >>> decode_attention(q, k, k, torch.zeros(1, 2, 64), 0.25).shape
        torch.Size([1, 4, 1, 16])
    """
    _check(query, keys, values, key_bias, num_splits)
    if kernel_path("decode_attention", query) == "torch":
        return decode_attention_ref(query, keys, values, key_bias, scale)
    return _decode_attention_triton(query, keys, values, key_bias, scale, num_splits)


def _check(query, keys, values, key_bias, num_splits) -> None:
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"query must be [B, H, 1, D]; got shape {tuple(query.shape)}")
    B, H, _, D = query.shape
    if keys.dim() != 4 or keys.shape[0] != B or keys.shape[3] != D or H % max(keys.shape[1], 1):
        raise ValueError(f"keys must be [B, Hk, S, D] with H % Hk == 0 for query {tuple(query.shape)}; got {tuple(keys.shape)}")
    if values.shape != keys.shape:
        raise ValueError(f"values must have the keys' shape {tuple(keys.shape)}; got {tuple(values.shape)}")
    if key_bias.shape != keys.shape[:3] or key_bias.dtype != torch.float32:
        raise ValueError(f"key_bias must be float32 {tuple(keys.shape[:3])}; got {key_bias.dtype} {tuple(key_bias.shape)}")
    for name, t in (("query", query), ("keys", keys), ("values", values), ("key_bias", key_bias)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1); got strides {t.stride()}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, the query on {query.device}")
    if keys.shape[2] == 0:
        raise ValueError("keys must hold at least one token (S >= 1)")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None; got {num_splits!r}")
