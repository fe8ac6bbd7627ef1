"""NOSA attention of one layer under transformers' continuous batching: the packed step, request by request.

A continuous-batching step hands every layer the new tokens of all scheduled requests packed into one sequence
(``query [1, H, N, D]``, ``key, value [1, Hk, N, D]``) with a ``NosaPagedCache``. The step's plan
(``RequestCaches.plan``: ``(request_id, past_length, query_length)`` in batch order) cuts it into requests; each
request's tokens go through its own NosaCache exactly as ``generate`` on that request alone sends them:

- a prompt piece is cut on the chunk grid (multiples of ``prefill_chunk_size`` from the request's first token; the
  scheduler already ends pieces on it, ``serving.scheduler``), and each chunk is one update of the request's cache
  (QUOKA's selection, dense tail, host writes); a whole prompt that ``generate`` would send through each layer whole
  (``NosaConfig.prefill_whole``) is one update, as there;
- the cache is told where the prompt ends before its first piece reaches the first layer (``begin_prefill``, so the
  dense tail and the sizing are those of the whole prompt) and that it has ended after its last piece leaves the
  last layer (``end_prefill``);
- a decode token is one update (selection, fetch, attention over the slot pool).

The outputs are packed back in the same order; positions no request owns (padding) are zeros.

Where the decode step runs on the device kernels (CUDA, or the Triton interpreter), the step's decode tokens go
through the layer as one batched update of the requests' rows of shared slot pools (``serving.decode_batch``, on a
plan of the step built at its first layer and reused by the others) and only the prompt pieces go request by
request; on the torch reference path every request goes through its own update, the reference the batched step is
tested against. On CUDA a step of decode tokens only replays a CUDA graph of the whole step (``serving.step_graph``).
"""

from __future__ import annotations

import torch

from ..attention.dispatch import attend_cache_inputs
from .decode_batch import batched_decode_runs, decode_batched


def is_serving_cache(cache) -> bool:
    """Whether ``cache`` is a continuous-batching cache (transformers' ``PagedAttentionCache`` or NOSA's)."""
    return cache is not None and hasattr(cache, "extend_read_and_write_indices")


def chunk_edges(past: int, length: int, prompt_length: int, chunk: int, whole: bool) -> list[tuple[int, int]]:
    """``(lo, hi)`` offsets into a request's ``length`` new tokens that start at ``past``: one update each.

    Prompt tokens are cut at multiples of ``chunk`` counted from the request's first token, unless ``whole`` (the
    whole prompt in one piece, sent through whole); tokens after the prompt (decoding) are one update.
    """
    end = past + length
    if whole or past >= prompt_length:
        return [(0, length)]
    edges = [past, *range((past // chunk + 1) * chunk, min(end, prompt_length), chunk)]
    if prompt_length < end:
        edges.append(prompt_length)
    edges.append(end)
    return [(a - past, b - past) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def serving_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, value_flat: torch.Tensor,
                      cache) -> torch.Tensor:
    """NOSA attention of one layer over a packed continuous-batching step. Returns ``[1, H, N, D]``.

    Args:
        module: the NOSA attention module (``layer_idx``, ``scaling``, ``eviction_head``).
        query: ``[1, H, N, D]``, key, value: ``[1, Hk, N, D]`` post-RoPE; value_flat: ``[1, N, Hk * D]``.
        cache: the step's ``NosaPagedCache``.
    """
    requests = getattr(cache, "nosa_requests", None)
    if requests is None:
        raise TypeError(
            "A NOSA model runs under transformers' continuous batching only through hf_nosa's manager: call "
            "hf_nosa.serving.enable(model) once (or use hf_nosa.serving.init_continuous_batching(model, ...)) before "
            "model.generate_batch / model.init_continuous_batching (transformers >= 5.18)."
        )
    layer_idx = module.layer_idx
    first, last = layer_idx == 0, layer_idx == requests.n_layers - 1
    bias = module.eviction_head(value_flat)  # [1, Hk, N]
    out = torch.zeros_like(query)
    chunk = requests.nosa_config.prefill_chunk()
    # the step's decode tokens as batched updates, on a plan built once per step (at its first layer)
    batched = decode_batched(requests, module, query, key, value, bias, out) if batched_decode_runs(key) else set()
    offset = 0
    for request_id, past, length in requests.plan:
        if length == 0 or request_id in batched:
            offset += length
            continue
        entry, nosa = requests.cache_of(request_id)
        held = nosa.get_seq_length(layer_idx)
        if held != past:
            raise RuntimeError(
                f"NOSA serving: request {request_id} holds {held} tokens in layer {layer_idx}, but this step continues "
                f"it from {past}: its cache and transformers' request state are out of step."
            )
        prompt = entry.prompt_length
        if first and past < prompt and not entry.prefilling:
            nosa.begin_prefill(prompt, padding=False)
            entry.prefilling = True
        whole = past == 0 and length >= prompt and requests.nosa_config.prefill_whole(1, prompt)
        for lo, hi in chunk_edges(past, length, prompt, chunk, whole):
            a, b = offset + lo, offset + hi
            q = query[:, :, a:b]
            inputs = nosa.update(key[:, :, a:b], value[:, :, a:b], layer_idx, query=q, bias=bias[:, :, a:b],
                                 attention_mask=None, scaling=module.scaling)
            out[:, :, a:b] = attend_cache_inputs(q, inputs, module.scaling)
        if last and entry.prefilling and past + length >= prompt:
            nosa.end_prefill()
            entry.prefilling = False
        offset += length
    return out

