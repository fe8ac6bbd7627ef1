"""QUOKA chunked prefill (design Sec. 4): a long prompt attends chunk by chunk to a fixed budget of blocks.

A NosaCache layer hands over the whole update (every new token of the forward call) and gets the attention
output back. The tokens are cut into chunks whose own keys (the chunk plus the start of its first block, if an
earlier call wrote it) span at most ``prefill_chunk_size`` tokens. Per chunk and KV head:

1. ``selection.quoka_query_choice`` keeps, per query head, the ``quoka_queries`` queries least similar to the
   chunk's mean query;
2. ``kernels.quoka_score`` scores every complete block before the chunk by the cosine between those queries
   (averaged over the GQA group) and the compressed keys;
3. ``selection.quoka_select_blocks`` takes sink + local + the top blocks, ``prefill_budget_blocks`` in all;
4. the chunk's queries attend to those blocks plus the chunk itself (causal), with the eviction bias.

So a chunk reads at most ``prefill_budget_tokens + prefill_chunk_size`` KV tokens per (sequence, KV head)
(``stats()["device_tokens"]``), and the prompt's K/V are never assembled on the device: within one forward call
the projection output of the layer exists already, and ``kernels.chunk_attention`` reads the listed rows of it in
place. A call that continues a sequence (a caller's own chunking, a new turn) gathers each chunk's keys, taking
blocks of earlier calls from the host store. Every token's K, V and eviction score go to the host store and extend
the compressed keys, so afterwards the layer is in the state a dense prefill leaves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import NosaConfig
from .kernels.chunk_attention import chunk_attention
from .kernels.quoka_score import quoka_score
from .masks import padding_bias
from .selection import (
    MASK_VALUE,
    compress_keys,
    num_windows,
    quoka_query_choice,
    quoka_select_blocks,
    windows_available,
)

# Chunks whose queries are chosen and scored together (tokens): bounds the transient copies of queries and
# compressed-key windows while keeping the number of launches per chunk small.
GROUP_TOKENS = 8192


def chunk_layout(start: int, end: int, cfg: NosaConfig) -> list[tuple[int, int, int]]:
    """``(lo, first, end)`` per chunk of the tokens ``start .. end - 1``.

    A chunk's queries are the tokens ``first .. end - 1``; its own keys ``lo .. end - 1`` begin at the start of
    its first block (``lo <= first``, the difference written by an earlier call) and span at most
    ``prefill_chunk_size`` tokens; every chunk after the first begins on a block boundary.
    """
    P, C = cfg.block_size, cfg.prefill_chunk_size
    chunks, pos = [], start
    while pos < end:
        lo = pos // P * P
        hi = min(end, lo + C)
        chunks.append((lo, pos, hi))
        pos = hi
    return chunks


def extend_compressed(compressed, keys: torch.Tensor, bias: torch.Tensor, start: int) -> None:
    """Tokens ``start .. start + T - 1`` arrive (``keys [B, Hk, T, D]``, ``bias [B, Hk, T]``): finish every window
    they complete and refill the ring, leaving ``compressed`` as ``rebuild`` over the whole sequence would."""
    cfg = compressed.cfg
    kernel, stride = cfg.compress_kernel, cfg.compress_stride
    end = start + keys.shape[2]
    n_old, n_new = compressed.n, num_windows(end, cfg)
    if n_new > n_old:
        first = n_old * stride  # first token of the first new window; the ring holds it if it precedes start
        past = torch.arange(first, start, device=keys.device) % kernel
        span_k = torch.cat([compressed.ring_k[:, :, past], keys[:, :, max(0, first - start) :]], 2)
        span_b = torch.cat([compressed.ring_b[:, :, past], bias[:, :, max(0, first - start) :]], 2)
        compressed._reserve(n_new)
        compressed.keys[:, :, n_old:n_new] = compress_keys(span_k, cfg)
        compressed.bias[:, :, n_old:n_new] = compress_keys(span_b, cfg)
        compressed.n = n_new
    recent = torch.arange(max(start, end - kernel), end, device=keys.device)
    compressed.ring_k[:, :, recent % kernel] = keys[:, :, recent - start]
    compressed.ring_b[:, :, recent % kernel] = bias[:, :, recent - start]


def _choose_blocks(layer, q, valid, group, start) -> torch.Tensor:
    """QUOKA selection for a group of chunks: ``[B, Hk, R, K]`` block indices (-1 = none), best first."""
    cfg = layer.cfg
    P, C = cfg.block_size, cfg.prefill_chunk_size
    B, H, _, D = q.shape
    R = len(group)
    lo0, first, end = group[0][0], group[0][1], group[-1][2]
    front, n_new = first - lo0, end - first
    # Chunk r of the group holds the tokens lo0 + r*C ..: lay the queries out as [B, H, R, C, D].
    queries = F.pad(q[:, :, first - start : end - start], (0, 0, front, R * C - front - n_new)).view(B, H, R, C, D)
    real = torch.zeros(B, R * C, dtype=torch.bool, device=q.device)
    real[:, front : front + n_new] = True if valid is None else valid[:, first - start : end - start]
    real = real.view(B, 1, R, C)
    index = quoka_query_choice(queries, cfg.quoka_queries, real)  # [B, H, R, n]
    kept = queries.gather(3, index[..., None].expand(-1, -1, -1, -1, D))  # [B, H, R, n, D]
    n_valid = real[:, 0].sum(-1).clamp(max=index.shape[-1])  # [B, R]

    # Chunk r's own keys begin at lo0 + r*C; computed on the device (a tensor built from a list would sync).
    lo = lo0 + torch.arange(R, device=q.device) * C
    current = lo // P
    n_windows = windows_available(lo - 1, cfg)  # windows complete before each chunk
    n_blocks = group[-1][0] // P
    scores = quoka_score(kept, layer.compressed.keys, n_windows, n_blocks, cfg, n_valid=n_valid,
                         compressed_bias=layer.compressed.bias)
    budget = min(cfg.prefill_budget_blocks, n_blocks)
    return quoka_select_blocks(scores, current, cfg, budget_blocks=budget)


def _group_index(selected, group, start, end, cfg) -> torch.Tensor:
    """``[B, Hk, R, S]`` int32 rows of this forward's K/V each chunk of the group reads (-1 = none): the tokens of
    its selected blocks (``selected [B, Hk, R, K]``), then its own tokens."""
    P, C = cfg.block_size, cfg.prefill_chunk_size
    B, Hk, R, _ = selected.shape
    device = selected.device
    blocks = selected[..., None] * P - start + torch.arange(P, device=device)
    blocks = torch.where(selected[..., None] >= 0, blocks, -1).flatten(3)  # [B, Hk, R, K * P]
    own = group[0][0] - start + torch.arange(R * C, device=device).view(R, C)  # chunk r: its C tokens
    own = torch.where(own < end - start, own, -1)
    return torch.cat([blocks, own.expand(B, Hk, R, C)], -1).to(torch.int32)


def _chunk_kv(layer, k, v, b, start, selected, lo, end):
    """Keys ``[B, Hk, S, D]``, values and bias ``[B, Hk, S]`` a chunk attends to: its selected blocks (``[B, Hk, K]``,
    -1 = none), then its own tokens ``lo .. end - 1``."""
    P = layer.cfg.block_size
    B, Hk, T, D = k.shape
    device = k.device
    K = selected.shape[-1]
    # Blocks written by this forward: read them from its K/V in place (clamped indices for the others).
    first = selected.clamp(min=0) * P - start
    index = (first[..., None] + torch.arange(P, device=device)).clamp(0, T - 1).flatten(2)  # [B, Hk, K * P]
    bi = torch.arange(B, device=device)[:, None, None]
    hi = torch.arange(Hk, device=device)[None, :, None]
    sel_k, sel_v, sel_b = k[bi, hi, index], v[bi, hi, index], b[bi, hi, index]
    sel_b = sel_b.masked_fill((selected < 0).repeat_interleave(P, -1), MASK_VALUE)
    if start > 0 and lo > 0:
        _fetch_earlier_blocks(layer, selected, start, sel_k.view(B, Hk, K, P, D), sel_v.view(B, Hk, K, P, D),
                              sel_b.view(B, Hk, K, P))
    own_k, own_v, own_b = (x[:, :, max(lo, start) - start : end - start] for x in (k, v, b))
    if lo < start:  # the start of the chunk's first block came with an earlier call
        hk, hv, hb = layer.host.read(lo, start, device)
        layer.bytes_to_device += sum(x.numel() * x.element_size() for x in (hk, hv, hb))
        own_k, own_v, own_b = torch.cat([hk, own_k], 2), torch.cat([hv, own_v], 2), torch.cat([hb, own_b], 2)
    return torch.cat([sel_k, own_k], 2), torch.cat([sel_v, own_v], 2), torch.cat([sel_b, own_b], 2)


def _fetch_earlier_blocks(layer, selected, start, slot_k, slot_v, slot_b) -> None:
    """Copy the selected blocks that lie (even partly) before ``start`` from the host store into their slots."""
    P = layer.cfg.block_size
    from_host = (selected >= 0) & (selected * P < start)
    b_idx, h_idx, i_idx = from_host.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    hk, hv, hb = layer.host.gather_blocks(b_idx.cpu(), h_idx.cpu(), selected[b_idx, h_idx, i_idx].cpu())
    device = slot_k.device
    slot_k[b_idx, h_idx, i_idx] = hk.to(device, non_blocking=True)
    slot_v[b_idx, h_idx, i_idx] = hv.to(device, non_blocking=True)
    slot_b[b_idx, h_idx, i_idx] = hb.to(device, non_blocking=True)
    layer.bytes_to_device += sum(x.numel() * x.element_size() for x in (hk, hv, hb))


_WRITERS: dict[torch.device, "torch.cuda.Stream"] = {}


def _write_to_host(layer, start, k, v, b):
    """Store the update in the host store; on CUDA from a side stream, so the copy overlaps the chunk attention.

    Returns that stream (None on CPU): the caller makes its stream wait for it once the layer is done.
    """
    if not k.is_cuda:
        layer.host.write(start, k, v, b)
        return None
    main = torch.cuda.current_stream(k.device)
    writer = _WRITERS.get(k.device)
    if writer is None:
        writer = _WRITERS[k.device] = torch.cuda.Stream(k.device)
    writer.wait_stream(main)
    with torch.cuda.stream(writer):
        layer.host.write(start, k, v, b)
    for t in (k, v, b):
        t.record_stream(writer)
    return writer


def quoka_prefill(layer, k, v, q, b, attention_mask, scale: float) -> torch.Tensor:
    """Store an update of several tokens in ``layer`` (a NosaLayer) and attend to it chunk by chunk with QUOKA.

    Args:
        k, v: ``[B, Hk, Tq, D]`` post-RoPE keys and values of the new tokens; q: ``[B, H, Tq, D]``.
        b: ``[B, Hk, Tq]`` fp32 eviction scores; attention_mask: the model's mask (padding) or None.

    Returns:
        ``[B, H, Tq, D]`` attention output in the query's dtype.
    """
    cfg = layer.cfg
    P = cfg.block_size
    B, Hk, T, _ = k.shape
    start = layer.seen
    end = start + T
    valid = None
    pad = padding_bias(attention_mask, start, T)
    if pad is not None:
        pad = pad.to(b.device)
        b = b + pad
        valid = pad[:, 0] == 0  # [B, Tq]
    writer = _write_to_host(layer, start, k, v, b)
    layer.seen = end

    out = torch.empty_like(q)
    chunks = chunk_layout(start, end, cfg)
    per_group = max(1, GROUP_TOKENS // cfg.prefill_chunk_size)
    for g in range(0, len(chunks), per_group):
        group = chunks[g : g + per_group]
        a, z = group[0][1] - start, group[-1][2] - start
        extend_compressed(layer.compressed, k[:, :, a:z], b[:, :, a:z], start + a)
        selected = _choose_blocks(layer, q, valid, group, start)  # [B, Hk, R, K]
        K = selected.shape[-1]
        for lo, first, hi in group:
            layer.peak_device_tokens = max(layer.peak_device_tokens, min(K, lo // P) * P + hi - lo)
        if start == 0:
            # Every key the group reads was written by this forward: read it in place.
            index = _group_index(selected, group, start, end, cfg)
            rows = [first - start for _, first, _ in group] + [z]
            chunk_attention(q, k, v, b, index, rows, [0] * len(group), scale, out=out)
            continue
        for r, (lo, first, hi) in enumerate(group):
            keys, values, key_bias = _chunk_kv(layer, k, v, b, start, selected[:, :, r, : min(K, lo // P)], lo, hi)
            S, n = keys.shape[2], hi - first
            index = torch.arange(S, device=k.device, dtype=torch.int32).expand(B, Hk, 1, S)
            rows_q = slice(first - start, hi - start)
            chunk_attention(
                q[:, :, rows_q], keys, values, key_bias, index, [0, n], [S - n], scale, out=out[:, :, rows_q]
            )

    # Leave the layer as a dense prefill would: empty slots but for the partly written last block.
    tail = end - end % P
    if tail >= start:
        layer._reset_slots(k, v, b)
    else:
        layer._reset_slots(*layer.host.read(tail, end, layer.device))
    if layer.selector is not None:
        layer.selector.observe(layer, k, b, start)
    if writer is not None:  # later kernels (decode fetches) read the store in stream order
        torch.cuda.current_stream(k.device).wait_stream(writer)
    return out
