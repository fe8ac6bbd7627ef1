"""Teaching transformers' ``generate`` the ``cache_implementation="nosa"`` string.

transformers keeps its cache strings in a fixed tuple and builds caches in
``GenerationMixin._prepare_cache_for_generation``; neither has a public hook. ``register()`` adds "nosa" to the
tuple and wraps that one method: for "nosa" it lets transformers build its default cache (so every version
puts it under its own keyword), then swaps in a NosaCache. It also wraps ``GenerationMixin.generate`` so that a
call on a user's NosaCache is one turn (``NosaCache.turn``): a generate that raises part-way leaves the cache as it
was before the call, where transformers would leave it half written. Idempotent and version-checked.

This module sits at the package's top level, below ``modeling/`` and not in it: ``import hf_nosa`` runs
``register()`` the moment transformers' generation code finishes loading, which can be in the middle of transformers
importing a model file (``modeling_llama`` imports ``GenerationMixin``); importing ``hf_nosa.modeling`` there would
import that half-loaded model file again. It needs only the cache, the config and the eviction heads' check
(``attention.eviction_head``); ``modeling.remote`` builds on it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache
from transformers.generation import configuration_utils

from .attention.eviction_head import check_eviction_heads
from .cache.nosa_cache import NosaCache
from .cache.workspace import workspace_of
from .config import NosaConfig

CACHE_IMPLEMENTATION = "nosa"
MIN_TRANSFORMERS, MAX_TRANSFORMERS = Version("5.17.0"), Version("6.0.0")
_CACHE_KWARGS = ("cache", "past_key_values")


def check_transformers_version() -> None:
    version = Version(transformers.__version__)
    if not (MIN_TRANSFORMERS <= Version(version.base_version) < MAX_TRANSFORMERS):
        raise ImportError(
            f"hf_nosa needs transformers >={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS}; found {transformers.__version__}. "
            'Install a supported version: pip install "transformers>=5.17,<6".'
        )
    missing = [
        name
        for name, present in (
            ("generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS", hasattr(configuration_utils, "ALL_CACHE_IMPLEMENTATIONS")),
            ("GenerationMixin._prepare_cache_for_generation", hasattr(GenerationMixin, "_prepare_cache_for_generation")),
        )
        if not present
    ]
    if missing:
        raise ImportError(
            f"transformers {transformers.__version__} lacks {missing}, which hf_nosa relies on to register "
            f'cache_implementation="nosa". Pass past_key_values=hf_nosa.NosaCache(model.config) instead, or '
            "install a transformers version hf_nosa supports."
        )


def nosa_config_for(model: Any, cache_config: dict | None) -> NosaConfig:
    """The model's NosaConfig with ``cache_config`` overrides; an unknown key is a ValueError."""
    base = NosaConfig.from_model_config(model.config)
    overrides = dict(cache_config or {})
    unknown = sorted(set(overrides) - set(NosaConfig.field_names()))
    if unknown:
        raise ValueError(
            f"cache_config has unknown key(s) {unknown} for cache_implementation='nosa'; allowed keys are "
            f"{list(NosaConfig.field_names())}."
        )
    return base.replace(**overrides)


def _prepare_cache_wrapper(original):
    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if generation_config.cache_implementation != CACHE_IMPLEMENTATION:
            result = original(self, generation_config, model_kwargs, *args, **kwargs)
            for key in _CACHE_KWARGS:  # a NosaCache the user passed: size it for this call before it fills
                if isinstance(model_kwargs.get(key), NosaCache):
                    model_kwargs[key].reserve(generation_config.max_length)
            return result
        nosa_config = nosa_config_for(self, generation_config.cache_config)
        if not hasattr(self.model.layers[0].self_attn, "eviction_head"):
            raise ValueError(
                'cache_implementation="nosa" needs a NOSA model: convert it first with hf_nosa.to_nosa(model).'
            )
        generation_config.cache_implementation = None
        try:
            original(self, generation_config, model_kwargs, *args, **kwargs)
        finally:
            generation_config.cache_implementation = CACHE_IMPLEMENTATION
        for key in _CACHE_KWARGS:
            if type(model_kwargs.get(key)) is DynamicCache:
                cache = NosaCache(self.config, nosa_config, max_cache_len=generation_config.max_length)
                cache.restore_on_error = False  # this call's own: nothing to keep if it raises
                if self.device.type == "cuda":  # buffers shared across calls keep the captured decode graph valid
                    cache.attach_workspace(workspace_of(self))
                model_kwargs[key] = cache
        return None

    _prepare_cache_for_generation._hf_nosa_wrapped = True
    return _prepare_cache_for_generation


def _check_not_empty(input_ids) -> None:
    """A prompt of no tokens is a ValueError naming it, before any work (transformers fails later, in a reshape)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() >= 1 and input_ids.shape[-1] == 0:
        raise ValueError(
            f"input_ids has no tokens (shape {tuple(input_ids.shape)}): a NOSA model needs a prompt of at least one "
            "token. Check the tokenizer's output for an empty prompt."
        )


def _generate_wrapper(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if getattr(getattr(self, "config", None), "nosa", None) is not None:
            _check_not_empty(args[0] if args else kwargs.get("input_ids", kwargs.get("inputs")))
            check_eviction_heads(self)  # every call, even one whose new input is a single token
        cache = next((kwargs[key] for key in _CACHE_KWARGS if isinstance(kwargs.get(key), NosaCache)), None)
        if cache is None:
            return original(self, *args, **kwargs)
        with cache.turn():  # a generate that raises part-way leaves the user's cache as it was before the call
            return original(self, *args, **kwargs)

    generate._hf_nosa_wrapped = True
    return generate


def register() -> None:
    """Make ``generate(..., cache_implementation="nosa", cache_config={...})`` build a NosaCache, and make a
    generate on a user's NosaCache one turn (``NosaCache.turn``: restored as it was if the call raises)."""
    check_transformers_version()
    if CACHE_IMPLEMENTATION not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = (*configuration_utils.ALL_CACHE_IMPLEMENTATIONS, CACHE_IMPLEMENTATION)
    current = GenerationMixin._prepare_cache_for_generation
    if not getattr(current, "_hf_nosa_wrapped", False):
        GenerationMixin._prepare_cache_for_generation = _prepare_cache_wrapper(current)
    if not getattr(GenerationMixin.generate, "_hf_nosa_wrapped", False):
        GenerationMixin.generate = _generate_wrapper(GenerationMixin.generate)


def generate(model, *args, **kwargs):
    """A ``custom_generate`` entry point: the stock generate with "nosa" registered.

    Hub checkpoints ship ``custom_generate/generate.py`` calling this, so ``cache_implementation="nosa"`` works
    on a model loaded with ``trust_remote_code=True`` without importing hf_nosa by hand.
    """
    register()
    return GenerationMixin.generate(model, *args, **kwargs)
