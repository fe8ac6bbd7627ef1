"""Serving a NOSA model on transformers' continuous batching (``generate_batch``, ``init_continuous_batching``,
``ContinuousBatchingManager``): one NosaCache per request (full K/V in the host store, a working set in the device
slot pool), admitted by host and device bytes, scheduled by transformers on NOSA's prefill chunk grid.

    >>> import hf_nosa.serving  # doctest: +SKIP
    >>> hf_nosa.serving.enable(model)  # doctest: +SKIP
    >>> outputs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=64))  # doctest: +SKIP

One idea per module: ``requests`` (the per-request caches and the budget), ``paged_cache`` (transformers' cache and
allocator, narrowed), ``scheduler`` (the chunk grid), ``attention`` (a packed step, request by request), ``manager``
(the manager and ``enable``). docs/serving.md says how transformers reaches the attention and what is left to do.

Only ``attention`` is imported with the package (``nosa_attention`` routes to it); the others import transformers'
continuous-batching internals, which move between versions, when first used.
"""

import importlib

from .attention import is_serving_cache, serving_attention

_LAZY = {
    "NosaBatchingManager": ".manager",
    "enable": ".manager",
    "init_continuous_batching": ".manager",
    "RequestCaches": ".requests",
    "ServingBudget": ".requests",
}

__all__ = ["is_serving_cache", "serving_attention", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
