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

``--rates R ...`` runs a request stream instead, through transformers' manager (``init_continuous_batching``,
``add_request`` at Poisson arrival times of R requests per second, ``inf``: all at once, the saturating load): per
method and rate, output tokens per second, p50 / p99 time to first token and time per output token, the largest
number of requests decoding at once (admitted concurrency), peak device memory, and NOSA's host memory. On CUDA the
device is capped at ``--cap-gb`` (the shape's cap of ``generate.py`` by default: 24 GB for "1b").

    python benchmarks/serve.py --shape 1b --requests 32 --min 16384 --max 65536 --new-tokens 1024 --rates 0.5 1 inf
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
from benchmarks.decode_throughput import CAP_GB, build_model  # noqa: E402
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


def _quantile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def stream_metrics(outputs: list, start: float, end: float) -> dict:
    """Output tok/s, time to first token and per output token (p50 / p99) and the largest number of requests
    decoding at once, from each request's ``GenerationOutput`` (``created_time``, per-token ``timestamps``)."""
    ttft, tpot, spans = [], [], []
    for o in outputs:
        stamps = o.timestamps or []
        if not stamps:
            continue
        ttft.append(stamps[0] - o.created_time)
        if len(stamps) > 1:
            tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        spans.append((stamps[0], stamps[-1]))
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], -e[1]))
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    tokens = sum(len(o.generated_tokens) for o in outputs)
    return dict(output_tok_s=tokens / (end - start), wall_s=end - start, generated_tokens=tokens,
                ttft_p50_s=_quantile(ttft, 0.5), ttft_p99_s=_quantile(ttft, 0.99), tpot_p50_s=_quantile(tpot, 0.5),
                tpot_p99_s=_quantile(tpot, 0.99), max_decoding=most)


def run_stream(model, prompts, rate: float, args, device) -> dict:
    """The prompts sent to one manager at Poisson arrival times of ``rate`` requests per second (inf: at once)."""
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens)
    rng = random.Random(args.seed + 1)
    gaps = [0.0] + [rng.expovariate(rate) if rate != float("inf") else 0.0 for _ in prompts[1:]]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching)
    if hasattr(manager, "warmup"):  # as transformers serve does: the cache and graphs are built before requests come
        manager.warmup()
    manager.start()
    start = due = time.perf_counter()
    try:
        for i, (prompt, gap) in enumerate(zip(prompts, gaps)):
            due += gap
            if due > time.perf_counter():
                time.sleep(due - time.perf_counter())
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=args.new_tokens, record_timestamps=True)
        results = {}
        while len(results) < len(prompts):
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"the manager stopped with {len(prompts) - len(results)} requests unanswered")
                continue
            results[out.request_id] = out
        end = time.perf_counter()
    finally:
        manager.stop(block=True)
    outputs = [results[f"r{i}"] for i in range(len(prompts))]
    row = dict(rate=rate, errors=[o.error for o in outputs if o.error], **stream_metrics(outputs, start, end))
    if device.type == "cuda":
        row["peak_device_gib"] = torch.cuda.max_memory_allocated() / (1 << 30)
    requests = getattr(manager, "nosa_requests", None)
    if requests is not None:
        row.update(host_budget_bytes=requests.budget.host_bytes, host_pool_bytes=requests.host_pool.allocated_bytes,
                   **requests.stats())
    return row


def floor_analysis(model, lengths: list[int], new_tokens: int, cap_gb: float | None, budget_tokens: int,
                   locality: float | None, pcie_gb_s: float = 51.0, hbm_tb_s: float = 3.35) -> dict:
    """What bounds each method, by arithmetic (issue: stock's concurrency is about free device memory / (context x
    bytes per token); NOSA's step is about batch x (1 - locality) x budget x bytes per token over PCIe plus the
    budget's KV over HBM). ``pcie_gb_s``: the host-to-device rate measured for block fetches (facts.md); ``hbm_tb_s``:
    an H100's HBM3. Per decode step and sequence, at the stream's mean context."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    kv_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * itemsize  # K and V, every layer
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    context = sum(lengths) / len(lengths) + new_tokens / 2
    free = cap_gb * 1e9 - weights if cap_gb else None
    miss = 1.0 - (locality if locality is not None and locality == locality else 0.0)
    return dict(
        kv_bytes_per_token=kv_token, weights_bytes=weights, mean_context=context, pcie_gb_s=pcie_gb_s,
        hbm_tb_s=hbm_tb_s,
        stock_max_concurrency=(free / (context * kv_token)) if free else None,
        stock_step_s_per_sequence=context * kv_token / (hbm_tb_s * 1e12),
        nosa_fetch_s_per_sequence=miss * budget_tokens * kv_token / (pcie_gb_s * 1e9),
        nosa_attention_s_per_sequence=budget_tokens * kv_token / (hbm_tb_s * 1e12),
        locality_used=1.0 - miss,
    )


def run_rates(method: str, prompts, args, device, dtype) -> dict:
    model = model_for(method, args, device, dtype)
    first_s, _ = run_batch(model, prompts[:1], args, device)  # start-up: compilation, first pinning
    rows = []
    for rate in args.rates:
        rows.append(run_stream(model, prompts, rate, args, device))
        print(json.dumps(dict(method=method, **{k: v for k, v in rows[-1].items() if k != "errors"})), flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(method=method, first_call_s=first_s, rates=rows)


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
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="requests per second of a Poisson stream through the manager (inf: all at once)")
    parser.add_argument("--cap-gb", type=float, default=None, help="device cap in GB on CUDA (default: the shape's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.shape == "smoke" and args.budget_tokens == 4096:
        args.budget_tokens = 64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cap = args.cap_gb or CAP_GB.get(args.shape)
    if device.type == "cuda":
        if cap:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1e9 / total))
    prompts = prompts_of(args, SHAPES[args.shape]["vocab_size"])
    if args.rates:
        rows = [run_rates(method, prompts, args, device, dtype) for method in args.methods.split(",")]
        result = dict(environment=environment(), args=vars(args), lengths=[len(p) for p in prompts], rows=rows)
        nosa = [r for row in rows if row["method"] == "nosa" for r in row["rates"]]
        locality = nosa[-1].get("locality") if nosa else None
        result["floor"] = floor_analysis(build_model(args.shape, "meta", dtype), [len(p) for p in prompts],
                                         args.new_tokens, cap if device.type == "cuda" else None,
                                         nosa_config(args).budget_tokens, locality)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return result
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
