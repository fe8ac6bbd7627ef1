"""Per-family NOSA attention classes and ``to_nosa``, which converts a loaded model in place."""

from __future__ import annotations

import types

import torch
from torch import nn

from ..attention.eviction_head import EvictionHead, check_eviction_heads, eviction_heads  # noqa: F401
from ..config import NosaConfig
from . import llama, qwen2, qwen3
from .base import NosaAttentionMixin
from .chunked import install_forward
from .fused import fuse_modules
from .tensor_parallel import shard_eviction_heads

FAMILIES = {
    "llama": llama,
    "qwen2": qwen2,
    "qwen3": qwen3,
}
SUPPORTED_ATTENTION = ("eager", "sdpa")


def family_of(model: nn.Module) -> str:
    """The NOSA family of a model instance ("llama", "qwen2", "qwen3"), or a TypeError listing the supported ones."""
    for name, binding in FAMILIES.items():
        if isinstance(model, binding.MODEL_CLASS):
            return name
    supported = ", ".join(binding.MODEL_CLASS.__name__ for binding in FAMILIES.values())
    raise TypeError(f"hf_nosa supports {supported}; got {type(model).__name__}.")


def _convert_attention(attn: nn.Module, attention_class: type, cfg: NosaConfig, allow_meta: bool) -> None:
    if not isinstance(attn, NosaAttentionMixin):
        weight = attn.v_proj.weight
        if weight.device.type == "meta" and not allow_meta:
            raise ValueError(
                f"layer {attn.layer_idx}: its weights are offloaded (on the meta device); NOSA needs every attention "
                "layer's weights on a real device. Load with a device_map that keeps attention on GPU or CPU."
            )
        kv_heads = attn.config.num_key_value_heads
        attn.__class__ = attention_class
        attn.eviction_head = EvictionHead(kv_heads, attn.head_dim, device=weight.device, dtype=weight.dtype)
        # accelerate's hooks call the forward they wrapped: point them at the NOSA forward.
        if hasattr(attn, "_old_forward"):
            attn._old_forward = types.MethodType(attention_class.forward, attn)
    attn.nosa_config = cfg


def check_convertible(config) -> None:
    """The checks every conversion makes on a model config: attention implementation and full-attention layers."""
    attn_impl = getattr(config, "_attn_implementation", None) or "eager"
    if attn_impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={attn_impl!r} is not supported by NOSA attention; allowed values are "
            f"{SUPPORTED_ATTENTION}. Load the model with attn_implementation='sdpa'."
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if sliding:
        raise ValueError(
            f"layers {sliding} use {layer_types[sliding[0]]!r}; NOSA converts full-attention layers only "
            "(set use_sliding_window=False)."
        )


def convert_layers(model: nn.Module, cfg: NosaConfig, *, allow_meta: bool = False) -> None:
    """Swap every attention module of ``model`` for its family's NOSA class, with an eviction head, in place, its
    RMSNorm and SiLU MLP modules for their fused-kernel subclasses (``modeling.fused``: same parameters and names),
    and route its forward through ``modeling.chunked.NosaForward``.

    ``allow_meta`` lets a model being built by ``from_pretrained`` (weights still on the meta device) convert;
    its eviction heads are then filled by the checkpoint.
    """
    binding = FAMILIES[family_of(model)]
    for layer in model.model.layers:
        _convert_attention(layer.self_attn, binding.ATTENTION_CLASS, cfg, allow_meta)
    fuse_modules(model, binding.FUSED_CLASSES)
    model.config.nosa = cfg.to_dict()
    install_forward(model)  # chunked prefill and graph-replayed decode with a NosaCache (modeling/chunked.py)
    if "init_continuous_batching" not in model.__dict__:  # hf_nosa.serving.enable (or the user's) already bound it
        model.init_continuous_batching = types.MethodType(_init_continuous_batching, model)


def _init_continuous_batching(model, *args, **kwargs):
    """transformers' continuous batching of a NOSA model (``generate_batch``, ``init_continuous_batching``, the
    manager ``transformers serve`` drives) runs NOSA (``hf_nosa.serving``) without a call of the user's: bound at
    conversion, importing the serving package (and checking the transformers version it needs) on first use."""
    from .. import serving

    serving.check_transformers_version()
    serving.enable(model)  # rebinds init_continuous_batching to the serving manager's, with the default budget
    return model.init_continuous_batching(*args, **kwargs)


def to_nosa(model: nn.Module, nosa_config: NosaConfig | None = None) -> nn.Module:
    """Convert a loaded Llama / Qwen2 / Qwen3 causal LM to NOSA attention, in place, and return it.

    Each attention module keeps its parameters (and their names) and gains ``eviction_head`` (``delta``:
    Linear Hk * D -> Hk, ``A``: zeros), so the converted model computes exactly what it did before until ``A``
    is trained. The NosaConfig is stored in ``model.config.nosa``.

    Args:
        model: a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (CPU, GPU, dispatched by
            accelerate, or sharded by ``from_pretrained(..., tp_plan="auto")``: then call it on every rank, see
            ``modeling.tensor_parallel``), possibly already converted (then only the config is updated).
        nosa_config: defaults to the model's "nosa" config section, else ``NosaConfig()``.
    """
    family_of(model)
    cfg = NosaConfig.from_model_config(model.config, nosa_config)
    check_convertible(model.config)
    convert_layers(model, cfg)
    shard_eviction_heads(model)  # a model sharded by transformers' tp_plan: each rank's KV heads (tensor_parallel.py)
    check_eviction_heads(model)
    return model


@torch.no_grad()
def randomize_eviction_heads(model: nn.Module, scale: float = 1.0, generator: torch.Generator | None = None):
    """Give every eviction head a random nonzero ``A`` (and ``delta``): for tests and benchmarks of the selection."""
    for head in eviction_heads(model).values():
        for param in (head.delta.weight, head.delta.bias, head.A):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_((noise * scale).to(param.dtype))
    return model
