"""Rotary position embedding of queries and keys in one launch, bitwise equal to transformers'
``apply_rotary_pos_emb`` (Llama, Qwen2 and Qwen3 share it: ``q * cos + rotate_half(q) * sin``, the same for k).

The stock function is about ten launches per layer (two products, a negation and a concatenation for
``rotate_half``, and the sum, for q and for k), which the decode graph pays in GPU time and a batch-1 prefill chunk
in host time. The kernel rounds exactly where torch does: ``q * cos`` to the result dtype, ``rotate_half(q) * sin``
to it, then their sum (the result dtype is ``promote_types(q.dtype, cos.dtype)``: bf16 for a bf16 model). A product
of two bf16 or fp16 numbers is exact in float32, so computing each step in float32 and rounding once gives torch's
bits; float32 inputs take float32 steps, with FMA contraction turned off (``enable_fp_fusion=False``) so that the
sum of products is not fused into one rounding. One program per (sequence, token) rotates all heads of q and k.
It has no backward: ``apply_rotary`` takes it only where no gradient is wanted.
"""

from __future__ import annotations

import torch

from ..backend import HAS_TRITON, inference_kernel_path, launcher, log_fallback, next_power_of_2, on_device, tl, triton
from ..host_format import cast_rtne

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAS_TRITON:

    @triton.jit
    def _rotate(p_x, p_o, stride_xh, stride_oh, Hx, o_d, o_p, m_d, left, b_cos, b_sin, BLOCK_H: tl.constexpr):
        """``x * cos + rotate_half(x) * sin`` for the ``Hx`` heads of one token, rounded as torch rounds."""
        o_h = tl.arange(0, BLOCK_H)
        m = (o_h < Hx)[:, None] & m_d[None, :]
        b_x = tl.load(p_x + o_h[:, None] * stride_xh + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_p = tl.load(p_x + o_h[:, None] * stride_xh + o_p[None, :], mask=m, other=0.0).to(tl.float32)
        b_rot = tl.where(left[None, :], -b_p, b_p)  # rotate_half: cat(-x2, x1)
        dtype = p_o.dtype.element_ty
        b_a = cast_rtne(b_x * b_cos[None, :], dtype).to(tl.float32)
        b_b = cast_rtne(b_rot * b_sin[None, :], dtype).to(tl.float32)
        tl.store(p_o + o_h[:, None] * stride_oh + o_d[None, :], cast_rtne(b_a + b_b, dtype), mask=m)

    @triton.jit(do_not_specialize=["T"])
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        stride_cb, stride_ct, stride_sb, stride_st,
        stride_qob, stride_qoh, stride_qot, stride_kob, stride_koh, stride_kot,
        T, H, Hk, D,
        BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Program (sequence b, token t): rotate ``q[b, :, t]`` and ``k[b, :, t]`` by ``cos[b, t]``, ``sin[b, t]``."""
        i_bt = tl.program_id(0).to(tl.int64)
        i_b, i_t = i_bt // T, i_bt % T
        half = D // 2
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        left = o_d < half
        o_p = tl.where(left, o_d + half, o_d - half)  # the partner element rotate_half moves here
        b_cos = tl.load(cos_ptr + i_b * stride_cb + i_t * stride_ct + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_sin = tl.load(sin_ptr + i_b * stride_sb + i_t * stride_st + o_d, mask=m_d, other=0.0).to(tl.float32)
        _rotate(q_ptr + i_b * stride_qb + i_t * stride_qt, qo_ptr + i_b * stride_qob + i_t * stride_qot,
                stride_qh, stride_qoh, H, o_d, o_p, m_d, left, b_cos, b_sin, BLOCK_H)
        _rotate(k_ptr + i_b * stride_kb + i_t * stride_kt, ko_ptr + i_b * stride_kob + i_t * stride_kot,
                stride_kh, stride_koh, Hk, o_d, o_p, m_d, left, b_cos, b_sin, BLOCK_HK)


def _launch(q, k, cos, sin):
    B, H, T, D = q.shape
    Hk = k.shape[1]
    dtype = torch.promote_types(q.dtype, cos.dtype)
    q_out, k_out = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)  # torch keeps q's layout too
    if q_out.numel() == 0:
        return q_out, k_out
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)
    with on_device(q):
        launcher(_rotary_kernel)[(B * T,)](
            q, k, cos, sin, q_out, k_out,
            *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
            *q_out.stride()[:3], *k_out.stride()[:3], T, H, Hk, D,
            BLOCK_H=next_power_of_2(H), BLOCK_HK=next_power_of_2(Hk), BLOCK_D=max(16, next_power_of_2(D)),
            enable_fp_fusion=False,
        )
    return q_out, k_out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``cat(-x2, x1)`` of the last dimension's halves."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(q, k, cos, sin, unsqueeze_dim: int = 1):
    """The torch reference: transformers' ``apply_rotary_pos_emb`` (the same lines in Llama, Qwen2 and Qwen3)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def _kernel_fits(q, k, cos, sin) -> str | None:
    """Why the kernel cannot take these inputs (the reference then runs), or None."""
    if q.dtype not in DTYPES or cos.dtype not in DTYPES:
        return f"its dtypes (q {q.dtype}, cos {cos.dtype}) are not in {DTYPES}"
    if k.dtype != q.dtype or sin.dtype != cos.dtype:
        return f"q and k ({q.dtype}, {k.dtype}) or cos and sin ({cos.dtype}, {sin.dtype}) differ in dtype"
    if any(t.stride(-1) != 1 for t in (q, k, cos, sin)):
        return "a last dimension is strided"
    return None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    """``apply_rotary_pos_emb(q, k, cos, sin)`` with the signature of transformers' own: Triton on CUDA where no
    gradient is wanted, the torch reference elsewhere (``HF_NOSA_KERNELS`` forces one, see ``backend.py``).

    Args:
        q: ``[B, H, T, D]`` queries (any strides but the last; the attention passes a transposed view).
        k: ``[B, Hk, T, D]`` keys.
        cos, sin: ``[B, T, D]`` or ``[1, T, D]`` (the rotary embedding's output).
        unsqueeze_dim: where cos and sin gain their heads dimension; the kernel covers 1 (the layout above), other
            values run the reference.

    Returns:
        ``(q_embed, k_embed)``, shaped and laid out like q and k, in ``promote_types(q.dtype, cos.dtype)``.

    Example:
        >>> q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        >>> cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
        >>> all(torch.equal(a, b) for a, b in zip(apply_rotary(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin)))
        True
    """
    if unsqueeze_dim != 1 or inference_kernel_path("rotary", q, k, cos, sin) == "torch":
        return apply_rotary_ref(q, k, cos, sin, unsqueeze_dim)
    if q.dim() != 4 or k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"apply_rotary: q must be [B, H, T, D] and k [B, Hk, T, D]; got shapes {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    B, _, T, D = q.shape
    if (cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1:] != (T, D)
            or D % 2):
        raise ValueError(f"apply_rotary: cos and sin must be [B, T, D] or [1, T, D] with an even D for q "
                         f"{tuple(q.shape)}; got {tuple(cos.shape)} and {tuple(sin.shape)}")
    why = _kernel_fits(q, k, cos, sin)
    if why is not None:
        log_fallback("rotary", q.device.type, why)
        return apply_rotary_ref(q, k, cos, sin, unsqueeze_dim)
    return _launch(q, k, cos, sin)
