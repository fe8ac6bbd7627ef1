"""Turning the masks transformers builds (bool for sdpa, additive float for eager, or None) into additive fp32."""

from __future__ import annotations

import torch

from .selection import MASK_VALUE


def additive_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, q_offset: int, device) -> torch.Tensor:
    """``[B or 1, 1, Tq, T]`` fp32 with 0 where a query may attend and ``MASK_VALUE`` elsewhere.

    A ``None`` mask means plain causal attention with the queries at positions ``q_offset .. q_offset + Tq - 1``.
    """
    if attention_mask is None:
        q_pos = torch.arange(q_offset, q_offset + q_len, device=device)[:, None]
        allowed = torch.arange(kv_len, device=device)[None, :] <= q_pos
        return torch.where(allowed, 0.0, MASK_VALUE)[None, None]
    mask = attention_mask[..., -q_len:, :kv_len]
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, MASK_VALUE).to(device)
    return torch.where(mask.float() < -1.0, MASK_VALUE, 0.0).to(device)


def padding_bias(attention_mask: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    """``[B, 1, n]`` fp32: ``MASK_VALUE`` for the new tokens ``start .. start + n - 1`` that are padding.

    The last query row sees every earlier real token, so a key it may not see is padding. The result is stored
    with the token's eviction score, so later steps never need the mask again.
    """
    if attention_mask is None:
        return None
    last_row = attention_mask[:, 0, -1, start : start + n]
    masked = ~last_row if last_row.dtype == torch.bool else last_row.float() < -1.0
    if masked.shape[-1] != n:
        raise ValueError(f"attention mask covers {masked.shape[-1]} of the {n} new tokens; expected all of them")
    return torch.where(masked, MASK_VALUE, 0.0)[:, None, :]
