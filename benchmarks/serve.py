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
    python benchmarks/serve.py --shape 1b --requests 8 --min 131072 --max 131072 --new-tokens 1024 --rates inf

Stock runs at transformers' defaults (``--max-batch-tokens`` aside) and, per ``--stock-config K=V,K=V``, at other
settings of its ``ContinuousBatchingConfig`` (``max_memory_percent``, ``page_size``, ``num_blocks``,
``max_requests_per_batch``, ...), each its own method row (``stock[K=V,...]``); ``--nosa-config K=V,...`` does the
same for NOSA (``nosa[K=V,...]``, e.g. ``max_batch_tokens=65536``), and ``--methods nosa-eager`` runs NOSA without its
decode-step CUDA graphs; NOSA streams get transformers' workload hints (the longest request). Every row also records
host memory (resident set now and peak, pinned bytes on CUDA) and device memory (peak allocated and reserved). A
stream run writes its JSON and, beside it, a PNG (``--out``'s name, ``.png``): output tok/s, p50 time
to first token and p50 time per output token against the offered load, per method (the ``inf`` load drawn past the
largest finite one); without matplotlib it says so and draws nothing. ``--smoke``: a seconds-long CPU stream run of
the smoke shape (3 requests, 8 new tokens, loads 50 and inf per second; NOSA, and stock at a 16-block paged cache,
since on the CPU transformers would fit its cache to the host's free memory).

    python -m benchmarks serve --smoke --out serve_smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
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
from benchmarks.harness import write_json  # noqa: E402
from benchmarks.serve_report import floor_analysis, plot_stream, saturation  # noqa: E402,F401 (tests import them here)
from hf_nosa import NosaConfig, to_nosa  # noqa: E402
from hf_nosa.modeling import randomize_eviction_heads  # noqa: E402
from hf_nosa.rules.devices import available_device_memory  # noqa: E402


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


# ContinuousBatchingConfig fields --stock-config may set: those of one scalar value (parsed by their type)
STOCK_KEYS = ("page_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
              "max_blocks_per_request", "allow_block_sharing", "use_async_batching", "use_cuda_graph",
              "q_padding_interval_size", "kv_padding_interval_size", "default_compile_level", "scheduler_type",
              "safety_margin", "cpu_offload_space")


def _parse_value(key: str, text: str, annotation):
    kind = str(annotation)
    if text.lower() == "none" and "None" in kind:
        return None
    if "bool" in kind and text.lower() in ("true", "false", "1", "0"):
        return text.lower() in ("true", "1")
    for name, cast in (("int", int), ("float", float)):
        if name in kind:
            try:
                return cast(text)
            except ValueError:
                if not ("float" in kind and name == "int"):
                    raise ValueError(f"--stock-config {key}={text!r}: {key} takes {kind}") from None
    if "str" in kind:
        return text
    raise ValueError(f"--stock-config {key}={text!r}: {key} takes {kind}")


def parse_stock_config(spec: str) -> dict:
    """``"K=V,K=V"`` as ContinuousBatchingConfig keyword arguments (keys among ``STOCK_KEYS``, values by type)."""
    fields = {f.name: f.type for f in dataclasses.fields(ContinuousBatchingConfig)}
    settings = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or key not in STOCK_KEYS or key not in fields:
            allowed = ", ".join(k for k in STOCK_KEYS if k in fields)
            raise ValueError(f"--stock-config {item!r}: expected K=V with K one of {allowed}")
        settings[key] = _parse_value(key, text.strip(), fields[key])
    if not settings:
        raise ValueError(f"--stock-config {spec!r}: expected K=V[,K=V...]")
    return settings


def stock_method(spec: str) -> str:
    """The method name of stock continuous batching at the settings ``spec`` (a ``--stock-config``)."""
    return "stock[" + ",".join(f"{k}={v}" for k, v in parse_stock_config(spec).items()) + "]"


def nosa_method(spec: str) -> str:
    """The method name of NOSA serving at the settings ``spec`` (a ``--nosa-config``)."""
    return "nosa[" + ",".join(f"{k}={v}" for k, v in parse_stock_config(spec).items()) + "]"


def batching_for(method: str, args) -> ContinuousBatchingConfig:
    """The continuous-batching config a method runs with: ``--max-batch-tokens``, and a ``stock[...]`` or
    ``nosa[...]`` method's settings."""
    settings = dict(max_batch_tokens=args.max_batch_tokens)
    if method == "nosa-eager":  # NOSA without its decode-step CUDA graphs (serving.step_graph)
        settings["use_cuda_graph"] = False
    for prefix in ("stock[", "nosa["):
        if method.startswith(prefix) and method.endswith("]"):
            settings.update(parse_stock_config(method[len(prefix):-1]))
    if method.startswith("stock") and torch.cuda.is_available() and torch.cuda.get_per_process_memory_fraction() < 1:
        settings["max_memory_percent"] = capped_memory_percent(settings.get("max_memory_percent"))
    return ContinuousBatchingConfig(**settings)


def capped_memory_percent(percent: float | None = None) -> float:
    """Stock's ``max_memory_percent`` under the device cap. transformers sizes its paged cache as that share of the
    device's free memory (``torch.cuda.mem_get_info``), which a per-process memory fraction does not lower: at the
    1b shape's 24 GB cap on an 80 GB card it asked for 38 GiB and ran out of memory. The same share (0.9, its default
    without logit processors, unless ``--stock-config`` sets one) of what the process may still take under the cap
    (``rules.devices.available_device_memory``), over free."""
    share = 0.9 if percent is None else percent
    left = available_device_memory("cuda")
    if left <= 0:
        raise RuntimeError("--cap-gb: the model alone fills the device cap; nothing is left for stock's paged cache")
    return share * min(1.0, left / torch.cuda.mem_get_info()[0])


def _proc_status(field: str) -> int | None:
    """A ``/proc/self/status`` size in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_memory_peaks(device) -> None:
    """Start the peaks ``memory_row`` reports: device (allocated, reserved), pinned host, resident set (Linux: the
    process' own ``clear_refs``; where refused the peak is the process' so far)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        reset_host = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
        if reset_host is not None:
            reset_host()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def memory_row(device) -> dict:
    """Host and device memory since ``reset_memory_peaks``: resident set (now, peak), pinned host bytes (CUDA's
    caching host allocator: now, peak) and device bytes (peak allocated, peak reserved); None where unknown."""
    row = dict(host_rss_bytes=_proc_status("VmRSS"), host_peak_rss_bytes=_proc_status("VmHWM"),
               pinned_bytes=None, pinned_peak_bytes=None, device_peak_bytes=None, device_reserved_peak_bytes=None)
    if device.type == "cuda":
        row.update(device_peak_bytes=torch.cuda.max_memory_allocated(),
                   device_reserved_peak_bytes=torch.cuda.max_memory_reserved())
        host_stats = getattr(torch.cuda.memory, "host_memory_stats", None)
        if host_stats is not None:
            stats = host_stats()
            row.update(pinned_bytes=stats.get("allocated_bytes.current"),
                       pinned_peak_bytes=stats.get("allocated_bytes.peak"))
    return row


def model_for(method: str, args, device, dtype):
    model = build_model(args.shape, device, dtype)
    if method.startswith("nosa"):
        import hf_nosa.serving

        model = to_nosa(model, nosa_config(args))
        randomize_eviction_heads(model, scale=0.1, generator=torch.Generator().manual_seed(1))
        given = dict(decode_rows=args.decode_rows, device_bytes=int(args.device_budget_gb * 1e9)
                     if getattr(args, "device_budget_gb", None) else None)
        budget = hf_nosa.serving.ServingBudget(**{k: v for k, v in given.items() if v is not None})
        hf_nosa.serving.enable(model, budget=budget)
    return model


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_batch(model, prompts, args, device, method: str = "stock", new_tokens: int | None = None) -> tuple[float, dict]:
    new_tokens = args.new_tokens if new_tokens is None else new_tokens
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = batching_for(method, args)
    sync(device)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching,
                               record_timestamps=True)
    sync(device)
    return time.perf_counter() - start, out


def run_method(method: str, prompts, args, device, dtype) -> dict:
    model = model_for(method, args, device, dtype)
    first_s, _ = run_batch(model, prompts[:1], args, device, method)
    reset_memory_peaks(device)
    wall_s, out = run_batch(model, prompts, args, device, method)
    memory = memory_row(device)
    outputs = [out.get(f"req_{i}") for i in range(len(prompts))]
    errors = [o.error if o is not None else "missing" for o in outputs if o is None or o.error]
    tokens = [list(o.generated_tokens) if o is not None else [] for o in outputs]
    first_token_s = [(o.timestamps[0] - o.created_time) if o is not None and o.timestamps else None for o in outputs]
    row = dict(method=method, first_call_s=first_s, wall_s=wall_s, errors=errors,
               delivered_tok_s=sum(len(t) for t in tokens) / wall_s, first_token_s=first_token_s, tokens=tokens,
               **memory)
    if method.startswith("nosa") and args.check:
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


def workload_hints(prompts, new_tokens: int):
    """What transformers serve and generate_batch tell a manager: NOSA's shared rows are sized for the longest."""
    from transformers.generation.continuous_batching.utils import WorkloadHints  # transformers >= 5.18

    return WorkloadHints(max(len(p) for p in prompts), new_tokens, len(prompts))


def run_stream(model, prompts, rate: float, args, device, method: str = "stock") -> dict:
    """The prompts sent to one manager at Poisson arrival times of ``rate`` requests per second (inf: at once)."""
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = batching_for(method, args)
    deadline = getattr(args, "deadline", None)
    rng = random.Random(args.seed + 1)
    gaps = [0.0] + [rng.expovariate(rate) if rate != float("inf") else 0.0 for _ in prompts[1:]]
    reset_memory_peaks(device)
    # stock at its defaults: hints would turn on its decode fast path, which needs flash-attn
    hints = workload_hints(prompts, args.new_tokens) if method.startswith("nosa") else None
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching,
                                             **({"workload_hints": hints} if hints is not None else {}))
    if hasattr(manager, "warmup"):  # as transformers serve does: the cache and graphs are built before requests come
        manager.warmup()
    manager.start()
    start = due = time.perf_counter()
    cut_short = False
    try:
        for i, (prompt, gap) in enumerate(zip(prompts, gaps)):
            due += gap
            if due > time.perf_counter():
                time.sleep(due - time.perf_counter())
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=args.new_tokens, record_timestamps=True,
                                streaming=deadline is not None)
        results, finished = {}, set()
        window = ProfileWindow(args, method, rate, start)
        admitted = 0  # the most requests transformers' scheduler held active at once (sampled as results come)
        while len(finished) < len(prompts):
            window.poll()
            admitted = max(admitted, _active_requests(manager))
            if deadline is not None and time.perf_counter() - start >= deadline:
                cut_short = True  # the unfinished requests count with the tokens they have
                break
            out = manager.get_result(timeout=0.05)  # short: the scheduler's active requests are sampled here
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"the manager stopped with {len(prompts) - len(finished)} requests unanswered")
                continue
            results[out.request_id] = out  # streaming: the latest output holds every token so far
            if out.is_finished():
                finished.add(out.request_id)
        end = time.perf_counter()
    finally:
        window.close()
        # a plain stop flushes: it waits for every request to finish, which a deadline is there to cut
        hard = cut_short and "hard_stop" in inspect.signature(manager.stop).parameters
        manager.stop(block=True, **({"hard_stop": True} if hard else {}))
    outputs = [results[f"r{i}"] for i in range(len(prompts)) if f"r{i}" in results]
    errors = [o.error for o in outputs if o.error]
    row = dict(rate=rate, errors=errors, failed_requests=len(errors), **stream_metrics(outputs, start, end),
               max_admitted=admitted, workload_hints=dataclasses.asdict(hints) if hints is not None else None,
               **memory_row(device))
    if deadline is not None:  # output_tok_s is then the tokens delivered by the deadline over the time to it
        row.update(deadline_s=deadline, finished_requests=len(finished), cut_short=len(finished) < len(prompts))
    if device.type == "cuda":
        row["peak_device_gib"] = row["device_peak_bytes"] / (1 << 30)
    requests = getattr(manager, "nosa_requests", None)
    if requests is not None:
        row.update(host_budget_bytes=requests.budget.host_bytes, host_pool_bytes=requests.host_pool.allocated_bytes,
                   device_budget_bytes=requests.budget.device_bytes, activation_reserve_bytes=requests.step_bytes,
                   bank_bytes=requests.rows.bank_bytes(), admitted_peak=requests.admitted_peak, **requests.stats())
    graphs = getattr(manager, "nosa_step_graphs", None)
    if graphs is not None:  # decode steps replayed as CUDA graphs (serving.step_graph)
        row["step_graphs"] = graphs.stats()
    if requests is not None:
        row["decode_runs"] = {str(rows): n for rows, n in sorted(requests.decode_runs.items())}  # rows -> updates
    if window.table is not None:
        row["profile"] = window.table
    # what the manager was sized to (the config it runs: transformers memoizes the cache's blocks and batch tokens)
    batching = getattr(manager, "continuous_batching_config", None) or batching
    row["batching"] = {k: getattr(batching, k, None) for k in ("max_memory_percent", "num_blocks", "max_batch_tokens",
                                                                 "page_size", "max_requests_per_batch")}
    return row


def _active_requests(manager) -> int:
    """Requests transformers' scheduler holds active (admitted: prefilling or decoding, their KV held) now; 0 before
    the manager's batch processor exists. The same count for stock and NOSA: NOSA's admission (host memory and
    the slot pools) decides which requests transformers' scheduler may activate."""
    processor = getattr(manager, "batch_processor", None)
    scheduler = getattr(processor, "scheduler", None)
    return len(getattr(scheduler, "active_requests", ()) or ())


class ProfileWindow:
    """``--profile DIR``: torch.profiler over ``--profile-seconds`` of the stream from ``--profile-after`` seconds
    (the steady decode of the running requests, not its start), every thread (the manager steps in its own); writes
    the op table sorted by device time and the timeline (chrome trace, gzip) under DIR, per method and rate."""

    def __init__(self, args, method: str, rate: float, start: float):
        self.dir, self.args, self.start = getattr(args, "profile", None), args, start
        self.tag = f"{method}-rate{rate:g}".replace("[", "_").replace("]", "").replace(",", "_").replace("=", "")
        self.profiler, self.table, self.pending = None, None, self.dir is not None

    def poll(self) -> None:
        now = time.perf_counter() - self.start
        if self.pending and self.profiler is None and now >= self.args.profile_after:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            config = None
            try:  # CPU ops of every thread, where this torch can (the manager's thread runs the steps)
                config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            except (AttributeError, TypeError):
                pass
            self.profiler = profile(activities=activities, experimental_config=config) if config else \
                profile(activities=activities)
            self.profiler.__enter__()
            self.began = now
        elif self.profiler is not None and now >= self.began + self.args.profile_seconds:
            self.close()

    def close(self) -> None:
        if self.profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        sort = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = self.profiler.key_averages().table(sort_by=sort, row_limit=40)
        with open(os.path.join(self.dir, f"{self.tag}-ops.txt"), "w") as f:
            f.write(table)
        self.profiler.export_chrome_trace(os.path.join(self.dir, f"{self.tag}-trace.json.gz"))
        self.table = os.path.join(os.path.basename(self.dir), f"{self.tag}-ops.txt")
        self.profiler, self.pending = None, False




def run_rates(method: str, prompts, args, device, dtype) -> dict:
    model = model_for(method, args, device, dtype)
    # start-up, not measured: compilation, graphs, the first pinning (a few decode steps reach all of them)
    first_s, _ = run_batch(model, prompts[:1], args, device, method, new_tokens=min(args.new_tokens, 16))
    rows = []
    for rate in args.rates:
        rows.append(run_stream(model, prompts, rate, args, device, method))
        print(json.dumps(dict(method=method, **{k: v for k, v in rows[-1].items() if k != "errors"})), flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(method=method, first_call_s=first_s, rates=rows, saturation=saturation(rows))






def methods_of(args) -> list[str]:
    """``--methods`` with a ``stock[...]`` row per ``--stock-config`` after them (each checked before any run)."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        if method not in ("stock", "nosa", "nosa-eager"):
            raise ValueError(f"--methods {args.methods!r}: {method!r} is not one of stock, nosa, nosa-eager "
                             "(stock at other settings: --stock-config K=V,...)")
    return (methods + [stock_method(spec) for spec in args.stock_config or []]
            + [nosa_method(spec) for spec in getattr(args, "nosa_config", None) or []])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min", type=int, default=4096)
    parser.add_argument("--max", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="tokens a step carries (default: each method's own: stock transformers' 8,192, NOSA "
                             "8,192 in whole prefill chunks and a token per decode row)")
    parser.add_argument("--budget-tokens", type=int, default=4096)
    parser.add_argument("--methods", default="stock,nosa",
                        help="comma-separated: stock, nosa, nosa-eager (NOSA without its decode-step CUDA graphs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare NOSA's tokens with generate on each alone")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="requests per second of a Poisson stream through the manager (inf: all at once)")
    parser.add_argument("--cap-gb", type=float, default=None, help="device cap in GB on CUDA (default: the shape's)")
    parser.add_argument("--stock-config", action="append", default=None, metavar="K=V,K=V",
                        help="stock continuous batching at these ContinuousBatchingConfig settings too, as its own "
                             f"method row (repeatable; keys: {', '.join(STOCK_KEYS)})")
    parser.add_argument("--nosa-config", action="append", default=None, metavar="K=V,K=V",
                        help="NOSA serving at these ContinuousBatchingConfig settings too (e.g. max_batch_tokens=65536:"
                             " whole prompts in one step), as its own method row (repeatable; keys as --stock-config)")
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU smoke run's defaults: shape smoke, 3 requests of 40-300 tokens, 8 new tokens, "
                             "loads 50 inf, nosa and stock[num_blocks=16,page_size=32] (what is given stays)")
    parser.add_argument("--out", default=None, help="the JSON; a stream run's PNG goes beside it (.png)")
    parser.add_argument("--decode-rows", type=int, default=None,
                        help="NOSA: ServingBudget.decode_rows, the requests decoded as one batched update (default: "
                             "the library's 32); a stream of more requests decoding at once wants as many")
    parser.add_argument("--device-budget-gb", type=float, default=None, metavar="GB",
                        help="NOSA: ServingBudget.device_bytes, in GB (default: the library's, half the free device "
                             "memory at most, the step's activations kept free)")
    parser.add_argument("--deadline", type=float, default=None, metavar="S",
                        help="a stream run: stop each stream S seconds after it starts (requests stream their tokens; "
                             "the unfinished count with what they have, the row says cut_short)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="a stream run: torch.profiler over a window of each method's stream (ops table, trace)")
    parser.add_argument("--profile-after", type=float, default=60.0, help="seconds into the stream the window opens")
    parser.add_argument("--profile-seconds", type=float, default=2.0, help="the window's length")
    args = parser.parse_args(argv)
    if args.smoke:  # its sizes, where the command line left the defaults
        # stock at a 16-block cache only: on the CPU transformers fits its cache to the host's free memory
        smoke = dict(shape="smoke", requests=3, min=40, max=300, new_tokens=8, rates=[50.0, float("inf")],
                     methods="nosa", stock_config=["num_blocks=16,page_size=32"])
        for key, value in smoke.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.min > args.max or args.min < 1:
        raise ValueError(f"--min {args.min} / --max {args.max}: prompt lengths need 1 <= min <= max")
    if args.shape == "smoke" and args.budget_tokens == 4096:
        args.budget_tokens = 64
    methods = methods_of(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cap = args.cap_gb or CAP_GB.get(args.shape)
    if device.type == "cuda":
        if cap:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1e9 / total))
    prompts = prompts_of(args, SHAPES[args.shape]["vocab_size"])
    if args.rates:
        rows = []
        result = dict(environment(), args=vars(args), lengths=[len(p) for p in prompts], rows=rows)
        for method in methods:
            rows.append(run_rates(method, prompts, args, device, dtype))
            if args.out:  # after every method, so a run cut short keeps what it measured
                write_json(args.out, result)
        nosa = [r for row in rows if row["method"].startswith("nosa") for r in row["rates"]]
        locality = nosa[-1].get("locality") if nosa else None
        result["floor"] = floor_analysis(build_model(args.shape, "meta", dtype), [len(p) for p in prompts],
                                         args.new_tokens, cap if device.type == "cuda" else None,
                                         nosa_config(args).budget_tokens, locality)
        if args.out:
            result["plot"] = None
            png = os.path.splitext(args.out)[0] + ".png"
            if plot_stream(rows, png):
                result["plot"] = os.path.basename(png)
            write_json(args.out, result)
        return result
    rows = [run_method(method, prompts, args, device, dtype) for method in methods]
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
