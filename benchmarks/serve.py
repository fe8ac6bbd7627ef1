"""Continuous batching (``model.generate_batch``): stock transformers against NOSA (``hf_nosa.serving``).

A random-weight Llama of ``--shape`` (``batch_plan.SHAPES``; bf16 on CUDA, fp32 on the CPU). ``--requests`` prompts
of ``--min``-``--max`` tokens (uniform, ``--seed``), ``--new-tokens`` greedy tokens each (no EOS), all handed to one
``generate_batch`` (transformers schedules them under ``--max-batch-tokens`` a step). Each method runs a small call
first (start-up: Triton compilation, first pinning, flash or sdpa warm-up), then the measured call; per method:
wall time of the call (the manager's start-up included, as a user sees it), delivered tokens per second (every
request's new tokens over the wall time), each request's time to its first token and its tokens. NOSA runs with
budget ``--budget-tokens`` and random eviction heads; stock with transformers' own choices (flash if installed, else
sdpa; its cache fitted to the free device memory). With ``--check``, NOSA's tokens are compared with NOSA
``generate`` on each request alone (the serving tests' claim, at this shape).

    python benchmarks/serve.py --shape 1b --requests 16 --min 4096 --max 16384 --out benchmarks/results/serve_1b.json
    python benchmarks/serve.py --shape smoke --requests 4 --min 40 --max 300 --new-tokens 8 --check   # CPU
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
from transformers import ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.batch_plan import SHAPES  # noqa: E402
from benchmarks.decode_throughput import build_model  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402


def prompts_of(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    lengths = [rng.randint(args.min, args.max) for _ in range(args.requests)]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def nosa_config(args) -> NosaConfig:
    if args.shape == "smoke":
        return NosaConfig(block_size=16, budget_tokens=args.budget_tokens, query_tokens=16, sink_tokens=16,
                          local_tokens=16, compress_kernel=8, compress_stride=4, prefill_chunk_size=64)
    return NosaConfig(budget_tokens=args.budget_tokens)


def model_for(method: str, args, device, dtype):
    model = build_model(args.shape, device, dtype)
    if method == "nosa":
        import hf_nosa.serving

        model = to_nosa(model, nosa_config(args))
        randomize_eviction_heads(model, scale=0.1, generator=torch.Generator().manual_seed(1))
        hf_nosa.serving.enable(model)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_batch(model, prompts, args, device) -> tuple[float, dict]:
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens)
    sync(device)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                               record_timestamps=True)
    sync(device)
    return time.perf_counter() - start, out


def run_method(method: str, prompts, args, device, dtype) -> dict:
    model = model_for(method, args, device, dtype)
    first_s, _ = run_batch(model, prompts[:1], args, device)
    wall_s, out = run_batch(model, prompts, args, device)
    outputs = [out.get(f"req_{i}") for i in range(len(prompts))]
    errors = [o.error if o is not None else "missing" for o in outputs if o is None or o.error]
    tokens = [list(o.generated_tokens) if o is not None else [] for o in outputs]
    first_token_s = [(o.timestamps[0] - o.created_time) if o is not None and o.timestamps else None for o in outputs]
    row = dict(method=method, first_call_s=first_s, wall_s=wall_s, errors=errors,
               delivered_tok_s=sum(len(t) for t in tokens) / wall_s, first_token_s=first_token_s, tokens=tokens)
    if method == "nosa" and args.check:
        alone = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            result = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                    do_sample=False, eos_token_id=-1, pad_token_id=0, cache_implementation="nosa")
            alone.append(result[0, len(prompt):].tolist())
        row["equals_generate_alone"] = [a == b for a, b in zip(tokens, alone)]
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min", type=int, default=4096)
    parser.add_argument("--max", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--budget-tokens", type=int, default=4096)
    parser.add_argument("--methods", default="stock,nosa")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare NOSA's tokens with generate on each alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.shape == "smoke" and args.budget_tokens == 4096:
        args.budget_tokens = 64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompts = prompts_of(args, SHAPES[args.shape]["vocab_size"])
    rows = [run_method(method, prompts, args, device, dtype) for method in args.methods.split(",")]
    result = dict(environment=environment(), args=vars(args), lengths=[len(p) for p in prompts], rows=rows)
    for row in rows:
        check = row.get("equals_generate_alone")
        print(f"{row['method']:>6}: {row['wall_s']:.2f} s, {row['delivered_tok_s']:.1f} delivered tok/s, "
              f"errors {len(row['errors'])}" + ("" if check is None else f", equals generate alone: {check}"))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
