"""Attention over what a NosaCache hands back, on the kernel that fits its shape.

One decode token over the slot pool runs ``kernels.decode_attention``; a prefill chunk over its keys with a causal
offset (QUOKA's blocks then the chunk, or the whole prefix) runs ``kernels.chunk_attention``; anything carrying an
explicit mask (the per-token decode rule, padding in a dense prefill) and every CPU path run
``dense_attention.biased_attention`` (sdpa's fused kernels with the bias folded in). All compute the function of
``attend``, the reference their tests hold them to.
"""

from __future__ import annotations

import torch

from .attend import AttentionInputs
from .dense_attention import biased_attention
from .kernels.backend import kernel_path
from .kernels.chunk_attention import chunk_attention
from .kernels.decode_attention import decode_attention


def attend_cache_inputs(query: torch.Tensor, inputs: AttentionInputs, scale: float) -> torch.Tensor:
    """``softmax(q . k * scale + bias) . v`` over ``inputs``; ``query [B, H, Tq, D]`` -> ``[B, H, Tq, D]``."""
    Tq = query.shape[2]
    if inputs.attn_mask is None and kernel_path("cache_attention", query) == "triton":
        if Tq == 1 and not inputs.causal:
            return decode_attention(query, inputs.keys, inputs.values, inputs.key_bias, scale)
        if inputs.causal:
            B, Hk, S = inputs.key_bias.shape
            index = torch.arange(S, device=query.device, dtype=torch.int32).expand(B, Hk, 1, S)
            return chunk_attention(query, inputs.keys, inputs.values, inputs.key_bias, index, [0, Tq],
                                   [inputs.q_offset], scale, out=torch.empty_like(query))
    return biased_attention(query, inputs, scale)
