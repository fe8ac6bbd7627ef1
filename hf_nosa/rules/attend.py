"""Attention over what a NOSA cache hands back: the torch reference used by every path."""

from __future__ import annotations

import torch

from .devices import host_to_device
from .inputs import AttentionInputs, DenseTail
from .masks import additive_mask

# Query rows per chunk, so that long prefills never hold all logits at once.
_QUERY_CHUNK = 1024


def chunk_spans(inputs: AttentionInputs) -> list[tuple[int, int]]:
    """The query range ``(lo, hi)`` of each of ``inputs.chunks``: a chunk's queries are its own keys."""
    spans, lo = [], 0
    for chunk in inputs.chunks:
        spans.append((lo, lo + chunk.keys.shape[2]))
        lo += chunk.keys.shape[2]
    return spans


def with_prefix_read(inputs: AttentionInputs) -> AttentionInputs:
    """``inputs`` with its prefix read whole (or its pool blocks fetched for every row) and put before its keys:
    the reference's view of it. A dense tail stays as it is (``attend`` reads its prefix)."""
    if inputs.prefix is None and inputs.blocks is None:
        return inputs
    if inputs.attn_mask is not None:
        raise ValueError("AttentionInputs: a prefix goes with the causal rule, not with an attn_mask")
    if inputs.prefix is not None and inputs.blocks is not None:
        raise ValueError("AttentionInputs: a prefix or pool blocks, not both")
    if inputs.prefix is not None:
        k, v, b = inputs.prefix.read(0, inputs.prefix.length)
    else:
        k, v, b = inputs.blocks.fetch(0, inputs.keys.shape[0])
    return AttentionInputs(torch.cat([k, inputs.keys], 2), torch.cat([v, inputs.values], 2),
                           torch.cat([b, inputs.key_bias], 2), None, inputs.q_offset + k.shape[2], inputs.causal,
                           tail=inputs.tail)


def own_keys(inputs: AttentionInputs, n_queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys, values and bias of a causal chunk's own tokens: the last ``n_queries`` of ``inputs`` (after its
    pool blocks when they were read in, ``with_prefix_read``)."""
    if not inputs.causal or inputs.attn_mask is not None or inputs.prefix is not None \
            or inputs.keys.shape[2] != inputs.q_offset + n_queries:
        raise ValueError("AttentionInputs: a dense tail goes with a causal chunk over its own keys (after any blocks)")
    return tuple(x[:, :, -n_queries:] for x in (inputs.keys, inputs.values, inputs.key_bias))


def with_dense_tail(out: torch.Tensor, query: torch.Tensor, tail: DenseTail, dense) -> torch.Tensor:
    """``out [B, H, Tq, D]`` (every query's attention without the tail) with each row's tail queries replaced:
    ``dense(query[:, :, q0:], q0)`` gives queries ``q0 ..`` (q0 the earliest first tail query) over the tail's
    prefix and the chunk's keys up to each query; rows whose tail starts later keep ``out`` before it."""
    first = tail.first_query
    q0, Tq = int(first.min()), query.shape[2]
    if q0 >= Tq:
        return out
    part = dense(query[:, :, q0:], q0)  # [B, H, Tq - q0, D]
    rows = torch.arange(q0, Tq) >= first[:, None]  # [B, Tq - q0], on the host with first
    if bool(rows.all()):
        out[:, :, q0:] = part
    else:
        out[:, :, q0:] = torch.where(host_to_device(rows, out.device)[:, None, :, None], part, out[:, :, q0:])
    return out


def attend(query: torch.Tensor, inputs: AttentionInputs, scale: float) -> torch.Tensor:
    """``softmax(q . k * scale + bias) . v`` with GQA; each KV head is read once for its whole group.

    Args:
        query: ``[B, H, Tq, D]``.
        inputs: keys/values ``[B, Hk, S, D]``, key_bias ``[B, Hk, S]``, optional additive mask
            ``[B or 1, 1 or Hk, Tq, S]``.

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype; fp32 accumulation.
    """
    if inputs.chunks is not None:
        return torch.cat([attend(query[:, :, lo:hi], chunk, scale)
                          for (lo, hi), chunk in zip(chunk_spans(inputs), inputs.chunks)], 2)
    if inputs.tail is not None:
        tail = inputs.tail
        own = own_keys(inputs, query.shape[2])

        def dense(part: torch.Tensor, q0: int) -> torch.Tensor:
            before = tail.prefix.read(0, tail.prefix.length)
            whole = AttentionInputs(*(torch.cat([x, y], 2) for x, y in zip(before, own)), None,
                                    before[0].shape[2] + q0, causal=True)
            return attend(part, whole, scale)

        return with_dense_tail(attend(query, inputs._replace(tail=None), scale), query, tail, dense)
    inputs = with_prefix_read(inputs)
    B, H, Tq, D = query.shape
    keys, values = inputs.keys.float(), inputs.values.float()
    Hk, S = keys.shape[1], keys.shape[2]
    G = H // Hk
    q = query.float().view(B, Hk, G, Tq, D)
    out = torch.empty(B, Hk, G, Tq, D, dtype=torch.float32, device=query.device)
    for lo in range(0, Tq, _QUERY_CHUNK):
        hi = min(Tq, lo + _QUERY_CHUNK)
        logits = torch.einsum("bkgtd,bksd->bkgts", q[:, :, :, lo:hi], keys) * scale
        logits = logits + inputs.key_bias.float()[:, :, None, None, :]
        if inputs.attn_mask is not None:
            logits = logits + inputs.attn_mask[:, :, None, lo:hi, :]
        elif inputs.causal:
            logits = logits + additive_mask(None, hi - lo, S, inputs.q_offset + lo, query.device)[:, :, None]
        out[:, :, :, lo:hi] = torch.einsum("bkgts,bksd->bkgtd", torch.softmax(logits, dim=-1), values)
    return out.view(B, H, Tq, D).to(query.dtype)
