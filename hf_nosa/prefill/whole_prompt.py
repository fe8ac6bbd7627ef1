"""QUOKA's chunks inside one layer: a prompt that goes through each layer whole.

A QUOKA prompt normally goes through the whole model one chunk at a time (``modeling.chunked``), so the device never
holds more than a chunk's activations and a budget of K/V; each chunk's blocks are read back from the host store and
the dense tail reads the whole prompt once more. That costs PCIe time and, at small batches, launch-bound host work
per chunk and layer: at 64K and batch 1 on an H200, generate's prefill in 2048-token chunks took 1.14 s of wall time
for 0.61 s of GPU work (1b shape, ``docs/results/2026-12-03_prefill_breakdown_64k_b1_eceb868.json``).

When the prompt is small enough to keep its activations on the device (``NosaConfig.prefill_whole_prompt_tokens``),
it goes through each layer whole, and the layer cuts it into the same chunks (``NosaConfig.prefill_chunk``). Each
chunk is selected as before (``quoka.quoka_select`` on the layer's compressed keys, which now cover the whole
prompt but are read only up to the chunk), and attends to:

- its QUOKA blocks, gathered from the layer's keys on the device (``gather_blocks``) instead of fetched from the host
  store; the host store gets the prompt in one write on the side stream, for decoding;
- itself, causally;
- for the rows whose dense tail it holds, those queries again over every earlier token, also on the device.

So every query attends to exactly the keys it would chunk by chunk; with a host store in the model's dtype the
outputs are the same up to the kernels' rounding (a quantized store is read unrounded here).
``AttentionInputs.chunks`` carries one ``AttentionInputs`` per chunk, which ``attention.dispatch`` (and the reference
``attend``) run in order.
"""

from __future__ import annotations

import torch

from ..attention.pool import PoolBlocks
from ..attention.prefix import DenseTail, Prefix
from ..rules.attend import AttentionInputs
from ..rules.selection import MASK_VALUE
from .quoka import quoka_select


def gather_blocks(k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, selected: torch.Tensor, block_size: int):
    """The blocks ``selected [B, Hk, K]`` (block indices, -1: none) of ``k, v [B, Hk, T, D]`` and ``b [B, Hk, T]``,
    one after another: ``[B, Hk, K * block_size, D]`` twice and ``[B, Hk, K * block_size]`` fp32. A missing block
    reads block 0 (finite values) behind a ``MASK_VALUE`` bias."""
    B, Hk, K = selected.shape
    D = k.shape[-1]
    tokens = selected.clamp(min=0)[..., None] * block_size + torch.arange(block_size, device=selected.device)
    tokens = tokens.flatten(2)  # [B, Hk, K * P]
    present = (selected >= 0)[..., None].expand(B, Hk, K, block_size).flatten(2)  # [B, Hk, K * P]
    wide = tokens[..., None].expand(B, Hk, K * block_size, D)
    return k.gather(2, wide), v.gather(2, wide), torch.where(present, b.float().gather(2, tokens), MASK_VALUE)


def _device_prefix(k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, length: int) -> Prefix:
    """The prompt's first ``length`` tokens, as a dense tail's prefix read in one piece where they lie."""
    return Prefix(lambda lo, hi: (k[:, :, lo:hi], v[:, :, lo:hi], b[:, :, lo:hi]), length, max(length, 1))


def quoka_chunks(layer, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, b: torch.Tensor,
                 valid: torch.Tensor | None, target: int) -> AttentionInputs:
    """A whole prompt's QUOKA chunks in one layer (``layer``: a NosaLayer at the start of a prompt).

    Args:
        k, v: ``[B, Hk, T, D]``, b: ``[B, Hk, T]`` fp32 (padding folded in), q: ``[B, H, T, D]``: the whole prompt.
        valid: ``[B, T]`` bool, False for padding (None: none).
        target: where the prompt ends (``T`` unless more updates follow).

    Stores the prompt (compressed keys, then the host store's write on the side stream) and returns the chunks'
    inputs as ``AttentionInputs.chunks``.
    """
    cfg = layer.cfg
    T = k.shape[2]
    C = cfg.prefill_chunk(layer.batch)
    layer._store(0, k, v, b)
    layer.peak_device_tokens = max(layer.peak_device_tokens, T)
    chunks = []
    for start in range(0, T, C):
        end = min(T, start + C)
        kc, vc, bc = k[:, :, start:end], v[:, :, start:end], b[:, :, start:end]
        first_tail = layer._first_tail_query(start, end, target)
        if first_tail is not None and not bool(first_tail.any()):  # every query of every row: the prefix only
            chunks.append(AttentionInputs(kc, vc, bc, None, 0, causal=True, prefix=_device_prefix(k, v, b, start)))
            continue
        chunk = AttentionInputs(kc, vc, bc, None, 0, causal=True)
        selected = quoka_select(layer, q[:, :, start:end], None if valid is None else valid[:, start:end], start)
        if selected.shape[-1]:
            P = cfg.block_size
            chunk = chunk._replace(blocks=PoolBlocks(
                lambda b0, b1, s=selected: gather_blocks(k[b0:b1], v[b0:b1], b[b0:b1], s[b0:b1], P), 1))
        if first_tail is not None:
            chunk = chunk._replace(tail=DenseTail(_device_prefix(k, v, b, start), first_tail))
        chunks.append(chunk)
    return AttentionInputs(k, v, b, None, 0, causal=True, chunks=tuple(chunks))
