"""GPU time by kernel, from torch.profiler: what the benchmarks' breakdowns are built from."""

from __future__ import annotations

import torch


def gpu_ms_by_kernel(run) -> dict[str, float]:
    """Milliseconds of device time per kernel name over one call of ``run()`` (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if us > 0:
            times[event.key] = times.get(event.key, 0.0) + us / 1000
    return times
