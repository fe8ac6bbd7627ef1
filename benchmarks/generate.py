"""End-to-end ``model.generate`` on CUDA: stock DynamicCache, stock static cache (compiled by generate) and
``cache_implementation="nosa"``, the user's path only (real prefill of random prompts, no hand-filled caches).

Shapes as in ``decode_throughput.py`` (random-weight Llama, bf16, sdpa): "1b" under a 24 GB device cap, "8b" under
48 GB (``torch.cuda.set_per_process_memory_fraction``). Per row: batch, time to first token, decode tok/s
(B * (N - 1) over the time after the first token), delivered tok/s (B * N over the whole call, prefill included),
peak device memory, locality, and the graph-replayed engine's tok/s on the same cache and batch (``greedy_decode``
right after the generate call). Each method runs once untimed at its batch first (Triton / torch.compile
compilation, graph capture, pinned host memory), then timed; ``first_call_s`` is the untimed call's wall time.

Batch search: stock methods double the batch until the prefill runs out of device memory (probing with 2 new
tokens, then a bisection). NOSA runs batch 1 and the stock batch first, then takes the smaller of the largest batch
whose host store fits 70% of the free host memory and the batch whose peak, extrapolated from those two rows,
reaches 92% of the cap; it steps down by 15% while the device (or pinning) says no. ``limit`` says which bound
stopped each method. ``--nosa-batches`` runs NOSA at those batches only (``limit`` "fixed"), no search: the way to
compare host stores (``--host-dtype``) at the same batch, one run each.

    python -m benchmarks generate --shape 1b --contexts 32768 65536 --out docs/results/generate.json
    python -m benchmarks generate --methods nosa --contexts 65536 --nosa-batches 38 --out bf16_b38.json
    python -m benchmarks generate --methods nosa --contexts 65536 --nosa-batches 38 --host-dtype float8_e4m3fn \
        --out fp8_b38.json
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

from benchmarks.decode_throughput import CAP_GB, HOST_SHARE, build_model  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.harness import cap_device, pyplot, save_figure, write_json  # noqa: E402
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.cache.decode_parts import decode_parts, stagger_fetches  # noqa: E402
from hf_nosa.cache.host_store import HostStore, available_host_memory  # noqa: E402
from hf_nosa.cache.pinned import release_pinned_memory  # noqa: E402
from hf_nosa.modeling.cuda_graph import greedy_decode  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402
from hf_nosa.attention.pool import fetch_parts  # noqa: E402
from hf_nosa.prefill.chunked import tail_piece_tokens  # noqa: E402
from hf_nosa.cache.workspace import workspace_of  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList  # noqa: E402

GiB = 1 << 30
SAVE = None  # set by main(): writes the JSON after every row, so a run stopped midway keeps what it measured
DEVICE_SHARE = 0.92  # of the device cap a NOSA batch is planned to peak at (the allocator's fragmentation)


class FirstTokenClock(LogitsProcessor):
    """Records when generate first processes logits: the end of the prefill (time to first token)."""

    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            torch.cuda.synchronize()
            self.first = time.perf_counter()
        return scores


class StopAfter(StoppingCriteria):
    """Ends a warm-up call after a few tokens while keeping the timed call's max_length (so the same sizes)."""

    def __init__(self, steps):
        self.steps, self.calls = steps, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= self.steps, dtype=torch.bool, device=input_ids.device)


def generate_once(model, batch, context, new_tokens, method, stop_after=None):
    ids = torch.randint(3, model.config.vocab_size, (batch, context), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(batch))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    if method == "static":
        kwargs["cache_implementation"] = "static"
    elif method == "nosa":
        kwargs["cache_implementation"] = "nosa"
    clock = FirstTokenClock()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    stopping = StoppingCriteriaList([StopAfter(stop_after)] if stop_after else [])
    out = model.generate(**kwargs, logits_processor=LogitsProcessorList([clock]), stopping_criteria=stopping)
    torch.cuda.synchronize()
    end = time.perf_counter()
    row = dict(batch=batch, ttft_s=clock.first - start, wall_s=end - start,
               decode_tok_s=batch * (new_tokens - 1) / (end - clock.first),
               delivered_tok_s=batch * new_tokens / (end - start),
               peak_device_gib=torch.cuda.max_memory_allocated() / GiB)
    return row, out


def fits(model, batch, context, method):
    """Whether a generate of 2 new tokens at this batch runs (device memory is highest in the prefill)."""
    try:
        generate_once(model, batch, context, 2, method)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def stock_batch(model, context, method, start=1, limit=256):
    if not fits(model, start, context, method):
        return 0
    lo, hi = start, None
    while hi is None and lo < limit:
        if fits(model, lo * 2, context, method):
            lo *= 2
        else:
            hi = lo * 2
    if hi is None:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(model, mid, context, method) else (lo, mid)
    return lo


def nosa_host_batch(model, context, new_tokens):
    """The most sequences whose host stores fit HOST_SHARE of the free host memory, counted as NosaCache's host
    check counts them (``HostStore.planned_bytes``: K and V in the store's format, a quantized store's block scales
    and tail block, the fp32 eviction scores, whole blocks)."""
    cfg = model.config
    nosa = cfg.nosa  # the converted model's NosaConfig, as a dict (to_nosa)
    per_seq = cfg.num_hidden_layers * HostStore.planned_bytes(
        1, cfg.num_key_value_heads, cfg.head_dim, model.dtype, nosa["block_size"], nosa["host_dtype"],
        context + new_tokens)
    return max(1, int(HOST_SHARE * (available_host_memory() or 0) // per_seq))


def largest_nosa_batch(model, context, new_tokens, measured, cap_gb):
    """The batch to try first for NOSA and the bound that sets it: the host store's (``nosa_host_batch``) or the
    device's, extrapolated linearly from the peaks of the two smallest measured batches (a failed try at a batch
    that cannot fit costs a whole prefill, so the search starts where it expects to fit)."""
    host = nosa_host_batch(model, context, new_tokens)
    if len(measured) < 2:
        return host, f"host memory ({HOST_SHARE:.0%} of the free host memory)"
    (b0, p0), (b1, p1) = [(r["batch"], r["peak_device_gib"]) for r in measured[:2]]
    per_seq = (p1 - p0) / (b1 - b0)
    usable = DEVICE_SHARE * cap_gb * 1e9 / GiB
    device = b0 + int((usable - p0) / per_seq) if per_seq > 0 else host
    if device < host:
        return device, (f"device memory ({DEVICE_SHARE:.0%} of the cap, {per_seq:.3f} GiB per sequence from the "
                        f"peaks at batch {b0} and {b1})")
    return host, f"host memory ({HOST_SHARE:.0%} of the free host memory)"


def engine_tok_s(model, cache, batch, steps=48):
    """Tokens per second of the graph-replayed decode step on the cache generate left (same shapes and batch)."""
    ids = torch.randint(3, model.config.vocab_size, (batch, 1), device="cuda")
    greedy_decode(model, cache, ids, 4)  # eager, eager, capture
    torch.cuda.synchronize()
    start = time.perf_counter()
    greedy_decode(model, cache, ids, steps)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - start)


def activation_moments(model, cache, batch, context) -> dict[str, dict[str, int]]:
    """The prefill's activations (bytes, bf16) at the moments that can set its peak, each as the terms live then,
    counted from the shapes (``benchmarks/memory_census.py`` lists what is live at the measured peak):

    - ``mlp``: a chunk in a layer's MLP: gate/up/product, five hidden-size tensors (the MLP's input norm, the
      layer's input and the residual, the embeddings and the previous chunk's final norm, held by the model's and
      ``modeling.chunked``'s loops), and every layer's held previous chunk (K, V, fp32 scores; the next chunk moves
      its blocks into the slot pool, ``prefill._move_in_previous_chunk``);
    - ``quoka_attention``: a QUOKA chunk in its attention: four hidden-size tensors, q/k/v, the previous chunks,
      and on the sdpa route the widened query, blocks and chunk for one part of the batch (``pool_attention``;
      ``flash_biased`` reads the blocks in place and adds nothing but its output);
    - ``tail_attention``: the dense-tail chunk in its attention: the same, but with one layer's previous chunk
      already moved in, three prefix pieces of ``prefill.tail_piece_tokens`` per row (one attended, one read ahead,
      one freed only when the stream that used it is done), the kernel output and three fp32 ``[B, H, C, D]``
      (accumulator, piece output, the previous piece's output), and on the sdpa route one piece's widened K/V and
      the widened query and kernel output;

    plus, at every moment, the causal mask of the chunk over the prompt (bool ``C x context``) and four ``[B,
    context]`` int64 tensors (ids, attention mask, position ids and generate's copy)."""
    cfg, ncfg = model.config, cache.nosa_config
    C, h, f = ncfg.prefill_chunk(batch), cfg.hidden_size, cfg.intermediate_size
    Hk, D, H, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads, cfg.num_hidden_layers
    B, bf16 = batch, 2
    wide = -(-(D + 3) // 8) * 8  # D' on the sdpa route: bf16 keeps the bias in three columns
    on_kernel = D == 1 << (D - 1).bit_length() and 16 <= D <= 256
    kv_token = Hk * (2 * D * bf16 + 4)  # K, V and the fp32 score of one token
    qkv = B * C * (H + 2 * Hk) * D * bf16
    rows = -(-batch // fetch_parts(torch.device("cuda"), batch))
    piece = tail_piece_tokens(ncfg.prefill_budget_blocks * ncfg.block_size, batch, ncfg.block_size)
    S = cache.layers[0].n_slots * ncfg.block_size + C
    moments = dict(
        mlp=dict(gate_up_product=B * C * 3 * f * bf16, hidden_states=B * 5 * C * h * bf16,
                 previous_chunks=B * L * C * kv_token),
        quoka_attention=dict(hidden_states=B * 4 * C * h * bf16, qkv=qkv, previous_chunks=B * L * C * kv_token,
                             widened_copies=0 if on_kernel else rows * (C * H * wide + S * Hk * wide * 2) * bf16),
    )
    if ncfg.prefill_dense_tail_tokens:
        tail = dict(hidden_states=B * 4 * C * h * bf16, qkv=qkv, previous_chunks=B * (L - 1) * C * kv_token,
                    prefix_pieces=B * 3 * piece * kv_token, outputs=B * (H * C * D * bf16 + 3 * H * C * D * 4))
        if not on_kernel:
            tail["widened_copies"] = B * (Hk * piece * wide * 2 + 2 * H * C * wide) * bf16
        moments["tail_attention"] = tail
    shared = dict(causal_mask=C * context, int64_inputs=4 * B * context * 8)
    for terms in moments.values():
        terms.update(shared)
    return moments


def chunk_activations(model, cache, batch, context) -> int:
    """The prefill's activations at its largest moment (``activation_moments``), bytes."""
    return max(sum(terms.values()) for terms in activation_moments(model, cache, batch, context).values())


def timed_row(model, batch, context, new_tokens, method, *, limit, engine=False, repeats=1):
    t0 = time.perf_counter()
    generate_once(model, batch, context, new_tokens, method, stop_after=8)  # compile, capture, pin
    first_call = time.perf_counter() - t0
    gc.collect()
    rows = []
    for i in range(repeats):  # the row is the run of median TTFT; the cache's stats are the last run's (the same)
        if i:
            del out
            gc.collect()
        row, out = generate_once(model, batch, context, new_tokens, method)
        rows.append(row)
    row = sorted(rows, key=lambda r: r["ttft_s"])[len(rows) // 2]
    if repeats > 1:
        row["ttft_runs_s"] = [r["ttft_s"] for r in rows]
    row.update(method=method, context=context, new_tokens=new_tokens, limit=limit, first_call_s=first_call)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    if method == "nosa":
        row["host_dtype"] = cache.nosa_config.host_dtype
        stats = cache.stats()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        cache_device = sum(t.numel() * t.element_size() for layer in cache.layers
                           for t in (layer.slot_k, layer.slot_v, layer.slot_b, layer.slot_block, layer.compressed.keys,
                                     layer.compressed.bias, layer.compressed.ring_k, layer.compressed.ring_b))
        row.update(locality=stats["locality"], bytes_to_device_per_token=stats["bytes_to_device"] / (batch * new_tokens),
                   host_gib=stats["host_bytes"] / GiB, device_kv_gib=stats["device_kv_bytes"] / GiB,
                   weights_gib=weights / GiB, cache_device_gib=cache_device / GiB,
                   chunk_activations_estimate_gib=chunk_activations(model, cache, batch, context) / GiB)
        row["peak_formula_gib"] = row["weights_gib"] + row["cache_device_gib"] + row["chunk_activations_estimate_gib"]
        owner = cache.state.workspace if cache.state.workspace is not None else cache
        graph = getattr(owner, "decode_graph", None)  # generate's DecodeGraph (modeling.chunked)
        row["prefill_chunk"] = cache.nosa_config.prefill_chunk(batch)
        row["decode_parts"] = decode_parts(cache, batch)
        row["decode_parts_stagger"] = stagger_fetches()
        if graph is not None:
            row.update(graph_captures=graph.captures, graph_replays=graph.replays, recaptures=graph.recaptures)
        if engine:
            row["engine_tok_s"] = engine_tok_s(model, cache, batch)
    del out, cache
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    if SAVE is not None:
        SAVE(row)
    return row


def nosa_config(args) -> NosaConfig:
    """NosaConfig defaults, but for ``--prefill-chunk-size``, ``--prefill-batch-tokens`` and ``--host-dtype`` when
    given (extra workloads beside the default's rows)."""
    overrides = dict(prefill_chunk_size=args.prefill_chunk_size, prefill_batch_tokens=args.prefill_batch_tokens,
                     host_dtype=args.host_dtype)
    return NosaConfig(**{k: v for k, v in overrides.items() if v is not None})


def release_host_stores(model):
    """Let the previous batch's pinned host store go back to the OS before the next one is checked and pinned."""
    workspace_of(model).buffers.clear()
    workspace_of(model).release_host()
    gc.collect()
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    release_pinned_memory()  # and hf_nosa's own pool of host-store buffers


def fixed_nosa_row(model, batch, context, args):
    """NOSA at ``batch`` as given (``--nosa-batches``): no stepping down, since the point is this batch; a batch
    that does not fit gives a row with its ``error``."""
    release_host_stores(model)
    try:
        return timed_row(model, batch, context, args.new_tokens, "nosa", limit="fixed", engine=not args.skip_engine,
                         repeats=args.repeats)
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as failure:
        error = f"{type(failure).__name__}: {failure}"[:500]
    print(f"nosa batch {batch} at {context}: {error[:200]}", flush=True)
    row = dict(method="nosa", batch=batch, context=context, new_tokens=args.new_tokens, limit="fixed",
               host_dtype=model.config.nosa["host_dtype"], error=error)
    if SAVE is not None:
        SAVE(row)
    return row


def run(args):
    cap = cap_device(args.cap_gb or CAP_GB[args.shape])
    model = build_model(args.shape, "cuda", torch.bfloat16)
    rows = []  # also written to the JSON as they come (SAVE)
    stock_batches = {}
    for context in args.contexts:
        for method in [m for m in args.methods if m != "nosa"]:
            b = stock_batch(model, context, method) if method == "dynamic" else stock_batches.get(context, 1)
            while b > 0:
                try:
                    rows.append(timed_row(model, b, context, args.new_tokens, method,
                                          limit="device memory (prefill OOM at the next batch)"
                                          if method == "dynamic" else "device memory (counted down from dynamic's batch)"))
                    break
                except torch.OutOfMemoryError:
                    b = b // 2 if method == "dynamic" else b - 1
            stock_batches.setdefault(context, b)
            if method == "static" and b != 1 and args.batch1:
                rows.append(timed_row(model, 1, context, args.new_tokens, method, limit="fixed"))
    # The stock static runs leave torch.compile's CUDA-graph pools allocated under the same cap: drop them first.
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    to_nosa(model, nosa_config(args))
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    if "nosa" in args.methods and args.nosa_batches:
        for context in args.contexts:
            rows += [fixed_nosa_row(model, b, context, args) for b in args.nosa_batches]
    elif "nosa" in args.methods:
        for context in args.contexts:
            release_host_stores(model)  # the previous context's
            # The fixed batches first: their peaks give the device memory one more sequence costs.
            small = sorted({1, stock_batches.get(context, 0)} - {0})
            measured = [timed_row(model, b, context, args.new_tokens, "nosa", limit="fixed",
                                  engine=not args.skip_engine) for b in small]
            rows += measured
            release_host_stores(model)  # the small batches', before counting free host memory
            b, limit = largest_nosa_batch(model, context, args.new_tokens, measured, cap)
            while b > max(small):
                try:
                    rows.append(timed_row(model, b, context, args.new_tokens, "nosa", limit=limit,
                                          engine=not args.skip_engine))
                    break
                except (torch.OutOfMemoryError, RuntimeError, MemoryError) as error:
                    print(f"nosa batch {b} at {context}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                    failure = type(error).__name__
                # Out of the except block, so the traceback's frames (and the failed call's cache) are gone.
                release_host_stores(model)
                b, limit = b * 17 // 20, f"stepped down by 15% after {failure} at batch {b}"
    return rows


def plot(result: dict, path: str) -> None:
    """Decode and delivered tok/s per method and batch, one panel per context (log scale)."""
    plt = pyplot()
    measured = [r for r in result["rows"] if "decode_tok_s" in r]  # not the rows of a batch that did not fit
    contexts = sorted({r["context"] for r in measured})
    if plt is None or not contexts:
        return
    fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        rows = [r for r in measured if r["context"] == context]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["decode_tok_s"] for r in rows], 0.4, label="decode tok/s")
        ax.bar([i + 0.2 for i in x], [r["delivered_tok_s"] for r in rows], 0.4, label="delivered tok/s")
        ax.set_xticks(list(x), [f"{r['method']}\nb{r['batch']}" for r in rows], fontsize=8)
        ax.set_title(f"{context // 1024}K prompt + {rows[0]['new_tokens']} new tokens", fontsize=10)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"model.generate, {result['shape']} shape, {result['cap_gb']:g} GB device cap: {result['gpu']}, "
                 f"torch {result['torch']}, transformers {result['transformers']}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", choices=("1b", "8b"), help="model shape (default: 1b)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536], help="prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=512, help="tokens generated per sequence (default: 512)")
    parser.add_argument("--methods", nargs="+", default=["dynamic", "static", "nosa"],
                        choices=("dynamic", "static", "nosa"), help="methods to run")
    parser.add_argument("--cap-gb", type=float, default=None, help="device memory cap (default: 24 for 1b, 48 for 8b)")
    parser.add_argument("--batch1", action="store_true", help="also run static + compile at batch 1")
    parser.add_argument("--prefill-chunk-size", type=int, default=None,
                        help="NOSA's prefill chunk (default: NosaConfig's); larger chunks re-read QUOKA's budget from "
                        "the host fewer times and hold more activations")
    parser.add_argument("--prefill-batch-tokens", type=int, default=None,
                        help="NOSA's prefill_batch_tokens (retired: it no longer changes the chunks)")
    parser.add_argument("--host-dtype", default=None, choices=("auto", "float8_e4m3fn", "int8"),
                        help="NOSA's host store format (default: NosaConfig's, the model's dtype)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed generate calls per --nosa-batches row; the row is the one of median TTFT")
    parser.add_argument("--nosa-batches", type=int, nargs="+", default=None, metavar="N",
                        help="run NOSA at these batches only (no largest-batch search): same-batch comparisons of "
                        "host stores")
    parser.add_argument("--skip-engine", action="store_true",
                        help="skip the graph-replayed engine's tok/s after each NOSA row (saves a few seconds a row)")
    parser.add_argument("--out", required=True, help="JSON file to write (and a PNG beside it)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the PNG of an existing --out JSON")
    args = parser.parse_args(argv)
    if args.nosa_batches is not None:
        if any(b < 1 for b in args.nosa_batches):
            raise ValueError(f"--nosa-batches must be positive integers, got {args.nosa_batches}")
        if "nosa" not in args.methods:
            raise ValueError(f"--nosa-batches needs 'nosa' in --methods, got {args.methods}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.plot_only:
        with open(args.out) as f:
            plot(json.load(f), os.path.splitext(args.out)[0] + ".png")
        return
    result = dict(environment(), shape=args.shape, cap_gb=args.cap_gb or CAP_GB[args.shape], rows=[],
                  nosa_config=nosa_config(args).to_dict())

    def save(row):
        result["rows"].append(row)
        write_json(args.out, result)

    global SAVE
    SAVE = save
    run(args)
    plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
