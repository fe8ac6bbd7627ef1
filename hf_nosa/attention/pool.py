"""A QUOKA chunk over the blocks its selection holds in the slot pool, fetched a part of the batch at a time.

A QUOKA chunk attends to the blocks chosen for it, held in the layer's slot pool, then to itself (causal). Bringing
the chosen blocks in crosses PCIe: in the 1b shape with random weights at 64K tokens, 35 of a chunk's 64 blocks per
layer and KV head are not yet on the device (``benchmarks/quoka_fetch_bytes.py``), about 8 GB per sequence over a
prompt, and the attention over them cannot start before they are in. So the cache hands the attention a
``PoolBlocks``: ``fetch(b0, b1)`` makes rows ``b0 .. b1 - 1`` of the pool hold their selection and returns those
rows' keys, values and bias; the attention runs a part of the batch at a time and, on CUDA, fetches part p + 1 on a
side stream while it attends over part p (``read_ahead``). Rows share nothing: the fetch of one part and the
attention of another touch different rows of the pool.

Where the Triton kernels run (CUDA), the attention is ``kernels.prefill.flash_biased`` reading the blocks where they lie
in the pool and then the chunk's own keys: no copy, and the bias one fp32 load per key. On an H200 it ran a 1b-shaped
chunk of 512 queries over 4096 pool keys at 240 TFLOP/s against 104 for the sdpa route with the bias in extra head
dimensions, which also copies blocks and chunk into widened buffers first (``dense_attention
.biased_attention_joined``; docs/results/2026-12-02_quoka_attention_512.json). That route stays where the kernel does
not run: the CPU, and head dims the kernel does not take.

``attend.with_prefix_read`` fetches every row at once and puts the blocks before the chunk's keys: the reference.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from ..kernels.prefill.flash_biased import flash_biased, runs_on_kernel
from ..rules.inputs import AttentionInputs, PoolBlocks  # noqa: F401  (PoolBlocks: named here for callers)
from .dense import biased_attention_joined
from .read_ahead import read_ahead

PARTS_ENV_VAR = "HF_NOSA_PREFILL_FETCH_PARTS"
MIN_ROWS_PER_PART = 4  # a small batch's prefill waits on kernel launches, not PCIe: more parts would only add launches


def fetch_parts(device: torch.device, batch: int) -> int:
    """How many parts of the batch a QUOKA chunk's fetch is split into: on CUDA ``HF_NOSA_PREFILL_FETCH_PARTS``
    (default 4; 1 turns the overlap off), with at least ``MIN_ROWS_PER_PART`` rows a part; on the CPU 1 (nothing to
    overlap with)."""
    if torch.device(device).type != "cuda":
        return 1
    value = os.environ.get(PARTS_ENV_VAR, "4")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{PARTS_ENV_VAR}={value!r} is invalid: it must be a positive integer (1: no overlap)")
    return min(int(value), max(1, batch // MIN_ROWS_PER_PART))


def part_bounds(batch: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous row ranges covering ``0 .. batch - 1``, sizes differing by at most one."""
    parts = max(1, min(parts, batch))
    edges = [batch * i // parts for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def attend_with_pool_blocks(query: torch.Tensor, inputs: AttentionInputs, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """``query [B, H, Tq, D]`` over ``inputs.blocks`` (all visible) and then ``inputs``' own keys, the queries
    being the last of them (causal), one part of the batch at a time. Returns ``[B, H, Tq, D]``, written into
    ``out`` when given (a view of a whole prompt's output: ``whole_prompt``)."""
    if not inputs.causal or inputs.attn_mask is not None or inputs.q_offset != 0 \
            or inputs.keys.shape[2] != query.shape[2]:
        raise ValueError("attend_with_pool_blocks: pool blocks go with a causal chunk over its own keys only")
    blocks = inputs.blocks
    bounds = part_bounds(query.shape[0], blocks.parts)
    out = torch.empty_like(query) if out is None else out
    reads = [partial(blocks.fetch, b0, b1) for b0, b1 in bounds]
    on_kernel = runs_on_kernel(query, "the QUOKA chunk attention")
    dtype = query.dtype
    for (b0, b1), (k, v, b) in zip(bounds, read_ahead(reads, query.device)):
        if on_kernel:
            flash_biased(query[b0:b1], inputs.keys[b0:b1].to(dtype), inputs.values[b0:b1].to(dtype),
                         inputs.key_bias[b0:b1].float(), scale, prefix=(k.to(dtype), v.to(dtype), b.float()),
                         out=out[b0:b1])
        else:
            # The blocks and the chunk go straight into the sdpa kernels' widened buffers, the bias always folded
            # in (the pool's is nonzero in nearly every call: eviction scores, empty slots).
            out[b0:b1] = biased_attention_joined(query[b0:b1], [k, inputs.keys[b0:b1]], [v, inputs.values[b0:b1]],
                                                 [b, inputs.key_bias[b0:b1]], scale)
    return out
