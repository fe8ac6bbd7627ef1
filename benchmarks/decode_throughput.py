"""Decode throughput at long context under a device-memory cap: transformers' caches against NosaCache.

Random-weight Llama shapes (1b: 16 layers, 32 heads, 8 KV heads x 64; 8b: 32 layers, 32 heads, 8 KV heads x 128),
contexts 16K / 32K / 64K, the device capped with ``torch.cuda.set_per_process_memory_fraction`` (24 GB for 1b,
48 GB for 8b) to emulate the cards people run long contexts on. Methods:

- ``dynamic``: transformers' default DynamicCache, eager decode loop, the faster of sdpa and eager attention;
- ``static_compile``: StaticCache + ``torch.compile(mode="reduce-overhead")``, the fastest stock path;
- ``offloaded``: ``DynamicCache(offloading=True)``;
- ``nosa``: NosaCache on the Triton path, eviction heads with random nonzero A, decode step replayed from a CUDA
  graph (``hf_nosa.modeling.cuda_graph``);
- ``nosa_fp8``: ``nosa`` with ``host_dtype="float8_e4m3fn"`` (K/V blocks in the host store as fp8 with one scale
  per block and KV head, dequantized into the slot pool by the fetch kernel), first at ``nosa``'s batch of the same
  run (``speedup_vs_bf16_same_batch``; the batch nosa's plan gives where nosa has no row), then at its own largest
  batch (``vs_bf16_largest``: batch and tok/s over nosa's);
- ``nosa_int8``: the same with ``host_dtype="int8"``;
- ``query_only``: the same engine with a query-aware-only selector (InfLLMv2-style baseline).

Each method runs at the largest batch that fits the device cap and the host budget (``batch_plan.py`` plans it); the
row says which bound it (the offloaded cache moves its whole KV every step, so its tok/s is flat in the batch: its
batch is bounded by ``--offload-step-gb`` moved per step). The host budget, one for every row, is ``HOST_SHARE`` of
the host memory available when the run starts (or ``--host-gb``); NOSA's host bytes are ``HostStore.planned_bytes``,
what NosaCache's pinned-memory check counts. A row that runs out of memory anyway (that check's MemoryError, a
device OOM) is tried at 15% fewer sequences, each failed try in ``stepped_down``. Caches are filled directly with
random keys and values (no prefill is timed). Beside each row: tok/s, ms per step, for NOSA the per-step GPU time of
selection / fetch / attention (torch.profiler over graph replays; before d31d849 the "eager" steps it profiled
went through the model's own decode graph too) and the rest, ``eager_ms_per_step`` (the stock forward, kernels
launched one by one), and the roofline floor: HBM bytes over
the measured HBM bandwidth plus PCIe bytes over the measured pinned-copy rate. Results go to
DIR/decode_throughput.json after every row (``--resume`` skips rows already there) and a plot to
DIR/decode_throughput.png.

    python -m benchmarks decode --out DIR          # everything (~8 min on an H200)
    python -m benchmarks decode --quick --out DIR  # 32K and 64K, fewer steps
    python -m benchmarks decode --smoke            # tiny sizes on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import batch_plan  # noqa: E402
from benchmarks.batch_plan import (  # noqa: E402  (SHAPES, CAP_GB, HOST_SHARE: also imported from here by others)
    CAP_GB, ENGINE, GB, HOST_DTYPE, HOST_SHARE, METHODS, QUANTIZED, SHAPES, free, host_budget, method_rows,
    pick_batch, total_steps,
)
from benchmarks.environment import environment  # noqa: E402
from benchmarks.harness import cap_device, pyplot, save_figure, write_json  # noqa: E402
from benchmarks.profiling import gpu_ms_by_kernel  # noqa: E402
from hf_nosa import NosaCache, NosaConfig, to_nosa  # noqa: E402
from hf_nosa.eval.baselines import QueryOnlySelector  # noqa: E402
from hf_nosa.cache.host_store import HostStore  # noqa: E402
from hf_nosa.kernels.decode.block_scores import block_select  # noqa: E402
from hf_nosa.cache.decode_parts import decode_parts, stagger_fetches  # noqa: E402
from hf_nosa.modeling.cuda_graph import DecodeGraph, stock_forward  # noqa: E402
from hf_nosa.kernels.prefill.host_write import host_write  # noqa: E402
from hf_nosa.modeling import eviction_heads, randomize_eviction_heads  # noqa: E402
from hf_nosa.rules.selection import compress_keys, num_windows  # noqa: E402

# K (or V) bytes of one host-store chunk, at most: the pinned allocator rounds sizes up to a power of two, so
# chunks just under 256 MB waste little, and torch's pinned pool can serve a later row's chunks from them.
HOST_CHUNK_BYTES = 256 << 20


# ----- the query-only baseline on the NOSA engine -----


def query_only_selector():
    """InfLLMv2-style selection (sink + local window + query-aware top blocks, no eviction head) on the device:
    ``hf_nosa.eval.baselines.QueryOnlySelector`` with its select run through the block_select kernel (the NOSA rule with
    the whole budget given to the query-aware part)."""

    class KernelQueryOnlySelector(QueryOnlySelector):
        name = "query_only"

        def observe(self, layer, keys, bias, start):
            pass

        def select(self, layer, query, t, scale):
            cfg = layer.cfg
            cfg = cfg.replace(query_tokens=cfg.budget_tokens - cfg.sink_tokens - cfg.local_tokens)
            return block_select(query, layer.compressed.keys, layer.compressed.bias, layer.step, cfg, scale)

    return KernelQueryOnlySelector()


# ----- models and caches -----


def build_model(shape: str, device, dtype):
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=1 << 18)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def nosa_config(smoke: bool) -> NosaConfig:
    if smoke:
        return NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                          compress_kernel=8, compress_stride=4, prefill="dense")
    return NosaConfig(prefill="dense")  # block 64, budget 4096 (query 1024, sink 64, local 1024), windows 32/16


def random_kv(cfg, batch, n, device, dtype, gen):
    shape = (batch, cfg.num_key_value_heads, n, cfg.head_dim)
    return (torch.randn(shape, generator=gen, device=device, dtype=dtype),
            torch.randn(shape, generator=gen, device=device, dtype=dtype))


def fill_transformers(model, cache, batch, context, device, dtype):
    cfg = model.config
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in range(cfg.num_hidden_layers):
        k, v = random_kv(cfg, batch, context, device, dtype, gen)
        cache.update(k, v, layer)
        del k, v
    return cache


def fill_nosa(model, cache: NosaCache, batch, context, total_steps, device, dtype, piece=1024):
    """Write ``context`` random tokens straight into every layer's host store, compressed keys, ring and tail
    slot (what a dense prefill leaves), with eviction scores from the model's own (random) eviction heads."""
    cfg, ncfg = model.config, cache.nosa_config
    heads = eviction_heads(model)
    gen = torch.Generator(device=device).manual_seed(0)
    ker, stride = ncfg.compress_kernel, ncfg.compress_stride
    overlap = ker - stride
    for i, layer in enumerate(cache.layers):
        like = torch.empty(batch, cfg.num_key_value_heads, 1, cfg.head_dim, device=device, dtype=dtype)
        layer.lazy_initialization(like, like)
        layer.compressed.reserve(num_windows(context + total_steps, ncfg))
        prev_k = prev_b = None
        for start in range(0, context, piece):
            n = min(piece, context - start)
            k, v = random_kv(cfg, batch, n, device, dtype, gen)
            b = heads[i](v.transpose(1, 2).flatten(2))  # [B, Hk, n] fp32
            host_write(layer.host, start, k, v, b)  # the kernel (UVA on CUDA), which also quantizes an fp8 store
            span_k = k if prev_k is None else torch.cat([prev_k, k], 2)
            span_b = b if prev_b is None else torch.cat([prev_b, b], 2)
            first = (start - (span_k.shape[2] - n)) // stride  # window index of the span's first token
            w = num_windows(span_k.shape[2], ncfg)
            layer.compressed.keys[:, :, first : first + w] = compress_keys(span_k, ncfg)
            layer.compressed.bias[:, :, first : first + w] = compress_keys(span_b, ncfg)
            prev_k, prev_b = k[:, :, n - overlap :], b[:, :, n - overlap :]
        layer.compressed.n = num_windows(context, ncfg)
        recent = torch.arange(context - ker, context, device=device)
        layer.compressed.ring_k[:, :, recent % ker] = k[:, :, -ker:]
        layer.compressed.ring_b[:, :, recent % ker] = b[:, :, -ker:]
        layer.seen = context
        layer._reset_slots(k, v, b)  # the partly written last block becomes the tail (keys end at `context`)
    return cache


# ----- measuring -----


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_bandwidths(device) -> dict:
    """HBM (device copy, read + write) and PCIe (pinned host->device copy) rates of this machine, now."""
    if device.type != "cuda":
        return dict(hbm_GBps=float("nan"), pcie_GBps=float("nan"))
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    rates = {}
    for name, fn, moved in (("hbm_GBps", lambda: b.copy_(a), 2 * n), ("pcie_GBps", lambda: b.copy_(host, non_blocking=True), n)):
        fn()
        sync(device)
        start = time.perf_counter()
        for _ in range(5):
            fn()
        sync(device)
        rates[name] = 5 * moved / (time.perf_counter() - start) / GB
    del a, b, host
    return rates


PHASES = {"_window_logits_kernel": "selection", "_select_kernel": "selection", "_fetch_step_kernel": "fetch",
          "_fetch_copy_kernel": "fetch",
          "_decode_attention_kernel": "attention", "_combine_splits_kernel": "attention"}


def kernel_breakdown(step_fn, steps) -> dict:
    """GPU ms per step of each NOSA phase and of all kernels, from torch.profiler over ``steps`` calls of
    ``step_fn`` (graph replays record their kernels too). Kernels that overlap (decode parts on their own streams)
    are each counted whole, so ``gpu_total`` may exceed the step's wall time."""

    def run():
        for _ in range(steps):
            step_fn()

    totals = defaultdict(float)
    for kernel, ms in gpu_ms_by_kernel(run).items():
        phase = next((p for name, p in PHASES.items() if name in kernel), None)
        if phase:
            totals[phase] += ms
        totals["gpu_total"] += ms
    return {k: totals[k] / steps for k in ("selection", "fetch", "attention", "gpu_total")}


@torch.no_grad()
def run_row(args, model, shape, method, context, batch, device, dtype, ncfg, bw, attn=None):
    """Fill a cache, decode ``args.steps`` timed tokens after warm-up; return the row."""
    cfg = model.config
    steps_cached = total_steps(args, method)
    compiled = None
    if method in ("dynamic", "offloaded"):
        model.config._attn_implementation = attn or "sdpa"
        cache = fill_transformers(model, DynamicCache(config=cfg, offloading=method == "offloaded"), batch, context, device, dtype)
    elif method == "static_compile":
        model.config._attn_implementation = "sdpa"
        cache = fill_transformers(model, StaticCache(config=cfg, max_cache_len=context + steps_cached), batch, context, device, dtype)
        torch._dynamo.reset()  # each row compiles afresh: CUDA-graph trees left by an earlier row's shapes can assert
        compiled = torch.compile(model.__call__, mode="reduce-overhead", fullgraph=False, dynamic=None)
    else:
        model.config._attn_implementation = "sdpa"
        selector = query_only_selector() if method == "query_only" else None
        if device.type == "cuda":
            HostStore.chunk_tokens = max(ncfg.block_size, HOST_CHUNK_BYTES // (batch * cfg.num_key_value_heads * cfg.head_dim * 2))
        cache_cfg = dataclasses.replace(ncfg, host_dtype=HOST_DTYPE.get(method, ncfg.host_dtype))
        cache = NosaCache(cfg, cache_cfg, selector=selector, max_cache_len=context + steps_cached)
        cache = fill_nosa(model, cache, batch, context, steps_cached, device, dtype)
    sync(device)

    token = torch.randint(3, cfg.vocab_size, (batch, 1), device=device)
    t0 = context
    graph = DecodeGraph(model, cache) if method in ENGINE and device.type == "cuda" else None

    def step(i, eager=False):
        nonlocal token
        pos = torch.full((batch, 1), t0 + i, device=device, dtype=torch.long)
        if graph is not None and not eager:
            logits = graph(token, pos)
        else:
            fn = compiled or model
            # A NOSA model's own forward replays a graph of its decode step (modeling.chunked); eager means the
            # stock forward, the step's kernels launched one by one.
            with stock_forward() if eager else contextlib.nullcontext():
                logits = fn(input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)

    i = 0
    start = time.perf_counter()
    # A DecodeGraph runs its first step eagerly (compiling) and captures on the second: both belong to the warmup.
    for _ in range(max(args.warmup, 2) if graph is not None else args.warmup):
        step(i)
        i += 1
    sync(device)
    warmup_s = time.perf_counter() - start
    row = dict(shape=shape, method=method, context=context, batch=batch)
    if method in ENGINE:
        before = cache.stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(i)
        i += 1
    sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    row.update(tok_per_s=batch / seconds, ms_per_step=1000 * seconds, warmup_s=warmup_s, steps=args.steps)
    if attn:
        row["attn"] = attn
    if compiled is not None:
        row["compile"] = "torch.compile(model.__call__, mode='reduce-overhead', dynamic=None); warm-up includes compile"

    # roofline floor
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    L, Hk, D, H = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    kv_read = L * batch * Hk * (context + i) * D * 2 * 2
    pcie = 0.0
    if method in ENGINE:
        after = cache.stats()
        loaded = (after["bytes_to_device"] - before["bytes_to_device"]) / args.steps
        token_write = L * batch * Hk * (2 * D * 2 + 4)  # the new token goes to the store (its tail, when fp8)
        S, P = ncfg.budget_blocks + 1, ncfg.block_size
        n_win = num_windows(context + i, ncfg)
        hbm = weights + L * batch * Hk * (S * P * (2 * D * 2 + 4) + n_win * (D * 2 + 4) + 2 * (H // Hk) * n_win * 4)
        pcie = loaded + token_write
        row.update(
            locality=(after["locality"] if after["decode_steps"] else float("nan")),
            blocks_per_step=(after["blocks_loaded"] - before["blocks_loaded"]) / args.steps,
            pcie_MB_per_step=pcie / 1e6, device_kv_GB=after["device_kv_bytes"] / GB, host_GB=after["host_bytes"] / GB,
            selector=("hf_nosa.eval.baselines.QueryOnlySelector + block_select kernel" if method == "query_only" else "nosa"),
        )
        if graph is not None:
            row.update(graph_captures=graph.captures, graph_replays=graph.replays,
                       decode_parts=decode_parts(cache, batch), decode_parts_stagger=stagger_fetches(),
                       recaptures=graph.recaptures)
            sync(device)
            start = time.perf_counter()
            for _ in range(3):  # what the CUDA graph gives: the same step without it
                step(i, eager=True)
                i += 1
            sync(device)
            row["eager_ms_per_step"] = 1000 * (time.perf_counter() - start) / 3
            try:
                row["breakdown_ms"] = kernel_breakdown(lambda: step(i), 2)  # graph replays, as timed
                parts = sum(row["breakdown_ms"][k] for k in ("selection", "fetch", "attention"))
                row["breakdown_ms"]["rest"] = row["ms_per_step"] - parts
            except Exception as error:  # the profiler is a measurement aid; its failure must not lose the row
                row["breakdown_ms"] = f"unavailable: {type(error).__name__}: {error}"[:300]
    else:
        hbm = weights + kv_read
        if method == "offloaded":
            pcie = 2 * kv_read
    row["hbm_MB_per_step"] = hbm / 1e6
    if bw["hbm_GBps"] == bw["hbm_GBps"]:  # measured (not NaN)
        hbm_ms, pcie_ms = 1000 * hbm / (bw["hbm_GBps"] * GB), 1000 * pcie / (bw["pcie_GBps"] * GB)
        row.update(floor_ms=hbm_ms + pcie_ms, floor_overlapped_ms=max(hbm_ms, pcie_ms),
                   x_floor=row["ms_per_step"] / (hbm_ms + pcie_ms))
    if device.type == "cuda":
        row["device_peak_GB"] = torch.cuda.max_memory_allocated() / GB
    del cache, compiled, graph
    return row


def attempt(args, model, shape, method, context, batch, device, dtype, ncfg, bw, attn=None):
    """run_row at ``batch``, again at 15% fewer sequences while it runs out of memory
    (``batch_plan.run_stepping_down``)."""

    def run(b):
        return run_row(args, model, shape, method, context, b, device, dtype, ncfg, bw, attn)

    return batch_plan.run_stepping_down(run, args, shape, method, context, batch, device, dtype, ncfg)



def save(result, out):
    if out:
        write_json(os.path.join(out, "decode_throughput.json"), result, indent=2)


def plot(result, out):
    plt = pyplot()
    shapes = sorted({r["shape"] for r in result["rows"] if "tok_per_s" in r})
    if plt is None or not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for method, same in ((m, same) for m in METHODS for same in (False, True)):  # same: at nosa's batch
            rows = sorted((r for r in result["rows"] if r["shape"] == shape and r["method"] == method and "tok_per_s" in r
                           and (r.get("at_nosa_batch", False) if same else r.get("own_plan", True))),
                          key=lambda r: r["context"])
            if rows:
                ax.plot([r["context"] / 1024 for r in rows], [r["tok_per_s"] for r in rows], marker="o",
                        linestyle="--" if same else "-", label=method + (" at nosa's batch" if same else ""))
                for r in rows:
                    ax.annotate(f"b{r['batch']}", (r["context"] / 1024, r["tok_per_s"]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("decode tok/s (whole batch)")
        cap = CAP_GB.get(shape)
        ax.set_title(f"{shape} shape" + (f", device capped at {cap} GB" if cap else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(out, "decode_throughput.png"), dpi=120)


def merge(paths, out):
    """Rows of several runs (e.g. one per shape, run in separate sessions) in one result file and plot."""
    result = None
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        if result is None:
            result = dict(part, rows=[], merged_from=[])
        keys = {(r["shape"], r["method"], r["context"]) for r in part["rows"]}
        result["rows"] = [r for r in result["rows"] if (r["shape"], r["method"], r["context"]) not in keys] + part["rows"]
        result["merged_from"].append(dict(command=part.get("command"), date=part.get("date"), gpu=part.get("gpu"),
                                          measured=part.get("measured")))
    save(result, out)
    if out:
        plot(result, out)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for decode_throughput.json / .png")
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--contexts", default="16384,32768,65536")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-gb", type=float, default=None,
                        help=f"host memory (GB) the host-side caches may use (default: {HOST_SHARE * 100:.0f}%% of "
                        "what is available when the run starts)")
    parser.add_argument("--offload-step-gb", type=float, default=6.0,
                        help="bound the offloaded cache's batch so a step moves at most this much")
    parser.add_argument("--quick", action="store_true", help="32K and 64K only, sdpa only, 8 steps")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in DIR and skip them")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (Triton interpreter for NOSA)")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="no run: merge the rows of these result files into DIR (JSON and plot)")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)

    smoke = args.smoke or not torch.cuda.is_available()
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("HF_NOSA_KERNELS", "triton")
        args.shapes, args.contexts, args.steps, args.warmup = "smoke", "256", 2, 1
    if args.quick:
        args.contexts, args.steps = "32768,65536", 8
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    ncfg = nosa_config(smoke)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods has unknown {unknown}; allowed: {METHODS}")
    methods = sorted(set(methods), key=METHODS.index)  # nosa before the quantized stores that run at its batch

    path = os.path.join(args.out, "decode_throughput.json") if args.out else None
    result = dict(environment(), nosa_config=ncfg.to_dict(), rows=[])
    if args.resume and path and os.path.exists(path):
        with open(path) as f:
            result["rows"] = [r for r in json.load(f)["rows"] if "error" not in r]
    done = {(r["shape"], r["method"], r["context"]) for r in result["rows"]}
    bw = measure_bandwidths(device)
    result["measured"] = bw
    free(device, host_need=1 << 62)  # the bandwidth test's pinned buffer goes back to the OS before counting
    budget, source = host_budget(args, smoke)
    result.update(host_budget_GB=budget / GB, host_budget=source)
    print("measured", bw, "; host budget", source, flush=True)

    def emit(row):
        result["rows"].append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        save(result, args.out)

    for shape in args.shapes.split(","):
        cap = CAP_GB[shape] * GB if CAP_GB[shape] else float("inf")
        if device.type == "cuda":
            cap_device(cap / GB)
        model = build_model(shape, device, dtype)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        converted = False
        for method in methods:
            if method in ("static_compile", "offloaded") and device.type != "cuda":
                continue  # needs CUDA (compile with CUDA graphs, offload streams)
            if method in ENGINE and not converted:
                to_nosa(model, ncfg)
                randomize_eviction_heads(model, scale=0.1, generator=torch.Generator().manual_seed(0))
                model.to(device=device, dtype=dtype)
                converted = True
            for context in map(int, args.contexts.split(",")):
                if (shape, method, context) in done:
                    continue
                plan = (lambda m, c=context: (2, "smoke", {}) if smoke else pick_batch(
                    m, shape, c, total_steps(args, m), ncfg, cap, budget, weights, args.offload_step_gb * GB))
                run = (lambda m, b, attn=None, c=context, model=model:
                       attempt(args, model, shape, m, c, b, device, dtype, ncfg, bw, attn))
                method_rows(args, shape, method, context, result["rows"], plan, run, emit)
        del model
        free(device)
    keys = ("shape", "method", "context", "batch", "tok_per_s", "speedup_vs_bf16_same_batch", "vs_bf16_largest")
    for r in (r for r in result["rows"] if r["method"] in QUANTIZED and "tok_per_s" in r):  # a summary
        print("against nosa:", {k: round(r[k], 2) if isinstance(r[k], float) else r[k] for k in keys if k in r},
              flush=True)
    if args.out:
        plot(result, args.out)
    return result


if __name__ == "__main__":
    main()
