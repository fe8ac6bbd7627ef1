"""Serving a NOSA model on transformers' continuous batching (``generate_batch``, ``init_continuous_batching``,
``ContinuousBatchingManager``): one NosaCache per request (full K/V in the host store, a working set in the device
slot pool), admitted by host and device bytes, scheduled by transformers on NOSA's prefill chunk grid.

    >>> import hf_nosa.serving  # doctest: +SKIP
    >>> hf_nosa.serving.enable(model)  # doctest: +SKIP
    >>> outputs = model.generate_batch(prompts, generation_config=GenerationConfig(max_new_tokens=64))  # doctest: +SKIP

One idea per module: ``requests`` (the per-request caches and the budget), ``paged_cache`` (transformers' cache and
allocator, narrowed), ``scheduler`` (the chunk grid), ``attention`` (a packed step, request by request), ``manager``
(the manager and ``enable``). docs/serving.md says how transformers reaches the attention and what is left to do.
"""

from .attention import is_serving_cache, serving_attention
from .manager import NosaBatchingManager, enable, init_continuous_batching
from .requests import RequestCaches, ServingBudget

__all__ = [
    "NosaBatchingManager",
    "RequestCaches",
    "ServingBudget",
    "enable",
    "init_continuous_batching",
    "is_serving_cache",
    "serving_attention",
]
