"""QUOKA's choice of blocks for one prefill chunk (design Sec. 4), used by the chunked prefill (``prefill``) and by a
prompt that goes through each layer whole (``whole_prompt``): kept queries, block scores over the compressed keys,
top blocks, each one launch on CUDA (``kernels.prefill.quoka_choice``, ``kernels.prefill.quoka_score``,
``kernels.prefill.quoka_top``)."""

from __future__ import annotations

import torch

from ..kernels.prefill.quoka_choice import quoka_kept_queries
from ..kernels.prefill.quoka_score import quoka_score
from ..kernels.prefill.quoka_top import quoka_top_blocks
from ..rules.selection import windows_before


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
    B, _, T, _ = query.shape
    lo = start // P * P  # the chunk's own keys begin on its first block
    n_blocks = lo // P
    budget = min(cfg.prefill_budget_blocks, n_blocks)
    n_keep = min(T, cfg.quoka_queries)
    n_windows = windows_before(lo, cfg)  # windows complete before the chunk, counted on the host
    counts = _counts(layer, max(n_windows, n_keep, layer.compressed.keys.shape[2]), query.device)
    if budget == 0:
        return torch.full((B, layer.kv_heads, 0), -1, dtype=torch.long, device=query.device)
    kept = quoka_kept_queries(query, cfg.quoka_queries, valid)  # [B, H, 1, n, D]
    if valid is None:
        n_valid = counts[n_keep : n_keep + 1].expand(B, 1)
    else:
        n_valid = valid[:, None].sum(-1, dtype=torch.int32).clamp(max=n_keep)  # [B, 1]
    compressed = layer.compressed
    scores = quoka_score(kept, compressed.keys, counts[n_windows : n_windows + 1], n_blocks, cfg, n_valid=n_valid,
                         compressed_bias=compressed.bias)
    return quoka_top_blocks(scores, n_blocks, cfg, budget)[:, :, 0]


def _counts(layer, upto: int, device: torch.device) -> torch.Tensor:
    """``0, 1, .., >= upto`` int32 on ``device``, made once per layer (sized by its compressed keys' capacity, so
    once per generation): a slice of it is a count the kernels read from the device, with no launch, where a
    ``torch.full`` and a dtype conversion per count took launches in every layer and chunk."""
    counts = getattr(layer, "_quoka_counts", None)
    if counts is None or counts.numel() <= upto or counts.device != device:
        counts = layer._quoka_counts = torch.arange(upto + 1, dtype=torch.int32, device=device)
    return counts
