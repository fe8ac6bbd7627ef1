"""The NOSA attention shared by every model family: eviction head, then attention over what the cache hands back."""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..attention.dense import biased_attention
from ..attention.dispatch import attend_cache_inputs
from ..attention.eviction_head import EvictionHead, eviction_bias  # noqa: F401 - imported from here before
from ..attention.selection_loss import alignment_enabled, layer_alignment_loss
from ..attention.training import nosa_training_attention
from ..cache.nosa_cache import NosaCache
from ..config import NosaConfig
from ..rules.attend import AttentionInputs
from ..rules.masks import additive_mask
from ..serving.attention import is_serving_cache, serving_attention


_warned_quoka = False


def _warn_quoka_without_nosa_cache() -> None:
    global _warned_quoka
    _warned_quoka = True
    logging.getLogger(__name__).warning(
        'prefill="quoka" chunks the prompt only inside a NosaCache; with another cache (or none) every key is on the '
        "device already and the prompt gets full attention. Use cache_implementation=\"nosa\" for QUOKA."
    )


def nosa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    value_flat: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache,
) -> torch.Tensor:
    """NOSA attention of one layer, after RoPE. Returns ``[B, H, Tq, D]``.

    With a NosaCache the cache decides what is attended (decode: the selected blocks; prefill: per its mode).
    With any other cache (or none), the keys are complete: full attention plus the eviction bias, or, in training
    mode or when the model's NosaConfig says ``prefill="nosa"``, the decode rule applied to every query token
    (``training.nosa_training_attention``; it equals NosaCache decoding).
    """
    if is_serving_cache(cache):  # transformers' continuous batching: a packed step, request by request
        return serving_attention(module, query, key, value, value_flat, cache)
    bias = module.eviction_head(value_flat)  # [B, Hk, Tq]
    if isinstance(cache, NosaCache):
        inputs = cache.update(
            key, value, module.layer_idx, query=query, bias=bias, attention_mask=attention_mask, scaling=module.scaling
        )
        return attend_cache_inputs(query, inputs, module.scaling)

    q_offset = 0
    if cache is not None:
        q_offset = cache.get_seq_length(module.layer_idx)
        key, value = cache.update(key, value, module.layer_idx)
        # A plain cache keeps no eviction scores; they are a function of the values, so recompute them.
        bias = module.eviction_head(value.transpose(1, 2).flatten(2))
    cfg: NosaConfig = module.nosa_config
    if module.training and alignment_enabled(module) and q_offset == 0:
        # auxiliary objectives for the two selection scores (selection_loss.py); the attention below is unchanged
        module.last_selection_loss = layer_alignment_loss(module, query, key, value_flat, cfg, module.scaling)
    if module.training or cfg.prefill == "nosa":
        # Training always uses the rule the model decodes with (design Sec. 5), whatever the prefill mode.
        return nosa_training_attention(
            query, key, value, bias, cfg, module.scaling, attention_mask=attention_mask, q_offset=q_offset
        )
    Tq, T = query.shape[2], key.shape[2]
    if cfg.prefill == "quoka" and Tq > 1 and not _warned_quoka:
        _warn_quoka_without_nosa_cache()
    mask = additive_mask(attention_mask, Tq, T, q_offset, query.device) if attention_mask is not None else None
    inputs = AttentionInputs(key, value, bias, mask, q_offset, causal=mask is None)
    return biased_attention(query, inputs, module.scaling)
