"""Selection alignment: auxiliary training losses that teach both selection scores where attention goes.

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

The eviction head gets the same kind of signal (``eviction_alignment_loss``). Through the attention bias alone its
gradient is proportional to ``A``, which starts at 0, and the bias only shifts logits the keys already set: in the
GPU retrofits (524 and 1,212 steps) every ``A`` stayed within 0.06 of 0, so the query-agnostic part of the budget
was ranked by an untrained ``delta``; with this loss (weight 0.1) ``A`` reached 0.6-1.1. The eviction loss compares the same full-attention block mass with a softmax over
the eviction block scores (``selection.eviction_block_scores``: max over windows of the mean b), over the same
candidate blocks. The scores are query-agnostic, so they learn the blocks later queries keep coming back to (a
needle, once its question is read), which is what the query-agnostic share of the budget is for. Its gradient
reaches ``A`` and ``delta`` only: the values are detached, so the head learns to read them and the values do not
bend towards the head.

Turn them on with ``enable_selection_loss(model, weight, eviction_weight=...)`` (recipes: ``selection_loss``,
``eviction_loss``); in training mode every NOSA layer then leaves its weighted loss on the module and
``selection_loss(model)`` sums them for the training step to add. Packed sequences only (no padding); gradient
checkpointing is refused, because a recomputed layer would not hand back the loss.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, S sampled positions, T tokens, N blocks, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config import NosaConfig
from ..rules.selection import compress_keys, eviction_block_scores, force_sink_and_local, query_block_scores

EPS = 1e-8


def sampled_positions(n_tokens: int, cfg: NosaConfig, positions: int) -> torch.Tensor:
    """``positions`` query positions spread evenly over the tokens that have a block to choose (long)."""
    first = (cfg.sink_blocks + cfg.local_blocks + 1) * cfg.block_size  # earliest token with a candidate block
    if n_tokens <= first:
        return torch.empty(0, dtype=torch.long)
    return torch.linspace(first, n_tokens - 1, min(positions, n_tokens - first)).round().long().unique()


def _attention_mass(q: torch.Tensor, k: torch.Tensor, at: torch.Tensor, n_blocks: int, cfg: NosaConfig, scale: float):
    """Full causal attention mass per block of the queries at ``at``, summed over each GQA group (no gradient).

    ``q``: ``[B, H, S, D]`` fp32, ``k``: ``[B, Hk, T, D]`` fp32. Returns ``[B, Hk, S, N]``.
    """
    B, H, S, D = q.shape
    Hk, T = k.shape[1], k.shape[2]
    with torch.no_grad():
        logits = torch.einsum("bkgsd,bktd->bkgst", q.view(B, Hk, H // Hk, S, D), k) * scale  # [B, Hk, G, S, T]
        logits = logits.masked_fill(torch.arange(T, device=k.device) > at[:, None], float("-inf"))
        probs = torch.softmax(logits, -1).sum(2)  # [B, Hk, S, T]
        pad = n_blocks * cfg.block_size - T
        return torch.nn.functional.pad(probs, (0, pad)).view(B, Hk, S, n_blocks, cfg.block_size).sum(-1)


def _positions_and_blocks(query: torch.Tensor, cfg: NosaConfig, positions: int) -> tuple[torch.Tensor, int]:
    """The sampled query positions (``[S]`` long, on the query's device) and the number of blocks of ``T`` tokens."""
    if positions < 1:
        raise ValueError(f"positions={positions} is invalid: it must be at least 1")
    T = query.shape[2]
    return sampled_positions(T, cfg, positions).to(query.device), (T + cfg.block_size - 1) // cfg.block_size


def _candidates(scores: torch.Tensor, at: torch.Tensor, cfg: NosaConfig) -> torch.Tensor:
    """``[..., S, N]`` bool: the blocks a selection part chooses among (before the token's block, neither sink nor
    local window); never empty, by the choice of positions."""
    forced, _ = force_sink_and_local(scores.detach(), at // cfg.block_size, cfg)
    return forced.isfinite()


def _kl(mass: torch.Tensor, log_predicted: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    target = mass * among
    target = target / target.sum(-1, keepdim=True).clamp_min(EPS)
    log_target = target.clamp_min(EPS).log()
    return torch.where(among, target * (log_target - log_predicted), 0.0).sum(-1).mean()  # mean over [B, Hk, S]


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
    at, N = _positions_and_blocks(query, cfg, positions)  # [S], blocks
    if at.numel() == 0:
        return query.new_zeros((), dtype=torch.float32)
    with torch.autocast(query.device.type, enabled=False):
        q, k = query[:, :, at].float(), key.float()  # [B, H, S, D], [B, Hk, T, D]
        mass = _attention_mass(q, k, at, N, cfg, scale)  # [B, Hk, S, N]
        scores = query_block_scores(q, compress_keys(k, cfg), at, N, cfg, scale)  # [B, Hk, S, N], with gradient
        among = _candidates(scores, at, cfg)
        predicted = scores * among
        predicted = predicted / predicted.sum(-1, keepdim=True).clamp_min(EPS)
        return _kl(mass, predicted.clamp_min(EPS).log(), among)


def eviction_alignment_loss(
    query: torch.Tensor, key: torch.Tensor, bias: torch.Tensor, cfg: NosaConfig, scale: float, *, positions: int = 32
) -> torch.Tensor:
    """KL(full-attention block mass || softmax of the eviction block scores) over the candidate blocks; a scalar.

    Args:
        query: ``[B, H, T, D]``, key: ``[B, Hk, T, D]`` post-RoPE, of positions ``0 .. T-1``.
        bias: ``[B, Hk, T]`` eviction-head scores b (with gradient).
        positions: how many query positions to sample per sequence.

    Returns:
        fp32 scalar, >= 0 (0 when no position has a candidate block).
    """
    at, N = _positions_and_blocks(query, cfg, positions)  # [S], blocks
    if at.numel() == 0:
        return query.new_zeros((), dtype=torch.float32)
    with torch.autocast(query.device.type, enabled=False):
        mass = _attention_mass(query[:, :, at].float(), key.float(), at, N, cfg, scale)  # [B, Hk, S, N]
        scores = eviction_block_scores(compress_keys(bias.float(), cfg), at, N, cfg)  # [B, Hk, S, N], with gradient
        among = _candidates(scores, at, cfg) & scores.isfinite()
        # finite fill: a row without candidates stays finite (and carries no weight) instead of turning NaN
        log_predicted = torch.log_softmax(scores.masked_fill(~among, -1e30), -1)
        return _kl(mass, log_predicted, among)


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


def enable_selection_loss(model: nn.Module, weight: float, *, positions: int = 32, eviction_weight: float = 0.0) -> nn.Module:
    """Make every NOSA attention layer of ``model`` compute the alignment losses in training mode.

    ``weight`` scales the selection (query-aware) loss, ``eviction_weight`` the eviction loss; 0 turns one off.
    Raises if the model has no NOSA layers or trains with gradient checkpointing.
    """
    for name, value in (("weight", weight), ("eviction_weight", eviction_weight)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r} is invalid: it must be a number >= 0 (0 turns the loss off)")
    if positions < 1:
        raise ValueError(f"positions={positions} is invalid: it must be at least 1")
    layers = _nosa_layers(model)
    if not layers:
        raise ValueError("enable_selection_loss needs a NOSA model (hf_nosa.to_nosa); this one has no eviction heads")
    if (weight or eviction_weight) and _checkpointing(model):
        raise ValueError(
            "the selection loss cannot be combined with gradient checkpointing (a recomputed layer does not hand "
            "its loss back); call model.gradient_checkpointing_disable() or set both weights to 0"
        )
    for layer in layers:
        layer.selection_loss_weight = float(weight)
        layer.eviction_loss_weight = float(eviction_weight)
        layer.selection_loss_positions = positions
        layer.last_selection_loss = None
    return model


def alignment_enabled(module: nn.Module) -> bool:
    """Whether ``module`` (a NOSA attention layer) computes an alignment loss in training mode."""
    return bool(getattr(module, "selection_loss_weight", 0.0) or getattr(module, "eviction_loss_weight", 0.0))


def layer_alignment_loss(module: nn.Module, query, key, value_flat, cfg: NosaConfig, scale: float) -> torch.Tensor:
    """One layer's weighted alignment losses for a training forward.

    ``query`` / ``key``: post-RoPE, as in ``eviction_alignment_loss``; ``value_flat``: ``[B, T, Hk * D]``, the
    input of the layer's eviction head (detached here).
    """
    positions = module.selection_loss_positions
    total = query.new_zeros((), dtype=torch.float32)
    if module.selection_loss_weight:
        total = total + module.selection_loss_weight * selection_alignment_loss(query, key, cfg, scale, positions=positions)
    if getattr(module, "eviction_loss_weight", 0.0):
        bias = module.eviction_head(value_flat.detach())  # [B, Hk, T]
        total = total + module.eviction_loss_weight * eviction_alignment_loss(
            query, key, bias, cfg, scale, positions=positions
        )
    return total


def selection_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the weighted losses the NOSA layers left in the last training forward (then cleared); None when
    the losses are off or no layer computed one."""
    total = None
    for layer in _nosa_layers(model):
        loss = getattr(layer, "last_selection_loss", None)
        if loss is None:
            continue
        total = loss if total is None else total + loss
        layer.last_selection_loss = None
    return total
