"""Batch planning for the decode benchmarks: how many sequences a row runs at, and what happens when that is wrong.

It decides (1) each method's largest batch under the device cap (weights and ``MARGIN`` aside), the host budget
and, for the offloaded cache, the bytes a step may move (``pick_batch``, with which bound set it); (2) the host
budget itself, ``HOST_SHARE`` of the host memory available when the run starts, one for every row, with NOSA's
host bytes counted by ``HostStore.planned_bytes`` so that a planned batch passes NosaCache's pinned-memory check;
(3) when to empty torch's pinned pool (``free``: that check does not count the pool's blocks); (4) the retry of a
row that runs out of memory anyway at 15% fewer sequences (``attempt``), since the plan is an estimate; (5) the
batches of the quantized host stores (nosa_fp8, nosa_int8): first nosa's, so their tok/s compares with nosa's at
the same batch, then their own plan's (``method_rows``). The shapes, device caps and method table live here
because every bound is computed from them; decode_throughput.py, generate.py and prefill*.py import them from
decode_throughput.py, which re-exports them.
"""

from __future__ import annotations

import gc
import traceback

import torch

from hf_nosa.cache.host_store import HostStore, available_host_memory
from hf_nosa.cache.pinned import release_pinned_memory
from hf_nosa.kernels.decode.block_scores import window_capacity_for
from hf_nosa.rules.selection import num_windows

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
MARGIN = 1.5 * GB  # device memory kept free for activations, workspaces, graph pools
# Of the host memory available (``available_host_memory``) the host stores may pin: the rest is the OS's and the
# slack of torch's pinned pool (power-of-two blocks). generate.py plans with the same share.
HOST_SHARE = 0.7


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


# ----- running at the planned batch -----


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
            release_pinned_memory()  # and hf_nosa's own pool of host-store buffers


def out_of_memory(error: BaseException) -> bool:
    """The host check's MemoryError, a device OOM, or a failed pinned allocation (CUDA's "out of memory")."""
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def step_down(batch: int) -> int:
    return min(batch - 1, batch * 17 // 20)  # 15% fewer sequences, at least one


def run_stepping_down(run, args, shape, method, context, batch, device, dtype, ncfg):
    """``run(batch)`` (decode_throughput's run_row at that batch); out of memory (``out_of_memory``), again at 15%
    fewer sequences: each failed try is in the row's ``stepped_down`` (batch and error). Any other error ends the
    row with ``error``."""
    tries = []
    while batch >= 1:
        host_need = batch * bytes_per_seq(method, shape, context, total_steps(args, method), ncfg, dtype)["host"]
        free(device, host_need if method in ENGINE else 0)
        available = available_host_memory()
        try:
            row = run(batch)
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
