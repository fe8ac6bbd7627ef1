"""Attention over what a NosaCache hands back, on the kernel that fits its shape.

- one decode token over the slot pool: ``kernels.decode.decode_attention``;
- a QUOKA chunk over its pool blocks and itself: ``attention.pool`` (``kernels.prefill.flash_biased`` reading the blocks
  where they lie), then, where the chunk holds a prompt's dense tail, those queries again over the whole prompt
  (``attention.prefix``, their output rows replaced);
- a chunk over a prompt read in pieces: ``attention.prefix``;
- a prompt that came whole (``whole_prompt``): each of its QUOKA chunks as above, in order;
- everything else (a staged prefix, the per-token decode rule, padding masks): ``attention.dense.biased_attention``.

All compute the function of ``attend``, the reference their tests hold them to.
"""

from __future__ import annotations

import torch

from ..kernels.backend import kernel_path
from ..kernels.decode.decode_attention import decode_attention
from ..rules.attend import AttentionInputs, chunk_spans, own_keys, with_dense_tail
from .dense import biased_attention
from .pool import attend_with_pool_blocks
from .prefix import attend_with_prefix


def attend_cache_inputs(query: torch.Tensor, inputs: AttentionInputs, scale: float) -> torch.Tensor:
    """``softmax(q . k * scale + bias) . v`` over ``inputs``; ``query [B, H, Tq, D]`` -> ``[B, H, Tq, D]``."""
    if inputs.chunks is not None:  # a prompt that came whole: its QUOKA chunks one after another
        out = torch.empty_like(query)
        for (lo, hi), chunk in zip(chunk_spans(inputs), inputs.chunks):
            if chunk.blocks is not None and chunk.tail is None:  # the kernel writes the rows where they go
                attend_with_pool_blocks(query[:, :, lo:hi], chunk, scale, out=out[:, :, lo:hi])
            else:
                out[:, :, lo:hi] = attend_cache_inputs(query[:, :, lo:hi], chunk, scale)
        return out
    if inputs.tail is not None:  # QUOKA's dense tail: the chunk as the rest says, then the tail's queries again
        tail, Tq = inputs.tail, query.shape[2]
        k, v, b = own_keys(inputs, Tq)
        out = attend_cache_inputs(query, inputs._replace(tail=None), scale)
        return with_dense_tail(out, query, tail, lambda part, q0: attend_with_prefix(
            part, k, v, b, tail.prefix, scale, first_query=q0))
    if inputs.prefix is not None:  # a chunk over a whole prompt: the prompt in pieces, then the chunk (causal)
        if not inputs.causal or inputs.attn_mask is not None or inputs.q_offset != 0 \
                or inputs.keys.shape[2] != query.shape[2]:
            raise ValueError("attend_cache_inputs: a prefix goes with a causal chunk over its own keys only")
        return attend_with_prefix(query, inputs.keys, inputs.values, inputs.key_bias, inputs.prefix, scale)
    if inputs.blocks is not None:  # a QUOKA chunk: its blocks fetched a part of the batch at a time, then the chunk
        return attend_with_pool_blocks(query, inputs, scale)
    if query.shape[2] == 1 and not inputs.causal and inputs.attn_mask is None \
            and kernel_path("cache_attention", query) == "triton":
        return decode_attention(query, inputs.keys, inputs.values, inputs.key_bias, scale)
    # A cache's bias is nonzero in nearly every call (eviction scores, empty slots, padding); looking first would
    # read it on the host once per layer and chunk, which drains the launch queue and leaves the GPU idle while
    # the next layer's work is queued.
    return biased_attention(query, inputs, scale, fold=True if query.is_cuda else None)
