"""The decoder layer's fused kernels (RMSNorm, rotary, SiLU product) against the stock torch ops they replace.

For each op at the 1b shape's sizes (hidden 2048, MLP 8192, 32 query / 8 KV heads of 64; Qwen3's per-head norm at
32 heads of 128), at a decode step (``--decode-rows`` sequences, one token) and a prefill chunk (batch 1,
``--chunk`` tokens):

- ``graph_us``: GPU time per call, from a CUDA graph of ``--calls`` calls replayed (what the decode graph pays);
- ``eager_us``: wall time per call of ``--calls`` eager calls with one synchronisation at the end (what a batch-1
  prefill pays: the host launching, when the GPU work is small);
- ``launches``: kernels per call in the graph; ``bitwise`` and ``max_abs_diff`` of the fused result against the
  stock one on the same inputs.

The stock side is the kernels' torch references (transformers' own lines, checked against transformers' modules in
``tests/kernels/``). Needs CUDA.

    python -m benchmarks decode layers --out DIR
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.harness import RESULTS  # noqa: E402

norm = importlib.import_module("hf_nosa.kernels.layers.rms_norm")
rotary = importlib.import_module("hf_nosa.kernels.layers.rotary")
silu = importlib.import_module("hf_nosa.kernels.layers.silu_mul")


def cases(rows: int, tokens: int, dtype: torch.dtype):
    """(name, stock fn, fused fn, args) at ``rows`` sequences of ``tokens`` tokens."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    hidden, w = r(rows, tokens, 2048), 1 + 0.1 * r(2048)
    heads, hw = r(rows, tokens, 32, 128), 1 + 0.1 * r(128)
    q, k = r(rows, tokens, 32, 64).transpose(1, 2), r(rows, tokens, 8, 64).transpose(1, 2)
    cos, sin = r(rows, tokens, 64), r(rows, tokens, 64)
    gate, up = r(rows, tokens, 8192), r(rows, tokens, 8192)
    return [
        ("rms_norm", norm.rms_norm_ref, norm.rms_norm, (hidden, w, 1e-6)),
        ("rms_norm_per_head", norm.rms_norm_ref, norm.rms_norm, (heads, hw, 1e-6)),
        ("rotary", rotary.apply_rotary_ref, rotary.apply_rotary, (q, k, cos, sin)),
        ("silu_mul", silu.silu_mul_ref, silu.silu_mul, (gate, up)),
    ]


def graph_us(fn, args, calls: int) -> tuple[float, int]:
    """GPU microseconds per call from a graph of ``calls`` calls, and the kernels one call launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    launches = None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
        launches = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # the profiler is optional here; the times stand without it
        pass
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * calls), launches


def eager_us(fn, args, calls: int) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def compare(a, b) -> tuple[bool, float]:
    a, b = (a, ) if torch.is_tensor(a) else a, (b, ) if torch.is_tensor(b) else b
    bitwise = all(torch.equal(x, y) for x, y in zip(a, b))
    return bitwise, max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-rows", type=int, default=42)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--out", default=str(RESULTS), help="folder for layer_kernels.json (default: docs/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("layer_kernels.py measures CUDA kernels: no CUDA device here.")
    dtype = getattr(torch, args.dtype)
    rows = []
    with torch.no_grad():
        for phase, (B, T) in (("decode", (args.decode_rows, 1)), ("prefill_chunk", (1, args.chunk))):
            for name, stock, fused, inputs in cases(B, T, dtype):
                bitwise, diff = compare(fused(*inputs), stock(*inputs))
                row = dict(phase=phase, op=name, batch=B, tokens=T, dtype=args.dtype, bitwise=bitwise,
                           max_abs_diff=diff)
                for side, fn in (("stock", stock), ("fused", fused)):
                    row[f"{side}_graph_us"], row[f"{side}_launches"] = graph_us(fn, inputs, args.calls)
                    row[f"{side}_eager_us"] = eager_us(fn, inputs, args.calls)
                rows.append(row)
                print(json.dumps(row))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "layer_kernels.json")
    with open(path, "w") as f:
        json.dump(dict(environment=environment(), settings=vars(args) | dict(out="DIR"), rows=rows), f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
