"""Training-free block selectors on the NosaCache engine: the baselines NOSA is measured against.

Each runs with the same host store, slot pool, fetch, budget and bias-free attention as NOSA, and keeps the sink
blocks and the local window like NOSA does; only the rule that picks the other blocks differs. Use them through
the selector hook::

    cache = NosaCache(model.config, nosa_config, selector=QuestSelector())

- ``QueryOnlySelector`` (InfLLMv2-style): NOSA's query-aware score (softmax over compressed-key windows, summed
  over the GQA group, max-pooled to blocks) picks the whole budget; no eviction head.
- ``QuestSelector`` (Quest, Tang et al. 2024): per block, the element-wise min and max of its keys bound
  ``q . k`` from above: ``sum_d max(q_d * max_d, q_d * min_d)``; the blocks with the highest bound (max over the
  query heads of the group) are taken.
- ``ShadowKVSelector`` (ShadowKV, Sun et al. 2024): per block, a landmark (the mean of its keys); per query head a
  softmax of ``q . landmark * scale`` over blocks, max over the group, top blocks. Outlier blocks (lowest
  minimum cosine similarity between a key and its landmark, among the blocks present at prefill) are always
  kept, taken from the same budget. ShadowKV's chunks are 8 tokens; here a chunk is one fetch block.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, D head dim, T tokens, P block size, N blocks, K budget
blocks.
"""

from __future__ import annotations

import torch

from ..rules.selection import MASK_VALUE, force_sink_and_local, query_block_scores, topk_recent_first

# A token whose stored score is at most this is padding (cache.py stores MASK_VALUE for it).
_PADDING = MASK_VALUE / 2


def _no_blocks(layer) -> torch.Tensor:
    return torch.full((layer.batch, layer.kv_heads, layer.cfg.budget_blocks), -1, dtype=torch.long, device=layer.device)


def top_blocks(scores: torch.Tensor, cfg, forced: torch.Tensor | None = None) -> torch.Tensor:
    """The budget of a training-free rule: sink and local window (and ``forced``) first, then the top scores.

    Args:
        scores: ``[B, Hk, N]`` over the complete blocks before the current one (N = current block index);
            ``-inf`` for blocks that must not be chosen.
        forced: optional ``[B, Hk, N]`` bool of other blocks to keep (ShadowKV's outliers).

    Returns:
        ``[B, Hk, K]`` long block indices, -1 where fewer than K blocks exist; ties go to the most recent block.
    """
    current = torch.tensor([scores.shape[-1]], device=scores.device)
    scores, _ = force_sink_and_local(scores.nan_to_num(nan=float("-inf"))[:, :, None], current, cfg)
    scores = scores[:, :, 0]
    if forced is not None:
        scores = scores.masked_fill(forced, float("inf"))
    return topk_recent_first(scores, cfg.budget_blocks)


def _ensure_blocks(state: dict, name: str, n_blocks: int, like: torch.Tensor, fill: float) -> torch.Tensor:
    """``state[name]``, grown along dim 2 to at least ``n_blocks`` blocks (new entries hold ``fill``)."""
    current = state.get(name)
    if current is not None and current.shape[2] >= n_blocks:
        return current
    have = 0 if current is None else current.shape[2]
    grow = max(n_blocks - have, 64, have // 2)
    extra = torch.full((*like.shape[:2], grow, *like.shape[3:]), fill, dtype=like.dtype, device=like.device)
    state[name] = extra if current is None else torch.cat([current, extra], 2)
    return state[name]


class QueryOnlySelector:
    """InfLLMv2-style: the query-aware block score alone fills the budget (sink and local window kept)."""

    name = "query_only"

    def observe(self, layer, keys: torch.Tensor, bias: torch.Tensor, start: int) -> None:
        """Nothing to keep: the cache's compressed keys are the whole index."""

    def select(self, layer, query: torch.Tensor, t: int, scale: float) -> torch.Tensor:
        cfg = layer.cfg
        c = t // cfg.block_size
        if c == 0:
            return _no_blocks(layer)
        keys = layer.compressed.keys[:, :, : layer.compressed.n]
        bias = layer.compressed.bias[:, :, : layer.compressed.n]  # marks the padding windows
        positions = torch.tensor([t], device=query.device)
        scores = query_block_scores(query, keys, positions, c, cfg, scale, compressed_bias=bias)[:, :, 0]  # [B,Hk,c]
        return top_blocks(scores, cfg)


class QuestSelector:
    """Quest: per-block key min/max bound the attention logit; the highest bounds fill the budget."""

    name = "quest"

    def observe(self, layer, keys: torch.Tensor, bias: torch.Tensor, start: int) -> None:
        P = layer.cfg.block_size
        state = layer.selector_state
        B, Hk, T, D = keys.shape
        real = (bias > _PADDING)[..., None]  # [B, Hk, T, 1]
        if start == 0:  # the whole sequence: rebuild
            N = -(-T // P)
            pad = N * P - T
            lo = torch.where(real, keys.float(), float("inf"))
            hi = torch.where(real, keys.float(), float("-inf"))
            lo = torch.nn.functional.pad(lo, (0, 0, 0, pad), value=float("inf")).view(B, Hk, N, P, D).amin(3)
            hi = torch.nn.functional.pad(hi, (0, 0, 0, pad), value=float("-inf")).view(B, Hk, N, P, D).amax(3)
            state.pop("kmin", None)
            state.pop("kmax", None)
            _ensure_blocks(state, "kmin", N, lo, float("inf"))[:, :, :N] = lo
            _ensure_blocks(state, "kmax", N, hi, float("-inf"))[:, :, :N] = hi
            return
        if T != 1:
            raise ValueError(f"QuestSelector.observe: expected the whole sequence (start=0) or one token, got {T} at {start}")
        b = start // P
        k = torch.where(real, keys.float(), float("nan"))[:, :, 0]  # [B, Hk, D]; NaN is ignored by fmin/fmax
        kmin = _ensure_blocks(state, "kmin", b + 1, k[:, :, None], float("inf"))
        kmax = _ensure_blocks(state, "kmax", b + 1, k[:, :, None], float("-inf"))
        if start % P == 0:  # a new block starts: forget whatever the slot held
            kmin[:, :, b] = float("inf")
            kmax[:, :, b] = float("-inf")
        kmin[:, :, b] = torch.fmin(kmin[:, :, b], k)
        kmax[:, :, b] = torch.fmax(kmax[:, :, b], k)

    def select(self, layer, query: torch.Tensor, t: int, scale: float) -> torch.Tensor:
        cfg = layer.cfg
        c = t // cfg.block_size
        if c == 0:
            return _no_blocks(layer)
        kmin = layer.selector_state["kmin"][:, :, :c]  # [B, Hk, c, D]
        kmax = layer.selector_state["kmax"][:, :, :c]
        B, H, _, D = query.shape
        Hk = kmin.shape[1]
        empty = kmax[..., 0] < kmin[..., 0]  # blocks of padding only
        q = query.float()[:, :, 0].view(B, Hk, H // Hk, 1, D)  # [B, Hk, G, 1, D]
        lo = kmin.masked_fill(empty[..., None], 0.0)[:, :, None]  # [B, Hk, 1, c, D]
        hi = kmax.masked_fill(empty[..., None], 0.0)[:, :, None]
        bound = torch.maximum(q * lo, q * hi).sum(-1).amax(2) * scale  # [B, Hk, c]
        return top_blocks(bound.masked_fill(empty, float("-inf")), cfg)


class ShadowKVSelector:
    """ShadowKV: block landmarks (key means) scored by the query, plus static outlier blocks, fill the budget.

    Args:
        outlier_fraction: share of the budget blocks reserved for outliers (ShadowKV keeps 24 chunks of 8 tokens
            per 1024 budget tokens, 3/16).
    """

    name = "shadowkv"

    def __init__(self, outlier_fraction: float = 3 / 16):
        if not isinstance(outlier_fraction, (int, float)) or isinstance(outlier_fraction, bool) or not 0 <= outlier_fraction < 1:
            raise ValueError(f"outlier_fraction={outlier_fraction!r} is invalid: it must be a number in [0, 1)")
        self.outlier_fraction = float(outlier_fraction)

    def observe(self, layer, keys: torch.Tensor, bias: torch.Tensor, start: int) -> None:
        P = layer.cfg.block_size
        state = layer.selector_state
        B, Hk, T, D = keys.shape
        real = (bias > _PADDING)[..., None].float()  # [B, Hk, T, 1]
        k = keys.float() * real
        if start == 0:
            N = -(-T // P)
            pad = N * P - T
            k = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, Hk, N, P, D)
            n = torch.nn.functional.pad(real[..., 0], (0, pad)).view(B, Hk, N, P)
            total = k.sum(3)
            count = n.sum(3)
            state.pop("ksum", None)
            state.pop("kcount", None)
            state.pop("outlier", None)
            _ensure_blocks(state, "ksum", N, total, 0.0)[:, :, :N] = total
            _ensure_blocks(state, "kcount", N, count, 0.0)[:, :, :N] = count
            # Outliers among the complete blocks: the lowest minimum cosine similarity of a key to its landmark.
            full = T // P
            mean = total / count.clamp(min=1)[..., None]
            cos = torch.nn.functional.cosine_similarity(k, mean[:, :, :, None], dim=-1)  # [B, Hk, N, P]
            cos = cos.masked_fill(n == 0, float("inf")).amin(-1)
            outlier = (-cos).masked_fill(torch.arange(N, device=k.device) >= full, float("-inf"))
            outlier = outlier.masked_fill(count == 0, float("-inf"))
            _ensure_blocks(state, "outlier", N, outlier, float("-inf"))[:, :, :N] = outlier
            return
        if T != 1:
            raise ValueError(f"ShadowKVSelector.observe: expected the whole sequence (start=0) or one token, got {T} at {start}")
        b = start // P
        ksum = _ensure_blocks(state, "ksum", b + 1, k, 0.0)
        kcount = _ensure_blocks(state, "kcount", b + 1, real[..., 0], 0.0)
        _ensure_blocks(state, "outlier", b + 1, real[..., 0], float("-inf"))
        if start % P == 0:
            ksum[:, :, b] = 0.0
            kcount[:, :, b] = 0.0
            state["outlier"][:, :, b] = float("-inf")  # blocks written while decoding are never outliers
        ksum[:, :, b] += k[:, :, 0]
        kcount[:, :, b] += real[:, :, 0, 0]

    def select(self, layer, query: torch.Tensor, t: int, scale: float) -> torch.Tensor:
        cfg = layer.cfg
        c = t // cfg.block_size
        if c == 0:
            return _no_blocks(layer)
        state = layer.selector_state
        count = state["kcount"][:, :, :c]
        landmark = state["ksum"][:, :, :c] / count.clamp(min=1)[..., None]  # [B, Hk, c, D]
        B, H, _, D = query.shape
        Hk = landmark.shape[1]
        q = query.float()[:, :, 0].view(B, Hk, H // Hk, D)
        logits = torch.einsum("bkgd,bknd->bkgn", q, landmark) * scale
        logits = logits.masked_fill((count == 0)[:, :, None], float("-inf"))
        scores = torch.softmax(logits, -1).nan_to_num(0.0).amax(2)  # [B, Hk, c]
        scores = scores.masked_fill(count == 0, float("-inf"))
        forced = None
        n_outliers = int(cfg.budget_blocks * self.outlier_fraction)
        if n_outliers:
            outlier = state["outlier"][:, :, :c]
            chosen = topk_recent_first(outlier, n_outliers)  # [B, Hk, n_outliers], -1 where none
            forced = torch.zeros(B, Hk, c + 1, dtype=torch.bool, device=outlier.device)
            forced.scatter_(-1, torch.where(chosen < 0, c, chosen), True)
            forced = forced[..., :c]
        return top_blocks(scores, cfg, forced)


BASELINES = {
    "query_only": QueryOnlySelector,
    "quest": QuestSelector,
    "shadowkv": ShadowKVSelector,
}


def make_selector(name: str):
    """A fresh selector by name: one of ``BASELINES`` ("query_only", "quest", "shadowkv")."""
    if name not in BASELINES:
        raise ValueError(f"selector {name!r} is unknown; allowed values are {tuple(BASELINES)}")
    return BASELINES[name]()
