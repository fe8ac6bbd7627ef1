"""Serving a NOSA model on transformers' continuous batching (``generate_batch``, ``init_continuous_batching``,
``ContinuousBatchingManager``): one NosaCache per request (full K/V in the host store, a working set in the device
slot pool), admitted by host and device bytes, scheduled by transformers on NOSA's prefill chunk grid.

    >>> import hf_nosa.serving  # doctest: +SKIP
    >>> hf_nosa.serving.enable(model)  # doctest: +SKIP
    >>> outputs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=64))  # doctest: +SKIP

One idea per module: ``requests`` (the per-request caches and the budget), ``paged_cache`` (transformers' cache and
allocator, narrowed), ``scheduler`` (the chunk grid), ``attention`` (a packed step: prompt pieces request by
request), ``decode_batch`` (its decode tokens as one batched update), ``row_pool`` (the requests' rows of shared
device tensors), ``host_rows`` (their host stores as rows of one), ``host_pool`` (host memory reused across
requests), ``manager`` (the manager and ``enable``). docs/serving.md says how transformers reaches the attention and what is left to do.

Only ``attention`` is imported with the package (``nosa_attention`` routes to it); the others import transformers'
continuous-batching internals, which move between versions, when first used.
"""

import importlib

import transformers
from packaging.version import Version

from .attention import is_serving_cache, serving_attention

# transformers' continuous batching has had one allocator per attention type (``cache_allocators``) since 5.18; 5.17
# kept its blocks in ``cache_manager.py`` with another interface (docs/serving.md).
MIN_TRANSFORMERS = Version("5.18.0")

_LAZY = {
    "NosaBatchingManager": ".manager",
    "enable": ".manager",
    "init_continuous_batching": ".manager",
    "RequestCaches": ".requests",
    "ServingBudget": ".requests",
}

__all__ = ["check_transformers_version", "is_serving_cache", "serving_attention", *_LAZY]


def check_transformers_version() -> None:
    """Raise an ImportError naming the versions when transformers' continuous batching is one serving cannot use."""
    found = Version(Version(transformers.__version__).base_version)
    if found < MIN_TRANSFORMERS:
        raise ImportError(
            f"hf_nosa.serving needs transformers >= {MIN_TRANSFORMERS} (continuous batching with one cache allocator "
            f"per attention type); found {transformers.__version__}. Install a newer one: "
            f'pip install "transformers>={MIN_TRANSFORMERS},<6". NOSA generate works on this version.'
        )


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    check_transformers_version()
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
