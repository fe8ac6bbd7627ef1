"""Where a retrofit step's time and peak memory go: dense sdpa against the NOSA sparse backend, one step each.

``train_step.py`` gives the step time and the peak; this breaks them down, to find what a NOSA step pays beyond the
dense one. Per mode and length (1b shape, the step of ``train_step.model_step``): GPU milliseconds by kernel over
one step (torch.profiler), the step's own time and peak, and the allocations live at the peak grouped by the
hf_nosa / transformers line that made them (the allocator's history, replayed as ``memory_census.py`` does). Then
one layer's sparse attention (forward + backward, iid queries) by kernel, for each shared / extras tile size of
``--tiles``.

    python -m benchmarks train breakdown --lengths 32768 --out docs/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_nosa  # noqa: E402,F401  (before memory_census: its batch_plan imports a submodule first)
from benchmarks.environment import environment  # noqa: E402
from benchmarks.memory_census import cuda_events, package_roots, peak_report, replay  # noqa: E402
from benchmarks.profiling import (  # noqa: E402
    gpu_idle_by_launch_site,
    gpu_ms_by_kernel,
    gpu_ms_by_site,
    gpu_stream_gaps,
)
from benchmarks.train_step import SHAPES, _inputs, _reset_peak, build  # noqa: E402
from hf_nosa import NosaConfig  # noqa: E402
from hf_nosa.attention import training  # noqa: E402
from hf_nosa.kernels.train.sparse_train_attention import sparse_train_attention  # noqa: E402
from hf_nosa.training.retrofit import load_recipe  # noqa: E402
from hf_nosa.attention.training import selected_blocks  # noqa: E402


def _table(times: dict[str, float], top: int) -> dict:
    """The ``top`` kernels by GPU time, and the total."""
    rows = sorted(times.items(), key=lambda kv: -kv[1])
    return dict(total_ms=sum(times.values()), kernels=[[name[:120], round(ms, 3)] for name, ms in rows[:top]])


def step_breakdown(mode: str, seq_len: int, args, shape, cfg, recipe) -> dict:
    device = torch.device("cuda")
    _reset_peak(device)
    model, optimizer = build(mode, shape, cfg, recipe, device, torch.bfloat16)
    ids = torch.randint(3, shape["vocab_size"], (1, seq_len), device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # kernel tuning, allocator warm-up
        step()
    torch.cuda.synchronize()
    _reset_peak(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    row = dict(kind="step_breakdown", mode=mode, seq_len=seq_len, step_times_s=times,
               peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30)
    row["gpu_ms"] = _table(gpu_ms_by_kernel(step), args.top)
    if args.sites:
        row["torch_ops_by_site"] = gpu_ms_by_site(step)[:args.sites]
    if args.gaps:
        row["compute_stream"] = gpu_stream_gaps(step, args.gaps)
        row["compute_stream"]["idle_by_launch_site"] = gpu_idle_by_launch_site(step, args.gaps)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=args.max_entries)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    events = cuda_events(trace, "free_requested")
    peak, _ = replay(events, baseline)
    report = peak_report(peak, 1, package_roots(), args.top, events)
    report.pop("traced_live_mib_per_sequence", None)
    row.update(memory_baseline_gib=baseline / 2**30, memory_peak=report, trace_entries=len(trace))
    del model, optimizer
    _reset_peak(device)
    return row


def attention_breakdown(seq_len: int, args, shape, cfg) -> list[dict]:
    """One layer's sparse attention by kernel per (shared tile, extras tile) rows, and dense sdpa beside it."""
    device = torch.device("cuda")
    H, Hk, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    scale = D**-0.5
    g = torch.Generator(device=device).manual_seed(0)
    q = _inputs("iid", H, seq_len, D, device, torch.bfloat16, g).requires_grad_()
    k = _inputs("iid", Hk, seq_len, D, device, torch.bfloat16, g).requires_grad_()
    v = torch.randn(1, Hk, seq_len, D, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    bias = (0.1 * torch.randn(1, Hk, seq_len, device=device, generator=g)).requires_grad_()
    grad = torch.randn(1, H, seq_len, D, device=device, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        bitmap = selected_blocks(q, k, bias.detach(), cfg, scale)
    rows = []
    runs = [("dense", None, lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=True).backward(grad))]
    for spec in args.tiles.split(","):
        tile, extra_tile = (int(x) for x in spec.split("/"))
        runs.append((f"sparse {tile}/{extra_tile}", (tile, extra_tile), lambda tile=tile, extra_tile=extra_tile:
                     sparse_train_attention(q, k, v, bias, bitmap, scale, block_size=cfg.block_size, tile=tile,
                                            extra_tile=extra_tile).backward(grad)))
    for name, tiles, fn in runs:
        try:
            fn()  # tuning
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                fn()
            torch.cuda.synchronize()
            row = dict(kind="attention_breakdown", run=name, seq_len=seq_len,
                       fwd_bwd_s=(time.perf_counter() - t0) / args.repeats, gpu_ms=_table(gpu_ms_by_kernel(fn), 20))
        except Exception as error:  # a tile size the kernels cannot take is a result too
            row = dict(kind="attention_breakdown", run=name, seq_len=seq_len, error=f"{type(error).__name__}: "
                       f"{error}"[:400])
        q.grad = k.grad = v.grad = bias.grad = None
        rows.append(row)
        print(json.dumps(dict(run=name, fwd_bwd_s=row.get("fwd_bwd_s"), error=row.get("error"))), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for train_step_breakdown.json")
    parser.add_argument("--lengths", default="32768", help="comma-separated sequence lengths (default 32768)")
    parser.add_argument("--modes", default="dense,nosa", help="comma-separated among dense, nosa")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps before the profiled one")
    parser.add_argument("--top", type=int, default=30, help="kernels and allocation sites reported")
    parser.add_argument("--max-entries", type=int, default=2_000_000, help="allocator history kept")
    parser.add_argument("--tiles", default="128/16,64/16,128/32",
                        help="shared/extras tile rows of the one-layer runs ('' for none)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gaps", type=int, default=0,
                        help="also profile one step's device timeline: the compute stream's idle time by gap length "
                             "and this many longest gaps with the kernels around them, then (profiled again with "
                             "Python stacks) the idle time before each kernel by the function that launched it, this "
                             "many functions (0: none)")
    parser.add_argument("--sites", type=int, default=0,
                        help="also profile one step with Python stacks and report this many (torch op, calling "
                             "function) pairs by GPU time (0: none)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("train_step_breakdown.py profiles CUDA kernels: it needs a GPU")
    shape, recipe_name = SHAPES["1b"]
    recipe = load_recipe(recipe_name)
    cfg = NosaConfig.from_dict(recipe["nosa"])
    training.CUDA_BACKEND = "sparse"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "train_step_breakdown.json")
    report = dict(environment(), shape="1b", recipe=recipe_name, nosa_config=cfg.to_dict(), results=[])
    for seq_len in (int(x) for x in args.lengths.split(",")):
        for mode in args.modes.split(","):
            row = step_breakdown(mode, seq_len, args, shape, cfg, recipe)
            report["results"].append(row)
            print(json.dumps(dict(mode=mode, seq_len=seq_len, step_times_s=row["step_times_s"],
                                  peak_memory_gb=row["peak_memory_gb"], gpu_total_ms=row["gpu_ms"]["total_ms"])),
                  flush=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
        if args.tiles:
            report["results"] += attention_breakdown(seq_len, args, shape, cfg)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
