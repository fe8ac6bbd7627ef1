"""Selection alignment: an auxiliary training loss that teaches the query-aware score where attention goes.

The selection is a discrete choice and carries no gradient, so training with the NOSA attention alone only
reinforces blocks that were already selected: a needle block the compressed-key score misses gets no signal to be
picked next time. This loss gives it one. For a few query positions per sequence it compares, over the blocks
the query-aware part chooses among (before the token's block, neither sink nor local window):

- the target: how much full attention (same queries and keys, no gradient) puts on each block, summed over the
  heads of the GQA group, normalised;
- the prediction: the query-aware block score of the decode rule (``selection.query_block_scores``, softmax over
  compressed windows, summed over the group, max-pooled to blocks), normalised;

and returns KL(target || prediction), averaged over positions and KV heads. Its gradient reaches the queries and
the compressed keys, so LoRA on ``q_proj``/``k_proj`` learns to rank the blocks attention needs first. It
changes no attention: the model still trains with exactly the rule it decodes with. (DeepSeek's sparse attention
trains its block indexer against the dense attention distribution the same way.)

Turn it on with ``enable_selection_loss(model, weight)``; in training mode every NOSA layer then leaves its loss
on the module and ``selection_loss(model)`` sums them, weighted, for the training step to add. Packed sequences
only (no padding); gradient checkpointing is refused, because a recomputed layer would not hand back the loss.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, S sampled positions, T tokens, N blocks, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import NosaConfig
from .selection import compress_keys, force_sink_and_local, query_block_scores

EPS = 1e-8


def sampled_positions(n_tokens: int, cfg: NosaConfig, positions: int) -> torch.Tensor:
    """``positions`` query positions spread evenly over the tokens that have a block to choose (long)."""
    first = (cfg.sink_blocks + cfg.local_blocks + 1) * cfg.block_size  # earliest token with a candidate block
    if n_tokens <= first:
        return torch.empty(0, dtype=torch.long)
    return torch.linspace(first, n_tokens - 1, min(positions, n_tokens - first)).round().long().unique()


def selection_alignment_loss(
    query: torch.Tensor, key: torch.Tensor, cfg: NosaConfig, scale: float, *, positions: int = 32
) -> torch.Tensor:
    """KL(full-attention block mass || query-aware block score) over the candidate blocks; a scalar.

    Args:
        query: ``[B, H, T, D]`` post-RoPE queries of positions ``0 .. T-1``.
        key: ``[B, Hk, T, D]`` post-RoPE keys.
        positions: how many query positions to sample per sequence.

    Returns:
        fp32 scalar, >= 0 (0 when no position has a candidate block).
    """
    if positions < 1:
        raise ValueError(f"positions={positions} is invalid: it must be at least 1")
    B, H, T, D = query.shape
    Hk = key.shape[1]
    G, P = H // Hk, cfg.block_size
    N = (T + P - 1) // P
    at = sampled_positions(T, cfg, positions).to(query.device)  # [S]
    if at.numel() == 0:
        return query.new_zeros((), dtype=torch.float32)
    with torch.autocast(query.device.type, enabled=False):
        q = query[:, :, at].float()  # [B, H, S, D]
        k = key.float()
        with torch.no_grad():
            logits = torch.einsum("bkgsd,bktd->bkgst", q.view(B, Hk, G, -1, D), k) * scale  # [B, Hk, G, S, T]
            logits = logits.masked_fill(torch.arange(T, device=k.device) > at[:, None], float("-inf"))
            probs = torch.softmax(logits, -1).sum(2)  # [B, Hk, S, T]
            pad = N * P - T
            mass = torch.nn.functional.pad(probs, (0, pad)).view(B, Hk, -1, N, P).sum(-1)  # [B, Hk, S, N]
        scores = query_block_scores(q, compress_keys(k, cfg), at, N, cfg, scale)  # [B, Hk, S, N], with gradient
        # the shared rule marks sink and local window +inf and later blocks -inf: what stays finite is chosen among
        # (never empty, by the choice of positions)
        forced, _ = force_sink_and_local(scores.detach(), at // P, cfg)
        chosen_among = forced.isfinite()  # [B, Hk, S, N]
        target = mass * chosen_among
        target = target / target.sum(-1, keepdim=True).clamp_min(EPS)
        predicted = scores * chosen_among
        predicted = predicted / predicted.sum(-1, keepdim=True).clamp_min(EPS)
        kl = (target * (target.clamp_min(EPS).log() - predicted.clamp_min(EPS).log())).sum(-1)  # [B, Hk, S]
        return kl.mean()


# ----- model plumbing -----


def _nosa_layers(model: nn.Module):
    return [m for m in model.modules() if hasattr(m, "eviction_head") and hasattr(m, "nosa_config")]


def _checkpointing(model: nn.Module) -> bool:
    # transformers >= 5.2x names it is_activation_checkpointing (the old name warns); earlier 5.x only the old one
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        try:
            return bool(getattr(model, name))
        except AttributeError:
            continue
    return False


def enable_selection_loss(model: nn.Module, weight: float, *, positions: int = 32) -> nn.Module:
    """Make every NOSA attention layer of ``model`` compute the selection alignment loss in training mode.

    ``weight`` 0 turns it off. Raises if the model has no NOSA layers or trains with gradient checkpointing.
    """
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
        raise ValueError(f"weight={weight!r} is invalid: it must be a number >= 0 (0 turns the loss off)")
    if positions < 1:
        raise ValueError(f"positions={positions} is invalid: it must be at least 1")
    layers = _nosa_layers(model)
    if not layers:
        raise ValueError("enable_selection_loss needs a NOSA model (hf_nosa.to_nosa); this one has no eviction heads")
    if weight and _checkpointing(model):
        raise ValueError(
            "the selection loss cannot be combined with gradient checkpointing (a recomputed layer does not hand "
            "its loss back); call model.gradient_checkpointing_disable() or set weight=0"
        )
    for layer in layers:
        layer.selection_loss_weight = float(weight)
        layer.selection_loss_positions = positions
        layer.last_selection_loss = None
    return model


def selection_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted sum of the losses the NOSA layers left in the last training forward (then cleared); None when
    the loss is off or no layer computed one."""
    total = None
    for layer in _nosa_layers(model):
        loss = getattr(layer, "last_selection_loss", None)
        if loss is None:
            continue
        weighted = layer.selection_loss_weight * loss
        total = weighted if total is None else total + weighted
        layer.last_selection_loss = None
    return total
