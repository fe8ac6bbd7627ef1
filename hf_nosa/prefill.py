"""QUOKA chunk selection (design Sec. 4): which earlier blocks one prefill chunk attends to.

The prompt reaches a NosaCache one chunk of ``prefill_chunk_size`` tokens at a time: ``modeling.chunked`` sends it
through the whole model chunk by chunk, so every layer finishes chunk i before any layer sees chunk i + 1. For a
chunk and per KV head:

1. ``selection.quoka_query_choice`` keeps, per query head, the ``quoka_queries`` queries least similar to the
   chunk's mean query;
2. ``kernels.quoka_score`` scores every complete block before the chunk by the cosine between those queries
   (averaged over the GQA group) and the compressed keys;
3. ``selection.quoka_select_blocks`` takes sink + local + the top blocks, ``prefill_budget_blocks`` in all;
4. the layer fetches those blocks into its slot pool (``kernels.fetch.fetch_selection``: blocks kept from the
   previous chunk stay, the others come from the host store) and the chunk attends to them plus itself (causal),
   with the eviction bias.

So a chunk reads at most ``prefill_budget_tokens + prefill_chunk_size`` KV tokens per (sequence, KV head)
(``stats()["device_tokens"]``), and the prompt's K/V are never on the device at once.
"""

from __future__ import annotations

import torch

from .kernels.host_write import host_write
from .kernels.quoka_score import quoka_score
from .selection import quoka_query_choice, quoka_select_blocks, windows_available

_WRITERS: dict[torch.device, "torch.cuda.Stream"] = {}


def write_to_host(host, start: int, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor):
    """Store tokens ``start ..`` in ``host``; on CUDA from a side stream, so the copy overlaps the attention.

    Returns that stream (None on CPU): the caller makes its stream wait for it before anything reads the store.
    """
    if not k.is_cuda:
        host_write(host, start, k, v, b)
        return None
    main = torch.cuda.current_stream(k.device)
    writer = _WRITERS.get(k.device)
    if writer is None:
        writer = _WRITERS[k.device] = torch.cuda.Stream(k.device)
    writer.wait_stream(main)
    with torch.cuda.stream(writer):
        host_write(host, start, k, v, b)
    for t in (k, v, b):
        t.record_stream(writer)
    return writer


def quoka_select(layer, query: torch.Tensor, valid: torch.Tensor | None, start: int) -> torch.Tensor:
    """QUOKA's blocks for one chunk whose queries are the tokens ``start ..``: ``[B, Hk, K]`` (-1 = none).

    Args:
        layer: a NosaLayer whose compressed keys cover every token before ``start``.
        query: ``[B, H, T, D]`` the chunk's post-RoPE queries.
        valid: ``[B, T]`` bool, False for padding (None: no padding).

    Candidates are the complete blocks before the block holding ``start``; K = min(prefill budget, candidates).
    """
    cfg = layer.cfg
    P = cfg.block_size
    B, H, T, D = query.shape
    lo = start // P * P  # the chunk's own keys begin on its first block
    n_blocks = lo // P
    budget = min(cfg.prefill_budget_blocks, n_blocks)
    if budget == 0:
        return torch.full((B, layer.kv_heads, 0), -1, dtype=torch.long, device=query.device)
    queries = query[:, :, None]  # [B, H, 1, T, D]
    real = None if valid is None else valid[:, None, None]  # [B, 1, 1, T]
    index = quoka_query_choice(queries, cfg.quoka_queries, real)  # [B, H, 1, n]
    kept = queries.gather(3, index[..., None].expand(-1, -1, -1, -1, D))  # [B, H, 1, n, D]
    n_keep = index.shape[-1]
    if real is None:
        n_valid = torch.full((B, 1), min(T, n_keep), dtype=torch.long, device=query.device)
    else:
        n_valid = real[:, 0].sum(-1).clamp(max=n_keep)  # [B, 1]
    first = torch.full((1,), lo, dtype=torch.long, device=query.device)
    n_windows = windows_available(first - 1, cfg)  # windows complete before the chunk
    compressed = layer.compressed
    scores = quoka_score(kept, compressed.keys, n_windows, n_blocks, cfg, n_valid=n_valid,
                         compressed_bias=compressed.bias)
    return quoka_select_blocks(scores, first // P, cfg, budget_blocks=budget)[:, :, 0]
