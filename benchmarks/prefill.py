"""Time to first token and peak device memory of a long prompt: dense prefill, dense chunked prefill, QUOKA.

Random-weight 1B-shaped Llama (16 layers, 32 heads, 8 KV heads x 64, bf16, sdpa). For each prompt length and
batch, in one run:

- ``dense``: the stock model prefills the whole prompt in one forward (transformers' DynamicCache);
- ``dense_chunked``: the stock model prefills it in chunks of ``--dense-chunk`` tokens (DynamicCache);
- ``no_attention``: the stock model with an attention that costs nothing (it returns zeros): the time of everything
  else in the forward (projections, MLP, norms, logits, cache writes), i.e. the floor of any sparse prefill;
  ``dense / no_attention`` is the largest TTFT speedup that cheaper attention alone can give;
- ``quoka@C``: the NOSA-converted model (eviction heads at A = 0) prefills it in one forward into a NosaCache
  with ``prefill="quoka"``: chunks of C tokens through the whole model one at a time, each attending to
  ``--budget`` tokens of blocks (read back from the host store) plus itself (``prefill_whole_prompt_tokens=0``);
- ``quoka_whole@C``: the same chunks and blocks with the prompt through each layer whole (``whole_prompt``; the
  default for a prompt of at most ``prefill_whole_prompt_tokens``, which this row sets to the prompt's size).

TTFT is the wall time from the token ids on the device to the first generated token (last-position logits,
argmax), after ``--warmup`` untimed runs; the median of ``--repeat`` runs is reported. Peak memory is
``torch.cuda.max_memory_allocated`` during the run minus what was allocated before it (weights). The JSON holds
the GPU, versions, command and date; the PNG plots TTFT and peak memory against the prompt length.

    python -m benchmarks prefill --out DIR
    python -m benchmarks prefill --smoke          # tiny sizes, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.environment import environment  # noqa: E402
from benchmarks.harness import pyplot, save_figure, write_json  # noqa: E402
from benchmarks.profiling import gpu_ms_by_kernel  # noqa: E402
from benchmarks.decode_throughput import SHAPES  # noqa: E402
from hf_nosa import NosaCache, NosaConfig, to_nosa  # noqa: E402
from hf_nosa.cache.workspace import workspace_of  # noqa: E402

SHAPE_1B = SHAPES["1b"]

warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values= is the keyword 5.17 knows


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def prefill_dense(model, ids, chunk=None):
    """The stock model with a DynamicCache, whole prompt or chunk by chunk; returns (first token, cache)."""
    cache = DynamicCache(config=model.config)
    step = chunk or ids.shape[1]
    for lo in range(0, ids.shape[1], step):
        logits = model(ids[:, lo : lo + step], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1].argmax(-1), cache


@torch.no_grad()
def prefill_quoka(model, ids, nosa_config):
    # As generate builds it: sized for the prompt up front, pinned host chunks reused from the model's workspace
    # (so repeats time the prefill, not cudaHostAlloc).
    cache = NosaCache(model.config, nosa_config, max_cache_len=ids.shape[1] + 1)
    if ids.is_cuda:
        cache.attach_workspace(workspace_of(model))
    logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    return logits[:, -1].argmax(-1), cache


def no_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function (transformers' AttentionInterface) that skips the attention: zeros ``[B, T, H, D]``."""
    B, H, T, D = query.shape
    return query.new_zeros(B, T, H, D), None


AttentionInterface.register("hf_nosa_bench_no_attention", no_attention)


@torch.no_grad()
def prefill_without_attention(model, ids):
    """``prefill_dense`` with the attention skipped (whole prompt, one forward); restores sdpa after."""
    model.config._attn_implementation = "hf_nosa_bench_no_attention"
    try:
        return prefill_dense(model, ids)
    finally:
        model.config._attn_implementation = "sdpa"


def measure(run, device, warmup, repeat):
    """Median seconds of ``run()`` and peak extra device memory (bytes) of the last timed run."""
    for _ in range(warmup):
        run()
    times, peak, result = [], 0, None
    for _ in range(repeat):
        result = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        result = run()
        sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base
    return statistics.median(times), peak, result


def kernel_profile(run, top=15) -> dict:
    """GPU time of one ``run()`` by kernel: the total and the ``top`` largest, in ms."""
    times = gpu_ms_by_kernel(run)
    largest = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {"gpu_ms": sum(times.values()), "kernels_ms": {name[:120]: round(ms, 3) for name, ms in largest}}


def kv_bytes_dense(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def plot(result, path):
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if "ttft_s" in r]
    batches = sorted({r["batch"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 8), squeeze=False)
    for j, batch in enumerate(batches):
        for method in methods:
            pts = sorted((r["context"], r["ttft_s"], r["peak_bytes"]) for r in rows
                         if r["batch"] == batch and r["method"] == method)
            if not pts:
                continue
            ctx = [p[0] / 1024 for p in pts]
            axes[0, j].plot(ctx, [p[1] for p in pts], marker="o", label=method)
            axes[1, j].plot(ctx, [p[2] / 2**30 for p in pts], marker="o", label=method)
        axes[0, j].set_title(f"batch {batch}: time to first token")
        axes[0, j].set_ylabel("seconds")
        axes[1, j].set_title(f"batch {batch}: peak device memory above the weights")
        axes[1, j].set_ylabel("GiB")
        for ax in axes[:, j]:
            ax.set_xlabel("prompt (K tokens)")
            ax.grid(alpha=0.3)
            ax.legend()
    model = "tiny Llama (smoke)" if result["smoke"] else "1B-shaped Llama"
    fig.suptitle(f"prefill, {model}, {result['dtype']}, {result['gpu']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", choices=("1b", "8b"), help="model shape (decode_throughput's)")
    parser.add_argument("--contexts", default="16384,32768,65536")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--budget", type=int, default=4096, help="QUOKA prefill budget (tokens)")
    parser.add_argument("--chunks", default="512,2048", help="QUOKA chunk sizes, one method each")
    parser.add_argument("--dense-chunk", type=int, default=512, help="chunk of the dense chunked prefill")
    parser.add_argument("--queries", type=int, default=16, help="QUOKA kept queries per head")
    parser.add_argument("--methods", default="dense,dense_chunked,no_attention,quoka,quoka_whole",
                        help="comma-separated rows to run (quoka: one per --chunks)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", default=None, help="folder for prefill.json and prefill.png")
    parser.add_argument("--profile", action="store_true",
                        help="also record GPU time by kernel of dense, no_attention and the first quoka chunk size at the "
                        "longest prompt and first batch (torch.profiler, one untimed run each)")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    known = ("dense", "dense_chunked", "no_attention", "quoka", "quoka_whole")
    unknown = set(methods) - set(known)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose among {', '.join(known)}")

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES["smoke"] if args.smoke else SHAPES[args.shape]
    block = 64
    if args.smoke:
        args.contexts, args.batches, args.budget, args.chunks, args.dense_chunk = "256,512", "1,2", 64, "32,64", 32
        args.warmup, args.repeat, block = 0, 1, 16
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]

    config = LlamaConfig(**shape, max_position_embeddings=max(contexts) * 2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    nosa_configs = {
        (chunk, whole): NosaConfig(
            block_size=block, budget_tokens=args.budget, query_tokens=args.budget // 4, sink_tokens=block,
            local_tokens=args.budget // 4, compress_kernel=block // 2, compress_stride=block // 4, prefill="quoka",
            prefill_chunk_size=chunk, quoka_queries=args.queries,  # exactly `chunk` at any batch
            prefill_whole_prompt_tokens=whole,
        )
        for chunk in chunks
        for whole in (0, max(contexts) * max(batches))
    }

    rows = []
    result = dict(environment(), smoke=args.smoke, shape=shape, dtype=str(dtype), budget_tokens=args.budget,
                  chunks=chunks, dense_chunk=args.dense_chunk, quoka_queries=args.queries, warmup=args.warmup,
                  repeat=args.repeat, rows=rows)
    g = torch.Generator().manual_seed(0)
    prompts = {(c, b): torch.randint(3, shape["vocab_size"], (b, c), generator=g) for c in contexts for b in batches}
    first_tokens = {}

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            write_json(os.path.join(args.out, "prefill.json"), result, indent=2)

    def run_method(method, context, batch, run, extra):
        ids = prompts[context, batch].to(device)
        try:
            seconds, peak, (token, cache) = measure(lambda: run(ids), device, args.warmup, args.repeat)
        except torch.OutOfMemoryError as error:
            record(dict(method=method, context=context, batch=batch, error=f"OOM: {error}"[:200]))
            return
        row = dict(method=method, context=context, batch=batch, ttft_s=seconds, tok_per_s=batch * context / seconds,
                   peak_bytes=peak, **extra(cache))
        if method == "dense":
            first_tokens[context, batch] = token.cpu()
        elif method != "no_attention" and (context, batch) in first_tokens:
            row["first_token_agrees_with_dense"] = float((token.cpu() == first_tokens[context, batch]).float().mean())
        record(row)
        del cache

    # The stock model first (dense rows), then the same weights converted for QUOKA.
    for context in contexts:
        for batch in batches:
            dense_extra = lambda cache: dict(kv_device_bytes=kv_bytes_dense(cache))  # noqa: E731
            if "dense" in methods:
                run_method("dense", context, batch, lambda ids: prefill_dense(model, ids), dense_extra)
            if "dense_chunked" in methods:
                run_method("dense_chunked", context, batch, lambda ids: prefill_dense(model, ids, args.dense_chunk),
                           dense_extra)
            if "no_attention" in methods:
                run_method("no_attention", context, batch, lambda ids: prefill_without_attention(model, ids),
                           dense_extra)
    profiles = None
    if args.profile and device.type == "cuda":
        profile_ids = prompts[max(contexts), batches[0]].to(device)
        profiles = result["profile"] = {"context": max(contexts), "batch": batches[0]}
        profiles["dense"] = kernel_profile(lambda: prefill_dense(model, profile_ids))
        profiles["no_attention"] = kernel_profile(lambda: prefill_without_attention(model, profile_ids))
    to_nosa(model, next(iter(nosa_configs.values())))
    for context in contexts:
        for batch in batches:
            for (chunk, whole), cfg in nosa_configs.items():
                method = "quoka_whole" if whole else "quoka"
                if method not in methods:
                    continue

                def quoka_extra(cache, cfg=cfg):
                    stats = cache.stats()
                    return dict(device_tokens=stats["device_tokens"],
                                device_tokens_bound=cfg.prefill_budget_blocks * cfg.block_size + cfg.prefill_chunk_size,
                                kv_device_bytes=stats["device_kv_bytes"], host_bytes=stats["host_bytes"],
                                bytes_to_device=stats["bytes_to_device"])

                run_method(f"{method}@{chunk}", context, batch, lambda ids, cfg=cfg: prefill_quoka(model, ids, cfg),
                           quoka_extra)

    if profiles is not None:
        for (chunk, whole), cfg in list(nosa_configs.items())[:2]:
            name = f"{'quoka_whole' if whole else 'quoka'}@{chunk}"
            profiles[name] = kernel_profile(lambda cfg=cfg: prefill_quoka(model, profile_ids, cfg))
        print(json.dumps(profiles), flush=True)

    for context in contexts:
        for batch in batches:
            by = {r["method"]: r for r in rows if r["context"] == context and r["batch"] == batch and "ttft_s" in r}
            for method, row in by.items():
                if method != "dense" and "dense" in by:
                    row["speedup_vs_dense"] = by["dense"]["ttft_s"] / row["ttft_s"]
            if "no_attention" in by:
                for row in by.values():
                    row["ttft_over_no_attention"] = row["ttft_s"] / by["no_attention"]["ttft_s"]
    if args.out:
        write_json(os.path.join(args.out, "prefill.json"), result, indent=2)
        plot(result, os.path.join(args.out, "prefill.png"))
    summary = [(r["method"], r["context"], r["batch"], round(r.get("ttft_s", float("nan")), 4),
                round(r.get("speedup_vs_dense", 1.0), 2)) for r in rows]
    print("method, context, batch, ttft_s, speedup_vs_dense")
    for line in summary:
        print(*line, sep=", ")
    return result


if __name__ == "__main__":
    main()
