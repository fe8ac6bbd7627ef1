"""Block fetch: make the device slot pool hold exactly the selected blocks (plus the block being written).

Per (sequence, KV head): slots whose block is still selected stay in place, the others are freed, and the
missing blocks are copied from the host store into freed slots. When a new block starts, one more freed slot
becomes the tail slot that receives the new tokens.

Slot pool layout (per layer): ``slot_k, slot_v [B, Hk, S + 1, P, D]``, ``slot_b [B, Hk, S + 1, P]`` where
``S = K + 1`` attended slots and slot ``S`` is a scratch slot that absorbs writes for entries with nothing to copy;
``slot_block [B, Hk, S]`` (block held, -1 when empty), ``tail_slot [B, Hk]``.

Two levels:

- ``plan_fetch`` + ``fetch_blocks``: the set difference and the copy as separate torch steps (the reference).
- ``fetch_step``: one whole decode step of the slot pool in one launch per layer (Triton on CUDA). Per (sequence,
  KV head) one program computes the ``plan_fetch`` set difference, copies the missing K, V and b blocks by
  reading the pinned host store directly through its device address (UVA: a pinned tensor's address is valid on
  the GPU; the kernel gets an int64 table of block addresses), writes the new token into the tail slot and into
  the host store, keeps ``slot_b == MASK_VALUE`` at every position that holds no token (so the attention can read
  the pool with no extra mask), counts what moved, and advances the step counter. No host sync.

A quantized host store (``host_dtype``, ``hf_nosa.cache.host_quant``): the kernel copies each block's bytes and its two
scales across PCIe and dequantizes into the slot pool (in the model's dtype); the new token goes to the row's tail
in the store and, when it completes its block, the block is quantized from the slot pool's tail slot (the block's
earlier tokens are there on the device) and stored with its scales. ``fetch_step_ref`` does the same through
``HostStore.write_rows``, whose tail holds the same values as the tail slot.

Rows of a left-padded batch are stored row-relative (``hf_nosa.rules.padding``): with ``offsets [B]`` (on the device)
row b's token at step t is ``t - offsets[b]`` for its block, tail position and host index.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ...rules.selection import MASK_VALUE
from ..backend import (HAS_TRITON, kernel_path, launcher, log_fallback, next_power_of_2, on_device, shared_zeros,
                       tl, triton)
from ..host_format import store_quantized

# ``host`` arguments are a ``hf_nosa.cache.host_store.HostStore``. The cache is the layer above the kernels, so its
# name stays in the (string) annotations and is not imported: imports only go down the layers.


class FetchPlan(NamedTuple):
    """What one decode step moves, computed on the device without a host sync."""

    missing: torch.Tensor  # [B, Hk, K] bool: selected and not resident
    dst_slot: torch.Tensor  # [B, Hk, K] long: slot each missing block goes to (scratch slot S otherwise)
    slot_block: torch.Tensor  # [B, Hk, S] long: blocks held after the step
    tail_slot: torch.Tensor  # [B, Hk] long
    n_resident: torch.Tensor  # [B, Hk] long: selected blocks that were already on the device
    n_selected: torch.Tensor  # [B, Hk] long


def plan_fetch(
    selected: torch.Tensor, slot_block: torch.Tensor, tail_slot: torch.Tensor, new_block, current_block
) -> FetchPlan:
    """Set difference between selected and resident blocks, and the slot each missing block lands in.

    Args:
        selected: ``[B, Hk, K]`` block indices (-1 = none).
        slot_block: ``[B, Hk, S]`` blocks held now.
        tail_slot: ``[B, Hk]`` slot of the block being written (ignored where ``new_block``).
        new_block: the token of this step starts block ``current_block``; it gets a fresh slot. A bool, or a
            ``[B]`` bool tensor per row (rows of a left-padded batch are at different row-relative indices).
        current_block: int, or ``[B]`` long tensor per row.
    """
    S = slot_block.shape[-1]
    device = slot_block.device
    lead = slot_block.shape[:-1]  # (B, Hk)
    new_block = torch.as_tensor(new_block, device=device).reshape(-1, *([1] * (len(lead) - 1))).expand(lead)
    current_block = torch.as_tensor(current_block, device=device).reshape(-1, *([1] * (len(lead) - 1))).expand(lead)
    slots = torch.arange(S, device=device)
    is_selected = selected >= 0
    match = (slot_block[..., :, None] == selected[..., None, :]) & is_selected[..., None, :]  # [B, Hk, S, K]
    keep = match.any(-1) | ((slots == tail_slot[..., None]) & ~new_block[..., None])
    resident = match.any(-2)  # [B, Hk, K]
    missing = is_selected & ~resident

    free = ~keep
    free_rank = torch.cumsum(free.long(), -1) - 1
    free_by_rank = torch.full((*lead, S + 1), S, dtype=torch.long, device=device)
    free_by_rank.scatter_(-1, torch.where(free, free_rank, S), slots.expand_as(slot_block))
    miss_rank = torch.cumsum(missing.long(), -1) - 1
    dst_slot = torch.where(missing, free_by_rank.gather(-1, miss_rank.clamp(min=0)), S)

    new_slot_block = torch.where(keep, slot_block, -1)
    padded = torch.cat([new_slot_block, new_slot_block.new_full((*lead, 1), -1)], -1)
    padded.scatter_(-1, dst_slot, torch.where(missing, selected, -1))
    fresh = free_by_rank.gather(-1, missing.sum(-1, keepdim=True)).squeeze(-1)
    tail_slot = torch.where(new_block, fresh, tail_slot)
    target = torch.where(new_block, tail_slot, S)[..., None]  # column S is scratch: rows without a new block
    padded.scatter_(-1, target, torch.where(new_block[..., None], current_block[..., None], -1))
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
    row0: int = 0,
) -> None:
    """Copy the missing blocks of ``plan`` from the host store into their slots (torch; syncs on CUDA). The pool's
    rows are the store's rows ``row0 ..``."""
    b_idx, h_idx, i_idx = plan.missing.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return
    blocks = selected[b_idx, h_idx, i_idx]
    dst = plan.dst_slot[b_idx, h_idx, i_idx]
    k, v, b = host.gather_blocks(b_idx.cpu() + row0, h_idx.cpu(), blocks.cpu())
    device = slot_k.device
    slot_k[b_idx, h_idx, dst] = k.to(device, non_blocking=True)
    slot_v[b_idx, h_idx, dst] = v.to(device, non_blocking=True)
    slot_b[b_idx, h_idx, dst] = b.to(device, non_blocking=True)


def fetch_blocks(plan, selected, host, slot_k, slot_v, slot_b) -> None:
    """Dispatcher: the torch copy wherever the slot pool lives (a UVA kernel replaces it on CUDA)."""
    fetch_blocks_ref(plan, selected, host, slot_k, slot_v, slot_b)


# ----- the fused decode step of the slot pool -----


class SlotPool(NamedTuple):
    """A layer's device slots (layout at the top of this file); every tensor is updated in place."""

    slot_k: torch.Tensor  # [B, Hk, S + 1, P, D]
    slot_v: torch.Tensor  # [B, Hk, S + 1, P, D]
    slot_b: torch.Tensor  # [B, Hk, S + 1, P] float32
    slot_block: torch.Tensor  # [B, Hk, S] long
    tail_slot: torch.Tensor  # [B, Hk] long


class StepCounters(NamedTuple):
    """Device counters a decode step advances without a host sync.

    ``counts`` int64 ``[5]``: blocks loaded, bytes moved to the device, then three scratch entries the kernel
    returns to zero (resident and selected blocks of the step, programs finished); ``locality`` float32 ``[2]``:
    the sum over counted steps of the share of selected blocks that were already resident, and the number of
    counted steps (those that selected at least one block).
    """

    counts: torch.Tensor
    locality: torch.Tensor

    @classmethod
    def zeros(cls, device) -> "StepCounters":
        return cls(torch.zeros(5, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.float32, device=device))


def count_share(locality: torch.Tensor, resident: torch.Tensor, selected: torch.Tensor) -> None:
    """Add one step's share of selected blocks already resident to ``locality`` ``[2]`` (sum, steps), on the
    device; a step that selected nothing is not counted (nothing could have been resident)."""
    counted = selected > 0
    locality[0].add_(torch.where(counted, resident.float() / selected.clamp(min=1).float(), 0.0))
    locality[1].add_(counted.float())


if HAS_TRITON:
    from .fetch_copy import _copy_blocks, _fetch_copy_kernel

    @triton.jit(do_not_specialize=["table_stride", "table_row_stride", "row0"])
    def _fetch_step_kernel(
        sel_ptr, slot_block_ptr, tail_ptr, slot_k_ptr, slot_v_ptr, slot_b_ptr, table_ptr,
        k_new_ptr, v_new_ptr, b_new_ptr, step_ptr, offset_ptr, counts_ptr, locality_ptr,
        copy_blk_ptr, copy_dst_ptr, n_copy_ptr,
        stride_sel_b, stride_sel_h, stride_sb_b, stride_sb_h, stride_tail_b, stride_tail_h,
        stride_k_b, stride_k_h, stride_k_s, stride_v_b, stride_v_h, stride_v_s, stride_b_b, stride_b_h, stride_b_s,
        stride_kn_b, stride_kn_h, stride_vn_b, stride_vn_h, stride_bn_b, stride_bn_h,
        table_stride, table_row_stride, block_bytes, count_locality, n_programs, row0,
        HK: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
        P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, NB: tl.constexpr,
        MASK: tl.constexpr, WRITE_HOST: tl.constexpr, DECODE: tl.constexpr,
        QUANT: tl.constexpr, FP8: tl.constexpr, QMAX: tl.constexpr, COPY: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_b = i_bh // HK
        i_h = i_bh % HK
        # A table per row (one store per row, ``serving.host_rows``): row b's blocks are in its own store's table,
        # where it is the store's only sequence; table_row_stride 0: one store, row b is its sequence b.
        table_ptr += (i_b + row0).to(tl.int64) * table_row_stride
        i_seq = tl.where(table_row_stride == 0, i_b + row0, 0)
        t_step = tl.load(step_ptr)
        t = t_step - tl.load(offset_ptr + i_b)  # the row-relative index of the token (hf_nosa.rules.padding)
        pos = (t % P).to(tl.int32)
        c = (t // P).to(tl.int32)
        new_block = (pos == 0) & DECODE  # a QUOKA prefill fetch (not DECODE) writes no token and has no tail

        # ---- plan: plan_fetch's set difference and slot assignment ----
        o_k = tl.arange(0, K_PAD)
        o_s = tl.arange(0, S_PAD)
        m_s = o_s < S
        b_sel = tl.load(sel_ptr + i_b * stride_sel_b + i_h * stride_sel_h + o_k, mask=o_k < K, other=-1).to(tl.int32)
        p_sb = slot_block_ptr + i_b * stride_sb_b + i_h * stride_sb_h + o_s
        b_sb = tl.load(p_sb, mask=m_s, other=-1).to(tl.int32)
        tail = tl.load(tail_ptr + i_b * stride_tail_b + i_h * stride_tail_h).to(tl.int32)
        is_sel = b_sel >= 0
        match = (b_sel[:, None] == b_sb[None, :]) & is_sel[:, None] & m_s[None, :]  # [K_PAD, S_PAD]
        keep = (tl.max(match.to(tl.int32), 0) > 0) | ((o_s == tail) & (pos != 0) & DECODE)
        keep = keep & m_s
        missing = is_sel & (tl.max(match.to(tl.int32), 1) == 0)
        free = (keep == 0) & m_s
        free_rank = tl.cumsum(free.to(tl.int32), 0) - 1
        miss_rank = tl.cumsum(missing.to(tl.int32), 0) - 1
        n_missing = tl.sum(missing.to(tl.int32), 0)
        n_selected = tl.sum(is_sel.to(tl.int32), 0)
        # missing block of rank r -> the free slot of rank r
        lands = (free_rank[None, :] == miss_rank[:, None]) & free[None, :] & missing[:, None]  # [K_PAD, S_PAD]
        assigned = tl.max(lands.to(tl.int32), 0) > 0
        dst_of = tl.sum(tl.where(lands, o_s[None, :], 0), 1)  # [K_PAD] slot of each missing block
        assigned_block = tl.sum(tl.where(lands, b_sel[:, None], 0), 0)
        new_tail = tl.sum(tl.where(free & (free_rank == n_missing), o_s, 0), 0)
        new_tail = tl.where(new_block, new_tail, tail)
        new_sb = tl.where(keep, b_sb, tl.where(assigned, assigned_block, -1))
        new_sb = tl.where(new_block & (o_s == new_tail), c, new_sb)
        tl.store(p_sb, new_sb.to(tl.int64), mask=m_s)
        tl.store(tail_ptr + i_b * stride_tail_b + i_h * stride_tail_h, new_tail.to(tl.int64))

        # ---- copy the missing blocks, NB at a time, straight from pinned host memory ----
        o_n = tl.arange(0, NB)
        o_p = tl.arange(0, P)
        o_d = tl.arange(0, D_PAD)
        m_d = o_d < D
        i_row = (i_seq * HK + i_h).to(tl.int64)  # this (sequence, head)'s row in a host chunk
        p_k_slots = slot_k_ptr + i_b.to(tl.int64) * stride_k_b + i_h * stride_k_h
        p_v_slots = slot_v_ptr + i_b.to(tl.int64) * stride_v_b + i_h * stride_v_h
        p_b_slots = slot_b_ptr + i_b.to(tl.int64) * stride_b_b + i_h * stride_b_h
        if COPY:
            for r0 in range(0, n_missing, NB):
                rank = r0 + o_n  # [NB]
                pick = (miss_rank[None, :] == rank[:, None]) & missing[None, :]  # [NB, K_PAD]
                m_n = rank < n_missing
                blk = tl.sum(tl.where(pick, b_sel[None, :], 0), 1)
                dst = tl.sum(tl.where(pick, dst_of[None, :], 0), 1)
                _copy_blocks(blk, dst, m_n, table_ptr, table_stride, i_row, p_k_slots, p_v_slots, p_b_slots,
                             stride_k_s, stride_v_s, stride_b_s, P, D, D_PAD, QUANT, FP8)
        else:  # the copy list, by rank, for fetch_copy's launch (several programs per row)
            tl.store(copy_blk_ptr + i_bh * K + miss_rank, b_sel, mask=missing & (o_k < K))
            tl.store(copy_dst_ptr + i_bh * K + miss_rank, dst_of, mask=missing & (o_k < K))
            tl.store(n_copy_ptr + i_bh, n_missing)

        # ---- empty slots and the tail: b = MASK wherever no token is held ----
        empty = m_s & (new_sb < 0)
        if tl.sum(empty.to(tl.int32), 0) > 0:
            p_empty = p_b_slots + o_s[:, None] * stride_b_s + o_p[None, :]
            tl.store(p_empty, tl.full([S_PAD, P], MASK, tl.float32), mask=empty[:, None])
        if DECODE:
            b_new = tl.load(b_new_ptr + i_b * stride_bn_b + i_h * stride_bn_h)
            p_tail_b = p_b_slots + new_tail * stride_b_s + o_p
            old = tl.load(p_tail_b)
            tl.store(p_tail_b, tl.where(o_p < pos, old, tl.where(o_p == pos, b_new, MASK)))
            k_new = tl.load(k_new_ptr + i_b * stride_kn_b + i_h * stride_kn_h + o_d, mask=m_d)
            v_new = tl.load(v_new_ptr + i_b * stride_vn_b + i_h * stride_vn_h + o_d, mask=m_d)
            tl.store(p_k_slots + new_tail * stride_k_s + pos * D + o_d, k_new, mask=m_d)
            tl.store(p_v_slots + new_tail * stride_v_s + pos * D + o_d, v_new, mask=m_d)
        if WRITE_HOST and DECODE:
            blk_t = t // P
            row_len_t = tl.load(table_ptr + 3 * table_stride + blk_t)
            row_t = i_row * row_len_t + t % P
            host_b = tl.load(table_ptr + 2 * table_stride + blk_t).to(slot_b_ptr.dtype)
            tl.store(host_b + row_t, b_new)
            if QUANT:
                if pos == P - 1:  # the token completes its block: quantize it from the tail slot (+ the token)
                    tile = o_p[:, None] * D + o_d[None, :]
                    mine = o_p[:, None] == pos
                    store_off = (i_row * row_len_t + o_p)[:, None] * D + o_d[None, :]
                    scale_off = i_row * (row_len_t // P)
                    b_kt = tl.load(p_k_slots + new_tail * stride_k_s + tile, mask=m_d[None, :], other=0.0)
                    b_kt = tl.where(mine, k_new[None, :], b_kt).to(tl.float32)
                    b_vt = tl.load(p_v_slots + new_tail * stride_v_s + tile, mask=m_d[None, :], other=0.0)
                    b_vt = tl.where(mine, v_new[None, :], b_vt).to(tl.float32)
                    for which in tl.static_range(2):  # K, then V: bytes in table rows 0 / 1, scales in rows 4 / 5
                        p_bits = tl.load(table_ptr + which * table_stride + blk_t).to(tl.pointer_type(tl.uint8))
                        p_scale = tl.load(table_ptr + (4 + which) * table_stride + blk_t).to(
                            tl.pointer_type(tl.float32))
                        store_quantized(b_kt if which == 0 else b_vt, p_bits + store_off, p_scale + scale_off,
                                        m_d[None, :], FP8, QMAX)
                else:  # the row's tail in the store, [B, Hk, P, D] in the model's dtype
                    tail_row = (i_row * P + pos) * D
                    p_tail_k = tl.load(table_ptr + 6 * table_stride).to(slot_k_ptr.dtype)
                    p_tail_v = tl.load(table_ptr + 7 * table_stride).to(slot_v_ptr.dtype)
                    tl.store(p_tail_k + tail_row + o_d, k_new, mask=m_d)
                    tl.store(p_tail_v + tail_row + o_d, v_new, mask=m_d)
            else:
                host_k = tl.load(table_ptr + blk_t).to(slot_k_ptr.dtype)
                host_v = tl.load(table_ptr + table_stride + blk_t).to(slot_v_ptr.dtype)
                tl.store(host_k + row_t * D + o_d, k_new, mask=m_d)
                tl.store(host_v + row_t * D + o_d, v_new, mask=m_d)

        # ---- counters; the last program to finish advances the step ----
        tl.atomic_add(counts_ptr, n_missing.to(tl.int64))
        tl.atomic_add(counts_ptr + 1, n_missing.to(tl.int64) * block_bytes)
        if count_locality != 0:
            tl.atomic_add(counts_ptr + 2, (n_selected - n_missing).to(tl.int64))
            tl.atomic_add(counts_ptr + 3, n_selected.to(tl.int64))
        if DECODE:
            ticket = tl.atomic_add(counts_ptr + 4, 1, sem="acq_rel")
        else:
            ticket = 0
        if DECODE and ticket == n_programs - 1:
            # Every other program has read the step and added its counts before taking its ticket.
            tl.store(step_ptr, t_step + 1)
            if count_locality != 0:
                resident = tl.atomic_xchg(counts_ptr + 2, 0)
                selected = tl.atomic_xchg(counts_ptr + 3, 0)
                if selected > 0:  # a step that selected nothing had nothing that could be resident
                    tl.atomic_add(locality_ptr, resident.to(tl.float32) / selected.to(tl.float32))
                    tl.atomic_add(locality_ptr + 1, 1.0)
            tl.atomic_xchg(counts_ptr + 4, 0)


BLOCKS_ENV_VAR = "HF_NOSA_FETCH_BLOCKS"


def blocks_per_copy() -> int:
    """Blocks a fetch program copies per iteration (``HF_NOSA_FETCH_BLOCKS``, default 2: 2 x 64 tokens x D of K and
    of V in flight). A one-byte host store moves half the bytes per iteration at the same count; the setting is
    there to measure whether more blocks in flight bring its step closer to its PCIe floor (issue 18)."""
    value = os.environ.get(BLOCKS_ENV_VAR, "2")
    if value not in ("1", "2", "4", "8"):
        raise ValueError(f"{BLOCKS_ENV_VAR}={value!r} is invalid: it must be 1, 2, 4 or 8 (blocks per iteration)")
    return int(value)


def _fetch_step_triton(selected, pool: SlotPool, host: HostStore, k_new, v_new, b_new, step, offsets, counters,
                       count_locality, decode: bool = True, row0: int = 0, step_rows: int | None = None):
    B, Hk, K = selected.shape
    step_programs = (B if step_rows is None else step_rows) * Hk  # the last of them advances the step
    # A part of the batch copies with as many programs as the whole batch would (fetch_copy's docstring).
    split = 1 if step_rows is None else -(-step_rows // B)
    S = pool.slot_block.shape[-1]
    P, D = pool.slot_k.shape[3], pool.slot_k.shape[4]
    table = host.block_table(pool.slot_k.device)  # [rows, n], or [B, rows, n]: one store per row (HostRows)
    table_row_stride = table.stride(0) if table.dim() == 3 else 0
    block_bytes = host.block_bytes()
    fmt = host.format
    quant, fp8 = fmt is not None, fmt is not None and not fmt.integer
    if split > 1:
        copy_blk = torch.empty(B * Hk, K, dtype=torch.int32, device=pool.slot_k.device)
        copy_dst = torch.empty(B * Hk, K, dtype=torch.int32, device=pool.slot_k.device)
        n_copy = torch.empty(B * Hk, dtype=torch.int32, device=pool.slot_k.device)
    else:
        copy_blk = copy_dst = n_copy = step  # not read: the plan launch copies
    with on_device(pool.slot_k):
        launcher(_fetch_step_kernel)[(B * Hk,)](
            selected, pool.slot_block, pool.tail_slot, pool.slot_k, pool.slot_v, pool.slot_b, table,
            k_new, v_new, b_new, step, offsets, counters.counts, counters.locality, copy_blk, copy_dst, n_copy,
            selected.stride(0), selected.stride(1), pool.slot_block.stride(0), pool.slot_block.stride(1),
            pool.tail_slot.stride(0), pool.tail_slot.stride(1),
            pool.slot_k.stride(0), pool.slot_k.stride(1), pool.slot_k.stride(2),
            pool.slot_v.stride(0), pool.slot_v.stride(1), pool.slot_v.stride(2),
            pool.slot_b.stride(0), pool.slot_b.stride(1), pool.slot_b.stride(2),
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), b_new.stride(0), b_new.stride(1),
            table.stride(-2), table_row_stride, block_bytes, int(bool(count_locality)), step_programs, row0,
            HK=Hk, K=K, K_PAD=next_power_of_2(K), S=S, S_PAD=next_power_of_2(S), P=P, D=D,
            D_PAD=next_power_of_2(D), NB=blocks_per_copy(), MASK=MASK_VALUE, WRITE_HOST=True, DECODE=decode,
            QUANT=quant, FP8=fp8, QMAX=fmt.qmax if fmt is not None else 1.0, COPY=split == 1,
            num_warps=8,
        )
        if split > 1:
            launcher(_fetch_copy_kernel)[(B * Hk, split)](
                copy_blk, copy_dst, n_copy, pool.slot_k, pool.slot_v, pool.slot_b, table,
                pool.slot_k.stride(0), pool.slot_k.stride(1), pool.slot_k.stride(2),
                pool.slot_v.stride(0), pool.slot_v.stride(1), pool.slot_v.stride(2),
                pool.slot_b.stride(0), pool.slot_b.stride(1), pool.slot_b.stride(2),
                table.stride(-2), table_row_stride, row0,
                HK=Hk, K=K, SPLIT=split, P=P, D=D, D_PAD=next_power_of_2(D), NB=blocks_per_copy(), QUANT=quant,
                FP8=fp8, num_warps=8,
            )


def fetch_step_ref(selected, pool: SlotPool, host: HostStore, k_new, v_new, b_new, step, counters, count_locality,
                   offsets=None):
    """Torch reference of ``fetch_step`` (reads the step with a host sync; CPU tensors in the tests)."""
    B, Hk = pool.tail_slot.shape
    device = pool.slot_k.device
    P, S = pool.slot_k.shape[3], pool.slot_block.shape[-1]
    t = int(step.reshape(-1)[0]) - (offsets.to(device) if offsets is not None else torch.zeros(B, dtype=torch.long,
                                                                                               device=device))
    pos = t % P  # [B]
    plan = plan_fetch(selected, pool.slot_block, pool.tail_slot, new_block=pos == 0, current_block=t // P)
    fetch_blocks_ref(plan, selected, host, pool.slot_k, pool.slot_v, pool.slot_b)
    pool.slot_block.copy_(plan.slot_block)
    pool.tail_slot.copy_(plan.tail_slot)
    pool.slot_b[:, :, :S].masked_fill_((pool.slot_block < 0)[..., None], MASK_VALUE)
    bi = torch.arange(B, device=device)[:, None]
    hi = torch.arange(Hk, device=device)[None, :]
    tail = pool.tail_slot
    row = pool.slot_b[bi, hi, tail]  # [B, Hk, P]
    o_p = torch.arange(P, device=device)
    at = pos[:, None, None]
    row = torch.where(o_p < at, row, torch.where(o_p == at, b_new.reshape(B, Hk, 1).float(), MASK_VALUE))
    pool.slot_b[bi, hi, tail] = row
    pool.slot_k[bi, hi, tail, pos[:, None]] = k_new.reshape(B, Hk, -1)
    pool.slot_v[bi, hi, tail, pos[:, None]] = v_new.reshape(B, Hk, -1)
    host.write_rows(t.cpu(), k_new.reshape(B, Hk, 1, -1), v_new.reshape(B, Hk, 1, -1), b_new.reshape(B, Hk, 1).float())
    loaded = plan.missing.sum()
    counters.counts[0].add_(loaded)
    counters.counts[1].add_(loaded * host.block_bytes())
    if count_locality:
        count_share(counters.locality, plan.n_resident.sum(), plan.n_selected.sum())
    step.add_(1)


def fetch_step(
    selected: torch.Tensor,
    pool: SlotPool,
    host: HostStore,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    b_new: torch.Tensor,
    step: torch.Tensor,
    counters: StepCounters,
    *,
    count_locality: bool,
    offsets: torch.Tensor | None = None,
    row0: int = 0,
    step_rows: int | None = None,
) -> None:
    """One decode step of a layer's slot pool, in place: fetch the selection, write the new token, count.

    Args:
        selected: ``[B, Hk, K]`` long blocks to hold (-1 = none), all before the current block.
        pool: the slot pool; afterwards it holds the selected blocks and the tail block with the new token, and
            ``slot_b`` is ``MASK_VALUE`` wherever a slot position holds no token.
        host: the host store; gets the new token. It must have room for it (``host.ensure_capacity``) and, when
            the pool is on CUDA, be pinned. The caller records the new length (``host.mark_device_written``).
            Or one store per row (``hf_nosa.serving.host_rows.HostRows``, a ``[B, rows, n]`` block table): row b
            reads and writes its own store, where it is sequence 0 (requests of a continuous-batching step).
        k_new, v_new: ``[B, Hk, 1, D]`` the new token's key and value; ``b_new``: ``[B, Hk, 1]`` float32 its score.
        step: ``[1]`` long on the pool's device, the cache index t of the new token; advanced by one.
        counters: advanced on the device (blocks and bytes loaded; locality when ``count_locality``).
        offsets: ``[B]`` long on the pool's device, each row's left padding: row b's token is row-relative index
            ``t - offsets[b]`` (blocks, tail position, host index; ``hf_nosa.rules.padding``). None: zeros.
        row0, step_rows: a step decoded a part of the batch at a time (``hf_nosa.cache.decode_parts``): the pool, the
            selection, the new token and the offsets are rows ``row0 .. row0 + B - 1`` of a batch of ``step_rows``.
            The step is advanced, and the locality counted, once every part has run (device kernels only: the
            parts share the step's counters, so no part may start after the step's next one).
    """
    split = row0 != 0 or (step_rows is not None and step_rows != pool.tail_slot.shape[0])
    if split and (isinstance(step_rows, bool) or not isinstance(step_rows, int)
                  or not 0 <= row0 < row0 + pool.tail_slot.shape[0] <= step_rows):
        raise ValueError(f"fetch_step: rows {row0} .. {row0 + pool.tail_slot.shape[0] - 1} are not a part of a batch "
                         f"of step_rows={step_rows!r} rows")
    _check_step(selected, pool, host, k_new, v_new, b_new, step, counters, row0=row0 if split else None)
    B = pool.tail_slot.shape[0]
    if offsets is None:
        offsets = torch.zeros(B, dtype=torch.long, device=pool.slot_k.device)
    elif offsets.shape != (B,) or offsets.dtype != torch.long or offsets.device != pool.slot_k.device:
        raise ValueError(f"offsets must be long [B={B}] on the slot pool's device; got {offsets.dtype} "
                         f"{tuple(offsets.shape)} on {offsets.device}")
    path = kernel_path("fetch", pool.slot_k)
    if path == "triton" and pool.slot_k.is_cuda and not host.pin:
        path = _unpinned_fallback()
    if path == "torch":
        if split:
            raise ValueError("fetch_step: a step split into parts of the batch runs on the device kernels only "
                             f"(the fetch kernel path is {path!r}; HF_NOSA_KERNELS)")
        return fetch_step_ref(selected, pool, host, k_new, v_new, b_new, step, counters, count_locality, offsets)
    _fetch_step_triton(selected, pool, host, k_new, v_new, b_new, step, offsets, counters, count_locality,
                       row0=row0, step_rows=step_rows)


def fetch_selection_ref(selected, pool: SlotPool, host: HostStore, counters: StepCounters, row0: int = 0) -> None:
    """Torch reference of ``fetch_selection``."""
    S = pool.slot_block.shape[-1]
    no_tail = torch.full_like(pool.tail_slot, -1)
    plan = plan_fetch(selected, pool.slot_block, no_tail, new_block=False, current_block=-1)
    fetch_blocks_ref(plan, selected, host, pool.slot_k, pool.slot_v, pool.slot_b, row0)
    pool.slot_block.copy_(plan.slot_block)
    pool.slot_b[:, :, :S].masked_fill_((pool.slot_block < 0)[..., None], MASK_VALUE)
    loaded = plan.missing.sum()
    counters.counts[0].add_(loaded)
    counters.counts[1].add_(loaded * host.block_bytes())


def fetch_selection(selected: torch.Tensor, pool: SlotPool, host: HostStore, counters: StepCounters, *,
                    row0: int = 0) -> None:
    """Make the slot pool hold exactly ``selected`` (QUOKA prefill: no token is written, no tail is kept).

    Blocks still selected stay in their slots, the missing ones are copied from the host store into freed slots
    (one launch on CUDA, reading pinned memory directly), ``slot_b`` is ``MASK_VALUE`` in every empty slot, and
    ``counters`` count the blocks and bytes moved. ``pool.tail_slot`` is left as it was and means nothing after.

    Args:
        selected: ``[B, Hk, K]`` long complete blocks of the host store (-1 = none), ``K < S``.
        row0: the pool's rows are the store's rows ``row0 .. row0 + B - 1`` (a slice of a layer's pool, fetched
            while the attention works on the rows before it: ``prefill.QuokaBlocks``).
    """
    # Not a decode step: the kernel reads no token and leaves the step alone, so these are read-only zeros.
    device = pool.slot_k.device
    step = shared_zeros((1,), torch.long, device)
    B, Hk = pool.tail_slot.shape
    D = pool.slot_k.shape[4]
    dummy_kv = shared_zeros((B, Hk, 1, D), pool.slot_k.dtype, device)
    dummy_b = shared_zeros((B, Hk, 1), torch.float32, device)
    _check_step(selected, pool, host, dummy_kv, dummy_kv, dummy_b, step, counters, row0=row0)
    path = kernel_path("fetch", pool.slot_k)
    if path == "triton" and pool.slot_k.is_cuda and not host.pin:
        path = _unpinned_fallback()
    if path == "torch":
        return fetch_selection_ref(selected, pool, host, counters, row0)
    offsets = shared_zeros((B,), torch.long, device)
    _fetch_step_triton(selected, pool, host, dummy_kv, dummy_kv, dummy_b, step, offsets, counters, False,
                       decode=False, row0=row0)


def _unpinned_fallback() -> str:
    from ..backend import forced_path

    if forced_path() == "triton":
        raise ValueError(
            "fetch on CUDA with HF_NOSA_KERNELS=triton needs a pinned host store (NosaConfig.offload=True): "
            "the kernel reads host memory through its device address."
        )
    log_fallback("fetch", "cuda", "the host store is not pinned (NosaConfig.offload=False)")
    return "torch"


def _check_step(selected, pool, host, k_new, v_new, b_new, step, counters, row0: int | None = None) -> None:
    """Shapes, dtypes and devices of a fetch; ``row0`` None: the pool holds every row of the store, else the store's
    rows ``row0 ..``."""
    B, Hk, S = pool.slot_block.shape
    P, D = pool.slot_k.shape[3], pool.slot_k.shape[4]
    if selected.dim() != 3 or tuple(selected.shape[:2]) != (B, Hk) or selected.dtype != torch.long:
        raise ValueError(f"selected must be long [B={B}, Hk={Hk}, K]; got {selected.dtype} {tuple(selected.shape)}")
    if selected.shape[2] >= S:
        raise ValueError(f"selected holds {selected.shape[2]} blocks but the pool has only {S} slots (needs K + 1)")
    if pool.slot_k.shape != (B, Hk, S + 1, P, D) or pool.slot_v.shape != pool.slot_k.shape:
        raise ValueError(f"slot_k/slot_v must be [B, Hk, S + 1, P, D] = {(B, Hk, S + 1, P, D)}; "
                         f"got {tuple(pool.slot_k.shape)}")
    if pool.slot_b.shape != (B, Hk, S + 1, P) or pool.slot_b.dtype != torch.float32:
        raise ValueError(f"slot_b must be float32 [B, Hk, S + 1, P]; "
                         f"got {pool.slot_b.dtype} {tuple(pool.slot_b.shape)}")
    for name, t in (("slot_k", pool.slot_k), ("slot_v", pool.slot_v), ("slot_b", pool.slot_b)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if tuple(t.shape) != (B, Hk, 1, D) or t.stride(-1) != 1 or t.dtype != pool.slot_k.dtype:
            raise ValueError(f"{name} must be {pool.slot_k.dtype} [B, Hk, 1, D] = {(B, Hk, 1, D)} "
                             "with a contiguous last dim")
    if tuple(b_new.shape) != (B, Hk, 1) or b_new.dtype != torch.float32:
        raise ValueError(f"b_new must be float32 [B, Hk, 1] = {(B, Hk, 1)}; got {b_new.dtype} {tuple(b_new.shape)}")
    if step.numel() != 1 or step.dtype != torch.long or step.device != pool.slot_k.device:
        raise ValueError("step must be a one-element long tensor on the slot pool's device")
    rows_fit = host.batch == B if row0 is None else 0 <= row0 <= host.batch - B
    if (host.kv_heads, host.head_dim, host.dtype, host.block_size) != (Hk, D, pool.slot_k.dtype, P) or not rows_fit:
        raise ValueError("the host store's batch, KV heads, head dim, dtype or block size do not fit the slot pool's "
                         f"(store batch {host.batch}, pool rows {row0 or 0} .. {(row0 or 0) + B - 1})")
    if counters.counts.device != pool.slot_k.device or counters.counts.numel() != 5:
        raise ValueError("counters must be StepCounters.zeros(device) on the slot pool's device")
