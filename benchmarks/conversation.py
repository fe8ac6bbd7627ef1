"""A new turn on a reused NosaCache, through ``generate``: its time to first token and peak device memory, against
re-prefilling the whole conversation with NOSA on a fresh cache.

Random-weight Llama of ``--shape`` (bf16, sdpa, eviction heads random), the device capped as in ``generate.py``
(24 GB for "1b"). Per batch: a first turn of ``--context`` tokens answered with ``--answer`` tokens, then a new turn
of ``--turn`` tokens on the same cache (``generate(whole_conversation, past_key_values=cache, max_new_tokens=1)``),
then the same whole conversation on a fresh cache. The peak is compared with the budget-bound formula of a first
prompt (``generate.activation_moments``: weights + the cache's device buffers + one chunk's activations at the
largest moment). Everything runs once untimed at a small context first (kernel compilation), and each batch runs
``--repeats`` conversations: the row is the last one, the earlier ones (new kernel variants, first pinning) beside it.

    python benchmarks/conversation.py --shape 1b --batches 1 8 --out benchmarks/results/conversation.json
    python benchmarks/conversation.py --smoke   # CPU-sized, checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_throughput import CAP_GB, build_model  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from hf_nosa import NosaCache, NosaConfig, to_nosa  # noqa: E402
from hf_nosa.cache.pinned import pinned_stats, release_pinned_memory  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402

GiB = 1 << 30


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device):
    if device.type == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def _generate(model, ids, cache, new_tokens):
    mask = torch.ones_like(ids)
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)


def formula_gib(model, cache, batch, context) -> dict:
    """The budget-bound peak of a first prompt of ``context`` tokens at ``batch`` rows."""
    from benchmarks.generate import chunk_activations

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache_device = sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
                       for t in (layer.slot_k, layer.slot_v, layer.slot_b, layer.slot_block, layer.compressed.keys,
                                 layer.compressed.bias, layer.compressed.ring_k, layer.compressed.ring_b))
    activations = chunk_activations(model, cache, batch, context)
    return dict(weights_gib=weights / GiB, cache_device_gib=cache_device / GiB, activations_gib=activations / GiB,
                formula_gib=(weights + cache_device + activations) / GiB)


def conversation_row(model, batch, context, answer, turn, device, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    first = torch.randint(3, vocab, (batch, context), generator=g).to(device)
    cache = NosaCache(model.config)
    _sync(device)
    t0 = time.perf_counter()
    out = _generate(model, first, cache, answer)
    _sync(device)
    first_turn_s = time.perf_counter() - t0
    held = cache.get_seq_length()
    conversation = torch.cat([out, torch.randint(3, vocab, (batch, turn), generator=g).to(device)], 1)
    loaded_before = cache.stats()["bytes_to_device"]
    pinned_before = pinned_stats()
    _peak_reset(device)
    before = torch.cuda.memory_allocated(device) / GiB if device.type == "cuda" else None
    _sync(device)
    t0 = time.perf_counter()
    _generate(model, conversation, cache, 1)
    _sync(device)
    turn_s = time.perf_counter() - t0
    turn_peak = _peak(device)
    stats = cache.stats()
    row = dict(batch=batch, context=context, answer=answer, turn=turn, held_tokens=held,
               conversation_tokens=conversation.shape[1], first_turn_s=first_turn_s, turn_ttft_s=turn_s,
               turn_peak_gib=turn_peak, allocated_before_turn_gib=before, device_tokens=stats["device_tokens"],
               turn_bytes_to_device=stats["bytes_to_device"] - loaded_before,
               # host memory the turn's growth page-locked (cache.pinned), new or taken back from freed caches
               turn_pinned=dict((k, pinned_stats()[k] - pinned_before[k]) for k in ("registrations", "reused",
                                                                                   "registered_bytes")))
    row.update(formula_gib(model, cache, batch, conversation.shape[1]))
    del cache, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fresh = NosaCache(model.config)
    _peak_reset(device)
    _sync(device)
    t0 = time.perf_counter()
    _generate(model, conversation, fresh, 1)
    _sync(device)
    row.update(reprefill_ttft_s=time.perf_counter() - t0, reprefill_peak_gib=_peak(device))
    row["ttft_ratio"] = row["turn_ttft_s"] / row["reprefill_ttft_s"]
    if turn_peak is not None:
        row["peak_over_formula"] = turn_peak / row["formula_gib"]
    del fresh
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        release_pinned_memory()  # and hf_nosa's own pool of host-store buffers
    print(json.dumps(row), flush=True)
    return row


def profile_turn(model, batch, context, answer, turn, device, out_prefix, seed=0) -> dict:
    """The new turn of ``conversation_row`` under torch.profiler: where its time goes (CUDA kernels by total time,
    host operations by their own time), written to ``out_prefix``-cuda.txt / -cpu.txt, and its timeline to
    -trace.json.gz; returns the turn's wall time and the GPU's busy time."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    first = torch.randint(3, vocab, (batch, context), generator=g).to(device)
    cache = NosaCache(model.config)
    out = _generate(model, first, cache, answer)
    conversation = torch.cat([out, torch.randint(3, vocab, (batch, turn), generator=g).to(device)], 1)
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
        t0 = time.perf_counter()
        _generate(model, conversation, cache, 1)
        _sync(device)
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    with open(f"{out_prefix}-cuda.txt", "w") as f:
        f.write(averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    with open(f"{out_prefix}-cpu.txt", "w") as f:
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    prof.export_chrome_trace(f"{out_prefix}-trace.json.gz")  # the timeline: what overlaps what, stream by stream
    busy = sum(e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    del cache, out
    gc.collect()
    return dict(batch=batch, turn_wall_s=wall, gpu_kernel_s=busy)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", help="model shape of benchmarks/batch_plan.py (default: 1b)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="rows per conversation (default: 1 8)")
    parser.add_argument("--context", type=int, default=61440 - 16, help="first turn's prompt tokens (default: 61424)")
    parser.add_argument("--answer", type=int, default=16, help="tokens answered to the first turn (default: 16)")
    parser.add_argument("--turn", type=int, default=4096, help="the new turn's tokens (default: 4096)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="conversations per batch; the row is the last, the earlier ones under 'runs' (default: 2)")
    parser.add_argument("--cap-gb", type=float, default=None, help="device cap in GB (default: the shape's)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and sizes on the CPU")
    parser.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    parser.add_argument("--profile", default=None,
                        help="also profile one more turn per batch: tables written to PROFILE-b<batch>-{cuda,cpu}.txt")
    parser.add_argument("--read-setting", default=None, metavar="FILE",
                        help="read the store with the best setting of `python -m benchmarks prefill read`'s JSON")
    args = parser.parse_args(argv)
    read_setting = None
    if args.read_setting:
        from hf_nosa.kernels.prefill import host_read

        read_setting = json.load(open(args.read_setting))["best"]
        host_read.READ_PATH, blocks, warps = read_setting
        if blocks is not None:
            host_read.READ_BLOCKS, host_read.READ_WARPS = blocks, warps
    if args.smoke:
        from transformers import LlamaConfig, LlamaForCausalLM

        device = torch.device("cpu")
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config).eval()
        cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                         compress_kernel=8, compress_stride=4, prefill_chunk_size=64)
        args.context, args.answer, args.turn, args.batches = 300, 4, 200, [1, 2]
    else:
        device = torch.device("cuda")
        cap = args.cap_gb or CAP_GB[args.shape]
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1e9 / total))
        model = build_model(args.shape, "cuda", torch.bfloat16)
        cfg = NosaConfig()
    to_nosa(model, cfg)
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    warm = dict(context=min(args.context, 8192 - 16), answer=4, turn=min(args.turn, 1024))
    conversation_row(model, args.batches[0], device=device, **warm)  # compile the kernels, untimed
    rows = []
    for batch in args.batches:  # the first run of a batch compiles the kernel variants its shapes need
        runs = [conversation_row(model, batch, args.context, args.answer, args.turn, device, seed=i)
                for i in range(args.repeats)]
        row = dict(runs[-1], runs=runs[:-1]) if len(runs) > 1 else runs[0]
        rows.append(row)
        if args.profile:
            row["profile"] = profile_turn(model, batch, args.context, args.answer, args.turn, device,
                                          f"{args.profile}-b{batch}", seed=args.repeats)
    result = dict(environment(), nosa_config=cfg.to_dict(), read_setting=read_setting,
                  shape=args.shape if not args.smoke else "smoke",
                  cap_gb=None if args.smoke else (args.cap_gb or CAP_GB[args.shape]), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
