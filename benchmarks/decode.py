"""Decode throughput: transformers' default cache against NosaCache on a random-weight 1B-shaped Llama.

Caches are filled with random keys and values at the target context (prefill is not what is measured), then
the model decodes ``--steps`` tokens one at a time. Reports tok/s and the device memory the KV cache holds.

    python -m benchmarks decode step --out docs/results
    python -m benchmarks decode step --smoke          # tiny sizes, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaCache, NosaConfig, to_nosa  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402

SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=97)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_kv(model, batch, context, device, dtype, generator_seed):
    cfg = model.config
    g = torch.Generator(device=device).manual_seed(generator_seed)
    shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
    return torch.randn(shape, generator=g, device=device, dtype=dtype), torch.randn(shape, generator=g, device=device, dtype=dtype)


def fill_default(model, batch, context, device, dtype):
    cache = DynamicCache(config=model.config)
    for layer in range(model.config.num_hidden_layers):
        k, v = random_kv(model, batch, context, device, dtype, layer)
        cache.update(k, v, layer)
    return cache


def fill_nosa(model, batch, context, device, dtype, nosa_config):
    cache = NosaCache(model.config, nosa_config)
    cfg = model.config
    for layer in range(cfg.num_hidden_layers):
        k, v = random_kv(model, batch, context, device, dtype, layer)
        query = torch.zeros(batch, cfg.num_attention_heads, 1, cfg.head_dim, device=device, dtype=dtype)
        bias = torch.randn(batch, cfg.num_key_value_heads, context, device=device)
        cache.update(k, v, layer, query=query.expand(-1, -1, context, -1), bias=bias)
        del k, v
    return cache


def kv_device_bytes(cache) -> int:
    if isinstance(cache, NosaCache):
        return cache.stats()["device_kv_bytes"]
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


@torch.no_grad()
def decode(model, cache, batch, context, steps, warmup, device):
    token = torch.randint(3, model.config.vocab_size, (batch, 1), device=device)
    for _ in range(warmup):
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    sync(device)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="16384,32768")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps; covers the compressed-key capacity growth that recompiles the kernels")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", default=None, help="folder for decode.json")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPE_SMOKE if args.smoke else SHAPE_1B
    if args.smoke:
        args.contexts, args.batches, args.budget, args.steps, args.warmup = "256", "2", 64, 4, 1
    config = LlamaConfig(**shape, max_position_embeddings=1 << 17)
    config._attn_implementation = args.attn
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    block = 64 if not args.smoke else 16
    nosa_config = NosaConfig(
        block_size=block, budget_tokens=args.budget, query_tokens=args.budget // 4, sink_tokens=block,
        local_tokens=args.budget // 4, compress_kernel=block // 2, compress_stride=block // 4,
    )
    to_nosa(model, nosa_config)
    randomize_eviction_heads(model, scale=0.1, generator=torch.Generator().manual_seed(0))

    rows = []
    result = dict(environment(), shape=shape, budget_tokens=args.budget, rows=rows)
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            for method in ("default", "nosa"):
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    if method == "default":
                        cache = fill_default(model, batch, context, device, dtype)
                    else:
                        cache = fill_nosa(model, batch, context, device, dtype, nosa_config)
                    seconds = decode(model, cache, batch, context, args.steps, args.warmup, device)
                except torch.OutOfMemoryError as error:
                    rows.append(dict(method=method, context=context, batch=batch, error=f"OOM: {error}"[:200]))
                    print(rows[-1], flush=True)
                    continue
                row = dict(
                    method=method, context=context, batch=batch, steps=args.steps,
                    tok_per_s=batch * args.steps / seconds, ms_per_step=1000 * seconds / args.steps,
                    kv_device_bytes=kv_device_bytes(cache),
                    full_kv_bytes=2 * shape["num_hidden_layers"] * batch * shape["num_key_value_heads"]
                    * context * shape["head_dim"] * torch.finfo(dtype).bits // 8,
                )
                if method == "nosa":
                    stats = cache.stats()
                    row.update(locality=stats["locality"], blocks_loaded=stats["blocks_loaded"])
                rows.append(row)
                print(row, flush=True)
                del cache
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, "decode.json"), "w") as f:
                        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
