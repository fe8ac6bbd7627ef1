"""A NOSA model over 1 GPU against N GPUs of one host (transformers' ``tp_plan="auto"``): decode tokens per second
through ``generate`` at the largest batch each fits, and output tokens per second and admitted concurrency through
continuous batching (``generate_batch``).

Run it under torchrun, once per GPU count, with the same arguments (every rank runs the whole script; rank 0
writes the JSON):

    torchrun --nproc-per-node 1 benchmarks/tensor_parallel.py --shape 8b --context 65536 --out tp1.json
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --shape 8b --context 65536 --out tp2.json
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --shape smoke --context 300 --new-tokens 4 \
        --batches 1 2 --requests 3 --out tp_smoke.json    # the CPU, gloo

A random-weight Llama of ``--shape`` (``batch_plan.SHAPES``) is written once to ``--folder`` (rank 0; the others
wait) and loaded sharded with ``from_pretrained(folder, tp_plan="auto")``, then converted with ``to_nosa`` on
every rank (random eviction heads, the same on every rank). ``generate``: for each of ``--batches`` (rows of
``--context`` random tokens), after an untimed call, the time of ``max_new_tokens=1`` and of ``--new-tokens``:
decode tok/s is ``batch x (new_tokens - 1)`` over the difference; a batch that runs out of memory ends the sweep.
Continuous batching: ``--requests`` prompts of ``--context`` tokens through ``generate_batch``: output tok/s over
the call and the most requests decoding at once (from per-token timestamps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.batch_plan import SHAPES  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.serve import stream_metrics  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_checkpoint(shape: str, folder: str, dtype: torch.dtype) -> None:
    """A random-weight Llama of ``shape`` saved to ``folder`` (skipped when it is there)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=1 << 18)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)


def load(args, dtype):
    from transformers import AutoModelForCausalLM

    import hf_nosa
    from hf_nosa.modeling import randomize_eviction_heads

    model = AutoModelForCausalLM.from_pretrained(args.folder, tp_plan="auto", dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    cfg = hf_nosa.NosaConfig() if args.shape != "smoke" else hf_nosa.NosaConfig(
        block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16, compress_kernel=8,
        compress_stride=4, prefill_chunk_size=64)
    hf_nosa.to_nosa(model, cfg)
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    return model


def generate_rows(model, args, device) -> list[dict]:
    rows = []
    vocab = model.config.vocab_size
    for batch in args.batches:
        ids = torch.randint(3, vocab, (batch, args.context), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(device)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      cache_implementation="nosa")
        try:
            model.generate(max_new_tokens=2, min_new_tokens=2, **kwargs)  # this batch's first call: compilation
            times = []
            for new in (1, args.new_tokens):
                _sync(device)
                start = time.perf_counter()
                model.generate(max_new_tokens=new, min_new_tokens=new, **kwargs)
                _sync(device)
                times.append(time.perf_counter() - start)
        except torch.OutOfMemoryError as error:
            rows.append(dict(batch=batch, error=f"out of memory: {str(error)[:200]}"))
            break
        decode_s = times[1] - times[0]
        rows.append(dict(batch=batch, first_token_s=times[0], total_s=times[1],
                         decode_tok_s=batch * (args.new_tokens - 1) / decode_s if decode_s > 0 else None))
        if dist.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    return rows


def serving_row(model, args, device) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    import hf_nosa.serving

    hf_nosa.serving.enable(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (args.context,), generator=g).tolist() for _ in range(args.requests)]
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    _sync(device)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, record_timestamps=True,
                               continuous_batching_config=ContinuousBatchingConfig(
                                   max_batch_tokens=args.max_batch_tokens))
    _sync(device)
    end = time.perf_counter()
    outputs = [out[key] for key in sorted(out)] if out else []
    return dict(requests=args.requests, errors=[o.error for o in outputs if o.error],
                **stream_metrics(outputs, start, end))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--context", type=int, default=65536, help="prompt tokens per sequence (default: 65536)")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per sequence (default: 128)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 48, 64],
                        help="generate's batches, until one runs out of memory (default: 1 8 16 32 48 64)")
    parser.add_argument("--requests", type=int, default=32, help="prompts through generate_batch (default: 32)")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--folder", default="/tmp/hf_nosa_tp_checkpoint", help="where the random checkpoint lives")
    parser.add_argument("--out", default=None, help="JSON file rank 0 writes")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = f"{args.folder}_{args.shape}"
    args.folder = folder
    if rank == 0:
        write_checkpoint(args.shape, folder, dtype)
    dist.barrier()
    model = load(args, dtype)
    device = model.device
    result = dict(environment(), shape=args.shape, context=args.context, new_tokens=args.new_tokens, world_size=world,
                  generate=generate_rows(model, args, device))
    if args.requests:
        result["continuous_batching"] = serving_row(model, args, device)
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k in ("world_size", "generate", "continuous_batching")}),
              flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()
    return result


if __name__ == "__main__":
    main()
