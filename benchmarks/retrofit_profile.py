"""Where a retrofit step's time goes: the smollm2-135m recipe's micro-step (batch_size 8K sequences, forward +
backward) on a random model of SmolLM2-135M's shape, by variant and by kernel.

The GPU retrofit of SmolLM2 ran at 10.8K tokens/s (6 s per 8-sequence step), about what the 16x larger 1b shape
reaches (docs/results/2026-11-30_train_step_16k_first.json): time that does not scale with the model. Variants, each built the way
``hf-nosa retrofit`` builds it (``retrofit._build_model``: to_nosa, fp32 eviction heads, PEFT LoRA; bf16 autocast):

- ``dense``: the same LoRA model without NOSA (stock sdpa attention);
- ``nosa``: NOSA training attention, no auxiliary loss;
- ``nosa+aux``: with the recipe's selection and eviction alignment losses (what the retrofit runs).

Per variant: the micro-step's wall time (mean over ``--steps`` after ``--warmup``), and one profiled micro-step
(torch.profiler): GPU busy time (sum of kernel times), kernel launches, and the kernels that take the most time.
Wall time well above GPU busy time means the step waits on the host (launches, syncs), not on the GPU; then more
sequences per micro-step (``--batches 1,4``: the same tokens per optimizer step in fewer, larger micro-steps)
spread the same launches over more tokens.

``docs/results/2026-12-02_retrofit_profile.json`` (H200) also has NOSA rows with ``bias_grad="value_column"``: an
eviction-bias gradient taken from the value gradient, slower than the default and since removed (docs/results.md).

    python -m benchmarks train retrofit --batches 1,4 --out docs/results
    python -m benchmarks train retrofit --smoke      # tiny sizes on the CPU
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
from hf_nosa.training.retrofit import _build_model, load_recipe  # noqa: E402
from hf_nosa.attention.selection_loss import selection_loss  # noqa: E402

# SmolLM2-135M-Instruct (the GGUF's config): weights are random here, only the shapes matter for time
SHAPE_SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                     tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=259, max_position_embeddings=4096,
                   tie_word_embeddings=True)
SMOKE_NOSA = dict(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                  compress_kernel=8, compress_stride=4)
VARIANTS = ("dense", "nosa", "nosa+aux")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(variant: str, recipe: dict, shape: dict, device, dtype):
    from peft import get_peft_model

    from hf_nosa.training.retrofit import lora_config

    base = {"family": "llama", "config": shape, "seed": 0}
    if variant == "dense":
        from hf_nosa.training.retrofit import load_base

        model = load_base(base, dtype=dtype)
        model.config.use_cache = False
        model = get_peft_model(model, lora_config(recipe))
    else:
        aux = variant == "nosa+aux"
        recipe = dict(recipe, selection_loss=recipe["selection_loss"] if aux else 0.0,
                      eviction_loss=recipe["eviction_loss"] if aux else 0.0)
        model, _, _ = _build_model(recipe, base, dtype)
    model = model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4)


def micro_step(model, ids, device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        aux = selection_loss(model)
    (loss if aux is None else loss + aux).backward()


def profile_step(model, ids, device, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        micro_step(model, ids, device)
        _sync(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        launches = sum(e.count for e in kernels)
        key = "self_device_time_total"
    else:
        kernels = [e for e in events if e.key.startswith("aten::")]
        busy = sum(e.self_cpu_time_total for e in kernels) / 1e6
        launches = sum(e.count for e in kernels)
        key = "self_cpu_time_total"
    kernels.sort(key=lambda e: getattr(e, key), reverse=True)
    return dict(profiled_wall_s=wall, busy_s=busy, launches=launches,
                top=[dict(name=e.key[:120], seconds=getattr(e, key) / 1e6, calls=e.count) for e in kernels[:top]])


def run_variant(variant, batch, args, recipe, shape, device, dtype) -> dict:
    torch.manual_seed(0)
    model, optimizer = build(variant, recipe, shape, device, dtype)
    ids = torch.randint(3, shape["vocab_size"], (batch, args.seq_len), device=device)
    for _ in range(args.warmup):  # FlexAttention and the kernels compile here
        micro_step(model, ids, device)
        optimizer.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        micro_step(model, ids, device)
        _sync(device)
        times.append(time.perf_counter() - t0)
        optimizer.zero_grad(set_to_none=True)
    row = dict(variant=variant, batch=batch, seq_len=args.seq_len, micro_step_s=sum(times) / len(times),
               step_times_s=times, tokens_per_s=batch * args.seq_len * len(times) / sum(times))
    row.update(profile_step(model, ids, device, args.top))
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    del model, optimizer
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for retrofit_profile.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated among {VARIANTS}")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the recipe's)")
    parser.add_argument("--batches", default=None, help="comma-separated sequences per micro-step (default: the "
                        "recipe's batch_size)")
    parser.add_argument("--steps", type=int, default=3, help="timed micro-steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed micro-steps per variant")
    parser.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        parser.error(f"--variants: {bad} unknown; allowed values are {VARIANTS}")
    recipe = load_recipe("smollm2-135m")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPE_SMOKE if args.smoke else SHAPE_SMOLLM2
    if args.smoke:
        recipe = dict(recipe, nosa={**recipe["nosa"], **SMOKE_NOSA})
    args.seq_len = args.seq_len or (256 if args.smoke else recipe["seq_len"])
    result = dict(environment(), shape=shape, recipe="smollm2-135m", nosa=recipe["nosa"], rows=[])
    batches = args.batches.split(",") if args.batches else [recipe["batch_size"]]
    for variant, batch in [(v, int(b)) for b in batches for v in variants]:
        try:
            row = run_variant(variant, batch, args, recipe, shape, device, dtype)
        except torch.OutOfMemoryError as error:
            result["rows"].append(dict(variant=variant, batch=batch, seq_len=args.seq_len, oom=str(error)[:200]))
            print(f"{variant:9s} batch {batch}: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        result["rows"].append(row)
        print(f"{variant:9s} batch {batch} micro-step {row['micro_step_s']:.3f} s ({row['tokens_per_s']:,.0f} tok/s), "
              f"busy {row['busy_s']:.3f} s, {row['launches']} launches", flush=True)
        for k in row["top"][:8]:
            print(f"    {k['seconds'] * 1e3:8.1f} ms  {k['calls']:6d}x  {k['name']}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "retrofit_profile.json"), "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
