"""The bookkeeping of benchmarks/memory_census.py: replaying allocation events to the peak, grouping what is live
there by site, the CPU storage tracker (views counted once, frees when the last holder dies) and the formula's
terms against generate.py's ``chunk_activations``."""

import gc
import os
import random

import pytest
import torch

from benchmarks.memory_census import (
    Event, StorageTracker, cuda_events, group_live, live_at, package_roots, projected_formula, replay,
)
from hf_nosa import NosaConfig
from hf_nosa.cache.host_store import HostStore
from hf_nosa.attention.pool import PARTS_ENV_VAR

ROOTS = {"hf_nosa": "/x/hf_nosa", "transformers": "/y/transformers", "torch": "/y/torch"}


def frames(*sites):
    """Frames innermost first from ``("package/file.py", line, function)`` triples under ROOTS."""
    out = []
    for short, line, name in sites:
        package, _, rest = short.partition("/")
        out.append((f"{ROOTS[package]}/{rest}" if package in ROOTS else f"/z/{short}", line, name))
    return tuple(out)


def test_replay_finds_the_first_highest_total_and_what_is_live_there():
    rng = random.Random(0)
    events, live, sizes, totals = [], set(), {}, []
    baseline = 1000
    total = baseline
    for i in range(400):  # random allocations and frees; the reference recomputes the total from scratch
        if live and rng.random() < 0.45:
            key = rng.choice(sorted(live))
            live.remove(key)
            events.append(Event("free", key, sizes[key]))
        else:
            sizes[i] = rng.randrange(1, 100)
            live.add(i)
            events.append(Event("alloc", i, sizes[i]))
        total = baseline + sum(sizes[k] for k in live)
        totals.append((total, set(live)))
    peak, _ = replay(events, baseline)
    best = max(t for t, _ in totals)
    first = next(i for i, (t, _) in enumerate(totals) if t == best)
    assert peak.bytes == best and peak.index == first
    assert set(peak.live) == totals[first][1]
    assert peak.final == totals[-1][0]
    assert events[peak.index].action == "alloc"


def test_replay_takes_frees_of_earlier_allocations_out_of_the_baseline():
    events = [Event("alloc", "a", 50), Event("free", "old", 30), Event("alloc", "b", 40), Event("free", "a", 50),
              Event("alloc", "c", 10)]
    peak, _ = replay(events, baseline=100)
    # 150 after a, 120 after the old block's free, 160 after b: the peak, with 70 of the baseline left
    assert (peak.bytes, peak.index, peak.baseline_live) == (160, 2, 70)
    assert set(peak.live) == {"a", "b"}
    assert peak.final == 100 - 30 + 40 + 10


def test_replay_phases_and_bad_events():
    events = [Event("alloc", 1, 10, info={"chunk": 0}), Event("alloc", 2, 5, info={"chunk": 512}),
              Event("free", 1, 10), Event("alloc", 3, 1, info={"chunk": 512})]
    _, by_phase = replay(events, phase=lambda e: e.info["chunk"])
    assert by_phase == {0: (10, 0), 512: (15, 1)}
    assert set(live_at(events, 1)) == {1, 2} and set(live_at(events, 3)) == {2, 3}
    with pytest.raises(ValueError, match="action"):
        replay([Event("malloc", 1, 1)])
    with pytest.raises(ValueError, match="again"):
        replay([Event("alloc", 1, 1), Event("alloc", 1, 1)])


def test_groups_by_innermost_hf_nosa_or_transformers_frame():
    attn = frames(("torch/nn/functional.py", 1, "pad"), ("hf_nosa/attention/dense.py", 80, "_widened"),
                  ("hf_nosa/attention/pool.py", 70, "attend_with_pool_blocks"))
    mlp = frames(("transformers/models/llama/modeling_llama.py", 164, "forward"),
                 ("hf_nosa/modeling/chunked.py", 148, "_chunked"))
    other = frames(("torch/functional.py", 3, "f"), ("script.py", 9, "main"))
    live = {1: Event("alloc", 1, 300, attn), 2: Event("alloc", 2, 100, attn), 3: Event("alloc", 3, 600, mlp),
            4: Event("alloc", 4, 7, other), 5: Event("alloc", 5, 1, ())}
    rows = group_live(live, batch=2, roots=ROOTS)
    assert [(r["site"], r["function"], r["bytes"], r["count"]) for r in rows] == [
        ("transformers/models/llama/modeling_llama.py:164", "forward", 600, 1),
        ("hf_nosa/attention/dense.py:80", "_widened", 400, 2),
        ("script.py:9", "main", 7, 1),
        ("(no python frame)", "", 1, 1),
    ]
    assert rows[1]["callers"] == ["hf_nosa/attention/pool.py:70 attend_with_pool_blocks"]
    assert rows[1]["mib_per_sequence"] == 200 / (1 << 20)
    assert len(group_live(live, batch=2, roots=ROOTS, top=2)) == 2


def test_cuda_trace_requested_against_completed_frees():
    where = [{"filename": "/x/hf_nosa/attention/read_ahead.py", "line": 1, "name": "start"},
             {"filename": "/z/run.py", "line": 2, "name": "<module>"}]
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 4096},
        {"action": "alloc", "addr": 0, "size": 100, "frames": where},
        {"action": "free_requested", "addr": 0, "size": 100},  # used on a side stream: completes later
        {"action": "alloc", "addr": 512, "size": 60, "frames": list(reversed(where))},  # outermost first
        {"action": "free_completed", "addr": 0, "size": 100},
        {"action": "free_requested", "addr": 512, "size": 60},
        {"action": "free_completed", "addr": 512, "size": 60},
    ]
    requested, completed = cuda_events(trace, "free_requested"), cuda_events(trace, "free_completed")
    assert [e.action for e in requested] == ["alloc", "free", "alloc", "free"]
    assert requested[2].frames[0][2] == "start"  # turned around: innermost first
    assert replay(requested)[0].bytes == 100
    assert replay(completed)[0].bytes == 160
    with pytest.raises(ValueError, match="free_action"):
        cuda_events(trace, "free")


def test_tracker_counts_a_storage_once_through_its_views_and_frees_it_with_the_last():
    tracker = StorageTracker(package_roots())
    with tracker:
        x = torch.ones(1000)  # 4000 bytes
        views = [x[10:], x.view(10, 100), x.view(10, 100).t(), x.detach()]
        x.add_(1)  # in place: no new storage
        y = x * 2  # a new one
        del x
        gc.collect()
        freed_early = [e for e in tracker.events if e.action == "free"]
        del views
        gc.collect()
        z = torch.empty(250)  # 1000 bytes
    assert freed_early == []  # the views still hold x's storage
    allocs = [e for e in tracker.events if e.action == "alloc"]
    assert [e.size for e in allocs] == [4000, 4000, 1000]
    assert allocs[0].info["shape"] == [1000] and allocs[0].info["dtype"] == "float32"
    peak, _ = replay(tracker.events)
    assert peak.bytes == 8000 and peak.index == 1  # x and y; x is gone by the time z comes
    assert peak.final == 5000
    assert {e.key for e in tracker.events if e.action == "free"} == {allocs[0].key}
    assert y.sum() == 4000 and z.numel() == 250  # (x was 2 after add_)


def test_tracker_sets_the_host_store_apart():
    tracker = StorageTracker(package_roots())
    with tracker:
        store = HostStore(2, 1, 4, torch.float32, 4, pin=False)
        store.ensure_capacity(8)
        k = torch.zeros(2, 1, 8, 4)
    host = sum(e.size for e in tracker.host_events if e.action == "alloc")
    assert host >= 2 * 8 * 4 * 4 * 2 + 2 * 8 * 4  # K, V and the fp32 scores
    assert [e.size for e in tracker.events if e.action == "alloc"] == [k.numel() * 4]


def test_formula_is_the_largest_moment(monkeypatch):
    monkeypatch.setenv(PARTS_ENV_VAR, "2")
    projected = projected_formula("1b", 65536, 512, 38, NosaConfig(prefill_chunk_size=512))
    assert projected["fetch_parts"] == 2
    moments = projected["moments_gib"]
    assert set(moments) == {"mlp", "quoka_attention", "tail_attention"}
    sums = {m: sum(t.values()) for m, t in moments.items()}
    assert abs(max(sums.values()) - projected["chunk_activations_gib"]) < 1e-9
    assert projected["largest_moment"] == max(sums, key=sums.get)
    per_seq = projected["moments_mib_per_sequence"]
    assert per_seq["mlp"]["gate_up_product"] == 512 * 3 * 8192 * 2 / (1 << 20)  # 1b: intermediate 8192, chunk 512
    assert per_seq["mlp"]["previous_chunks"] == 16 * 512 * 8 * (64 * 2 * 2 + 4) / (1 << 20)
    assert per_seq["tail_attention"]["prefix_pieces"] > 0
    assert projected["tail_piece_tokens"] < 4096  # 38 rows: fewer tokens a piece than one row's budget
    # without a dense tail there is no tail moment
    assert "tail_attention" not in projected_formula("1b", 65536, 512, 38,
                                                     NosaConfig(prefill_dense_tail_tokens=0))["moments_gib"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replay_matches_the_allocator_statistics():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=10000)
    try:
        a = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, _ = replay(cuda_events(trace, "free_requested"), before)
    assert peak.bytes == torch.cuda.memory_stats()["requested_bytes.all.peak"]
    assert peak.bytes - before == (3 << 20) + (5 << 20)
    site = os.path.basename(peak.live[b.data_ptr()].frames[0][0])
    assert site == "test_memory_census.py"  # innermost frame first
    del b, c
