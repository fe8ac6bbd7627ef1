"""What a QUOKA prefill fetches over PCIe per chunk: blocks per (chunk, layer, KV head), with and without moving the
previous chunk's local blocks into the slot pool on the device (``prefill.PrefillPaths._move_in_previous_chunk``).

Counts, not times: ``NosaCache.stats()["blocks_loaded"]`` after one ``model.generate`` prefill of random tokens, for
the 1b shape's attention layout (32 query / 8 KV heads of 64, NosaConfig defaults: budget 4096, local 1024, chunks of
512) with a narrower model (``--hidden``, ``--layers``) so that it runs on a CPU; random weights and random nonzero
eviction heads, as in ``benchmarks/generate.py``. Selection depends on the weights, so the numbers describe this
random model, not a trained one.

    python -m benchmarks prefill fetch-bytes --context 16384 --chunks 512,2048         # CPU, about a minute a row
    python -m benchmarks prefill fetch-bytes --context 4096 --chunks 512 --hidden 256  # smaller
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.batch_plan import SHAPES  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaCache, NosaConfig, to_nosa  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402
from hf_nosa.prefill.chunked import PrefillPaths  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def measure(context: int, chunk: int, layers: int, hidden: int, move_in: bool, device: str) -> dict:
    shape = dict(SHAPES["1b"], num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                 vocab_size=1024, head_dim=SHAPES["1b"]["hidden_size"] // SHAPES["1b"]["num_attention_heads"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=1 << 18)).eval().to(device)
    model.config._attn_implementation = "sdpa"
    to_nosa(model, NosaConfig(prefill_chunk_size=chunk))
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(3, 1024, (1, context), generator=torch.Generator().manual_seed(1)).to(device)
    cache = NosaCache(model.config)
    original = PrefillPaths._move_in_previous_chunk
    if not move_in:
        PrefillPaths._move_in_previous_chunk = lambda self, start, selected: setattr(self, "previous_chunk", None)
    try:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, cache=cache)
        seconds = time.perf_counter() - start
    finally:
        PrefillPaths._move_in_previous_chunk = original
    stats = cache.stats()
    chunk_layer_heads = (context // chunk) * layers * model.config.num_key_value_heads
    return dict(context=context, chunk=chunk, layers=layers, hidden=hidden, move_in=move_in,
                blocks_loaded=stats["blocks_loaded"], bytes_to_device=stats["bytes_to_device"],
                blocks_per_chunk_layer_head=stats["blocks_loaded"] / chunk_layer_heads,
                budget_blocks=model.config.nosa["budget_tokens"] // model.config.nosa["block_size"], seconds=seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--chunks", default="512", help="comma list of prefill chunk sizes")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (the 1b shape's: 2048)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args(argv)
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        for move_in in (False, True):
            row = measure(args.context, chunk, args.layers, args.hidden, move_in, args.device)
            rows.append(row)
            print(f"context {row['context']}, chunk {chunk}, move-in {'on ' if move_in else 'off'}: "
                  f"{row['blocks_per_chunk_layer_head']:.1f} of {row['budget_blocks']} blocks fetched per chunk, layer "
                  f"and KV head; {row['bytes_to_device'] / 1e6:.1f} MB ({row['seconds']:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), device=args.device, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
