"""Where generate's NOSA prefill spends its time: the GPU time of one ``model.generate`` prefill by kind of kernel,
against the wall time, and the host syncs on the way.

Issue 14's 64K delivered tok/s is set by the time to the first token at the largest batch (the decode is at its
engine's speed). This runs what ``benchmarks/generate.py`` runs for NOSA (1b shape, bf16, sdpa, 24 GB cap,
NosaConfig defaults, random nonzero eviction heads, random prompts), but stops after the first token and profiles
it (torch.profiler, CUDA activity only):

- ``wall_s``: the prefill's wall time unprofiled (second call: the first pins the host store and compiles);
- ``gpu_busy_s``: the union of kernel intervals on all streams; ``wall - busy`` is time the GPU waited on the host;
- ``by_kind``: summed kernel time per kind (GEMM, attention, fetch, host write/read, QUOKA scoring, copies, other
  elementwise, sort/top-k, reductions), with the top kernels of each;
- ``host_syncs``: the ``file:line`` places where a prefill at a small size synchronised with the host (torch's sync
  debug mode), with counts: a sync per layer and chunk serialises the host's launches with the GPU's work;
- ``wall_s_by_fetch_parts``: the prefill's wall time (twice each, before the profile) with a QUOKA chunk's fetch
  split into 1, 2, 4 parts of the batch (``HF_NOSA_PREFILL_FETCH_PARTS``; ``pool_attention``), each part's fetch
  overlapping the previous part's attention;
- ``host_profile``: where the host's time goes, for a prefill the GPU waits on (batch 1): cProfile of one prefill,
  self time by package (``hf_nosa``, ``transformers``, ``torch``, ``triton``, the C functions torch's ops are) and the
  functions with the most self and cumulative time (cProfile's own overhead inflates ``profiled_s``; compare
  shares, not seconds).

    python -m benchmarks prefill breakdown --context 65536 --batch 16 --out DIR
    python -m benchmarks prefill breakdown --smoke       # CPU: the bookkeeping only (no profile)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import re
import sys
import time
from collections import Counter, defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_throughput import CAP_GB, build_model  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.harness import cap_device, write_json  # noqa: E402
from benchmarks.profiling import busy_seconds  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402
from hf_nosa.attention.pool import PARTS_ENV_VAR  # noqa: E402

# First match wins: the order puts the specific names before the generic ones.
KINDS = [
    ("fetch", r"_fetch_step_kernel"),
    ("host_write", r"_host_write_kernel"),
    ("host_read", r"_host_read|read_span"),
    ("quoka_score", r"_quoka_(score|normaliser)_kernel"),
    ("attention", r"flash|fmha|sdpa|attention|cudnn"),
    ("gemm", r"gemm|nvjet|cutlass|sm\d+_xmma|cublas"),
    ("copy", r"[Cc]opy|CatArray|Memcpy|Memset|index_elementwise|gather|scatter|repeat"),
    ("sort_topk", r"[Ss]ort|topk|radix"),
    ("reduce", r"reduce_kernel|[Ss]oftmax|cumsum|scan"),
    ("elementwise", r"elementwise|vectorized|Functor|pow|exp|silu|neg|fill"),
]


def kind_of(name: str) -> str:
    """The kind of a kernel, from its name (``KINDS``), or "other"."""
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def summarize(kernels: list[tuple[str, float, float]], top: int = 4) -> dict:
    """``kernels``: ``(name, start_us, end_us)``; per kind the summed milliseconds, launches and top kernels."""
    by_kind: dict[str, dict] = defaultdict(lambda: dict(ms=0.0, launches=0, top=Counter()))
    for name, a, b in kernels:
        entry = by_kind[kind_of(name)]
        entry["ms"] += (b - a) / 1e3
        entry["launches"] += 1
        entry["top"][name[:110]] += (b - a) / 1e3
    out = {}
    for kind, entry in sorted(by_kind.items(), key=lambda kv: -kv[1]["ms"]):
        out[kind] = dict(ms=round(entry["ms"], 3), launches=entry["launches"],
                         top={k: round(v, 3) for k, v in entry["top"].most_common(top)})
    return out


def prefill(model, batch, context, seed=0):
    ids = torch.randint(3, model.config.vocab_size, (batch, context), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(seed))
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                   cache_implementation="nosa")
    torch.cuda.synchronize()


def package_of(filename: str, function: str) -> str:
    """The package a cProfile entry belongs to: ``hf_nosa``, ``transformers``, ``torch``, ``triton``, ``benchmarks``,
    ``builtin`` (C functions: torch's ops, tensor methods), else ``python`` (the standard library and the rest)."""
    if filename == "~":
        return "builtin"
    for package in ("hf_nosa", "transformers", "triton", "torch", "benchmarks"):
        if f"/{package}/" in filename.replace("\\", "/"):
            return package
    return "python"


def short_name(filename: str, line: int, function: str) -> str:
    """``package/file.py:line(function)`` (the path from the package on), or the C function's name."""
    if filename == "~":
        return function
    path = filename.replace("\\", "/")
    for package in ("hf_nosa", "transformers", "triton", "torch", "benchmarks"):
        at = path.rfind(f"/{package}/")
        if at >= 0:
            path = path[at + 1:]
            break
    return f"{path}:{line}({function})"


def summarize_profile(stats: pstats.Stats, top: int = 30) -> dict:
    """Self time by package and the ``top`` functions by self and by cumulative time (seconds, call counts)."""
    by_package: Counter = Counter()
    rows = []
    for (filename, line, function), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        by_package[package_of(filename, function)] += tottime
        rows.append((short_name(filename, line, function), ncalls, tottime, cumtime))
    total = sum(by_package.values())

    def listed(key):
        return [dict(function=name, calls=calls, self_s=round(self_s, 4), cumulative_s=round(cum_s, 4))
                for name, calls, self_s, cum_s in sorted(rows, key=key)[:top]]

    return dict(profiled_s=round(total, 4),
                self_s_by_package={k: round(v, 4) for k, v in by_package.most_common()},
                top_self=listed(lambda r: -r[2]), top_cumulative=listed(lambda r: -r[3]))


def host_profile(run, top: int = 30) -> dict:
    """cProfile of ``run()``, summarised by ``summarize_profile``."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    return summarize_profile(pstats.Stats(profiler), top)


def profiled_kernels(run) -> list[tuple[str, float, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    kernels = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us() > 0:
            kernels.append((event.name, event.time_range.start, event.time_range.end))
    return kernels


def host_syncs(model, batch, context) -> dict[str, int]:
    """``file:line`` of every host sync in one prefill (sync debug mode "warn"), with counts; after one prefill of
    the same shape, so that one-time set-up (allocation, compilation) is not counted."""
    from hf_nosa.modeling.cuda_graph import _noting_host_syncs

    prefill(model, batch, context, seed=1)
    with _noting_host_syncs() as places:
        prefill(model, batch, context, seed=1)
    return dict(Counter(places).most_common())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", choices=("1b", "8b"))
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prefill-chunk-size", type=int, default=None, help="default: NosaConfig's")
    parser.add_argument("--prefill-batch-tokens", type=int, default=None, help="default: NosaConfig's")
    parser.add_argument("--host-dtype", default=None, choices=("auto", "float8_e4m3fn", "int8"),
                        help="the host store's format (default: NosaConfig's, the model's dtype)")
    parser.add_argument("--sync-context", type=int, default=4096, help="prompt length of the host-sync pass")
    parser.add_argument("--fetch-parts", default="1,2,4",
                        help="also time the prefill with HF_NOSA_PREFILL_FETCH_PARTS at each of these (comma list)")
    parser.add_argument("--host-profile", action="store_true",
                        help="also cProfile one prefill (after the timed ones, before the kernel profile)")
    parser.add_argument("--out", default=None, help="folder for prefill_breakdown.json")
    parser.add_argument("--smoke", action="store_true", help="check the bookkeeping on the CPU and exit")
    args = parser.parse_args(argv)
    if args.smoke:
        kernels = [("_fetch_step_kernel", 0.0, 10.0), ("nvjet_sm90_tst", 5.0, 25.0), ("CatArrayBatchedCopy", 30.0, 31.0)]
        print(json.dumps(dict(busy_s=busy_seconds([k[1:] for k in kernels]), by_kind=summarize(kernels)), indent=1))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("prefill_breakdown.py needs CUDA (use --smoke on the CPU)")
    cap_device(CAP_GB[args.shape])
    model = build_model(args.shape, "cuda", torch.bfloat16)
    overrides = dict(prefill_chunk_size=args.prefill_chunk_size, prefill_batch_tokens=args.prefill_batch_tokens,
                     host_dtype=args.host_dtype)
    to_nosa(model, NosaConfig(**{k: v for k, v in overrides.items() if v is not None}))
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    result = dict(environment(), commit=os.environ.get("HF_NOSA_COMMIT"), shape=args.shape, context=args.context,
                  batch=args.batch, nosa_config=model.config.nosa)
    result["host_syncs"] = host_syncs(model, 2, args.sync_context)
    t0 = time.perf_counter()
    prefill(model, args.batch, args.context)  # pins the host store, compiles
    result["first_call_s"] = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    prefill(model, args.batch, args.context)
    result["wall_s"] = time.perf_counter() - t0
    # Before the profile (a profiled process launches slower afterwards: the same setting measured 15.4 s before
    # and 22.6 s after it), each setting twice, in one order and then the reverse, so that drift shows.
    result["wall_s_by_fetch_parts"] = {}
    default_parts = os.environ.get(PARTS_ENV_VAR)
    settings = [p for p in args.fetch_parts.split(",") if p]
    for parts in settings + settings[::-1]:
        os.environ[PARTS_ENV_VAR] = parts
        t0 = time.perf_counter()
        prefill(model, args.batch, args.context)
        result["wall_s_by_fetch_parts"].setdefault(parts, []).append(time.perf_counter() - t0)
    if default_parts is None:
        os.environ.pop(PARTS_ENV_VAR, None)
    else:
        os.environ[PARTS_ENV_VAR] = default_parts
    if args.host_profile:
        result["host_profile"] = host_profile(lambda: prefill(model, args.batch, args.context))
        shares = result["host_profile"]["self_s_by_package"]
        print("host self time by package:", {k: round(v, 2) for k, v in shares.items()})
        for row in result["host_profile"]["top_self"][:15]:
            print(f"  {row['self_s']:8.3f} s self {row['cumulative_s']:8.3f} s cum {row['calls']:8d}  {row['function']}")
    t0 = time.perf_counter()
    kernels = profiled_kernels(lambda: prefill(model, args.batch, args.context))
    result["profiled_wall_s"] = time.perf_counter() - t0
    result["gpu_busy_s"] = busy_seconds([k[1:] for k in kernels])
    result["kernel_sum_s"] = sum(b - a for _, a, b in kernels) / 1e6
    result["launches"] = len(kernels)
    result["by_kind"] = summarize(kernels)
    result["per_sequence_s"] = result["wall_s"] / args.batch
    print(json.dumps({k: v for k, v in result.items() if k != "by_kind"}, indent=1))
    for kind, entry in result["by_kind"].items():
        print(f"{kind:12s} {entry['ms']:10.1f} ms  {entry['launches']:8d} launches  "
              + "; ".join(f"{n[:50]} {ms:.0f}" for n, ms in list(entry["top"].items())[:2]))
    if args.out:
        write_json(os.path.join(args.out, "prefill_breakdown.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
