"""Dense attention with the eviction bias on the fast kernels: ``softmax(q . k * scale + b) . v`` through sdpa.

Design Sec. 4 puts every dense path on the fast kernels. The bias of key ``j`` is folded into the dot product by
extra head dimensions: the queries get columns of ones and key ``j`` gets ``b_j / scale`` in those columns, so
that ``q' . k'_j * scale = q . k_j * scale + b_j`` exactly, and any softmax attention (FlashAttention, cuDNN,
memory-efficient, the CPU flash kernel) computes the biased softmax with its own causal masking and no
materialised bias. The logits stay in the kernel's log domain, so the bias has no range limit: ``|b|`` of 80 and
``MASK_VALUE`` (-1e30, "never attend") are as exact as small biases. In bf16/fp16 one column would round ``b``
to 8/11 bits; ``b / scale`` is split into three columns (``hi + mid + lo``, each the rounding error of the
previous ones) that the kernel sums in its fp32 accumulator, which keeps ``b`` to about fp32 precision. fp16
cannot hold ``MASK_VALUE``: its columns are clamped to +-65504 (a logit offset of at least 65504 * scale, which
hides a key as surely as -1e30). The head dimension is padded to a multiple of 8 (the fast kernels' alignment;
they also need q, k and v to share it, so v gets zero columns that are cut from the output): 64 -> 72.

The other identity, ``A(q, k, v e^(b - m)) / A(q, k, e^(b - m))``, keeps the dot product as it is but needs
``e^(b - m)`` within the value dtype's range over every row's visible keys; with ``|b|`` up to 80 and causal rows
that see only low-bias keys, it underflows (0/0). The columns above have no such limit and cost the same padding.

With an all-zero bias that needs no gradient (a freshly converted model, ``A == 0``, outside training) the columns
are left out: plain sdpa on the original head dimension (with the mask, if any). On CUDA, a nonzero bias without
a mask and without gradients (inference: a converted model's prefill, ``prefill="dense"``) runs the
``kernels.prefill.flash_biased`` kernel instead, which adds the bias inside one flash pass at the original head
dimension; the columns remain the route for masks, gradients, ``torch.compile`` and other head dims. ``attend.attend``
is the torch reference (``biased_attention_ref``).

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, Tq queries, S keys, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.prefill.flash_biased import flash_biased, runs_on_kernel
from ..rules.attend import AttentionInputs, with_prefix_read
from ..rules.attend import attend as biased_attention_ref
from ..rules.selection import MASK_VALUE

__all__ = ["biased_attention", "biased_attention_joined", "biased_attention_ref", "bias_columns"]

_ALIGN = 8  # head-dim multiple the fused sdpa kernels need
_FP16_LIMIT = 65504.0


def bias_columns(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold a per-key bias into extra head dimensions: ``q' . k'_j * scale == q . k_j * scale + bias_j``.

    Differentiable in ``bias`` (the split's lower columns carry no gradient; their sum's gradient is one).

    Args:
        query: ``[B, H, Tq, D]``; keys, values: ``[B, Hk, S, D]`` in the query's dtype.
        bias: ``[B, Hk, S]`` float32 added to every query's logit of key ``j`` (after the scaling).

    Returns:
        ``q' [B, H, Tq, D']``, ``k' [B, Hk, S, D']``, ``v' [B, Hk, S, D']`` with ``D'`` the next multiple of 8 at
        least ``D + 1`` (fp32) or ``D + 3`` (bf16/fp16); v's extra columns are zero.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
        >>> b = torch.randn(1, 1, 5)
        >>> q2, k2, v2 = bias_columns(q, k, v, b, 0.5)
        >>> torch.allclose(q2 @ k2.transpose(-1, -2) * 0.5, q @ k.transpose(-1, -2) * 0.5 + b[:, :, None], atol=1e-5)
        True
    """
    cols = _columns(bias, query.dtype, scale)
    D, n = query.shape[-1], len(cols)
    width = _width(D, n)
    # One concatenation per tensor (a single copy): q gets [1] * n + [0] * pad, k the columns then zeros.
    q2 = _widened_query(query, n, width)
    k2 = torch.cat([keys, F.pad(torch.stack(cols, -1), (0, width - D - n))], -1)
    v2 = torch.cat([values, values.new_zeros(1, 1, 1, width - D).expand(*values.shape[:3], width - D)], -1)
    return q2, k2, v2


def _columns(bias: torch.Tensor, dtype: torch.dtype, scale: float) -> list[torch.Tensor]:
    """``bias / scale`` as the columns the keys carry: one in fp32/fp64, three (``hi + mid + lo``) in bf16/fp16."""
    x = bias.float() / scale
    if dtype == torch.float32 or dtype == torch.float64:
        return [x.to(dtype)]
    if dtype == torch.float16:
        x = x.clamp(-_FP16_LIMIT, _FP16_LIMIT)
    hi = x.to(dtype)
    mid = (x - hi.float()).to(dtype)
    return [hi, mid, (x - hi.float() - mid.float()).to(dtype)]


def _width(D: int, n: int) -> int:
    return -(-(D + n) // _ALIGN) * _ALIGN


def _widened_query(query: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``[B, H, Tq, width]``: the query, then ``n`` ones (they meet the keys' bias columns), then zeros."""
    B, H, Tq, D = query.shape
    extra = torch.cat([query.new_ones(n), query.new_zeros(width - D - n)])
    return torch.cat([query, extra.expand(B, H, Tq, width - D)], -1)


def _widened(parts: list[torch.Tensor], width: int, columns: torch.Tensor | None) -> torch.Tensor:
    """``parts`` (``[B, Hk, S_i, D]``) joined along the keys into one ``[B, Hk, S, width]`` buffer in a single copy,
    ``columns`` (``[B, Hk, S, n]``) after the first D columns and zeros in the rest."""
    B, Hk, _, D = parts[0].shape
    out = parts[0].new_empty(B, Hk, sum(p.shape[2] for p in parts), width)
    lo = 0
    for part in parts:
        out[:, :, lo : lo + part.shape[2], :D].copy_(part)
        lo += part.shape[2]
    n = 0 if columns is None else columns.shape[-1]
    if columns is not None:
        out[..., D : D + n].copy_(columns)
    out[..., D + n :].zero_()
    return out


def biased_attention_joined(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                            bias: list[torch.Tensor], scale: float) -> torch.Tensor:
    """``biased_attention`` over keys given in parts along the key axis, the queries being the last ``Tq`` keys
    (lower-right causal): a QUOKA chunk over its blocks and then itself (``attention.pool``). The parts go straight
    into the widened buffers the fused kernels read (one copy of the keys and values, where joining them first and
    then widening would copy them twice). No gradient.

    Args:
        query: ``[B, H, Tq, D]``; keys, values: lists of ``[B, Hk, S_i, D]``; bias: list of ``[B, Hk, S_i]`` fp32.

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype.
    """
    B, H, Tq, D = query.shape
    dtype = query.dtype
    cols = torch.stack(_columns(torch.cat(bias, 2), dtype, scale), -1)  # [B, Hk, S, n]: small beside the keys
    width = _width(D, cols.shape[-1])
    q2 = _widened_query(query, cols.shape[-1], width)
    k2 = _widened([k.to(dtype) for k in keys], width, cols)
    v2 = _widened([v.to(dtype) for v in values], width, None)
    S = k2.shape[2]
    if Tq == S:
        out = _sdpa(q2, k2, v2, None, True, scale, gqa_with_mask=query.device.type == "cpu")
    else:
        out = _sdpa(q2, k2, v2, _lower_right(Tq, S, query.device, dtype), False, scale,
                    gqa_with_mask=query.device.type == "cpu")
    return out[..., :D]


def _mask_floor(dtype: torch.dtype) -> float:
    return max(MASK_VALUE, torch.finfo(dtype).min)


def _causal(Tq: int, S: int, q_offset: int, device, dtype) -> torch.Tensor:
    """``[1, 1, Tq, S]`` additive mask in ``dtype``: query ``i`` sees keys ``j <= q_offset + i``."""
    allowed = torch.arange(S, device=device)[None, :] <= torch.arange(q_offset, q_offset + Tq, device=device)[:, None]
    return torch.where(allowed, 0.0, _mask_floor(dtype)).to(dtype)[None, None]


def _lower_right(Tq: int, S: int, device, dtype):
    """The mask of queries that are the last ``Tq`` of ``S`` keys. On CUDA sdpa's lower-right causal variant runs
    FlashAttention without a mask; elsewhere an explicit mask (the CPU kernel is as fast with it, and the variant's
    module imports torch._dynamo, 1.6 s on a CPU)."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(Tq, S)
    return _causal(Tq, S, S - Tq, device, dtype)


def _sdpa(q, k, v, mask, is_causal: bool, scale: float, *, gqa_with_mask: bool) -> torch.Tensor:
    """sdpa with GQA: ``q [B, H, Tq, D']``, ``k/v [B, Hk, S, D']``; mask None, a ``CausalBias`` or a tensor
    ``[B or 1, 1 or Hk, Tq, S]``. ``gqa_with_mask``: the masked kernels take GQA (CPU) or need the KV heads
    repeated (CUDA, where a masked GQA call would fall back to the math kernel; a half-precision ``CausalBias``
    does not)."""
    H, Hk = q.shape[1], k.shape[1]
    G = H // Hk
    if G == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)
    B, _, Tq, Dp = q.shape
    if type(mask) is torch.Tensor and mask.shape[1] > 1:  # (a CausalBias is a Tensor subclass)
        # A mask per KV head: one call per member of the GQA group, each with H = Hk (no mask copy).
        qg = q.view(B, Hk, G, Tq, Dp)
        outs = [F.scaled_dot_product_attention(qg[:, :, g], k, v, attn_mask=mask, scale=scale) for g in range(G)]
        return torch.stack(outs, 2).view(B, H, Tq, v.shape[-1])
    if gqa_with_mask or (type(mask) is not torch.Tensor and q.dtype in (torch.float16, torch.bfloat16)):
        # A CausalBias (the lower-right variant) in half precision runs FlashAttention, which reads the KV heads as
        # they are: no copy of the keys and values per query head (4 x a QUOKA chunk's keys at every layer).
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def biased_attention(query: torch.Tensor, inputs: AttentionInputs, scale: float, *, fold: bool | None = None
                     ) -> torch.Tensor:
    """``softmax(q . k * scale + key_bias [+ attn_mask | causal]) . v`` with GQA, through sdpa's fused kernels.

    Computes what ``attend.attend`` computes (its reference), on the fast kernels: the bias rides in extra head
    dimensions (module docstring). An all-zero bias that needs no gradient is plain sdpa. Deciding that reads the
    bias on the host (one sync); under ``torch.compile`` the bias is always folded in instead, and ``fold=True``
    skips the check (for callers whose bias is nearly always nonzero, where the sync would only stall the queue).

    Args:
        query: ``[B, H, Tq, D]``.
        inputs: an ``AttentionInputs`` (its other fields are ignored): keys/values ``[B, Hk, S, D]``, key_bias
            ``[B, Hk, S]`` (``MASK_VALUE`` hides a key), attn_mask additive ``[B or 1, 1 or Hk, Tq, S]`` or None,
            q_offset and causal (used when attn_mask is None: query ``i`` sees keys ``j <= q_offset + i``).
        scale: the logit scaling, applied before the bias.
        fold: True folds the bias in without looking at it; None (default) looks first.

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype. Rows that see no key (every key masked) are arbitrary, as in the
        reference.

    Example:
        >>> q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
        >>> inputs = AttentionInputs(k, v, torch.randn(1, 2, 6), None, 0, causal=True)
        >>> out = biased_attention(q, inputs, 0.25)
        >>> torch.allclose(out, biased_attention_ref(q, inputs, 0.25), atol=1e-5)
        True
    """
    inputs = with_prefix_read(inputs)  # (prefix_attention.attend_with_prefix reads it in pieces instead)
    keys, values, bias, attn_mask = inputs.keys, inputs.values, inputs.key_bias, inputs.attn_mask
    if query.dim() != 4 or keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(
            f"query must be [B, H, Tq, D] and keys/values [B, Hk, S, D]; got {tuple(query.shape)}, "
            f"{tuple(keys.shape)} and {tuple(values.shape)}"
        )
    B, H, Tq, D = query.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if keys.shape[0] != B or keys.shape[3] != D or H % Hk:
        raise ValueError(
            f"keys {tuple(keys.shape)} do not fit query {tuple(query.shape)}: need [B, Hk, S, D] with H % Hk == 0"
        )
    if tuple(bias.shape) != (B, Hk, S):
        raise ValueError(f"key_bias has shape {tuple(bias.shape)}; expected [B, Hk, S] = {(B, Hk, S)}")
    if attn_mask is not None and (
        attn_mask.dim() != 4 or attn_mask.shape[0] not in (1, B) or attn_mask.shape[1] not in (1, Hk)
        or tuple(attn_mask.shape[2:]) != (Tq, S)
    ):
        raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}; expected [B or 1, 1 or Hk, Tq, S] for "
                         f"B={B}, Hk={Hk}, Tq={Tq}, S={S}")
    dtype = query.dtype
    q, k, v = query, keys.to(dtype), values.to(dtype)
    compiling = torch.compiler.is_compiling()
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, keys, values, bias))
    # A zero bias that is being trained (A == 0 at the start of a retrofit) still needs its gradient.
    if fold or compiling or (bias.requires_grad and torch.is_grad_enabled()) or bool(bias.any()):
        if (attn_mask is None and query.is_cuda and not compiling and not grad
                and runs_on_kernel(query, "dense biased attention")):
            # The bias inside one flash pass: D stays 64 where the columns below move it onto 96-wide tiles
            # (32K causal, 1b: 11.8 against 14.0 ms; docs/results/2026-12-02_dense_attention.json).
            return flash_biased(q, k, v, bias.float(), scale, q_offset=inputs.q_offset, causal=inputs.causal)
        q, k, v = bias_columns(q, k, v, bias, scale)

    mask, is_causal = None, False
    if attn_mask is not None:
        # fp16 cannot hold MASK_VALUE (it would become -inf, and a row of -inf is NaN): clamp to its range.
        mask = attn_mask.clamp(min=_mask_floor(dtype)).to(dtype) if dtype == torch.float16 else attn_mask.to(dtype)
    elif inputs.causal and inputs.q_offset < S - 1:  # (from q_offset = S - 1 on, every query sees every key)
        if inputs.q_offset == 0 and Tq == S:
            is_causal = True
        elif inputs.q_offset + Tq == S:
            mask = _lower_right(Tq, S, query.device, dtype)
        else:
            mask = _causal(Tq, S, inputs.q_offset, query.device, dtype)
    out = _sdpa(q, k, v, mask, is_causal, scale, gqa_with_mask=query.device.type == "cpu")
    return out[..., :D] if out.shape[-1] != D else out
