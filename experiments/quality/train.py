"""A small time-boxed training loop for the quality experiment (pretraining and both fine-tunes).

The learning-rate schedule runs on progress = max(elapsed / seconds, step / max_steps), so a run cut by the wall
clock still warms up and decays fully. Loss is the per-token cross-entropy weighted by the stream's weights.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F


def lr_factor(progress: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup`` of the run, then cosine down to ``floor``."""
    if progress < warmup:
        return max(progress / warmup, 0.01)
    x = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x))


def weighted_loss(model, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean of ``weights * CE`` over ``ids[:, 1:]`` predicted from ``ids[:, :-1]``: ``ids, weights [B, L + 1]``."""
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits.float()  # [B, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    w = weights[:, 1:].flatten()
    return (ce * w).sum() / w.sum()


def train(
    model,
    batches,
    *,
    param_groups: list[dict],
    seconds: float,
    max_steps: int | None = None,
    device: torch.device,
    log=print,
    log_every: int = 25,
    grad_clip: float = 1.0,
    step_hook=None,
    extra_loss=None,
) -> dict:
    """Train until ``seconds`` of wall clock or ``max_steps`` steps, whichever comes first.

    Args:
        batches: an iterator of ``(ids, weights)``.
        param_groups: AdamW groups, each with its own ``lr`` (the peak).
        step_hook: called as ``step_hook(step)`` before each step (curricula).
        extra_loss: called after each forward; a tensor it returns is added to the loss (auxiliary objectives such
            as ``hf_nosa.attention.selection_loss.selection_loss``), None adds nothing.

    Returns:
        ``{"steps", "tokens", "seconds", "losses": [[step, loss], ...], "final_loss"}``.
    """
    optimizer = torch.optim.AdamW(param_groups, betas=(0.9, 0.95), weight_decay=0.0)
    peaks = [group["lr"] for group in optimizer.param_groups]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    model.train()
    started = time.perf_counter()
    step, tokens, losses, recent, extras = 0, 0, [], [], []
    iterator = iter(batches)
    while True:
        elapsed = time.perf_counter() - started
        if elapsed >= seconds or (max_steps is not None and step >= max_steps):
            break
        progress = max(elapsed / seconds, step / max_steps if max_steps else 0.0)
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * lr_factor(progress)
        if step_hook is not None:
            step_hook(step)
        ids, weights = next(iterator)
        ids, weights = ids.to(device, non_blocking=True), weights.to(device, non_blocking=True)
        with autocast:
            loss = weighted_loss(model, ids, weights)
        extra = extra_loss() if extra_loss is not None else None
        if extra is not None:
            extras.append(extra.detach())
            loss = loss + extra
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in param_groups for p in g["params"]], grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += ids[:, :-1].numel()
        recent.append(loss.detach())
        if step % log_every == 0:
            value = float(torch.stack(recent).mean())
            recent.clear()
            losses.append([step, value])
            rate = tokens / (time.perf_counter() - started)
            aux = f"  (auxiliary {float(torch.stack(extras).mean()):.4f})" if extras else ""
            extras.clear()
            log(f"  step {step:5d}  loss {value:.4f}{aux}  lr {optimizer.param_groups[0]['lr']:.2e}  {rate / 1e3:.0f}K tok/s")
    if recent:
        losses.append([step, float(torch.stack(recent).mean())])
    model.eval()
    return {
        "steps": step,
        "tokens": tokens,
        "seconds": time.perf_counter() - started,
        "losses": losses,
        "final_loss": losses[-1][1] if losses else float("nan"),
    }
