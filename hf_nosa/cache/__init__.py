"""NosaCache: the K/V of every token in pinned host memory, a fixed block budget on the device.

``nosa_cache`` (``NosaCache`` and its per-layer ``NosaLayer``, built from the decode and prefill paths),
``host_store`` and ``host_quant`` (the host store and its formats), ``pinned`` (its page-locked buffers, pooled),
``compressed_keys`` (the device-side window means), ``decode_step`` (one decode token: selection, fetch, what the
attention reads), ``decode_parts`` (a step a part of the batch at a time), ``workspace`` (device buffers shared
across ``generate`` calls), ``selectors`` (the hook for other selection rules). Below: ``prefill``, ``attention``,
``kernels``, ``rules``.
"""

from .nosa_cache import NosaCache, NosaLayer

__all__ = ["NosaCache", "NosaLayer"]
