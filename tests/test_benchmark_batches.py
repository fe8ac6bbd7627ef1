"""The benchmarks' batch planning on the CPU: host budgets from the memory available, host bytes counted as
NosaCache's pinned-memory check counts them, stepping down when a row runs out of memory anyway, quantized stores
compared with nosa at nosa's batch, and generate.py's fixed NOSA batches."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import hf_nosa.cache.host_store
from benchmarks import batch_plan as bp
from benchmarks import decode_throughput as dt
from benchmarks import generate as gen
from hf_nosa import NosaCache

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

GiB = 1 << 30
BIG_CAP = 1e15  # a device cap that never bounds the batch: the host budget does


def dt_args(**overrides):
    return argparse.Namespace(**dict(dict(warmup=3, steps=8, quick=True, host_gb=None), **overrides))


def per_token_bytes(head_dim: int, host_dtype: str, block_size: int) -> float:
    """Host bytes of one token of one KV head from first principles: K and V (two bytes a value in bf16, one in
    fp8 / int8, plus the two fp32 block scales shared by the block's tokens) and the fp32 eviction score."""
    if host_dtype == "auto":
        return 2 * head_dim * 2 + 4
    return 2 * head_dim + 4 + 8 / block_size


# ----- batch_plan.py: planning -----


@pytest.mark.parametrize("host_dtype", ["auto", "float8_e4m3fn", "int8"])
def test_planned_batch_passes_the_cache_host_check_and_one_more_does_not(monkeypatch, host_dtype):
    """The batch planned under a budget is the largest NosaCache accepts when exactly that much is available: the
    planner counts the host store's bytes as the cache's check does."""
    ncfg = dataclasses.replace(dt.nosa_config(smoke=True), host_dtype=host_dtype)
    model = dt.build_model("smoke", "cpu", torch.float32)
    context, args = 256, dt_args()
    steps = bp.total_steps(args, "nosa")
    budget = int(torch.randint(2_000_000, 8_000_000, (1,), generator=torch.Generator().manual_seed(1)))
    batch, bound, _ = bp.pick_batch("nosa", "smoke", context, steps, ncfg, BIG_CAP, budget, 0, 0, torch.float32)
    assert bound == "host" and batch > 2
    monkeypatch.setattr(hf_nosa.cache.host_store, "available_host_memory", lambda: budget)
    cfg = model.config

    def initialise(b):
        cache = NosaCache(cfg, ncfg, max_cache_len=context + steps)
        like = torch.zeros(b, cfg.num_key_value_heads, 1, cfg.head_dim)
        cache.layers[0].lazy_initialization(like, like)  # layer 0 checks the whole cache's host memory

    initialise(batch)
    with pytest.raises(MemoryError, match=f"batch {batch + 1} "):
        initialise(batch + 1)


def test_default_host_budget_is_a_share_of_the_available_memory(monkeypatch):
    available = 123 * GiB + 4567
    monkeypatch.setattr(bp, "available_host_memory", lambda: available)
    budget, source = bp.host_budget(dt_args(), smoke=False)
    assert budget == pytest.approx(bp.HOST_SHARE * available) and "available" in source
    assert bp.host_budget(dt_args(host_gb=50.0), smoke=False) == (50e9, "--host-gb")
    monkeypatch.setattr(bp, "available_host_memory", lambda: None)
    with pytest.raises(ValueError, match="--host-gb"):
        bp.host_budget(dt_args(), smoke=False)


@pytest.mark.parametrize("shape", ["1b", "8b"])
@pytest.mark.parametrize("context", [32768, 65536])
def test_quantized_store_plans_about_twice_the_bf16_batch(monkeypatch, shape, context):
    available = int(torch.randint(40, 120, (1,), generator=torch.Generator().manual_seed(context)).item()) * GiB
    monkeypatch.setattr(bp, "available_host_memory", lambda: available)
    budget, _ = bp.host_budget(dt_args(), smoke=False)
    ncfg = dt.nosa_config(smoke=False)
    steps = bp.total_steps(dt_args(), "nosa")
    s = bp.SHAPES[shape]
    L, Hk, D, P = s["num_hidden_layers"], s["num_key_value_heads"], s["head_dim"], ncfg.block_size
    batches = {}
    for method, host_dtype in (("nosa", "auto"), ("nosa_fp8", "float8_e4m3fn"), ("nosa_int8", "int8")):
        batch, bound, bounds = bp.pick_batch(method, shape, context, steps, ncfg, BIG_CAP, budget, 0, 0)
        need = bp.bytes_per_seq(method, shape, context, steps, ncfg)["host"]
        assert bound == "host" and batch * need <= budget < (batch + 1) * need
        # the same count from first principles, up to the rounding to whole blocks and the quantized tails
        first_principles = L * Hk * (context + steps) * per_token_bytes(D, host_dtype, P)
        assert need == pytest.approx(first_principles, rel=0.01)
        batches[method] = batch
    ratio = per_token_bytes(D, "auto", P) / per_token_bytes(D, "float8_e4m3fn", P)  # 1.97 (D 64), 1.98 (D 128)
    assert abs(batches["nosa_fp8"] - ratio * batches["nosa"]) <= 2
    assert batches["nosa_int8"] == batches["nosa_fp8"]


# ----- decode_throughput.py: stepping down -----


@pytest.fixture
def freed(monkeypatch):
    """batch_plan.free recorded instead of run: its gc.collect costs ~0.2 s a try in a full test session, and these
    tests try up to 20 batches. Returns the host bytes each call was given."""
    needs = []
    monkeypatch.setattr(bp, "free", lambda device, host_need=0: needs.append(host_need))
    return needs


def fake_runner(calls, fits_up_to, error):
    def run_row(args, model, shape, method, context, batch, *rest):
        calls.append(batch)
        if batch > fits_up_to:
            raise error
        return dict(shape=shape, method=method, context=context, batch=batch, tok_per_s=10.0 * batch)

    return run_row


@pytest.mark.parametrize("error", [
    MemoryError("NosaCache host store: batch N needs more than is available"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory"),  # a failed pinned allocation
])
def test_attempt_steps_down_by_15_percent_after_running_out_of_memory(monkeypatch, freed, error):
    calls = []
    fits_up_to = int(torch.randint(20, 60, (1,), generator=torch.Generator().manual_seed(3)))
    monkeypatch.setattr(dt, "run_row", fake_runner(calls, fits_up_to, error))
    row = dt.attempt(dt_args(), None, "1b", "nosa_fp8", 32768, 100, torch.device("cpu"), torch.bfloat16,
                     dt.nosa_config(smoke=False), {})
    assert all(b <= a * 0.85 and b >= a * 0.85 - 1 for a, b in zip(calls, calls[1:]))  # 15% fewer each time
    assert row["batch"] == calls[-1] <= fits_up_to and all(b > fits_up_to for b in calls[:-1])
    assert [t["batch"] for t in row["stepped_down"]] == calls[:-1]
    assert all(type(error).__name__ in t["error"] for t in row["stepped_down"])
    assert "error" not in row
    assert len(freed) == len(calls) and all(need > 0 for need in freed)  # the last row's leftovers go before each try


def test_attempt_does_not_retry_other_errors_and_reports_running_out_at_batch_1(monkeypatch, freed):
    calls = []
    monkeypatch.setattr(dt, "run_row", fake_runner(calls, 0, ValueError("a bug")))
    args = (dt_args(), None, "1b", "nosa", 32768, 50, torch.device("cpu"), torch.bfloat16, dt.nosa_config(False), {})
    row = dt.attempt(*args)
    assert calls == [50] and row["error"].startswith("ValueError: a bug") and row["stepped_down"] == []
    calls.clear()
    monkeypatch.setattr(dt, "run_row", fake_runner(calls, 0, MemoryError("no host memory")))
    row = dt.attempt(*args)
    assert calls[-1] == 1 and "out of memory at every batch" in row["error"] and len(row["stepped_down"]) == len(calls)
    assert len(freed) == 1 + len(calls)  # before every try of both rows


# ----- decode_throughput.py: quantized stores at nosa's batch -----


def drive(method, rows, plans):
    """method_rows with planned batches ``plans`` and a fake runner whose tok/s depends on method and batch."""
    emitted, ran = [], []

    def run(m, batch, attn=None):
        ran.append(batch)
        return dict(shape="1b", method=m, context=32768, batch=batch, tok_per_s=(17.0 if m != "nosa" else 10.0) * batch)

    dt.method_rows(dt_args(), "1b", method, 32768, rows, lambda m: plans[m], run, emitted.append)
    return emitted, ran


def test_quantized_store_runs_at_nosas_batch_first_then_at_its_own():
    nosa = dict(shape="1b", method="nosa", context=32768, batch=61, tok_per_s=610.0)
    plans = {"nosa": (65, "host", {}), "nosa_fp8": (113, "device", {"device": 113, "host": 129})}
    emitted, ran = drive("nosa_fp8", [nosa], plans)
    assert ran == [61, 113]  # nosa's row's batch (stepped down from its plan), then the fp8 store's own plan
    same, own = emitted
    assert same["at_nosa_batch"] and not same["own_plan"] and same["bound"] == "nosa's batch"
    assert same["speedup_vs_bf16_same_batch"] == pytest.approx(17 * 61 / 610.0)
    assert "speedup_vs_bf16_same_batch" not in own and own["own_plan"] and own["bound"] == "device"
    assert own["vs_bf16_largest"] == dict(bf16_batch=61, batch_ratio=pytest.approx(113 / 61),
                                          tok_s_ratio=pytest.approx(17 * 113 / 610.0))


def test_quantized_store_takes_nosas_plan_when_nosa_has_no_row():
    failed = dict(shape="1b", method="nosa", context=32768, batch=65, error="MemoryError: ...")
    plans = {"nosa": (65, "host", {}), "nosa_int8": (129, "host", {})}
    emitted, ran = drive("nosa_int8", [failed], plans)
    assert ran == [65, 129] and emitted[0]["bound"] == "nosa's plan"
    assert all("speedup_vs_bf16_same_batch" not in r for r in emitted)  # nothing to compare with


def test_one_row_when_the_quantized_plan_is_nosas_batch():
    nosa = dict(shape="1b", method="nosa", context=32768, batch=94, tok_per_s=940.0)
    emitted, ran = drive("nosa_fp8", [nosa], {"nosa": (94, "device", {}), "nosa_fp8": (94, "device", {"device": 94})})
    assert ran == [94] and len(emitted) == 1
    row = emitted[0]
    assert row["at_nosa_batch"] and row["own_plan"] and row["batch_bounds"] == {"device": 94}
    assert row["speedup_vs_bf16_same_batch"] == pytest.approx(1.7)


def test_nosa_runs_before_the_quantized_stores_whatever_the_order_given(monkeypatch):
    for name, value in (("TRITON_INTERPRET", "1"), ("HF_NOSA_KERNELS", "triton")):  # what --smoke sets, undone after
        monkeypatch.setenv(name, value)
    order = []
    monkeypatch.setattr(dt, "method_rows", lambda args, shape, method, *rest: order.append(method))
    monkeypatch.setattr(dt, "measure_bandwidths", lambda device: dict(hbm_GBps=float("nan"), pcie_GBps=float("nan")))
    dt.main(["--smoke", "--methods", "nosa_int8,nosa_fp8,nosa"])
    assert order == ["nosa", "nosa_fp8", "nosa_int8"]
    with pytest.raises(ValueError, match="--methods has unknown"):
        dt.main(["--smoke", "--methods", "nosa_fp4"])


# ----- generate.py -----


def test_generate_parses_fixed_nosa_batches():
    args = gen.parse_args(["--methods", "nosa", "--host-dtype", "float8_e4m3fn", "--nosa-batches", "38", "76",
                           "--out", "x.json"])
    assert args.nosa_batches == [38, 76] and args.host_dtype == "float8_e4m3fn" and not args.skip_engine
    assert gen.parse_args(["--out", "x.json", "--skip-engine"]).nosa_batches is None
    with pytest.raises(ValueError, match="--nosa-batches must be positive"):
        gen.parse_args(["--nosa-batches", "0", "--out", "x.json"])
    with pytest.raises(ValueError, match="needs 'nosa' in --methods"):
        gen.parse_args(["--methods", "dynamic", "--nosa-batches", "4", "--out", "x.json"])


def test_generate_fixed_batch_row_keeps_a_batch_that_does_not_fit(monkeypatch):
    saved, timed = [], []
    model = argparse.Namespace(config=argparse.Namespace(nosa=dict(host_dtype="float8_e4m3fn")))
    args = gen.parse_args(["--methods", "nosa", "--nosa-batches", "8", "80", "--skip-engine", "--repeats", "3",
                           "--out", "x.json"])

    def timed_row(model, batch, context, new_tokens, method, *, limit, engine=False, repeats=1):
        timed.append((batch, limit, engine, repeats))
        if batch > 40:
            raise MemoryError(f"batch {batch} needs more than is available")
        return dict(batch=batch, limit=limit)

    monkeypatch.setattr(gen, "timed_row", timed_row)
    monkeypatch.setattr(gen, "release_host_stores", lambda model: None)
    monkeypatch.setattr(gen, "SAVE", saved.append)
    rows = [gen.fixed_nosa_row(model, b, 32768, args) for b in args.nosa_batches]
    assert timed == [(8, "fixed", False, 3), (80, "fixed", False, 3)]  # no stepping down from a fixed batch
    assert rows[0] == dict(batch=8, limit="fixed")
    assert rows[1]["limit"] == "fixed" and rows[1]["batch"] == 80 and rows[1]["error"].startswith("MemoryError")
    assert saved == [rows[1]] and rows[1]["host_dtype"] == "float8_e4m3fn"


@pytest.mark.parametrize("host_dtype", ["auto", "float8_e4m3fn"])
def test_generate_host_batch_counts_what_the_cache_checks(monkeypatch, host_dtype):
    available = 97 * GiB
    monkeypatch.setattr(gen, "available_host_memory", lambda: available)
    s = dt.SHAPES["1b"]
    config = argparse.Namespace(nosa=dict(host_dtype=host_dtype, block_size=64), **s)
    model = argparse.Namespace(config=config, dtype=torch.bfloat16)
    batch = gen.nosa_host_batch(model, 65536, 512)
    one = s["num_hidden_layers"] * hf_nosa.cache.host_store.HostStore.planned_bytes(
        1, s["num_key_value_heads"], s["head_dim"], torch.bfloat16, 64, host_dtype, 65536 + 512)
    assert batch * one <= gen.HOST_SHARE * available < (batch + 1) * one


def test_recorded_command_names_the_script_from_the_repository_root(monkeypatch):
    from benchmarks import environment

    script = Path(environment.__file__).resolve().parent / "decode.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--batch", "4", "--out", "/somewhere/results"])
    command = environment.command_line()
    assert command.endswith("python benchmarks/decode.py --batch 4 --out DIR")
    assert str(script.parent) not in command


def test_recorded_command_writes_the_output_folders_paths_as_dir(monkeypatch):
    from benchmarks import environment

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(sys, "argv", ["python -m benchmarks serve", "--profile", "/run/out/profile", "--out",
                                      "/run/out/serve.json"])
    command = environment.command_line()
    assert command.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ")
    assert command.endswith("serve --profile DIR/profile --out DIR") and "/run/out" not in command
