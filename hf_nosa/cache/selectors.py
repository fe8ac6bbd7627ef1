"""The hook that lets another block-selection rule run on the NosaCache engine (for baselines).

A selector sees every token written to a layer (``observe``) and chooses the blocks of each decode step
(``select``). Per-layer state goes in ``layer.selector_state`` (tensors with the batch first), which the cache
reorders for beam search and clears on reset. ``None`` means the NOSA rule of ``rules/selection.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockSelector(Protocol):
    name: str

    def observe(self, layer, keys: torch.Tensor, bias: torch.Tensor, start: int) -> None:
        """Tokens ``start .. start + T - 1`` were written: ``keys [B, Hk, T, D]``, ``bias [B, Hk, T]``.

        After a prefill or crop the whole sequence is passed again with ``start == 0``.
        """

    def select(self, layer, query: torch.Tensor, t: int, scale: float) -> torch.Tensor:
        """Blocks for the decode token at cache index ``t``: ``[B, Hk, K]`` long, -1 for none, all < t // P."""
