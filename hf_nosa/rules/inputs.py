"""The data the attention paths pass around: what a NosaCache hands the attention of one layer (``AttentionInputs``)
and the keys it holds elsewhere (``PoolBlocks`` in the slot pool, ``Prefix`` read in pieces, QUOKA's ``DenseTail``).
Types only, so the reference (``attend``) and the kernel paths (``attention.pool``, ``attention.prefix``,
``attention.dense``) can all import them without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class PoolBlocks(NamedTuple):
    """Keys before those an ``AttentionInputs`` holds, in the slot pool once fetched: ``fetch(b0, b1)`` returns
    ``(k, v, b)`` of rows ``b0 .. b1 - 1`` (``[b1 - b0, Hk, S, D]`` twice and ``[b1 - b0, Hk, S]`` fp32), every
    query seeing all of them; the attention asks for them ``parts`` rows ranges at a time."""

    fetch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    parts: int


class Prefix(NamedTuple):
    """Keys before those an ``AttentionInputs`` holds: ``read(lo, hi)`` returns ``(k, v, b)`` of prefix tokens
    ``lo .. hi - 1`` (``[B, Hk, hi - lo, D]`` twice and ``[B, Hk, hi - lo]`` fp32) on the query's device;
    ``length`` tokens in all, read ``piece_tokens`` at a time."""

    read: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    length: int
    piece_tokens: int


class DenseTail(NamedTuple):
    """QUOKA's dense tail in a prefill chunk: row b's queries ``first_query[b] ..`` (``[B]`` long, on the host;
    the chunk's length or more: none of the row's) attend to every token of ``prefix`` and causally to the chunk."""

    prefix: Prefix
    first_query: torch.Tensor


class AttentionInputs(NamedTuple):
    """What a NOSA cache hands the attention of one layer.

    keys, values: ``[B, Hk, S, D]``; key_bias: ``[B, Hk, S]`` fp32 added to every query's logits (eviction score,
    padding, empty slots); attn_mask: additive ``[B or 1, 1 or Hk, Tq, S]`` fp32 or None; q_offset: position of
    the first query among the keys (for causal masking when attn_mask is None); causal: whether to apply it.
    prefix: keys before these, too many for the device at once, read in pieces (``attention.prefix.Prefix``;
    every query sees all of them; q_offset and attn_mask then count the keys above only); None: none.
    blocks: keys before these held in the slot pool once fetched, a part of the batch at a time
    (``attention.pool.PoolBlocks``; every query sees all of them; q_offset counts the keys above only); None: none.
    tail: QUOKA's dense tail (``attention.prefix.DenseTail``): row b's queries from ``tail.first_query[b]`` on
    attend instead to every token before the keys above (``tail.prefix``) and causally to those keys; the
    others as the fields above say. None: none.
    chunks: QUOKA's chunks of a prompt that came whole (``whole_prompt``): one ``AttentionInputs`` per run of
    consecutive queries, in order, each a causal chunk over its own keys (with its blocks, prefix or tail); the
    fields above then hold the whole prompt's keys. None: none.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_bias: torch.Tensor
    attn_mask: torch.Tensor | None
    q_offset: int
    causal: bool
    prefix: Prefix | None = None
    blocks: PoolBlocks | None = None
    tail: DenseTail | None = None
    chunks: tuple[AttentionInputs, ...] | None = None
