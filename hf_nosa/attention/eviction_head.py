"""The eviction head, ``b = A * softplus(delta(v))`` (design Sec. 3.1), and the heads of a converted model: found
(``eviction_heads``) and checked for NaN and inf (``check_eviction_heads``) by everything that runs them (the
conversion, the forward before every prompt, ``generate``, the serving manager)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.layers.eviction_bias import eviction_scale
from ..rules.selection import eviction_scores


def eviction_bias(value_flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, A: torch.Tensor):
    """``selection.eviction_bias`` (``[B, T, Hk * D]`` -> ``[B, Hk, T]`` float32) as the eviction heads run it: where
    no gradient is wanted (and nothing is being compiled) the scale and softplus are one kernel on CUDA
    (``kernels.layers.eviction_bias``: one launch where ``selection.eviction_scores`` takes three in every layer and
    prefill chunk); with a gradient, the torch rule, which reaches ``A`` and ``delta``."""
    logits = F.linear(value_flat.to(weight.dtype), weight, bias)  # [B, T, Hk]
    if (torch.is_grad_enabled() and (logits.requires_grad or A.requires_grad)) or torch.compiler.is_compiling():
        return eviction_scores(logits, A)
    return eviction_scale(logits, A)


class EvictionHead(nn.Module):
    """``b = A * softplus(delta(v))``: one query-agnostic score per token and KV head (design Sec. 3.1).

    ``delta`` reads the values of all KV heads concatenated (``Hk * D -> Hk``); ``A`` starts at zero so a freshly
    converted model is exactly the original one.
    """

    # Under transformers' tensor parallelism: this rank's KV heads (``modeling.tensor_parallel.KVHeadShard``, set by
    # to_nosa / from_pretrained after sharding); its parameters stay whole, it computes the rank's rows.
    tensor_parallel = None

    def __init__(self, kv_heads: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.delta = nn.Linear(kv_heads * head_dim, kv_heads, device=device, dtype=dtype)
        self.A = nn.Parameter(torch.zeros(kv_heads, device=device, dtype=dtype))

    def forward(self, value_flat: torch.Tensor) -> torch.Tensor:
        """``[B, T, Hk * D]`` -> ``[B, Hk, T]`` float32; on a tensor-parallel rank ``[B, T, Hk_local * D]`` (its
        own KV heads' values) -> ``[B, Hk_local, T]``."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel(self, value_flat)
        if value_flat.shape[-1] != self.delta.in_features:
            raise ValueError(
                f"eviction head: the values are {tuple(value_flat.shape)}, but delta reads Hk * D = "
                f"{self.delta.in_features} features. A model sharded by tensor parallelism after its conversion must "
                "be converted again on every rank: hf_nosa.to_nosa(model)."
            )
        return eviction_bias(value_flat, self.delta.weight, self.delta.bias, self.A)


def check_eviction_heads(model: nn.Module) -> None:
    """ValueError naming the layer and parameter when an eviction head holds NaN or inf (it would turn every
    logit into NaN without an error). One host sync when every head is finite (the forward checks before every
    prompt)."""
    named = [(i, name, param) for i, head in eviction_heads(model).items()
             for name, param in (("A", head.A), ("delta.weight", head.delta.weight), ("delta.bias", head.delta.bias))
             if param is not None and param.device.type != "meta"]
    if not named:
        return
    with torch.no_grad():
        finite = [torch.isfinite(param).all().to(named[0][2].device) for _, _, param in named]
        if bool(torch.stack(finite).all()):
            return
    for i, name, param in named:
        if not bool(torch.isfinite(param).all()):
            raise ValueError(
                f"layer {i}: eviction_head.{name} holds NaN or inf values, so every logit would be NaN. The "
                "checkpoint or the training run that wrote it is broken: reload the weights, or reset the heads "
                "(A = 0 is the untrained head)."
            )


def eviction_heads(model: nn.Module) -> dict[int, EvictionHead]:
    """The eviction head of every converted layer, by layer index."""
    return {
        i: layer.self_attn.eviction_head
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.self_attn, "eviction_head")
    }
