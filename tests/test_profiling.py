"""The bookkeeping of benchmarks/profiling.py: where a stream has nothing to run."""

import random

from benchmarks.profiling import GAP_BUCKETS_MS, busy_seconds, stream_gaps


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
