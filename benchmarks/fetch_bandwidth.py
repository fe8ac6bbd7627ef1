"""Block-fetch bandwidth: ``fetch_step`` moving random 64-token blocks against a pinned host->device copy.

``fetch_step`` is the decode path's one launch per layer: per (sequence, KV head) it diffs the selection against
the resident blocks and copies the missing K, V and b blocks straight out of the pinned host store (UVA). Each
iteration here selects K random blocks per (sequence, KV head) disjoint from the resident ones, so all K are
fetched; the same bytes are then moved by one ``copy_`` from a pinned buffer, in the same run. The target is
fetch >= 90% of the copy.

``--contention`` (CUDA) times the same fetches again while a side stream keeps the SMs busy, once with bf16 GEMMs
(compute) and once with device copies (HBM): the fetch reads host memory from SM threads (UVA), so work that
shares the SMs may slow it, which is what overlapping a decode step's fetch with its compute would meet.

    python -m benchmarks decode fetch --out DIR [--contention]
    python -m benchmarks decode fetch --smoke      # tiny sizes on CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from hf_nosa.cache.host_store import HostStore  # noqa: E402
from hf_nosa.kernels.decode.fetch import SlotPool, StepCounters, fetch_step  # noqa: E402

# batch, KV heads, head dim, blocks fetched per (sequence, head)
CONFIGS = [(32, 8, 128, 64), (64, 8, 64, 64), (8, 8, 128, 64), (4, 8, 128, 16), (128, 8, 64, 8)]
SMOKE_CONFIGS = [(2, 2, 64, 4)]


class Timer:
    """Seconds of device work between start() and stop() (CUDA events; wall clock on CPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b) / 1000
        return time.perf_counter() - self.t


def busy_side_stream(kind: str, seconds: float, device) -> torch.cuda.Stream:
    """A side stream queued with about ``seconds`` of ``kind`` work ("gemm": 4096^3 bf16 matmuls; "hbm": 1 GiB
    device copies), so that whatever the current stream runs next overlaps it."""
    side = torch.cuda.Stream(device)
    if kind == "gemm":
        a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
        op, each_s = (lambda: a @ a), 2 * 4096**3 / 500e12  # about 0.3 ms at 500 TFLOP/s
    else:
        x, y = torch.empty(1 << 30, dtype=torch.uint8, device=device), torch.empty(1 << 30, dtype=torch.uint8, device=device)
        op, each_s = (lambda: y.copy_(x)), 2 * (1 << 30) / 4e12  # about 0.5 ms at 4 TB/s
    torch.cuda.synchronize(device)
    with torch.cuda.stream(side):
        for _ in range(int(seconds / each_s) + 1):
            op()
    return side


def run_config(B, Hk, D, K, P, tokens, iters, warmup, device, dtype, contention=False):
    pin = device.type == "cuda"
    host = HostStore(B, Hk, D, dtype, P, pin=pin)
    host.ensure_capacity(tokens + iters + warmup + 1)  # contents do not matter for bandwidth
    host.length = tokens
    S = K + 1
    pool = SlotPool(
        torch.zeros(B, Hk, S + 1, P, D, dtype=dtype, device=device),
        torch.zeros(B, Hk, S + 1, P, D, dtype=dtype, device=device),
        torch.zeros(B, Hk, S + 1, P, dtype=torch.float32, device=device),
        torch.full((B, Hk, S), -1, dtype=torch.long, device=device),
        torch.zeros(B, Hk, dtype=torch.long, device=device),
    )
    counters = StepCounters.zeros(device)
    step = torch.tensor([tokens], device=device)
    n_blocks = tokens // P
    # Two disjoint random selections per (sequence, head); alternating them makes every block a miss.
    perm = torch.rand(B, Hk, n_blocks).argsort(-1)[..., : 2 * K]
    selections = [perm[..., :K].contiguous().to(device), perm[..., K:].contiguous().to(device)]
    k_new = torch.randn(B, Hk, 1, D, dtype=dtype, device=device)
    b_new = torch.randn(B, Hk, 1, device=device)
    timer = Timer(device)

    def fetch(i):
        fetch_step(selections[i % 2], pool, host, k_new, k_new, b_new, step, counters, count_locality=False)

    for i in range(warmup):
        fetch(i)
    before = int(counters.counts[0])
    timer.start()
    for i in range(warmup, warmup + iters):
        fetch(i)
    seconds = timer.stop()
    loaded = int(counters.counts[0]) - before
    assert loaded == B * Hk * K * iters, (loaded, B * Hk * K * iters)
    block_bytes = P * (2 * D * torch.finfo(dtype).bits // 8 + 4)
    nbytes = loaded * block_bytes // iters  # per iteration

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(warmup):
        dst.copy_(src, non_blocking=True)
    timer.start()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    copy_seconds = timer.stop()
    fetch_gbps = nbytes * iters / seconds / 1e9
    copy_gbps = nbytes * iters / copy_seconds / 1e9
    row = dict(
        batch=B, kv_heads=Hk, head_dim=D, block_size=P, blocks_per_head=K, host_tokens=tokens, iters=iters,
        bytes_per_iter=nbytes, fetch_ms=1000 * seconds / iters, copy_ms=1000 * copy_seconds / iters,
        fetch_GBps=fetch_gbps, pinned_copy_GBps=copy_gbps, ratio=fetch_gbps / copy_gbps,
        meets_target=fetch_gbps >= 0.9 * copy_gbps,
    )
    if contention and device.type == "cuda":
        for kind in ("gemm", "hbm"):
            side = busy_side_stream(kind, 3 * seconds, device)  # outlasts the timed fetches
            timer.start()
            for i in range(iters):
                fetch(i)
            busy = timer.stop()
            side.synchronize()
            row[f"fetch_GBps_beside_{kind}"] = nbytes * iters / busy / 1e9
            row[f"fetch_slowdown_beside_{kind}"] = busy / seconds
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for fetch_bandwidth.json")
    parser.add_argument("--tokens", type=int, default=32768, help="host tokens per (sequence, head)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in the Triton interpreter")
    parser.add_argument("--contention", action="store_true",
                        help="also time the fetch beside a side stream of GEMMs and of device copies (CUDA)")
    args = parser.parse_args(argv)
    if args.smoke or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("HF_NOSA_KERNELS", "triton")
        device, dtype, configs, P = torch.device("cpu"), torch.float32, SMOKE_CONFIGS, 16
        args.tokens, args.iters, args.warmup = 256, 2, 1
    else:
        device, dtype, configs, P = torch.device("cuda"), torch.bfloat16, CONFIGS, 64
    result = dict(environment(), rows=[])
    for B, Hk, D, K in configs:
        row = run_config(B, Hk, D, K, P, args.tokens, args.iters, args.warmup, device, dtype, args.contention)
        result["rows"].append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "fetch_bandwidth.json"), "w") as f:
                json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
