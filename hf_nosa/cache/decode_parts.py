"""A decode step run a part of the batch at a time, each part on its own CUDA stream, so fetches and compute overlap.

A NOSA decode step does, per layer and one after the other: the projections, the selection, the fetch of the blocks
the selection changed (host to device, bound by PCIe), the attention over the slot pool, the MLP. Its kernels keep
the GPU busy the whole step, but the fetch kernel mostly waits on PCIe: at 64K tokens x 42 sequences (1b shape,
graph-replayed engine, H200) the fetch takes 14.2 ms of a 20.9 ms step with the fp8 host store (27.4 of 34.0 with
bf16), and the selection (2.3 ms), the attention (1.9) and the rest of the model (2.4) run while no block moves
(``docs/results/2026-12-02_fetch_blocks_2_fp8.json``, ``breakdown_ms``).

Here the batch is split into parts and every part runs the whole model forward on its own stream, over a view of
its rows of the cache (``CacheRows``). Rows share nothing in a decode step, so the parts need no synchronisation
until their logits are joined; while one part waits on PCIe in a layer's fetch, another computes. The parts of a
layer's step share its step index and counters: the fetch kernel advances the step once the programs of every
part have read it (``kernels.decode.fetch.fetch_step``'s ``step_rows``).

``modeling.cuda_graph.DecodeGraph`` captures the parts' streams into one graph. ``HF_NOSA_DECODE_PARTS`` sets the
number of parts (default 1: one forward over the whole batch); a part keeps at least ``MIN_ROWS_PER_PART`` rows.
Only the NOSA selection runs by parts (another selector observes the whole batch at once).

Parts left free run in lockstep: they start together and do the same work, so their fetches share PCIe at the same
moments and their compute waits at the same moments (the first A/B, ``docs/results.md``: 2 parts ran 5% slower
than 1 at 64K x 8). Staggered (``HF_NOSA_DECODE_PARTS_STAGGER``, default 1), a part's fetch in a layer waits for
the previous part's fetch in that layer to end (one CUDA event per layer and part, recorded inside the capture), so
part p + 1 fetches while part p computes what comes after its fetch.
"""

from __future__ import annotations

import os

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention.pool import part_bounds
from ..rules.attend import AttentionInputs
from .nosa_cache import NosaCache, NosaLayer

PARTS_ENV_VAR = "HF_NOSA_DECODE_PARTS"
MIN_ROWS_PER_PART = 4  # fewer rows leave the fetch of a part too few programs to keep PCIe busy
STAGGER_ENV_VAR = "HF_NOSA_DECODE_PARTS_STAGGER"


def decode_parts(cache: NosaCache, batch: int) -> int:
    """How many parts a decode step of ``cache`` at ``batch`` rows runs in: ``HF_NOSA_DECODE_PARTS`` (default 1),
    with at least ``MIN_ROWS_PER_PART`` rows a part; 1 with a selector other than NOSA's."""
    value = os.environ.get(PARTS_ENV_VAR, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{PARTS_ENV_VAR}={value!r} is invalid: it must be a positive integer (1: the whole batch "
                         "in one forward)")
    if cache.selector is not None:
        return 1
    return max(1, min(int(value), batch // MIN_ROWS_PER_PART))


def stagger_fetches() -> bool:
    """Whether a captured step by parts orders each layer's fetches part after part (``HF_NOSA_DECODE_PARTS_STAGGER``:
    1, the default, or 0)."""
    value = os.environ.get(STAGGER_ENV_VAR, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{STAGGER_ENV_VAR}={value!r} is invalid: it must be 1 (each layer's fetches run part after "
                         "part) or 0 (the parts' streams run free)")
    return value == "1"


def fetch_events(layers: int, parts: int, device) -> list[list[torch.cuda.Event]]:
    """One CUDA event per (layer, part) for staggered fetches, created and recorded once on the current stream, so
    that a capture only records and waits on them."""
    events = [[torch.cuda.Event() for _ in range(parts)] for _ in range(layers)]
    stream = torch.cuda.current_stream(device)
    for row in events:
        for event in row:
            event.record(stream)
    return events


class LayerRows(CacheLayerMixin):
    """Rows ``b0 .. b1 - 1`` of a ``NosaLayer`` for a device-kernel decode step (``NosaLayer.decode_rows``)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, layer: NosaLayer, b0: int, b1: int, fetch_after=None, fetch_done=None):
        super().__init__()
        self.layer, self.b0, self.b1 = layer, b0, b1
        self.fetch_after, self.fetch_done = fetch_after, fetch_done  # CUDA events of a staggered step, or None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("LayerRows views a layer that already holds its sequences")

    def update(self, key_states, value_states, *args, query=None, bias=None, scaling=None, **kwargs
               ) -> AttentionInputs:
        rows = self.b1 - self.b0
        if key_states.shape[0] != rows or key_states.shape[2] != 1 or query is None or bias is None:
            raise ValueError(f"LayerRows takes one decode token of its {rows} rows with the query and eviction "
                             f"scores; got keys {tuple(key_states.shape)}")
        scale = scaling if scaling is not None else key_states.shape[-1] ** -0.5
        layer = self.layer
        # Outside a capture the parts run in order, and the layer's host-side bookkeeping goes with the first and
        # the last of them, as ``_decode_fused`` does for a whole batch; a captured step leaves it to the caller.
        capturing = key_states.is_cuda and torch.cuda.is_current_stream_capturing()
        t = layer.seen
        if not capturing and self.b0 == 0:
            layer.prepare_fused_step(t)
        inputs = layer.decode_rows(key_states, value_states, query, bias.float(), scale, self.b0, self.b1,
                                   fetch_after=self.fetch_after, fetch_done=self.fetch_done)
        if not capturing and self.b1 == layer.batch:
            layer.finish_fused_step(t)
        return inputs

    def get_seq_length(self) -> int:
        return self.layer.get_seq_length()

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.layer.get_mask_sizes(*args, **kwargs)

    def get_max_length(self) -> int:
        return self.layer.get_max_length()


class CacheRows(NosaCache):
    """Rows ``b0 .. b1 - 1`` of a NosaCache, for one decode forward of those rows; it shares every buffer."""

    def __init__(self, cache: NosaCache, b0: int, b1: int, events: list | None = None, part: int = 0):
        """``events``: ``fetch_events(...)`` for a staggered step (part ``part`` waits on part ``part - 1``)."""
        Cache.__init__(self, layers=[
            LayerRows(layer, b0, b1) if events is None else
            LayerRows(layer, b0, b1, events[i][part - 1] if part > 0 else None, events[i][part])
            for i, layer in enumerate(cache.layers)])
        self.nosa_config, self.selector, self.state = cache.nosa_config, cache.selector, cache.state
        self.workspace_lost, self.broken = cache.workspace_lost, cache.broken
        self._turns = 1  # a part of its cache's call: that call's turn restores the whole cache


def forward_by_parts(forward, cache: NosaCache, input_ids: torch.Tensor, position_ids: torch.Tensor, parts: int,
                     streams: list | None = None, events: list | None = None) -> torch.Tensor:
    """Logits ``[B, vocab]`` of one decode token per row, the batch run ``parts`` rows ranges at a time.

    ``forward(input_ids, position_ids, cache)`` runs the model and returns the last position's logits. With
    ``streams`` (CUDA, one per part, inside a graph capture) every part runs on its own stream after the current
    one, which waits for them all before the logits are joined, and the caller runs the layers'
    ``prepare_fused_step`` before and ``finish_fused_step`` after the replay. Without, the parts run one after the
    other on the current stream and each layer's bookkeeping goes with its first and last part. ``events``
    (``fetch_events``, with ``streams``) staggers the parts' fetches.
    """
    bounds = part_bounds(input_ids.shape[0], parts)
    if streams is None:
        outs = [forward(input_ids[b0:b1], position_ids[b0:b1], CacheRows(cache, b0, b1)) for b0, b1 in bounds]
        return torch.cat(outs)
    if len(streams) < len(bounds):
        raise ValueError(f"forward_by_parts: {len(bounds)} parts need as many streams; got {len(streams)}")
    main = torch.cuda.current_stream(input_ids.device)
    outs = []
    for part, ((b0, b1), stream) in enumerate(zip(bounds, streams)):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            outs.append(forward(input_ids[b0:b1], position_ids[b0:b1], CacheRows(cache, b0, b1, events, part)))
    for stream in streams[:len(bounds)]:
        main.wait_stream(stream)
    return torch.cat(outs)
