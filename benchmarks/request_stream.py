"""A stream of batch-1 requests of different lengths through ``generate``: stock static cache + compile against
``cache_implementation="nosa"``, wall time per call and whether a call of a new shape pays a warm-up.

Random-weight Llama of ``--shape`` (bf16, sdpa), the device capped as in ``generate.py`` (24 GB for "1b"). The
stream: ``--requests`` prompt lengths drawn uniformly from ``--min``-``--max`` tokens (``--seed``), ``--new-tokens``
greedy tokens each, one after the other. Each method runs a first request untimed (compilation, graph capture,
first pinning), then the stream twice: the first pass is the measurement, the second the repeat each call is held
against (a call slower than its repeat paid for something its shape brought: pinning, a recompile, a recapture).
Stock static runs with one ``max_cache_len`` for the whole stream (the longest request), so it never recompiles.

    python benchmarks/request_stream.py --shape 1b --out benchmarks/results/request_stream.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_throughput import CAP_GB, build_model  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402


def one_call(model, length, new_tokens, method, max_cache_len, seed) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    ids = ids.to("cuda")
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False)
    if method == "static":
        kwargs.update(cache_implementation="static", cache_config={"max_cache_len": max_cache_len})
    else:
        kwargs.update(cache_implementation="nosa")
    before = _counters(model)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    after = _counters(model)
    why = {k: after[k] - before[k] if isinstance(after[k], int) else after[k][len(before[k]):] for k in after}
    why["variant_keys"] = sorted(set(after["variant_keys"]) - set(before["variant_keys"]))
    WHY.append(why)
    return seconds


WHY: list[dict] = []  # per call: what it compiled, captured and pinned (the causes of a warm-up)


def _counters(model) -> dict:
    """Kernel variants compiled so far, decode graphs captured (and why recaptured), pinned host pool bytes."""
    from hf_nosa.modeling.cuda_graph import compiled_kernel_variants
    from hf_nosa.cache.workspace import workspace_of

    workspace = workspace_of(model)
    graph = workspace.decode_graph
    return dict(kernel_variants=compiled_kernel_variants(), graph_captures=graph.captures if graph else 0,
                recaptures=list(graph.recaptures) if graph else [], host_pool_bytes=workspace.host_bytes(),
                variant_keys=_variant_keys())


def _variant_keys() -> list[str]:
    """``kernel: specialization key`` of every Triton variant this package compiled so far (what a new length
    specialized on: an argument's divisibility by 16, its being 1, a constexpr), for the calls that compiled one."""
    keys = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("hf_nosa.kernels.") or module is None:
            continue
        for attr, value in vars(module).items():
            for cache in getattr(value, "device_caches", {}).values():
                try:
                    keys.extend(f"{name.rsplit('.', 1)[-1]}.{attr}: {key}" for key in cache[0])
                except (TypeError, IndexError):
                    pass
    return sorted(keys)


def run_stream(model, method, lengths, args) -> dict:
    max_cache_len = max(lengths) + args.new_tokens
    WHY.clear()
    first = one_call(model, lengths[0], args.new_tokens, method, max_cache_len, seed=0)
    passes = []
    for _ in range(2):
        passes.append([one_call(model, n, args.new_tokens, method, max_cache_len, seed=i + 1)
                       for i, n in enumerate(lengths[1:])])
        gc.collect()
    calls, repeats = passes
    ratios = [a / b for a, b in zip(calls, repeats)]
    row = dict(method=method, first_length=lengths[0], first_call_s=first, lengths=lengths[1:], calls_s=calls,
               repeats_s=repeats, total_s=sum(calls), repeat_total_s=sum(repeats), worst_call_over_repeat=max(ratios),
               call_over_repeat=ratios, first_call_why=WHY[0], calls_why=WHY[1:len(calls) + 1],
               repeats_why=WHY[len(calls) + 1:])
    print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", help="model shape of benchmarks/batch_plan.py (default: 1b)")
    parser.add_argument("--requests", type=int, default=10, help="requests in the stream, timed (default: 10)")
    parser.add_argument("--min", type=int, default=8192, help="shortest prompt (default: 8192)")
    parser.add_argument("--max", type=int, default=65536, help="longest prompt (default: 65536)")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per request (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="draws the lengths (default: 0)")
    parser.add_argument("--methods", nargs="+", default=["static", "nosa"], choices=["static", "nosa"])
    parser.add_argument("--cap-gb", type=float, default=None, help="device cap in GB (default: the shape's)")
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min, args.max) for _ in range(args.requests + 1)]  # the first: untimed
    cap = args.cap_gb or CAP_GB[args.shape]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1e9 / total))
    model = build_model(args.shape, "cuda", torch.bfloat16)
    result = dict(environment(), shape=args.shape, cap_gb=cap, new_tokens=args.new_tokens, rows=[])
    for method in args.methods:
        if method == "nosa":
            torch._dynamo.reset()  # the stock static run's compiled graphs and pools go first
            gc.collect()
            torch.cuda.empty_cache()
            to_nosa(model, NosaConfig())
            randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
        result["rows"].append(run_stream(model, method, lengths, args))
        rows = result["rows"]
        if len(rows) == 2:
            result["nosa_over_static_total"] = rows[1]["total_s"] / rows[0]["total_s"]
        if args.out:  # after every method: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
