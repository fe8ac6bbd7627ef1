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


def gpu_ms_by_site(run, packages: tuple[str, ...] = ("hf_nosa", "transformers", "peft")) -> list[dict]:
    """Milliseconds of device time of torch's own ops over one call of ``run()`` (CUDA only), by op and by the
    innermost Python line of ``packages`` that called it: which lines of the library launch the elementwise and copy
    kernels around its Triton ones. A kernel counts for the innermost op or Python call the profiler saw around it
    (Triton's launches: a Python function)."""
    from torch.profiler import ProfilerActivity, profile

    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # without it the ops' Python stacks stay empty
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 experimental_config=verbose) as prof:
        run()
        torch.cuda.synchronize()
    sites: dict[tuple[str, str], list] = {}
    for event in prof.key_averages(group_by_stack_n=24):
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        if us <= 0:
            continue
        frame = next((f for f in event.stack or [] if any(f"{p}/" in f for p in packages)), "(no package frame)")
        frame = frame[frame.rfind("site-packages/") + 14:] if "site-packages/" in frame else frame
        for p in packages:  # a checkout's path down to the package
            at = frame.find(f"{p}/")
            if at > 0 and "site-packages" not in frame:
                frame = frame[at:]
        entry = sites.setdefault((event.key, frame), [0.0, 0])
        entry[0] += us / 1000
        entry[1] += event.count
    rows = [dict(op=op, site=site, ms=round(ms, 3), calls=calls) for (op, site), (ms, calls) in sites.items()]
    return sorted(rows, key=lambda r: -r["ms"])
