"""What is live at the peak of a NOSA ``model.generate`` and where it was allocated, beside generate.py's formula.

Issue 14 asks that NOSA's peak device memory be within 10% of weights + cache device buffers + one chunk's
activations (``benchmarks/generate.py``: ``chunk_activations``, ``weights_gib``, ``cache_device_gib``). This census
finds what the formula leaves out: it replays every allocation and free of one generate call, finds the moment of
the highest live total, and groups the allocations live at that moment by the innermost ``hf_nosa/`` or
``transformers/`` frame that made them (file:line, function), with bytes, counts and bytes per sequence.

- CUDA: the model and prompt of ``generate.py`` (``build_model``, ``generate_once``: random-weight Llama, bf16,
  random nonzero eviction heads), one untimed call first as generate.py makes one (workspace buffers, pinned host
  store, Triton compilation, decode graph), then one call under ``torch.cuda.memory._record_memory_history``. The
  snapshot's device trace is replayed from the bytes live when recording started (weights, workspace buffers,
  the decode graph's: ``baseline_live_gib``, not grouped). Frees count when requested, as torch's allocated and
  requested-bytes statistics count them (``max_memory_allocated``); the peak with frees counted when completed (a
  block used on a side stream is reused only after that stream's work: ``record_stream``) is reported beside it.
- CPU: the same generate at a small size under a ``TorchDispatchMode`` that tracks tensor storages (a view shares
  its base's storage and is not counted again; a storage is freed when the last tensor seen holding it dies).
  What the host store allocates (``HostStore`` chunks, pinned staging) is host memory on CUDA and is reported
  apart. It sees the tensors Python-level ops return, not a kernel's private scratch. The CPU runs hf_nosa's torch
  references: reads from the host store are views of it (device copies on CUDA), a QUOKA chunk's attention takes
  the sdpa route with widened copies (on CUDA flash_biased reads the slot pool in place), one fetch part, no side
  streams. ``--kernels triton`` runs the Triton kernels in the interpreter instead (CUDA's allocations, but
  hours at these sizes). Per allocation it also records the prefill chunk and decoder layer it was made in.

    python -m benchmarks generate memory --device cuda --context 65536 --batch 38 --out DIR/memory_census_64k.json
    python -m benchmarks generate memory --device cpu --layers 2 --context 8192 --batch 4 --new-tokens 2 \\
        --out docs/results/memory_census_cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
import weakref
from collections import Counter, defaultdict
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import transformers  # noqa: E402

import hf_nosa  # noqa: E402
from benchmarks.batch_plan import CAP_GB, SHAPES  # noqa: E402
from benchmarks.environment import environment  # noqa: E402
from benchmarks.harness import cap_device, write_json  # noqa: E402
from hf_nosa import NosaCache  # noqa: E402
from hf_nosa.attention.pool import PARTS_ENV_VAR, fetch_parts  # noqa: E402

GiB = 1 << 30
# Where a frame's file lives decides its name in the report and whether it names an allocation's site.
SITE_PACKAGES = ("hf_nosa", "transformers")
_HERE = os.path.abspath(__file__)
# HostStore's own storage (and the pinned staging of its torch-reference gather): host memory on CUDA.
HOST_FUNCTIONS = {"_empty", "_chunk", "_stored_blocks", "__init__"}


def package_roots() -> dict[str, str]:
    roots = {"hf_nosa": hf_nosa.__file__, "transformers": transformers.__file__, "torch": torch.__file__}
    try:
        import triton

        roots["triton"] = triton.__file__
    except ImportError:
        pass
    roots = {name: os.path.dirname(os.path.abspath(path)) for name, path in roots.items()}
    roots["benchmarks"] = os.path.dirname(_HERE)
    return roots


# ----- events, replay and grouping (the same for both devices) -----


class Event(NamedTuple):
    """``action`` "alloc" or "free"; ``key`` names the allocation (an address, a serial); ``frames`` innermost
    first, each ``(filename, line, function)`` (allocations only); ``info``: shape, dtype, chunk, layer (CPU)."""

    action: str
    key: object
    size: int
    frames: tuple = ()
    info: dict | None = None


class Peak(NamedTuple):
    bytes: int  # baseline + what the events left live, at the peak
    index: int  # the event that reached it (-1: the baseline itself)
    live: dict  # key -> alloc Event live at the peak (events' allocations only)
    baseline_live: int  # of the baseline, what was still live at the peak
    final: int  # live after the last event
    events: int


def replay(events: list[Event], baseline: int = 0, phase=None) -> tuple[Peak, dict]:
    """Replay ``events`` from ``baseline`` live bytes (allocated before the trace began; a free of a key never
    allocated in the trace comes out of it). Returns the peak (the first event reaching the highest total) with
    the allocations live there, and, with ``phase`` (event -> key or None), per phase the highest total and the
    event reaching it."""
    total, base, best, best_index, best_base = baseline, baseline, baseline, -1, baseline
    sizes: dict = {}
    by_phase: dict = {}
    for i, e in enumerate(events):
        if e.action == "alloc":
            if e.key in sizes:
                raise ValueError(f"replay: event {i} allocates {e.key!r} again before freeing it")
            sizes[e.key] = e.size
            total += e.size
            if total > best:
                best, best_index, best_base = total, i, base
            if phase is not None and (p := phase(e)) is not None and total > by_phase.get(p, (-1, -1))[0]:
                by_phase[p] = (total, i)
        elif e.action == "free":
            size = sizes.pop(e.key, None)
            if size is None:  # allocated before the trace: part of the baseline
                base -= e.size
                total -= e.size
            else:
                total -= size
        else:
            raise ValueError(f"replay: event {i} has action {e.action!r}; allowed values are 'alloc' and 'free'")
    return Peak(best, best_index, live_at(events, best_index), best_base, total, len(events)), by_phase


def live_at(events: list[Event], index: int) -> dict:
    """key -> alloc Event of the trace's allocations live right after event ``index``."""
    live: dict = {}
    for e in events[: index + 1]:
        if e.action == "alloc":
            live[e.key] = e
        elif e.key in live:
            del live[e.key]
    return live


def short_name(filename: str, roots: dict[str, str]) -> str:
    """A frame's file as ``package/relative/path.py`` (no path of the machine that ran it)."""
    path = os.path.abspath(filename)
    for name, root in roots.items():
        if path.startswith(root + os.sep):
            return name + "/" + os.path.relpath(path, root).replace(os.sep, "/")
    return os.path.basename(filename)


def site_of(frames, roots: dict[str, str]) -> tuple[str, str]:
    """``("package/file.py:line", function)`` of the innermost hf_nosa or transformers frame; failing that, of the
    innermost frame outside torch and this file; failing that, "(no python frame)"."""
    fallback = None
    for filename, line, name in frames:
        short = short_name(filename, roots)
        if short.split("/", 1)[0] in SITE_PACKAGES:
            return f"{short}:{line}", name
        if fallback is None and not short.startswith(("torch/", "triton/")) and os.path.abspath(filename) != _HERE:
            fallback = (f"{short}:{line}", name)
    return fallback or ("(no python frame)", "")


def callers_of(frames, roots: dict[str, str], depth: int = 3) -> list[str]:
    """The hf_nosa / transformers frames outside the site, innermost first (``depth`` of them)."""
    out = []
    for filename, line, name in frames:
        short = short_name(filename, roots)
        if short.split("/", 1)[0] in SITE_PACKAGES:
            out.append(f"{short}:{line} {name}")
    return out[1 : 1 + depth]


def group_live(live: dict, batch: int, roots: dict[str, str], top: int = 30) -> list[dict]:
    """The allocations of ``live`` grouped by site, largest first: bytes, count, bytes per sequence, the commonest
    sizes, the callers of the largest allocation and (CPU) its shape and dtype."""
    groups: dict = defaultdict(list)
    for e in live.values():
        groups[site_of(e.frames, roots)].append(e)
    rows = []
    for (site, function), members in groups.items():
        size = sum(e.size for e in members)
        largest = max(members, key=lambda e: e.size)
        row = dict(site=site, function=function, bytes=size, gib=size / GiB, count=len(members),
                   mib_per_sequence=size / batch / (1 << 20),
                   sizes=[[s, n] for s, n in Counter(e.size for e in members).most_common(3)],
                   callers=callers_of(largest.frames, roots))
        if largest.info:
            row["largest"] = {k: v for k, v in largest.info.items() if k in ("shape", "dtype", "chunk", "layer")}
        rows.append(row)
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:top]


def peak_report(peak: Peak, batch: int, roots: dict[str, str], top: int, events: list[Event]) -> dict:
    at = events[peak.index] if peak.index >= 0 else None
    report = dict(peak_bytes=peak.bytes, peak_gib=peak.bytes / GiB, event_index=peak.index, events=peak.events,
                  baseline_live_gib=peak.baseline_live / GiB,
                  traced_live_gib=(peak.bytes - peak.baseline_live) / GiB,
                  traced_live_mib_per_sequence=(peak.bytes - peak.baseline_live) / batch / (1 << 20),
                  final_gib=peak.final / GiB)
    if at is not None:
        report["reached_at"] = [" ".join(map(str, site_of(at.frames, roots)))] + callers_of(at.frames, roots, 8)
        if at.info:
            report["reached_at_info"] = at.info
    report["groups"] = group_live(peak.live, batch, roots, top)
    return report


# ----- generate.py's formula, term by term -----


def formula_parts(model, cache, batch: int, context: int) -> dict:
    """``generate.activation_moments`` (what the formula counts live at each moment that can set the prefill's
    peak) in GiB and MiB per sequence, and ``generate.chunk_activations``, the largest of them."""
    from benchmarks.generate import activation_moments, chunk_activations
    from hf_nosa.prefill.chunked import tail_piece_tokens

    ncfg = cache.nosa_config
    moments = activation_moments(model, cache, batch, context)
    mib = 1 << 20
    return dict(moments_gib={m: {k: v / GiB for k, v in t.items()} for m, t in moments.items()},
                moments_mib_per_sequence={m: {k: v / batch / mib for k, v in t.items()} for m, t in moments.items()},
                largest_moment=max(moments, key=lambda m: sum(moments[m].values())),
                chunk_activations_gib=chunk_activations(model, cache, batch, context) / GiB, batch=batch,
                chunk=ncfg.prefill_chunk(batch), fetch_parts=fetch_parts(torch.device("cuda"), batch),
                tail_piece_tokens=tail_piece_tokens(ncfg.prefill_budget_blocks * ncfg.block_size, batch,
                                                    ncfg.block_size))


def projected_formula(shape: str, context: int, new_tokens: int, batch: int, nosa_config) -> dict:
    """The formula's terms for ``shape`` at ``context`` x ``batch`` (the GPU row being explained), from the
    shapes alone: a NosaCache that holds nothing yet knows its slot count."""
    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=1 << 18)
    cache = NosaCache(config, nosa_config, max_cache_len=context + new_tokens)
    return dict(shape=shape, context=context,
                **formula_parts(types.SimpleNamespace(config=config), cache, batch, context))


def measured_parts(model, cache) -> dict:
    """Weights and the cache's device buffers, counted as generate.py's ``timed_row`` counts them."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache_device = sum(t.numel() * t.element_size() for layer in cache.layers
                       for t in (layer.slot_k, layer.slot_v, layer.slot_b, layer.slot_block, layer.compressed.keys,
                                 layer.compressed.bias, layer.compressed.ring_k, layer.compressed.ring_b))
    return dict(weights_gib=weights / GiB, cache_device_gib=cache_device / GiB)


# ----- CPU: a dispatch mode that follows tensor storages -----


class StorageTracker(TorchDispatchMode):
    """Records an "alloc" event for every new storage an op returns and a "free" event when the last tensor seen
    holding it dies (``weakref.finalize``). An output sharing its storage with an input (a view, an in-place op)
    is no new allocation; views of storages made before the mode (weights, the prompt) are not followed."""

    def __init__(self, roots: dict[str, str]):
        super().__init__()
        self.roots = roots
        self.events: list[Event] = []  # device memory on CUDA
        self.host_events: list[Event] = []  # the host store's own storage
        self.skipped = Counter()  # allocations left out, by reason
        self.live: dict[int, list] = {}  # data_ptr -> [key, size, holder ids, events list]
        self.serial = 0
        self.recording = True
        self._triton_root = roots.get("triton")

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording:
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.device.type != "meta"}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._follow(t, inputs)
        return out

    def _follow(self, t: torch.Tensor, inputs: set) -> None:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            return
        entry = self.live.get(ptr)
        if entry is not None and ptr not in inputs and id(t) not in entry[2]:
            # a new storage at the address of one whose holders are still alive: that one was resized or swapped
            self._release_all(ptr)
            entry = None
        if entry is None:
            if ptr in inputs:  # a view of a storage made before the census began
                return
            frames = self._frames()
            where = self._where(frames)
            if where is None:
                self.skipped["triton interpreter copies"] += size
                return
            self.serial += 1
            events = self.host_events if where == "host" else self.events
            info = dict(shape=list(t.shape), dtype=str(t.dtype).replace("torch.", ""), **self._context(frames))
            events.append(Event("alloc", self.serial, size, tuple((f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
                                                                   for f in frames), info))
            entry = self.live[ptr] = [self.serial, size, set(), events]
        if id(t) not in entry[2]:
            entry[2].add(id(t))
            weakref.finalize(t, self._release, ptr, entry[0], id(t))

    def _release(self, ptr: int, key: int, holder: int) -> None:
        entry = self.live.get(ptr)
        if entry is None or entry[0] != key:
            return
        entry[2].discard(holder)
        if not entry[2]:
            self._release_all(ptr)

    def _release_all(self, ptr: int) -> None:
        key, size, _, events = self.live.pop(ptr)
        if self.recording:
            events.append(Event("free", key, size))

    @staticmethod
    def _frames() -> list:
        frames, f = [], sys._getframe(3)  # above _frames, _follow and __torch_dispatch__
        while f is not None:
            frames.append(f)
            f = f.f_back
        return frames

    def _where(self, frames) -> str | None:
        """"device", "host" (the host store's storage) or None (the Triton interpreter's own copies)."""
        for f in frames:
            path = os.path.abspath(f.f_code.co_filename)
            if self._triton_root and path.startswith(self._triton_root + os.sep):
                return None
            short = short_name(path, self.roots)
            if short == "hf_nosa/cache/host_store.py" and f.f_code.co_name in HOST_FUNCTIONS:
                return "host"
        return "device"

    @staticmethod
    def _context(frames) -> dict:
        """The prefill chunk (its first token) and the decoder layer an allocation happened in, when inside them."""
        context = {}
        for f in frames:
            name = f.f_code.co_name
            if name == "_chunked" and "a" in f.f_locals and "chunk" not in context:
                context["chunk"] = f.f_locals["a"]
            elif name == "forward" and "layer" not in context and "decoder_layer" in f.f_locals:
                attn = getattr(f.f_locals["decoder_layer"], "self_attn", None)
                context["layer"] = getattr(attn, "layer_idx", None)
        return context


def run_cpu(args) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.generate import nosa_config
    from hf_nosa import to_nosa
    from hf_nosa.modeling import randomize_eviction_heads

    if args.kernels == "triton":
        os.environ["HF_NOSA_KERNELS"], os.environ["TRITON_INTERPRET"] = "triton", "1"
    shape = dict(SHAPES[args.shape])
    shape.update({k: v for k, v in (("num_hidden_layers", args.layers), ("vocab_size", args.vocab)) if v})
    config = LlamaConfig(**shape, max_position_embeddings=1 << 18)
    config._attn_implementation = "sdpa"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    to_nosa(model, nosa_config(args))
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(3, config.vocab_size, (args.batch, args.context),
                        generator=torch.Generator().manual_seed(args.batch))
    mask = torch.ones_like(ids)
    roots = package_roots()
    tracker = StorageTracker(roots)
    start = time.perf_counter()
    with torch.no_grad(), tracker:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True,
                             cache_implementation="nosa")
    tracker.recording = False
    seconds = time.perf_counter() - start
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    peak, by_chunk = replay(tracker.events, phase=lambda e: (e.info or {}).get("chunk"))
    host_peak, _ = replay(tracker.host_events)
    report = peak_report(peak, args.batch, roots, args.top, tracker.events)
    last = max(by_chunk)  # the prompt's last chunk: the dense tail's
    last_bytes, last_index = by_chunk[last]
    tail = peak_report(Peak(last_bytes, last_index, live_at(tracker.events, last_index), 0, peak.final,
                            peak.events), args.batch, roots, args.top, tracker.events)
    return dict(
        device="cpu", kernels=args.kernels, dtype=args.dtype, shape=args.shape, model_shape=shape,
        context=args.context, batch=args.batch, new_tokens=args.new_tokens, seconds=seconds,
        note=("CPU census: device memory = storages ops returned inside generate (weights and the prompt are "
              "outside it); the host store's storage is reported apart (host memory on CUDA); one fetch part, no "
              "side streams" + ("; torch references: host-store reads are views of the store (device copies on "
                                "CUDA), QUOKA and dense-tail attention on the sdpa route with widened copies "
                                "(flash_biased on CUDA)" if args.kernels == "torch" else "")),
        peak=report, peak_last_chunk=tail,
        peak_by_chunk_gib={str(k): v[0] / GiB for k, v in sorted(by_chunk.items())},
        host_store_peak_gib=host_peak.bytes / GiB, skipped_bytes=dict(tracker.skipped),
        measured=measured_parts(model, cache), formula=formula_parts(model, cache, args.batch, args.context),
    )


# ----- CUDA: the allocator's own history -----


def cuda_events(trace: list[dict], free_action: str) -> list[Event]:
    """The allocator's trace entries as events: "alloc", and ``free_action`` ("free_requested" or
    "free_completed") as "free"; the other entries (segments, snapshots, the other free) are left out."""
    if free_action not in ("free_requested", "free_completed"):
        raise ValueError(f"free_action={free_action!r}; allowed values are 'free_requested' and 'free_completed'")
    events = []
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            frames = [(f["filename"], f["line"], f["name"]) for f in entry.get("frames", [])]
            if frames and frames[0][2] == "<module>":  # outermost first: turn it around
                frames.reverse()
            events.append(Event("alloc", entry["addr"], entry["size"], tuple(frames)))
        elif action == free_action:
            events.append(Event("free", entry["addr"], entry["size"]))
    return events


def run_cuda(args) -> dict:
    import gc

    from benchmarks.decode_throughput import build_model
    from benchmarks.generate import generate_once, nosa_config
    from hf_nosa import to_nosa
    from hf_nosa.modeling import randomize_eviction_heads

    cap = cap_device(args.cap_gb or CAP_GB[args.shape])
    model = build_model(args.shape, "cuda", torch.bfloat16)
    to_nosa(model, nosa_config(args))
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    if not args.no_warmup:  # as generate.py's timed_row: compilation, graph capture, pinned host store
        generate_once(model, args.batch, args.context, args.new_tokens, "nosa", stop_after=args.stop_after)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # completes the frees still waiting on a side stream before the trace starts
    before = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=args.max_entries)
    try:
        row, out = generate_once(model, args.batch, args.context, args.new_tokens, "nosa", stop_after=args.stop_after)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    if len(trace) >= args.max_entries:
        raise RuntimeError(f"the allocator kept only the last {args.max_entries} events of {len(trace)}+; the replay "
                           "needs them all: raise --max-entries")
    roots = package_roots()
    baseline = before["requested_bytes.all.current"]
    reports = {}
    for action in ("free_requested", "free_completed"):
        events = cuda_events(trace, action)
        peak, _ = replay(events, baseline)
        reports[action] = peak_report(peak, args.batch, roots, args.top, events)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    measured = measured_parts(model, cache)
    formula = formula_parts(model, cache, args.batch, args.context)
    measured.update(peak_device_gib=row["peak_device_gib"],
                    requested_bytes_peak_gib=stats["requested_bytes.all.peak"] / GiB,
                    baseline_requested_gib=baseline / GiB,
                    baseline_allocated_gib=before["allocated_bytes.all.current"] / GiB)
    measured["peak_formula_gib"] = (measured["weights_gib"] + measured["cache_device_gib"]
                                    + formula["chunk_activations_gib"])
    return dict(device=torch.cuda.get_device_name(0), cap_gb=cap, shape=args.shape, context=args.context,
                batch=args.batch, new_tokens=args.new_tokens, stop_after=args.stop_after,
                fetch_parts_env=os.environ.get(PARTS_ENV_VAR), trace_entries=len(trace),
                note=("peak = requested bytes (the trace's sizes; max_memory_allocated adds the allocator's "
                      "rounding), frees counted when requested; peak_free_completed counts a block used on a side "
                      "stream until that stream's work is done"),
                peak=reports["free_requested"], peak_free_completed=reports["free_completed"],
                measured=measured, formula=formula)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default="1b", choices=("1b", "8b"), help="model shape (default: 1b)")
    parser.add_argument("--layers", type=int, default=None, help="CPU: fewer layers than the shape's")
    parser.add_argument("--vocab", type=int, default=None, help="CPU: a smaller vocabulary than the shape's")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="CPU: model dtype")
    parser.add_argument("--kernels", default="torch", choices=("torch", "triton"),
                        help="CPU: hf_nosa's torch references, or its Triton kernels in the interpreter")
    parser.add_argument("--context", type=int, default=65536, help="prompt tokens (default: 65536)")
    parser.add_argument("--batch", type=int, default=38, help="sequences (default: 38)")
    parser.add_argument("--new-tokens", type=int, default=512, help="generate's max_new_tokens (sizes the cache)")
    parser.add_argument("--stop-after", type=int, default=8, help="CUDA: decode steps actually run (the peak is in "
                        "the prefill; the cache is sized for --new-tokens all the same)")
    parser.add_argument("--no-warmup", action="store_true", help="CUDA: trace the first call (no untimed call)")
    parser.add_argument("--cap-gb", type=float, default=None, help="CUDA: device memory cap (default: generate.py's)")
    parser.add_argument("--max-entries", type=int, default=4_000_000, help="CUDA: allocator trace entries kept")
    parser.add_argument("--prefill-chunk-size", type=int, default=None,
                        help="NOSA's prefill chunk (default: NosaConfig's)")
    parser.add_argument("--host-dtype", default=None, choices=("auto", "float8_e4m3fn", "int8"))
    parser.add_argument("--project-context", type=int, default=65536, help="the formula's terms at this context ...")
    parser.add_argument("--project-batch", type=int, default=38, help="... and batch, 1b shape (the GPU row)")
    parser.add_argument("--top", type=int, default=30, help="groups reported (default: 30)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    for name in ("layers", "vocab", "context", "batch", "new_tokens", "stop_after", "max_entries", "top"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.device == "cuda" and (args.layers or args.vocab or args.kernels != "torch" or args.dtype != "bfloat16"):
        raise ValueError("--layers, --vocab, --kernels and --dtype are for --device cpu; the CUDA census runs "
                         "generate.py's model as it is (bf16, the whole shape)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
    return args


def main(argv=None):
    args = parse_args(argv)
    from benchmarks.generate import nosa_config

    result = dict(environment(), census=run_cuda(args) if args.device == "cuda" else run_cpu(args))
    result["formula_projected"] = projected_formula("1b", args.project_context, args.new_tokens, args.project_batch,
                                                    nosa_config(args))
    write_json(args.out, result)
    census = result["census"]
    print(f"peak {census['peak']['peak_gib']:.3f} GiB ({census['peak']['traced_live_mib_per_sequence']:.1f} MiB per "
          f"sequence traced); formula chunk activations {census['formula']['chunk_activations_gib']:.3f} GiB")
    for g in census["peak"]["groups"][:12]:
        print(f"  {g['gib']:8.3f} GiB {g['mib_per_sequence']:8.2f} MiB/seq x{g['count']:<4d} {g['site']} "
              f"{g['function']}")


if __name__ == "__main__":
    main()
