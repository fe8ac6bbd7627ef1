"""The bookkeeping of benchmarks/prefill_breakdown.py: kernel kinds and the GPU busy time over several streams."""

import random

from benchmarks.prefill_breakdown import busy_seconds, kind_of, summarize


def test_kinds_of_the_prefill_kernels():
    assert kind_of("_fetch_step_kernel") == "fetch"
    assert kind_of("_read_span_kernel") == "host_read"
    assert kind_of("_quoka_normaliser_kernel") == "quoka_score"
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<96, 128>>") == "attention"
    assert kind_of("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN") == "gemm"
    assert kind_of("void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<2u>>") == "copy"
    assert kind_of("void at::native::radixSortKVInPlace<2, -1, 32, 4, float, long>") == "sort_topk"
    assert kind_of("some_new_kernel") == "other"


def test_busy_time_is_the_union_of_intervals():
    rng = random.Random(0)
    intervals = []
    for _ in range(200):  # integer end points: unit cells [t, t + 1) are either covered or not
        a = rng.randrange(0, 1000)
        intervals.append((a, a + rng.randrange(0, 30)))
    covered = sum(1 for t in range(1100) if any(a <= t < b for a, b in intervals))
    assert busy_seconds(intervals) * 1e6 == covered
    assert busy_seconds(intervals) * 1e6 <= sum(b - a for a, b in intervals)


def test_summary_sums_each_kind():
    kernels = [("_fetch_step_kernel", 0.0, 10.0), ("_fetch_step_kernel", 20.0, 25.0), ("nvjet_x", 0.0, 100.0)]
    out = summarize(kernels)
    assert list(out) == ["gemm", "fetch"]  # most time first
    assert out["fetch"] == dict(ms=0.015, launches=2, top={"_fetch_step_kernel": 0.015})
