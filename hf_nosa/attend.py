"""Attention over what a NOSA cache hands back: the torch reference used by every path."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from .masks import additive_mask

if TYPE_CHECKING:
    from .pool_attention import PoolBlocks
    from .prefix_attention import Prefix

# Query rows per chunk, so that long prefills never hold all logits at once.
_QUERY_CHUNK = 1024


class AttentionInputs(NamedTuple):
    """What a NOSA cache hands the attention of one layer.

    keys, values: ``[B, Hk, S, D]``; key_bias: ``[B, Hk, S]`` fp32 added to every query's logits (eviction score,
    padding, empty slots); attn_mask: additive ``[B or 1, 1 or Hk, Tq, S]`` fp32 or None; q_offset: position of
    the first query among the keys (for causal masking when attn_mask is None); causal: whether to apply it.
    prefix: keys before these, too many for the device at once, read in pieces (``prefix_attention.Prefix``;
    every query sees all of them; q_offset and attn_mask then count the keys above only); None: none.
    blocks: keys before these held in the slot pool once fetched, a part of the batch at a time
    (``pool_attention.PoolBlocks``; every query sees all of them; q_offset counts the keys above only); None: none.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_bias: torch.Tensor
    attn_mask: torch.Tensor | None
    q_offset: int
    causal: bool
    prefix: Prefix | None = None
    blocks: PoolBlocks | None = None


def with_prefix_read(inputs: AttentionInputs) -> AttentionInputs:
    """``inputs`` with its prefix read whole (or its pool blocks fetched for every row) and put before its keys:
    the reference's view of it."""
    if inputs.prefix is None and inputs.blocks is None:
        return inputs
    if inputs.attn_mask is not None:
        raise ValueError("AttentionInputs: a prefix goes with the causal rule, not with an attn_mask")
    if inputs.prefix is not None and inputs.blocks is not None:
        raise ValueError("AttentionInputs: a prefix or pool blocks, not both")
    if inputs.prefix is not None:
        k, v, b = inputs.prefix.read(0, inputs.prefix.length)
    else:
        k, v, b = inputs.blocks.fetch(0, inputs.keys.shape[0])
    return AttentionInputs(torch.cat([k, inputs.keys], 2), torch.cat([v, inputs.values], 2),
                           torch.cat([b, inputs.key_bias], 2), None, inputs.q_offset + k.shape[2], inputs.causal)


def attend(query: torch.Tensor, inputs: AttentionInputs, scale: float) -> torch.Tensor:
    """``softmax(q . k * scale + bias) . v`` with GQA; each KV head is read once for its whole group.

    Args:
        query: ``[B, H, Tq, D]``.
        inputs: keys/values ``[B, Hk, S, D]``, key_bias ``[B, Hk, S]``, optional additive mask
            ``[B or 1, 1 or Hk, Tq, S]``.

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype; fp32 accumulation.
    """
    inputs = with_prefix_read(inputs)
    B, H, Tq, D = query.shape
    keys, values = inputs.keys.float(), inputs.values.float()
    Hk, S = keys.shape[1], keys.shape[2]
    G = H // Hk
    q = query.float().view(B, Hk, G, Tq, D)
    out = torch.empty(B, Hk, G, Tq, D, dtype=torch.float32, device=query.device)
    for lo in range(0, Tq, _QUERY_CHUNK):
        hi = min(Tq, lo + _QUERY_CHUNK)
        logits = torch.einsum("bkgtd,bksd->bkgts", q[:, :, :, lo:hi], keys) * scale
        logits = logits + inputs.key_bias.float()[:, :, None, None, :]
        if inputs.attn_mask is not None:
            logits = logits + inputs.attn_mask[:, :, None, lo:hi, :]
        elif inputs.causal:
            logits = logits + additive_mask(None, hi - lo, S, inputs.q_offset + lo, query.device)[:, :, None]
        out[:, :, :, lo:hi] = torch.einsum("bkgts,bksd->bkgtd", torch.softmax(logits, dim=-1), values)
    return out.view(B, H, Tq, D).to(query.dtype)
