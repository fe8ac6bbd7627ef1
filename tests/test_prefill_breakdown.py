"""The bookkeeping of benchmarks/prefill_breakdown.py: kernel kinds, the GPU busy time over several streams, and the
host profile's split by package."""

import random

import torch

from benchmarks.prefill_breakdown import busy_seconds, host_profile, kind_of, package_of, short_name, summarize


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


def _python_loop(n):
    total = 0
    for i in range(n):
        total += i * i
    return total


def _profiled_work():
    x = torch.randn(64, 64)
    for _ in range(50):
        x = torch.tanh(x @ x) * 0.5
    return _python_loop(20000) + float(x.sum())


def test_host_profile_splits_self_time_by_package():
    out = host_profile(_profiled_work, top=10)
    shares = out["self_s_by_package"]
    assert "builtin" in shares and "python" in shares  # torch's C ops, and this file's loop
    assert abs(sum(shares.values()) - out["profiled_s"]) < 1e-3
    assert len(out["top_self"]) <= 10
    assert any("_python_loop" in row["function"] and row["calls"] == 1 for row in out["top_cumulative"])
    selfs = [row["self_s"] for row in out["top_self"]]
    assert selfs == sorted(selfs, reverse=True)


def test_package_and_short_name_of_a_profile_entry():
    path = "/x/site-packages/transformers/models/llama/modeling_llama.py"
    assert package_of(path, "forward") == "transformers"
    assert package_of("/w/hf_nosa/prefill/chunked.py", "_prefill") == "hf_nosa"
    assert package_of("~", "<built-in method torch.cat>") == "builtin"
    assert short_name(path, 12, "forward") == "transformers/models/llama/modeling_llama.py:12(forward)"
