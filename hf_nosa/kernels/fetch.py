"""Block fetch: make the device slot pool hold exactly the selected blocks (plus the block being written).

Per (sequence, KV head): slots whose block is still selected stay in place, the others are freed, and the
missing blocks are copied from the host store into freed slots. When a new block starts, one more freed slot
becomes the tail slot that receives the new tokens.

Slot pool layout (per layer): ``slot_k, slot_v [B, Hk, S + 1, P, D]``, ``slot_b [B, Hk, S + 1, P]`` where
``S = K + 1`` attended slots and slot ``S`` is a scratch slot that absorbs writes for entries with nothing to copy;
``slot_block [B, Hk, S]`` (block held, -1 when empty), ``tail_slot [B, Hk]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..host_store import HostStore


class FetchPlan(NamedTuple):
    """What one decode step moves, computed on the device without a host sync."""

    missing: torch.Tensor  # [B, Hk, K] bool: selected and not resident
    dst_slot: torch.Tensor  # [B, Hk, K] long: slot each missing block goes to (scratch slot S otherwise)
    slot_block: torch.Tensor  # [B, Hk, S] long: blocks held after the step
    tail_slot: torch.Tensor  # [B, Hk] long
    n_resident: torch.Tensor  # [B, Hk] long: selected blocks that were already on the device
    n_selected: torch.Tensor  # [B, Hk] long


def plan_fetch(
    selected: torch.Tensor, slot_block: torch.Tensor, tail_slot: torch.Tensor, new_block: bool, current_block: int
) -> FetchPlan:
    """Set difference between selected and resident blocks, and the slot each missing block lands in.

    Args:
        selected: ``[B, Hk, K]`` block indices (-1 = none).
        slot_block: ``[B, Hk, S]`` blocks held now.
        tail_slot: ``[B, Hk]`` slot of the block being written (ignored when ``new_block``).
        new_block: the token of this step starts block ``current_block``; it gets a fresh slot.
    """
    S = slot_block.shape[-1]
    slots = torch.arange(S, device=slot_block.device)
    is_selected = selected >= 0
    match = (slot_block[..., :, None] == selected[..., None, :]) & is_selected[..., None, :]  # [B, Hk, S, K]
    keep = match.any(-1)
    if not new_block:
        keep = keep | (slots == tail_slot[..., None])
    resident = match.any(-2)  # [B, Hk, K]
    missing = is_selected & ~resident

    free = ~keep
    free_rank = torch.cumsum(free.long(), -1) - 1
    free_by_rank = torch.full((*slot_block.shape[:-1], S + 1), S, dtype=torch.long, device=slot_block.device)
    free_by_rank.scatter_(-1, torch.where(free, free_rank, S), slots.expand_as(slot_block))
    miss_rank = torch.cumsum(missing.long(), -1) - 1
    dst_slot = torch.where(missing, free_by_rank.gather(-1, miss_rank.clamp(min=0)), S)

    new_slot_block = torch.where(keep, slot_block, -1)
    padded = torch.cat([new_slot_block, new_slot_block.new_full((*new_slot_block.shape[:-1], 1), -1)], -1)
    padded.scatter_(-1, dst_slot, torch.where(missing, selected, -1))
    if new_block:
        tail_slot = free_by_rank.gather(-1, missing.sum(-1, keepdim=True)).squeeze(-1)
        padded.scatter_(-1, tail_slot[..., None], current_block)
    return FetchPlan(
        missing=missing,
        dst_slot=dst_slot,
        slot_block=padded[..., :S],
        tail_slot=tail_slot,
        n_resident=(is_selected & resident).sum(-1),
        n_selected=is_selected.sum(-1),
    )


def fetch_blocks_ref(
    plan: FetchPlan,
    selected: torch.Tensor,
    host: HostStore,
    slot_k: torch.Tensor,
    slot_v: torch.Tensor,
    slot_b: torch.Tensor,
) -> None:
    """Copy the missing blocks of ``plan`` from the host store into their slots (torch; syncs on CUDA)."""
    b_idx, h_idx, i_idx = plan.missing.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    blocks = selected[b_idx, h_idx, i_idx]
    dst = plan.dst_slot[b_idx, h_idx, i_idx]
    k, v, b = host.gather_blocks(b_idx.cpu(), h_idx.cpu(), blocks.cpu())
    device = slot_k.device
    slot_k[b_idx, h_idx, dst] = k.to(device, non_blocking=True)
    slot_v[b_idx, h_idx, dst] = v.to(device, non_blocking=True)
    slot_b[b_idx, h_idx, dst] = b.to(device, non_blocking=True)


def fetch_blocks(plan, selected, host, slot_k, slot_v, slot_b) -> None:
    """Dispatcher: the torch copy wherever the slot pool lives (a UVA kernel replaces it on CUDA)."""
    fetch_blocks_ref(plan, selected, host, slot_k, slot_v, slot_b)
