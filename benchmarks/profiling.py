"""GPU time by kernel, from torch.profiler: what the benchmarks' breakdowns are built from."""

from __future__ import annotations

import bisect
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


# Chrome-trace categories of what runs on a stream, and of the host calls that launch it.
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def idle_by_launch_site(trace: dict, packages: tuple[str, ...] = ("hf_nosa", "transformers", "peft"),
                        min_gap_ms: float = 0.01, top: int = 30) -> list[dict]:
    """The busiest stream's idle time before each activity, summed by the Python function that launched it.

    A gap ends when the next activity starts. ``host_late`` counts the gaps whose activity the host launched only after
    the stream had run dry: the stream waited on the host (Python, a sync) rather than on a dependency, and the
    function named is the one whose work came before the launch.

    Args:
        trace: a profiler's Chrome trace (``export_chrome_trace``) of a run with ``with_stack=True``.
        packages: path parts the innermost named frame must hold (the first package found in that frame wins).
        min_gap_ms: shorter gaps are left out (back-to-back launches).
        top: sites listed, most idle time first.

    Returns:
        ``[{site, idle_ms, gaps, host_late}]``: ``site`` is ``file(line): function`` of the innermost frame of
        ``packages`` around the launch, ``"(no launch found)"`` when the trace holds none for the activity.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in _DEVICE_CATEGORIES]
    if not device:
        return []
    busy = Counter()
    for e in device:
        busy[e["tid"]] += e.get("dur", 0)
    stream = max(busy, key=busy.get)
    mine = sorted((e for e in device if e["tid"] == stream), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    frames: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") == "python_function" and any(f"{p}/" in e["name"] for p in packages):
            frames.setdefault(e["tid"], []).append(e)
    starts = {}
    for tid, fs in frames.items():
        fs.sort(key=lambda f: f["ts"])
        starts[tid] = [f["ts"] for f in fs]

    def site_of(launch: dict) -> str:
        # On one thread frames nest: the innermost around t is the latest one started by t that has not ended.
        fs, t = frames.get(launch["tid"], []), launch["ts"]
        i = bisect.bisect_right(starts.get(launch["tid"], []), t) - 1
        while i >= 0 and fs[i]["ts"] + fs[i].get("dur", 0) < t:
            i -= 1
        if i < 0:
            return "(no package frame)"
        name = fs[i]["name"]
        for p in packages:  # a checkout's or an environment's path, down to the package
            at = name.find(f"{p}/")
            if at >= 0:
                return name[at:]
        return name

    sites: dict[str, list] = {}
    end = mine[0]["ts"] + mine[0].get("dur", 0)
    for e in mine[1:]:
        gap_us = e["ts"] - end
        if gap_us >= min_gap_ms * 1e3:
            launch = launches.get(e.get("args", {}).get("correlation"))
            site = site_of(launch) if launch is not None else "(no launch found)"
            entry = sites.setdefault(site, [0.0, 0, 0])
            entry[0] += gap_us / 1e3
            entry[1] += 1
            entry[2] += int(launch is not None and launch["ts"] >= end)
        end = max(end, e["ts"] + e.get("dur", 0))
    rows = [dict(site=site, idle_ms=round(ms, 3), gaps=n, host_late=late) for site, (ms, n, late) in sites.items()]
    return sorted(rows, key=lambda r: -r["idle_ms"])[:top]


def gpu_idle_by_launch_site(run, top: int = 30) -> list[dict]:
    """``idle_by_launch_site`` of one call of ``run()`` (CUDA only), profiled with Python stacks."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # without it the trace holds no Python frames
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 experimental_config=verbose) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return idle_by_launch_site(trace, top=top)
