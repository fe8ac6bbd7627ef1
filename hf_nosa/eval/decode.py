"""The evaluation decode loop: dense prefill, then every later token through the cache's decode path.

Sparse methods differ only in decode, so the loop makes sure what is measured goes through it: the prompt is
prefilled up to ``decode_from``, the rest of the prompt (the question) is fed one token at a time, and then the
answer is generated greedily (or, for perplexity, the reference tokens are fed and scored). The same loop runs
the default cache, so every method sees exactly the same computation but for its attention.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from ..cache.nosa_cache import NosaCache


@dataclass
class DecodeResult:
    """``tokens``: ``[B, n]`` generated ids (stop tokens included, nothing after them is meaningful);
    ``nll``: ``[B, G]`` negative log-likelihood of the fed tokens ``decode_from .. T-1`` (when scored);
    ``decode_steps``: single-token forwards run; ``prefill_stats``: the cache's stats right after the prefill."""

    tokens: torch.Tensor
    nll: torch.Tensor | None
    decode_steps: int
    prefill_stats: dict | None


@functools.lru_cache(maxsize=8)
def _cache_keyword(model_class: type) -> str:
    """transformers >= 5.2x names the cache argument ``cache``; earlier 5.x ``past_key_values``."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _stats(cache) -> dict | None:
    return cache.stats() if hasattr(cache, "stats") else None


@torch.no_grad()
def decode(
    model,
    input_ids: torch.Tensor,
    *,
    cache,
    decode_from: int,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 0,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    score: bool = False,
    prefill_chunk: int = 4096,
) -> DecodeResult:
    """Run one batch: prefill ``input_ids[:, :decode_from]``, feed the rest token by token, then generate.

    Args:
        input_ids: ``[B, T]`` prompts, left-padded where ``attention_mask`` (``[B, T]``, 1 = real) says so.
        cache: a fresh cache object (``DynamicCache``, ``NosaCache``, ...), filled by this call.
        decode_from: first prompt position fed through the decode path (``1 <= decode_from <= T``).
        max_new_tokens: greedy tokens to generate after the prompt; stops early once every row produced one of
            ``stop_ids``.
        score: also return the NLL of each fed token ``decode_from .. T-1`` under the model.
        prefill_chunk: prefill in pieces of this many tokens (bounds the memory of dense prefill) with other caches
            than a NosaCache.
    """
    B, T = input_ids.shape
    if not 1 <= decode_from <= T:
        raise ValueError(f"decode_from={decode_from} is invalid: it must be in [1, {T}] for prompts of {T} tokens")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk} is invalid: it must be positive")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    keyword = _cache_keyword(type(model))
    mask = attention_mask.to(device).long() if attention_mask is not None else None
    if mask is not None and bool(mask.all()):
        mask = None  # no padding: let the model build its plain causal mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if mask is not None else torch.arange(T, device=device).expand(B, T)

    def forward(ids: torch.Tensor, start: int, end: int, pos: torch.Tensor) -> torch.Tensor:
        kwargs = {keyword: cache, "use_cache": True, "position_ids": pos, "logits_to_keep": 1}
        if mask is not None:
            kwargs["attention_mask"] = full_mask[:, :end]
        return model(input_ids=ids, **kwargs).logits[:, -1].float()  # [B, V]

    full_mask = None
    if mask is not None:
        full_mask = torch.cat([mask, mask.new_ones(B, max_new_tokens + 1)], 1)

    logits = None
    # A NosaCache's model sends the prompt through itself in chunks (NosaConfig.prefill_chunk), with the cache's prefill
    # mode; pieces sent one by one would be updates after a prompt instead (the per-token decode rule).
    piece = decode_from if isinstance(cache, NosaCache) else prefill_chunk
    for start in range(0, decode_from, piece):
        end = min(decode_from, start + piece)
        logits = forward(input_ids[:, start:end], start, end, positions[:, start:end])
    prefill_stats = _stats(cache)

    nll = []
    steps = 0
    for t in range(decode_from, T):
        if score:
            nll.append(-torch.log_softmax(logits, -1).gather(-1, input_ids[:, t : t + 1])[:, 0])
        logits = forward(input_ids[:, t : t + 1], t, t + 1, positions[:, t : t + 1])
        steps += 1

    generated = []
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device) if stop_ids else None
    last_pos = positions[:, -1:]
    for i in range(max_new_tokens):
        token = logits.argmax(-1)  # [B]
        generated.append(token)
        if stop is not None:
            done |= torch.isin(token, stop)
            if bool(done.all()):
                break
        if i == max_new_tokens - 1:
            break
        logits = forward(token[:, None], T + i, T + i + 1, last_pos + i + 1)
        steps += 1
    tokens = torch.stack(generated, 1) if generated else input_ids.new_zeros(B, 0)
    return DecodeResult(tokens=tokens, nll=torch.stack(nll, 1) if score and nll else None, decode_steps=steps, prefill_stats=prefill_stats)
