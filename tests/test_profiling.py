"""The bookkeeping of benchmarks/profiling.py: where a stream has nothing to run."""

import random

from benchmarks.profiling import GAP_BUCKETS_MS, busy_seconds, idle_by_launch_site, stream_gaps


def test_gaps_of_the_busiest_stream_add_up_to_its_idle_time():
    rng = random.Random(1)
    activities, t = [], 0.0
    for i in range(300):  # stream 7: back to back, overlapping, or after a gap of up to 30 ms
        t += rng.choice([0.0, -2.0, rng.uniform(0, 30_000)])
        length = rng.uniform(1, 500)
        activities.append((7, t, t + length, f"k{i}"))
        t += length
    activities += [(9, a, a + 50.0, "copy") for a in range(0, 100_000, 10_000)]  # a side stream, less busy
    rng.shuffle(activities)
    out = stream_gaps(activities, top=5)
    assert out["stream"] == 7 and set(out["other_streams_ms"]) == {"9"} and out["other_streams_ms"]["9"] == 0.5
    mine = [(a, b) for s, a, b, _ in activities if s == 7]
    span = (max(b for _, b in mine) - min(a for a, _ in mine)) / 1e3
    assert abs(out["span_ms"] - span) < 1e-3
    assert abs(out["busy_ms"] - busy_seconds(mine) * 1e3) < 1e-3
    assert abs(out["idle_ms"] - (span - busy_seconds(mine) * 1e3)) < 2e-3
    assert abs(sum(b["ms"] for b in out["idle_by_gap_ms"].values()) - out["idle_ms"]) < 2e-2
    assert len(out["gaps"]) == 5 and out["gaps"] == sorted(out["gaps"], key=lambda g: -g["ms"])
    assert set(out["idle_by_gap_ms"]) <= {f"<={b}" for b in GAP_BUCKETS_MS} | {f">{GAP_BUCKETS_MS[-1]}"}


def test_one_gap_names_the_activities_around_it():
    activities = [(1, 0.0, 100.0, "a"), (1, 50.0, 120.0, "b"), (1, 2120.0, 2200.0, "c")]
    out = stream_gaps(activities)
    assert out["gaps"] == [dict(ms=2.0, after="b", before="c")]
    assert out["idle_by_gap_ms"] == {"<=10.0": dict(ms=2.0, gaps=1)}
    assert stream_gaps([])["stream"] is None


def _x(cat, name, ts, dur, tid, **args):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, pid=0, args=args)


def test_idle_time_goes_to_the_innermost_function_that_launched_the_kernel_after_it():
    outer = "/env/site-packages/transformers/models/llama/modeling_llama.py(300): forward"
    inner = "/repo/hf_nosa/attention/training.py(440): nosa_training_attention"
    trace = dict(traceEvents=[
        _x("python_function", outer, 0, 1000, tid=1),
        _x("python_function", "/repo/hf_nosa/rules/masks.py(10): helper", 5, 10, tid=1),  # ended before the launches
        _x("python_function", inner, 100, 400, tid=1),
        _x("python_function", "/env/site-packages/torch/nn/functional.py(1): linear", 150, 5, tid=1),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 2, tid=1, correlation=1),    # outer's: k1
        _x("cuda_runtime", "cudaLaunchKernel", 152, 2, tid=1, correlation=2),   # inside torch, inside inner: k2
        _x("cuda_driver", "cuLaunchKernel", 300, 2, tid=1, correlation=3),      # inner: k3
        _x("cuda_runtime", "cudaLaunchKernel", 600, 2, tid=2, correlation=4),   # a thread without frames: k4
        _x("kernel", "k1", 30, 125, tid=7, correlation=1),
        _x("kernel", "k2", 185, 20, tid=7, correlation=2),     # 30 us after k1, launched before k1 ended
        _x("kernel", "k3", 310, 40, tid=7, correlation=3),     # 105 us after k2, launched after it ended: host late
        _x("kernel", "k4", 650, 10, tid=7, correlation=4),
        _x("kernel", "k5", 700, 10, tid=7, correlation=99),    # no launch in the trace
        _x("gpu_memcpy", "copy", 0, 5, tid=9),                 # a side stream, less busy
    ])
    rows = {r["site"]: r for r in idle_by_launch_site(trace, min_gap_ms=0.02)}
    assert rows["hf_nosa/attention/training.py(440): nosa_training_attention"] == dict(
        site="hf_nosa/attention/training.py(440): nosa_training_attention", idle_ms=0.135, gaps=2, host_late=1)
    assert rows["(no package frame)"]["idle_ms"] == 0.3 and rows["(no package frame)"]["host_late"] == 1
    assert rows["(no launch found)"]["gaps"] == 1
    assert abs(sum(r["idle_ms"] for r in rows.values()) - (30 + 105 + 300 + 40) / 1e3) < 1e-9
    assert idle_by_launch_site(trace, min_gap_ms=0.2)[0]["site"] == "(no package frame)"
    assert idle_by_launch_site(dict(traceEvents=[])) == []
