"""How fast the dense tail reads the host store: ``read_span``'s GB/s by blocks per program and warps, its copy-engine
path (``READ_PATH = "copy"``), and a plain pinned copy of the same bytes.

A new turn's dense tail reads the whole conversation from the host store a piece at a time
(``hf_nosa.attention.prefix``); at batch 8 and 64K in the 1b shape that is 16 GB, which read at 26-29 GB/s in the
turn's profile (``docs/results/2026-12-07_turn_profile_b8_bf9adc4-cuda.txt``), about half of what pinned copies
reach. This reads the same pieces (``--piece`` tokens of every row at a time, the whole store) for each setting of
``kernels.prefill.host_read.READ_BLOCKS`` and ``READ_WARPS`` and for the copy path, checks each against the torch
reference, and writes the best as ``[path, blocks, warps]``.

    python -m benchmarks prefill read --batch 8 --tokens 65536 --out FILE.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import cuda_time_ms, write_json  # noqa: E402
from hf_nosa.cache.host_store import HostStore  # noqa: E402
from hf_nosa.kernels.prefill import host_read  # noqa: E402


def filled_store(batch: int, kv_heads: int, head_dim: int, tokens: int, block: int) -> HostStore:
    store = HostStore(batch, kv_heads, head_dim, torch.bfloat16, block, pin=True)
    store.reserve(tokens)
    store.ensure_capacity(tokens)
    for chunk in (*store.k_chunks, *store.v_chunks, *store.b_chunks):  # random on the device, copied down
        chunk.copy_(torch.randn(chunk.shape, device="cuda").to(chunk.dtype))
    store.length = tokens
    torch.cuda.synchronize()
    return store


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--piece", type=int, default=4096, help="tokens of every row a read takes (default: 4096)")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    store = filled_store(args.batch, args.kv_heads, args.head_dim, args.tokens, 64)
    spans = [(lo, min(args.tokens, lo + args.piece)) for lo in range(0, args.tokens, args.piece)]
    nbytes = sum(store.read_bytes(lo, hi) for lo, hi in spans)
    saved = host_read.READ_PATH, host_read.READ_BLOCKS, host_read.READ_WARPS
    rows = []
    reference = host_read.read_span_ref(store, spans[-1][0], spans[-1][1], "cuda")
    settings = [("kernel", blocks, warps) for blocks, warps in itertools.product(args.blocks, args.warps)]
    try:
        for path, blocks, warps in settings + [("copy", None, None)]:
            host_read.READ_PATH = path
            if path == "kernel":
                host_read.READ_BLOCKS, host_read.READ_WARPS = blocks, warps
            got = host_read.read_span(store, spans[-1][0], spans[-1][1], "cuda")
            same = all(torch.equal(a, b) for a, b in zip(got, reference))
            seconds = cuda_time_ms(lambda: [host_read.read_span(store, lo, hi, "cuda") for lo, hi in spans],
                                   args.repeats) / 1e3
            rows.append(dict(path=path, blocks=blocks, warps=warps, seconds=seconds, gb_s=nbytes / seconds / 1e9,
                             equal=same))
            print(rows[-1], flush=True)
    finally:
        host_read.READ_PATH, host_read.READ_BLOCKS, host_read.READ_WARPS = saved
    # the copy engine on the same bytes, one contiguous pinned buffer a piece
    piece_bytes = nbytes // len(spans)
    src = torch.empty(piece_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(piece_bytes, dtype=torch.uint8, device="cuda")
    copy_s = cuda_time_ms(lambda: [dst.copy_(src, non_blocking=True) for _ in spans], args.repeats) / 1e3
    best = max((r for r in rows if r["equal"]), key=lambda r: r["gb_s"])
    result = dict(batch=args.batch, kv_heads=args.kv_heads, head_dim=args.head_dim, tokens=args.tokens,
                  piece=args.piece, bytes=nbytes, rows=rows, copy_engine_gb_s=nbytes / copy_s / 1e9,
                  best=[best["path"], best["blocks"], best["warps"]])
    print(dict(copy_engine_gb_s=result["copy_engine_gb_s"], best=result["best"]), flush=True)
    return write_json(args.out, result) if args.out else result


if __name__ == "__main__":
    main()
