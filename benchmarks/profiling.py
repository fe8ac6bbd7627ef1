"""GPU time by kernel, from torch.profiler: what the benchmarks' breakdowns are built from."""

from __future__ import annotations

from collections import Counter

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
    innermost function of ``packages`` that called it (the profiler names it ``file(line of its def): name``): which
    functions of the library launch the elementwise and copy kernels around its Triton ones. A kernel counts for the innermost op or Python call the profiler saw around it
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


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (microseconds in, seconds out): GPU busy time with
    kernels on several streams counted once where they overlap."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e6


# Gap lengths (ms) the idle time of a stream is summed by: many short gaps are launches the host is late with, a
# few long ones waits (a host sync, an event).
GAP_BUCKETS_MS = (0.01, 0.1, 1.0, 10.0)


def stream_gaps(activities: list[tuple[int, float, float, str]], top: int = 20) -> dict:
    """Where the busiest stream (a training step's compute stream) has nothing to run.

    Args:
        activities: ``(stream, start_us, end_us, name)`` of the device's kernels, copies and memsets over one run.
        top: longest gaps listed.

    Returns:
        ``stream``, its ``span_ms`` (first start to last end), ``busy_ms`` and ``idle_ms``; ``other_streams_ms``,
        busy time of each other stream; ``idle_by_gap_ms``, the idle time summed by gap length (``GAP_BUCKETS_MS``
        upper bounds, the last bucket unbounded) with the gaps' counts; ``gaps``, the ``top`` longest, each with the
        activity it comes ``after`` and the one it comes ``before``.
    """
    by_stream: dict[int, list[tuple[float, float, str]]] = {}
    for stream, a, b, name in activities:
        by_stream.setdefault(stream, []).append((a, b, name))
    if not by_stream:
        return dict(stream=None, span_ms=0.0, busy_ms=0.0, idle_ms=0.0, other_streams_ms={}, idle_by_gap_ms={},
                    gaps=[])
    busy = {s: busy_seconds([(a, b) for a, b, _ in acts]) * 1e3 for s, acts in by_stream.items()}
    stream = max(busy, key=busy.get)
    acts = sorted(by_stream[stream])
    gaps, end, last = [], acts[0][1], acts[0][2]
    for a, b, name in acts[1:]:
        if a > end:
            gaps.append(((a - end) / 1e3, last, name))
        if b >= end:
            end, last = b, name
    span = (end - acts[0][0]) / 1e3
    buckets = Counter()
    counts = Counter()
    for ms, _, _ in gaps:
        bound = next((f"<={b}" for b in GAP_BUCKETS_MS if ms <= b), f">{GAP_BUCKETS_MS[-1]}")
        buckets[bound] += ms
        counts[bound] += 1
    order = [f"<={b}" for b in GAP_BUCKETS_MS] + [f">{GAP_BUCKETS_MS[-1]}"]
    return dict(
        stream=stream, span_ms=round(span, 3), busy_ms=round(busy[stream], 3), idle_ms=round(span - busy[stream], 3),
        other_streams_ms={str(s): round(ms, 3) for s, ms in busy.items() if s != stream},
        idle_by_gap_ms={k: dict(ms=round(buckets[k], 3), gaps=counts[k]) for k in order if counts[k]},
        gaps=[dict(ms=round(ms, 3), after=previous[:100], before=following[:100])
              for ms, previous, following in sorted(gaps, key=lambda g: -g[0])[:top]],
    )


def gpu_stream_gaps(run, top: int = 20) -> dict:
    """``stream_gaps`` of one call of ``run()`` (CUDA only), from the profiler's device activities."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    activities = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == torch.autograd.DeviceType.CUDA and event.duration_ns() > 0:
            activities.append((event.device_resource_id(), event.start_ns() / 1e3, event.end_ns() / 1e3,
                               event.name()))
    return stream_gaps(activities, top)
