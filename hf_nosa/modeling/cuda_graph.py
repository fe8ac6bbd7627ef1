"""Replaying a NOSA decode step from a CUDA graph.

transformers' ``generate`` captures CUDA graphs only through ``torch.compile`` with a compileable cache (static
shapes, no Python state), which NosaCache is not: its host store grows and its counters live in Python. Its
device-kernel decode path is, however, free of host syncs and reads the token index from the device, so the
whole model forward of one decode token can be captured by hand and replayed, with the cache's Python bookkeeping
run around each replay. ``DecodeGraph`` does that; ``greedy_decode`` is a small generation loop on top.

Graphs are kept by key (the batch, every layer's buffer addresses and shapes, whether the step counts locality):
up to ``MAX_GRAPHS`` of them, the least recently replayed dropped first, so a request whose buffers and shapes
an earlier one had (the first step after a prefill, or a cache whose compressed keys sit in a workspace buffer of
the same capacity) replays that graph instead of capturing again. A step of a new key runs eagerly before its
capture, so kernels are compiled outside it (the first two steps after a prefill run eagerly); the first step's
graph, which differs only in not counting locality, is captured beside the second's, so the next request replays
both. A left-padded batch replays too: each row's padding length is a device tensor the kernels read
(``hf_nosa.rules.padding``). Limits: greedy only in ``greedy_decode``; CUDA only. With ``HF_NOSA_DECODE_PARTS``
above 1 the graph holds the batch's parts on their own streams, so one part's fetch overlaps another's compute
(``hf_nosa.cache.decode_parts``).

A capture that raises is cleaned up before the error reaches the caller (``abandon_capture``): the capture stream
ends, the caller's stream, the allocator's private pool and the default CUDA generator are put back, so the process
can go on decoding eagerly (and keep using CUDA random numbers).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import warnings
from collections import OrderedDict
from contextvars import ContextVar

import torch

from ..cache.graph_capture import capture

logger = logging.getLogger(__name__)

_STOCK_FORWARD: ContextVar[bool] = ContextVar("hf_nosa_stock_forward", default=False)
# Captured decode graphs a DecodeGraph keeps (each holds its own memory pool: one decode step's activations).
MAX_GRAPHS = 8


class stock_forward:
    """Inside this context a NOSA model's forward is the stock one (``modeling.chunked`` steps aside), so a graph
    captures the plain decode forward rather than a replay of itself."""

    def __enter__(self):
        self._token = _STOCK_FORWARD.set(True)

    def __exit__(self, *exc):
        _STOCK_FORWARD.reset(self._token)


def in_stock_forward() -> bool:
    return _STOCK_FORWARD.get()


def cache_keyword(module: torch.nn.Module) -> str:
    """The name this transformers version gives the cache argument of ``module.forward``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class DecodeGraph:
    """One decode token of ``model`` with a NosaCache, captured once and replayed.

    Args:
        model: a NOSA causal LM (``hf_nosa.to_nosa``) on CUDA, in eval mode.
        cache: its NosaCache, after a prefill, on the device-kernel path (CUDA tensors, ``HF_NOSA_KERNELS`` not
            ``torch``).

    Call it with ``input_ids [B, 1]`` and ``position_ids [B, 1]`` (CUDA long); it returns ``[B, vocab]`` logits
    (a buffer the next call overwrites).
    """

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.graph: torch.cuda.CUDAGraph | None = None  # the graph of ``key``, the last one replayed
        self.key = None
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (graph, ids, positions, logits), LRU last
        self._eager_keys: set = set()  # keys that ran their eager step (kept while their graph may be asked for)
        self.captures = 0
        self.replays = 0
        self.capturing_failed: BaseException | None = None  # set when a capture raised (callers fall back)
        self.eager_syncs: list[str] = []  # where the last eager step of a new key synchronised with the host
        self._part_streams: list[torch.cuda.Stream] = []  # one per part of the batch (hf_nosa.cache.decode_parts)
        self._fetch_events: list | None = None  # per layer and part, when the parts' fetches are staggered
        self.recaptures: list[str] = []  # why the captured graph stopped fitting, once per change (for benchmarks)

    def _layers(self):
        return list(self.cache.layers)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if not input_ids.is_cuda or input_ids.shape[1] != 1 or position_ids.shape != input_ids.shape:
            raise ValueError("DecodeGraph takes CUDA input_ids and position_ids of shape [B, 1]")
        layers = self._layers()
        if not layers or not all(layer.is_initialized and layer.seen > 0 for layer in layers):
            raise ValueError("DecodeGraph needs a cache that went through a prefill (every layer initialised)")
        t = layers[0].seen
        for layer in layers:
            layer.prepare_fused_step(t)
        key = (tuple(input_ids.shape), tuple(layer.fused_graph_key() for layer in layers), *self._parts_key(input_ids))
        if key in self.graphs:
            self.graphs.move_to_end(key)
            self.graph, self.static_ids, self.static_pos, self.static_logits = self.graphs[key]
            self.key = key
        else:
            change = _key_change(self.key, key) if self.key is not None else None
            if change is not None and (not self.recaptures or self.recaptures[-1] != change):
                self.recaptures.append(change)
            if key not in self._eager_keys:
                # Run a step of this key eagerly first: it compiles every kernel variant the capture will launch
                # (compiling or loading a module while capturing is not allowed). Host syncs in it are noted: a
                # sync that is also in the captured step breaks the capture, and the error then names them.
                if len(self._eager_keys) >= 4 * MAX_GRAPHS:
                    self._eager_keys.clear()
                self._eager_keys.add(key)
                with _noting_host_syncs() as self.eager_syncs:
                    return self._forward(input_ids, position_ids)
            first = first_step_key(key)
            if first != key and first in self._eager_keys and first not in self.graphs:
                # A request's first decode step counts no locality (``warm``), so its graph differs from the later
                # steps' only there. It ran eagerly, so its kernels are compiled: capturing it now, beside this one,
                # lets the next request of the same buffers replay its first step instead of paying a capture.
                self._capture_first_step(input_ids, position_ids, first, layers)
            self._capture(input_ids, position_ids, key)
        self.static_ids.copy_(input_ids)
        self.static_pos.copy_(position_ids)
        self.graph.replay()
        self.replays += 1
        for layer in layers:
            layer.finish_fused_step(t)
        return self.static_logits

    def _parts(self, input_ids) -> int:
        from ..cache.decode_parts import decode_parts  # the cache's module imports this one

        return decode_parts(self.cache, input_ids.shape[0])

    def _parts_key(self, input_ids) -> tuple[int, bool]:
        from ..cache.decode_parts import stagger_fetches

        parts = self._parts(input_ids)
        return parts, parts > 1 and stagger_fetches()

    def _model_forward(self, input_ids, position_ids, cache):
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                         **{cache_keyword(self.model): cache})
        return out.logits[:, -1]

    def _forward(self, input_ids, position_ids, *, capturing: bool = False):
        """The model's decode forward; by parts of the batch (``hf_nosa.cache.decode_parts``) each on its own stream
        when capturing, one after the other otherwise (the eager step before a capture compiles the same kernels)."""
        parts = self._parts(input_ids)
        with stock_forward():
            if parts == 1:
                return self._model_forward(input_ids, position_ids, self.cache)
            from ..cache.decode_parts import forward_by_parts

            streams = self._part_streams[:parts] if capturing else None  # made by _capture, before capturing
            events = self._fetch_events if capturing else None
            return forward_by_parts(self._model_forward, self.cache, input_ids, position_ids, parts, streams, events)

    def _capture_first_step(self, input_ids, position_ids, key, layers) -> None:
        """Capture the graph of ``key``, a first decode step's (no layer warm), while the layers are warm."""
        warm = [layer.warm for layer in layers]
        try:
            for layer in layers:
                layer.warm = False
            self._capture(input_ids, position_ids, key)
        finally:
            for layer, was in zip(layers, warm):
                layer.warm = was

    def _capture(self, input_ids, position_ids, key) -> None:
        self.graph = None
        self.static_ids = input_ids.clone()
        self.static_pos = position_ids.clone()
        out = {}

        def step():
            out["logits"] = self._forward(self.static_ids, self.static_pos, capturing=True)

        parts, stagger = self._parts_key(input_ids)
        while len(self._part_streams) < parts:
            self._part_streams.append(torch.cuda.Stream(input_ids.device))
        if stagger:
            from ..cache.decode_parts import fetch_events

            self._fetch_events = fetch_events(len(self._layers()), parts, input_ids.device)
        else:
            self._fetch_events = None

        compiled = compiled_kernel_variants()
        try:
            graph = capture(step, input_ids.device)
        except Exception as error:  # capture() left the process usable; the caller decides whether to go on eagerly
            notes = []
            if self.eager_syncs:
                notes.append(f"the eager step before the capture synchronised with the host at: "
                             f"{'; '.join(self.eager_syncs[:3])}")
            after = compiled_kernel_variants()
            new = after - compiled if min(after, compiled) >= 0 else 0
            if new > 0:
                notes.append(f"Triton compiled {new} kernel variant(s) during the capture, which the eager step "
                             "before it did not launch")
            if notes:
                error = RuntimeError(f"{error} ({'; '.join(notes)})")
            self.capturing_failed = error
            raise error
        self.static_logits = out["logits"]
        self.graph, self.key = graph, key
        self.graphs[key] = (graph, self.static_ids, self.static_pos, self.static_logits)
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)  # the least recently replayed; its memory pool goes with it
        self.captures += 1


def first_step_key(key: tuple) -> tuple:
    """The ``DecodeGraph`` key of the same batch and buffers at a request's first decode step: every layer's
    ``warm`` (the last item of ``NosaLayer.fused_graph_key``) False."""
    return (key[0], tuple(layer[:-1] + (False,) for layer in key[1]), *key[2:])


def _key_change(old: tuple, new: tuple) -> str | None:
    """What differs between two ``DecodeGraph`` keys, in words (the first difference); None when they are equal."""
    from ..cache.nosa_cache import NosaLayer

    if old[0] != new[0]:
        return f"input shape {old[0]} -> {new[0]}"
    if old[2:] != new[2:]:
        return f"decode parts, staggered {old[2:]} -> {new[2:]}"
    for i, (a, b) in enumerate(zip(old[1], new[1])):
        for name, x, y in zip(NosaLayer.FUSED_GRAPH_KEY_NAMES, a, b):
            if x != y:
                return f"layer {i}: {name} {x} -> {y}"
    return None if old == new else "layer count"


def compiled_kernel_variants() -> int:
    """How many Triton kernel variants this package's kernels have compiled so far (-1 where Triton keeps them
    elsewhere than this version does): a capture that compiles one fails, and this says so."""
    from ..kernels import backend

    if not backend.HAS_TRITON:
        return 0
    total = 0
    try:
        for name, module in list(sys.modules.items()):
            if not name.startswith("hf_nosa.kernels.") or module is None:
                continue
            for value in vars(module).values():
                for cache in getattr(value, "device_caches", {}).values():
                    total += len(cache[0])
    except (TypeError, IndexError, AttributeError):
        return -1
    return total


class _noting_host_syncs:
    """Context: the places (``file:line``) where CUDA operations synchronised with the host inside it, from torch's
    sync debug mode in "warn"; other warnings pass through."""

    def __enter__(self) -> list[str]:
        self.places: list[str] = []
        self._previous = torch.cuda.get_sync_debug_mode()
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self.places

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._previous)
        self._caught.__exit__(*exc)
        for record in self._records:
            if "synchroniz" in str(record.message):
                self.places.append(f"{os.path.basename(record.filename)}:{record.lineno}")
            else:
                warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)


@torch.no_grad()
def greedy_decode(model, cache, next_ids: torch.Tensor, steps: int, *, use_graph: bool = True) -> torch.Tensor:
    """Greedy decoding of ``steps`` tokens after a prefill, with ``DecodeGraph`` (or eagerly).

    Args:
        next_ids: ``[B, 1]`` the first token to feed (e.g. the argmax of the prefill's last logits).

    Returns:
        ``[B, steps]`` the tokens fed, ``next_ids`` first.
    """
    step = DecodeGraph(model, cache) if use_graph else None
    ids = next_ids
    fed = []
    for _ in range(steps):
        t = cache.get_seq_length()
        pos = torch.full_like(ids, t)
        fed.append(ids)
        if step is not None:
            logits = step(ids, pos)
        else:
            with stock_forward():
                out = model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_keyword(model): cache})
            logits = out.logits[:, -1]
        ids = logits.argmax(-1, keepdim=True)
    return torch.cat(fed, 1)
