"""QUOKA's block scoring kernel (``kernels.quoka_score``) at the shapes of a generate prefill: time per call (one
layer, one chunk) and that time summed over a whole prompt's chunks and layers, per sequence.

1b shape (8 KV heads of 64, 32 query heads, 16 layers), NosaConfig defaults (512-token chunks, 16 kept queries per
head, windows of 32 every 16 tokens). A chunk at position t scores the blocks before it on the t / 16 windows before
it, so the prompt's total grows with the square of its length; the last chunk's call is timed and the prompt's sum
estimated as chunks x the mean of the first and last call (the work is linear in t).

    python -m benchmarks prefill score --contexts 32768 65536 --batches 1 38 --out docs/results/quoka_score.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaConfig  # noqa: E402
from hf_nosa.kernels.prefill.quoka_score import quoka_score  # noqa: E402
from hf_nosa.rules.selection import windows_available  # noqa: E402

LAYERS, H, HK, D = 16, 32, 8, 64


def call_ms(cfg, batch, position, capacity, repeat=20):
    """Milliseconds of one scoring call for a chunk starting at ``position``."""
    P = cfg.block_size
    kept = torch.randn(batch, H, 1, cfg.quoka_queries, D, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(batch, HK, capacity, D, device="cuda", dtype=torch.bfloat16)
    first = torch.full((1,), position, dtype=torch.long, device="cuda")
    n_windows = windows_available(first - 1, cfg)
    n_blocks = position // P
    for _ in range(3):
        quoka_score(kept, keys, n_windows, n_blocks, cfg)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        quoka_score(kept, keys, n_windows, n_blocks, cfg)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 38])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = NosaConfig()
    rows = []
    for context in args.contexts:
        capacity = context // cfg.compress_stride + 64  # the compressed keys' capacity: prompt + new tokens
        chunks = context // cfg.prefill_chunk_size
        for batch in args.batches:
            first_ms = call_ms(cfg, batch, cfg.prefill_chunk_size * 2, capacity)
            last_ms = call_ms(cfg, batch, context - cfg.prefill_chunk_size, capacity)
            prompt_s = LAYERS * chunks * (first_ms + last_ms) / 2 / 1e3
            rows.append(dict(context=context, batch=batch, first_chunk_ms=first_ms, last_chunk_ms=last_ms,
                             prompt_s=prompt_s, prompt_s_per_sequence=prompt_s / batch))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(environment(), shape="1b", nosa_config=cfg.to_dict(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
