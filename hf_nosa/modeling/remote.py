"""Config and model classes of exported NOSA checkpoints (model_type "nosa_llama", "nosa_qwen2", "nosa_qwen3").

An exported checkpoint's ``config.json`` names its own model_type and, through ``auto_map``, small remote-code
files that subclass the classes below. Each model class is the stock ``*ForCausalLM`` whose attention layers are
converted to NOSA in ``__init__``, so ``from_pretrained`` loads the eviction heads by name like any other weight.
``remote_generate`` is what the checkpoint's ``custom_generate/generate.py`` calls.

Importing this module also names these classes in the ``transformers`` namespace (``expose_to_transformers``), where
``transformers serve`` looks a checkpoint's architecture up.

Example:
    >>> from hf_nosa.modeling.remote import register_auto_classes
    >>> register_auto_classes()  # then AutoModelForCausalLM.from_pretrained(folder) works without remote code
"""

from __future__ import annotations

import logging

import torch

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ..config import NosaConfig
from . import check_convertible, check_eviction_heads, convert_layers, eviction_heads, to_nosa
from .tensor_parallel import shard_eviction_heads

logger = logging.getLogger(__name__)

MODEL_TYPE_PREFIX = "nosa_"


def _validated_nosa_section(config) -> NosaConfig:
    section = getattr(config, "nosa", None)
    if isinstance(section, NosaConfig):
        return section
    if section is not None and not isinstance(section, dict):
        raise ValueError(
            f'{type(config).__name__}: the "nosa" section of config.json must be a JSON object of NosaConfig '
            f"fields, got {type(section).__name__}."
        )
    try:
        return NosaConfig.from_dict(section)
    except (TypeError, ValueError) as error:
        raise ValueError(f'{type(config).__name__}: the "nosa" section of config.json is invalid: {error}') from None


class _NosaConfigMixin:
    """Validates the "nosa" section when the config is built, so a bad checkpoint fails at load, not at decode."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.nosa = _validated_nosa_section(self).to_dict()


class NosaLlamaConfig(_NosaConfigMixin, LlamaConfig):
    """``LlamaConfig`` of a NOSA checkpoint; its "nosa" attribute holds the NosaConfig fields."""

    model_type = "nosa_llama"


class NosaQwen2Config(_NosaConfigMixin, Qwen2Config):
    """``Qwen2Config`` of a NOSA checkpoint; its "nosa" attribute holds the NosaConfig fields."""

    model_type = "nosa_qwen2"


class NosaQwen3Config(_NosaConfigMixin, Qwen3Config):
    """``Qwen3Config`` of a NOSA checkpoint; its "nosa" attribute holds the NosaConfig fields."""

    model_type = "nosa_qwen3"


class _NosaCausalLMMixin:
    """The stock causal LM with NOSA attention in every layer, built in ``__init__`` (also on the meta device).

    ``from_pretrained`` builds the model on the meta device before loading weights, which ``to_nosa`` refuses (it
    converts loaded models, whose weights must be real); so this runs the same checks and conversion with meta
    weights allowed: the eviction heads are created wherever the layer's weights are, to be filled by the
    checkpoint. A checkpoint without eviction heads gets ``A = 0`` (see
    ``initialize_weights``): the stock model's outputs, with recency deciding what the eviction head would have.
    """

    family: str = ""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        cfg = _validated_nosa_section(self.config)
        check_convertible(self.config)
        convert_layers(self, cfg, allow_meta=True)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        # with tp_plan the model is sharded after __init__ converted it: give the eviction heads their ranks' KV heads
        shard_eviction_heads(model)
        check_eviction_heads(model)  # a broken checkpoint fails at load, not as NaN logits at decode
        return model

    def initialize_weights(self):
        super().initialize_weights()
        # The stock init is dispatched to the inner model, which knows no eviction head: a head the checkpoint did
        # not provide gets A = 0 here (delta is an nn.Linear, initialised by the stock rule).
        with torch.no_grad():
            for head in eviction_heads(self).values():
                if not getattr(head.A, "_is_hf_initialized", False):
                    head.A.zero_()


class NosaLlamaForCausalLM(_NosaCausalLMMixin, LlamaForCausalLM):
    """``LlamaForCausalLM`` with NOSA attention; loads exported NOSA Llama checkpoints."""

    config_class = NosaLlamaConfig
    family = "llama"


class NosaQwen2ForCausalLM(_NosaCausalLMMixin, Qwen2ForCausalLM):
    """``Qwen2ForCausalLM`` with NOSA attention; loads exported NOSA Qwen2 / Qwen2.5 checkpoints."""

    config_class = NosaQwen2Config
    family = "qwen2"


class NosaQwen3ForCausalLM(_NosaCausalLMMixin, Qwen3ForCausalLM):
    """``Qwen3ForCausalLM`` with NOSA attention; loads exported NOSA Qwen3 checkpoints."""

    config_class = NosaQwen3Config
    family = "qwen3"


# family -> (config class, model class); model_type is MODEL_TYPE_PREFIX + family.
REMOTE_CLASSES = {
    "llama": (NosaLlamaConfig, NosaLlamaForCausalLM),
    "qwen2": (NosaQwen2Config, NosaQwen2ForCausalLM),
    "qwen3": (NosaQwen3Config, NosaQwen3ForCausalLM),
}


def family_of_model_type(model_type: str) -> str:
    """The family of a config.json model_type: "llama" for "llama" and "nosa_llama", etc.; ValueError otherwise."""
    family = model_type[len(MODEL_TYPE_PREFIX) :] if model_type.startswith(MODEL_TYPE_PREFIX) else model_type
    if family not in REMOTE_CLASSES:
        allowed = sorted([*REMOTE_CLASSES, *(MODEL_TYPE_PREFIX + f for f in REMOTE_CLASSES)])
        raise ValueError(f"config.json model_type={model_type!r} is not a NOSA family; allowed values are {allowed}.")
    return family


def register_auto_classes() -> None:
    """Register the NOSA model types with ``AutoConfig`` / ``AutoModelForCausalLM`` (idempotent).

    Afterwards an exported folder loads with ``AutoModelForCausalLM.from_pretrained(folder)`` without
    ``trust_remote_code``, through these classes rather than the folder's remote-code files.
    """
    for config_class, model_class in REMOTE_CLASSES.values():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


def expose_to_transformers() -> None:
    """Name the NOSA config and model classes in the ``transformers`` namespace, under their own names (idempotent;
    a name transformers already has is left alone).

    Why: ``transformers serve`` (5.25) loads a checkpoint with ``getattr(transformers, config.architectures[0])``,
    not through ``auto_map``, so an exported checkpoint's architecture ("NosaLlamaForCausalLM") is unknown to it even
    with ``--trust-remote-code``. The checkpoint's remote code imports this module when ``AutoConfig`` reads it,
    before serve looks the name up; serve then loads the model with these classes.
    """
    for namespace in _transformers_namespaces():
        for classes in REMOTE_CLASSES.values():
            for cls in classes:
                if cls.__name__ not in vars(namespace):
                    setattr(namespace, cls.__name__, cls)


def _transformers_namespaces() -> list:
    """``sys.modules["transformers"]`` and every other ``transformers`` module object a loaded module holds as a
    global: importing a model file can put a new ``transformers`` module in ``sys.modules`` (seen with 5.25), while
    serve's own module keeps the one it imported."""
    import sys
    import types

    found = {}
    for module in [sys.modules.get("transformers"), *list(sys.modules.values())]:
        held = module if getattr(module, "__name__", None) == "transformers" else getattr(module, "__dict__", {}).get(
            "transformers")
        if isinstance(held, types.ModuleType) and held.__name__ == "transformers":
            found[id(held)] = held
    return list(found.values())


expose_to_transformers()


def _wants_nosa_cache(kwargs: dict) -> bool:
    if kwargs.get("cache_implementation") == "nosa":
        return True
    generation_config = kwargs.get("generation_config")
    return getattr(generation_config, "cache_implementation", None) == "nosa"


def remote_generate(model, *args, **kwargs):
    """The ``custom_generate`` of exported checkpoints: the stock generate with ``cache_implementation="nosa"``.

    ``cache_implementation="nosa"`` (with an optional ``cache_config`` of NosaConfig overrides) builds a NosaCache;
    everything else is the stock generate, unchanged. A model without eviction heads (a stock checkpoint handed
    this function through ``custom_generate=``) asked for "nosa" is converted in place with ``to_nosa`` first,
    with a warning: its eviction heads start untrained (``A = 0``), which leaves its outputs under any other cache
    exactly as they were.
    """
    from ..generation import generate

    if _wants_nosa_cache(kwargs) and not eviction_heads(model):
        logger.warning(
            "%s has no eviction heads: converting it in place with hf_nosa.to_nosa for cache_implementation='nosa'. "
            "Its eviction heads are untrained (A = 0), so the blocks beyond the query-aware part are picked by "
            "recency; load a NOSA checkpoint to use trained ones.",
            type(model).__name__,
        )
        to_nosa(model)
    return generate(model, *args, **kwargs)
