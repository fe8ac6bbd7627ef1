"""Decode throughput at long context under a device-memory cap: transformers' caches against NosaCache.

Random-weight Llama shapes (1b: 16 layers, 32 heads, 8 KV heads x 64; 8b: 32 layers, 32 heads, 8 KV heads x 128),
contexts 16K / 32K / 64K, the device capped with ``torch.cuda.set_per_process_memory_fraction`` (24 GB for 1b,
48 GB for 8b) to emulate the cards people run long contexts on. Methods:

- ``dynamic``: transformers' default DynamicCache, eager decode loop, the faster of sdpa and eager attention;
- ``static_compile``: StaticCache + ``torch.compile(mode="reduce-overhead")``, the fastest stock path;
- ``offloaded``: ``DynamicCache(offloading=True)``;
- ``nosa``: NosaCache on the Triton path, eviction heads with random nonzero A, decode step replayed from a CUDA
  graph (``hf_nosa.kernels.cuda_graph``);
- ``nosa_fp8``: ``nosa`` with ``host_dtype="float8_e4m3fn"`` (K/V blocks in the host store as fp8 with one scale
  per block and KV head, dequantized into the slot pool by the fetch kernel), first at ``nosa``'s batch of the same
  run (``speedup_vs_bf16_same_batch``; the batch nosa's plan gives where nosa has no row), then at its own largest
  batch (``vs_bf16_largest``: batch and tok/s over nosa's);
- ``nosa_int8``: the same with ``host_dtype="int8"``;
- ``query_only``: the same engine with a query-aware-only selector (InfLLMv2-style baseline).

Each method runs at the largest batch that fits the device cap and the host budget; the row says which bound it
(the offloaded cache moves its whole KV every step, so its tok/s is flat in the batch: its batch is bounded by
``--offload-step-gb`` moved per step). The host budget, one for every row, is ``HOST_SHARE`` of the host memory
available when the run starts (or ``--host-gb``); NOSA's host bytes are ``HostStore.planned_bytes``, what
NosaCache's pinned-memory check counts. A row that runs out of memory anyway (that check's MemoryError, a device
OOM) is tried at 15% fewer sequences, each failed try in ``stepped_down``. Caches are filled directly with random
keys and values (no prefill is timed). Beside each row: tok/s, ms per step, for NOSA
the per-step GPU time of selection / fetch / attention (torch.profiler over eager steps) and the rest, and the
roofline floor: HBM bytes over the measured HBM bandwidth plus PCIe bytes over the measured pinned-copy rate.
Results go to DIR/decode_throughput.json after every row (``--resume`` skips rows already there) and a plot to
DIR/decode_throughput.png.

    PYTHONPATH=. python benchmarks/decode_throughput.py --out DIR            # everything (~8 min on an H200)
    PYTHONPATH=. python benchmarks/decode_throughput.py --quick --out DIR    # 32K and 64K, fewer steps
    python benchmarks/decode_throughput.py --smoke                           # tiny sizes on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from collections import defaultdict

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.profiling import gpu_ms_by_kernel  # noqa: E402
from hf_nosa import NosaCache, NosaConfig, to_nosa  # noqa: E402
from hf_nosa.baselines import QueryOnlySelector  # noqa: E402
from hf_nosa.host_store import HostStore, available_host_memory  # noqa: E402
from hf_nosa.kernels.block_scores import block_select, window_capacity_for  # noqa: E402
from hf_nosa.kernels.cuda_graph import DecodeGraph  # noqa: E402
from hf_nosa.kernels.host_write import host_write  # noqa: E402
from hf_nosa.modeling import eviction_heads, randomize_eviction_heads  # noqa: E402
from hf_nosa.selection import compress_keys, num_windows  # noqa: E402

GB = 1e9
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=97),
}
CAP_GB = {"1b": 24, "8b": 48, "smoke": None}
GiB = 1 << 30
METHODS = ("dynamic", "static_compile", "offloaded", "nosa", "nosa_fp8", "nosa_int8", "query_only")
ENGINE = ("nosa", "nosa_fp8", "nosa_int8", "query_only")  # the methods that run NosaCache's engine
HOST_DTYPE = {"nosa_fp8": "float8_e4m3fn", "nosa_int8": "int8"}
QUANTIZED = tuple(HOST_DTYPE)  # compared with nosa (the model-dtype store) at nosa's batch
# K (or V) bytes of one host-store chunk, at most: the pinned allocator rounds sizes up to a power of two, so
# chunks just under 256 MB waste little, and torch's pinned pool can serve a later row's chunks from them.
HOST_CHUNK_BYTES = 256 << 20
MARGIN = 1.5 * GB  # device memory kept free for activations, workspaces, graph pools
# Of the host memory available (``available_host_memory``) the host stores may pin: the rest is the OS's and the
# slack of torch's pinned pool (power-of-two blocks). generate.py plans with the same share.
HOST_SHARE = 0.7


# ----- the query-only baseline on the NOSA engine -----


def query_only_selector():
    """InfLLMv2-style selection (sink + local window + query-aware top blocks, no eviction head) on the device:
    ``hf_nosa.baselines.QueryOnlySelector`` with its select run through the block_select kernel (the NOSA rule with
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


# ----- batch sizes -----


def bytes_per_seq(method, shape, context, steps, ncfg, dtype=torch.bfloat16):
    s = SHAPES[shape]
    L, Hk, D, H = s["num_hidden_layers"], s["num_key_value_heads"], s["head_dim"], s["num_attention_heads"]
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    kv = L * Hk * (context + steps) * D * 2 * dtype_bytes
    if method in ("dynamic", "static_compile"):
        return dict(device=kv * (1 + 1 / L), host=0)  # DynamicCache.update copies one layer at a time
    if method == "offloaded":
        return dict(device=2 * kv / L, host=kv)
    P, S = ncfg.block_size, ncfg.budget_blocks + 1
    W = window_capacity_for(num_windows(context + steps, ncfg))
    slots = (S + 1) * P * (2 * D * dtype_bytes + 4)
    compressed = W * (D * dtype_bytes + 4) + ncfg.compress_kernel * (D * dtype_bytes + 4)
    scratch = (H // Hk) * W * 4 / L  # window logits: one buffer reused by every layer
    # What NosaCache's host-memory check counts for a cache of max_cache_len = context + steps (run_row's), so a
    # batch planned within the budget passes it: K, V (in the store's format, with a quantized store's block
    # scales and model-dtype tail block), scores, rounded up to whole blocks.
    host = L * HostStore.planned_bytes(1, Hk, D, dtype, P, HOST_DTYPE.get(method, ncfg.host_dtype), context + steps)
    return dict(device=L * Hk * (slots + compressed + scratch), host=host)


def pick_batch(method, shape, context, steps, ncfg, cap, host_bytes, weights, offload_step_bytes, dtype=torch.bfloat16):
    """The largest batch under the device cap (weights and MARGIN aside), the host budget and, for the offloaded
    cache, the bytes a step may move: (batch, the bound that sets it, every bound)."""
    need = bytes_per_seq(method, shape, context, steps, ncfg, dtype)
    bounds = {"device": int((cap - weights - MARGIN) // need["device"])}
    if need["host"]:
        bounds["host"] = int(host_bytes // need["host"])
    if method == "offloaded":  # every step moves the whole cache twice: flat tok/s in batch, so bound the time
        bounds["time"] = max(1, int(offload_step_bytes // (2 * need["host"])))
    bound = min(bounds, key=bounds.get)
    return max(1, bounds[bound]), bound, bounds


def total_steps(args, method) -> int:
    """Decode steps a row runs (timed, warm-up, eager and profiled ones): its cache holds context + this many."""
    return args.warmup + args.steps + (5 if method in ENGINE else 0) + 2


def host_budget(args, smoke: bool) -> tuple[float, str]:
    """Bytes the host stores of every row may plan on, and where the number comes from."""
    if args.host_gb is not None:
        return args.host_gb * GB, "--host-gb"
    available = available_host_memory()
    if available is None:
        if smoke:
            return float("inf"), "unbounded (smoke: batches are fixed)"
        raise ValueError("--host-gb: the available host memory cannot be read on this machine; give the budget in GB")
    return HOST_SHARE * available, f"{HOST_SHARE:.0%} of the {available / GiB:.1f} GiB available at the start"


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
          "_decode_attention_kernel": "attention", "_combine_splits_kernel": "attention"}


def kernel_breakdown(step_fn, steps) -> dict:
    """GPU ms per step of each NOSA phase and of all kernels, from torch.profiler over eager steps."""

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
            selector=("hf_nosa.baselines.QueryOnlySelector + block_select kernel" if method == "query_only" else "nosa"),
        )
        if graph is not None:
            row.update(graph_captures=graph.captures, graph_replays=graph.replays)
            sync(device)
            start = time.perf_counter()
            for _ in range(3):  # what the CUDA graph gives: the same step without it
                step(i, eager=True)
                i += 1
            sync(device)
            row["eager_ms_per_step"] = 1000 * (time.perf_counter() - start) / 3
            try:
                row["breakdown_ms"] = kernel_breakdown(lambda: step(i, eager=True), 2)
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


def free(device, host_need: int = 0):
    """Drop what the last row left. NosaCache's host check compares with the memory the OS can still hand out,
    which does not count the pinned blocks torch's pool keeps for reuse: the pool is emptied when the next row
    needs more than that (emptying it always would pin every row's store afresh)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if host_need > (available_host_memory() or 0):
            torch._C._host_emptyCache()


def out_of_memory(error: BaseException) -> bool:
    """The host check's MemoryError, a device OOM, or a failed pinned allocation (CUDA's "out of memory")."""
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def step_down(batch: int) -> int:
    return min(batch - 1, batch * 17 // 20)  # 15% fewer sequences, at least one


def attempt(args, model, shape, method, context, batch, device, dtype, ncfg, bw, attn=None):
    """run_row at ``batch``; out of memory (``out_of_memory``), again at 15% fewer sequences: each failed try is
    in the row's ``stepped_down`` (batch and error). Any other error ends the row with ``error``."""
    tries = []
    while batch >= 1:
        host_need = batch * bytes_per_seq(method, shape, context, total_steps(args, method), ncfg, dtype)["host"]
        free(device, host_need if method in ENGINE else 0)
        available = available_host_memory()
        try:
            row = run_row(args, model, shape, method, context, batch, device, dtype, ncfg, bw, attn)
        except Exception as error:  # keep the run going; the row records what failed
            if not out_of_memory(error):
                traceback.print_exc()
                return dict(shape=shape, method=method, context=context, batch=batch, stepped_down=tries,
                            error=f"{type(error).__name__}: {error}"[:500])
            tries.append(dict(batch=batch, error=f"{type(error).__name__}: {error}"[:400]))
        else:
            row["stepped_down"] = tries
            if available is not None:
                row["host_available_GB"] = available / GB  # before the row, after its free()
            return row
        # Out of the except block, so the failed try's frames (and the cache they hold) can go.
        print(f"{method} {shape} {context}: batch {batch} failed ({tries[-1]['error'][:160]}); "
              f"trying {step_down(batch)}", flush=True)
        batch = step_down(batch)
    return dict(shape=shape, method=method, context=context, batch=0, stepped_down=tries,
                error=f"out of memory at every batch down to 1 ({tries[-1]['error'][:200]})")


def nosa_rows(rows, shape, context) -> list[dict]:
    return [r for r in rows if (r["shape"], r["method"], r["context"]) == (shape, "nosa", context) and "tok_per_s" in r]


def compare_with_nosa(row, rows) -> None:
    """A quantized store's row against nosa's (the model-dtype store) in ``rows``: ``speedup_vs_bf16_same_batch``
    where nosa has a row at the same batch; for a row at its own plan's batch, ``vs_bf16_largest`` (batch and tok/s
    over those of nosa's row at nosa's plan)."""
    if "tok_per_s" not in row:
        return
    ref = nosa_rows(rows, row["shape"], row["context"])
    same = [r for r in ref if r["batch"] == row["batch"]]
    if same:
        row.update(bf16_tok_per_s_same_batch=same[-1]["tok_per_s"],
                   speedup_vs_bf16_same_batch=row["tok_per_s"] / same[-1]["tok_per_s"])
    if row.get("own_plan") and ref:
        row["vs_bf16_largest"] = dict(bf16_batch=ref[-1]["batch"], batch_ratio=row["batch"] / ref[-1]["batch"],
                                      tok_s_ratio=row["tok_per_s"] / ref[-1]["tok_per_s"])


def method_rows(args, shape, method, context, rows, plan, run, emit) -> None:
    """One method's rows at one context, each to ``emit`` as it comes; ``rows``: those already there, ``plan(method)``
    -> (batch, bound, bounds), ``run(method, batch, attn)`` -> row. A quantized store runs first at nosa's batch (its
    row's here, or nosa's plan's where it has none), then at its own plan's batch unless that is the same."""
    batch, bound, bounds = plan(method)
    common = dict(device_cap_GB=CAP_GB[shape])
    if method in QUANTIZED:
        ref = nosa_rows(rows, shape, context)
        ref_batch, source = (ref[-1]["batch"], "nosa's batch") if ref else (plan("nosa")[0], "nosa's plan")
        row = run(method, ref_batch)
        own = ref_batch == batch
        row.update(common, at_nosa_batch=True, own_plan=own, bound=f"{bound} (= {source})" if own else source,
                   batch_bounds=bounds if own else {}, planned_batch=ref_batch)
        compare_with_nosa(row, rows)
        emit(row)
        if own:
            return
    if method == "dynamic":
        candidates = [run(method, batch, attn) for attn in (("sdpa",) if args.quick else ("sdpa", "eager"))]
        ok = [r for r in candidates if "tok_per_s" in r]
        row = max(ok, key=lambda r: r["tok_per_s"]) if ok else candidates[0]
        row["tried"] = {r.get("attn", "?"): r.get("tok_per_s") for r in candidates}
    else:
        row = run(method, batch)
    row.update(common, bound=bound, batch_bounds=bounds, planned_batch=batch)
    if method in QUANTIZED:
        row.update(at_nosa_batch=False, own_plan=True)
        compare_with_nosa(row, rows)
    emit(row)


def save(result, out):
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "decode_throughput.json"), "w") as f:
            json.dump(result, f, indent=2)


def plot(result, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in result["rows"] if "tok_per_s" in r})
    if not shapes:
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
    fig.savefig(os.path.join(out, "decode_throughput.png"), dpi=120)


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
                        help=f"host memory (GB) the host-side caches may use (default: {HOST_SHARE:.0%} of what is "
                        "available when the run starts)")
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
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
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
