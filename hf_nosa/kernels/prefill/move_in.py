"""Moving the previous prefill chunk's blocks into the slot pool (``PrefillPaths._move_in_previous_chunk``) in one
launch per chunk and layer.

Each QUOKA chunk's local window gains the previous chunk's complete blocks, which are still on the device as that
chunk's keys and values. They take the slots whose block the chunk did not select: the free slots in slot order,
then (only when the pool has fewer free slots than blocks to place) kept slots, whose block stays and whose copy
goes to the scratch slot ``S`` instead. The torch reference (``move_in_ref``) takes 17 launches (compare, sort,
gathers, scatters); at batch 1 the prefill is bound by the host issuing launches, so the kernel does it in one:
one program per (sequence, KV head) finds the slots (a slot's rank is the number of slots before it in that order,
counted pairwise over the at most ``S`` slots), copies the blocks, then writes the slots' new block indices.
"""

from __future__ import annotations

import torch

from ..backend import HAS_TRITON, kernel_path, launcher, next_power_of_2, on_device, tl, triton

if HAS_TRITON:

    @triton.jit(do_not_specialize=["first", "n", "a", "stride_bb", "stride_bh"])
    def _move_in_kernel(
        held_ptr, sel_ptr, k_ptr, v_ptr, b_ptr, sk_ptr, sv_ptr, sb_ptr,
        stride_hb, stride_hh, stride_hs,
        stride_eb, stride_eh, stride_ek,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_vb, stride_vh, stride_vt, stride_vd,
        stride_bb, stride_bh, stride_bt,
        stride_skb, stride_skh, stride_sks, stride_skp, stride_skd,
        stride_svb, stride_svh, stride_svs, stride_svp, stride_svd,
        stride_sbb, stride_sbh, stride_sbs, stride_sbp,
        Hk, S, K, P, D, first, n, a,
        BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Program (sequence x KV head): place blocks ``first .. first + n - 1`` (tokens ``a ..`` of k/v/b)."""
        i_bh = tl.program_id(0)
        i_b, i_h = (i_bh // Hk).to(tl.int64), (i_bh % Hk).to(tl.int64)
        o_s = tl.arange(0, BLOCK_S)
        m_s = o_s < S
        p_held = held_ptr + i_b * stride_hb + i_h * stride_hh + o_s * stride_hs
        held = tl.load(p_held, mask=m_s, other=-1)
        kept = tl.zeros([BLOCK_S], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            sel = tl.load(sel_ptr + i_b * stride_eb + i_h * stride_eh + o_k * stride_ek, mask=o_k < K, other=-1)
            match = (held[:, None] == sel[None, :]) & (held >= 0)[:, None] & (o_k < K)[None, :]
            kept = tl.maximum(kept, tl.max(match.to(tl.int32), axis=1))
        # order: free slots by index, then kept slots by index (the reference's stable sort of `kept`); past S last
        key = tl.where(m_s, kept * BLOCK_S + o_s, 2 * BLOCK_S + o_s)
        rank = tl.sum((key[None, :] < key[:, None]).to(tl.int32), axis=1)  # [BLOCK_S]

        o_p = tl.arange(0, BLOCK_P)
        o_d = tl.arange(0, BLOCK_D)
        m_pd = (o_p < P)[:, None] & (o_d < D)[None, :]
        for j in range(0, n):
            at = rank == j
            slot = tl.sum(tl.where(at, o_s, 0))
            placed = tl.sum(tl.where(at, kept, 0)) == 0
            target = tl.where(placed, slot, S).to(tl.int64)  # the scratch slot absorbs what has no place
            t = a + j * P + o_p
            p_k = k_ptr + i_b * stride_kb + i_h * stride_kh + t[:, None] * stride_kt + o_d[None, :] * stride_kd
            p_v = v_ptr + i_b * stride_vb + i_h * stride_vh + t[:, None] * stride_vt + o_d[None, :] * stride_vd
            q_k = sk_ptr + i_b * stride_skb + i_h * stride_skh + target * stride_sks
            q_v = sv_ptr + i_b * stride_svb + i_h * stride_svh + target * stride_svs
            tl.store(q_k + o_p[:, None] * stride_skp + o_d[None, :] * stride_skd, tl.load(p_k, mask=m_pd), mask=m_pd)
            tl.store(q_v + o_p[:, None] * stride_svp + o_d[None, :] * stride_svd, tl.load(p_v, mask=m_pd), mask=m_pd)
            b_row = tl.load(b_ptr + i_b * stride_bb + i_h * stride_bh + t * stride_bt, mask=o_p < P)
            q_b = sb_ptr + i_b * stride_sbb + i_h * stride_sbh + target * stride_sbs
            tl.store(q_b + o_p * stride_sbp, b_row, mask=o_p < P)
        # every thread has read `held` above before any of it is overwritten
        tl.debug_barrier()
        new = tl.where((rank < n) & (kept == 0), first + rank, held)
        tl.store(p_held, new.to(tl.int64), mask=m_s)


def move_in_ref(slot_k, slot_v, slot_b, slot_block, selected, k, v, b, first: int, n: int, a: int) -> None:
    """The torch reference (in place): blocks ``first .. first + n - 1``, held by ``k/v/b [B, Hk, T(, D)]`` from
    token ``a``, take the first ``n`` slots in the order free slots, then kept slots (a slot is kept when its block
    is in ``selected [B, Hk, K]``); a block given a kept slot is written to the scratch slot ``S`` and the slot
    keeps its block."""
    B, Hk, S = slot_block.shape
    P, D = slot_k.shape[3], slot_k.shape[4]
    held = slot_block
    kept = ((held[..., :, None] == selected[..., None, :]) & (held >= 0)[..., None]).any(-1)
    slot = torch.sort(kept.to(torch.int8), dim=-1, stable=True).indices[..., :n]  # [B, Hk, n], free slots first
    placed = ~kept.gather(2, slot)  # (always, unless the pool is smaller than the selection plus one slot)
    blocks = torch.arange(first, first + n, device=held.device).expand(B, Hk, n)
    held.scatter_(2, slot, torch.where(placed, blocks, held.gather(2, slot)))
    target = torch.where(placed, slot, S)
    slot_k.scatter_(2, target[..., None, None].expand(B, Hk, n, P, D), k[:, :, a : a + n * P].reshape(B, Hk, n, P, D))
    slot_v.scatter_(2, target[..., None, None].expand(B, Hk, n, P, D), v[:, :, a : a + n * P].reshape(B, Hk, n, P, D))
    slot_b.scatter_(2, target[..., None].expand(B, Hk, n, P), b[:, :, a : a + n * P].reshape(B, Hk, n, P))


def move_in(slot_k, slot_v, slot_b, slot_block, selected, k, v, b, first: int, n: int, a: int) -> None:
    """Put blocks ``first .. first + n - 1`` into the slot pool, in place (Triton on CUDA, torch elsewhere;
    ``HF_NOSA_KERNELS`` forces one, see ``backend.py``).

    Args:
        slot_k, slot_v: ``[B, Hk, S + 1, P, D]`` the pool and its scratch slot; slot_b: ``[B, Hk, S + 1, P]``.
        slot_block: ``[B, Hk, S]`` long, each slot's block (-1: none); updated for the slots that get a block.
        selected: ``[B, Hk, K]`` long, the blocks the chunk selected (-1: none): their slots are kept.
        k, v: ``[B, Hk, T, D]``, b: ``[B, Hk, T]``: the blocks' tokens, block ``first + j`` from token ``a + j * P``.
        n: blocks to place, at most ``S``.
    """
    B, Hk, S = slot_block.shape
    P = slot_k.shape[3]
    if n <= 0:
        return
    if n > S or a < 0 or a + n * P > k.shape[2]:
        raise ValueError(
            f"move_in: n must be at most S = {S} and tokens a .. a + n * P within the {k.shape[2]} given; "
            f"got n={n}, a={a}, P={P}"
        )
    if kernel_path("move_in", k) == "torch":
        move_in_ref(slot_k, slot_v, slot_b, slot_block, selected, k, v, b, first, n, a)
        return
    K, D = selected.shape[2], slot_k.shape[4]
    with on_device(k):
        launcher(_move_in_kernel)[(B * Hk,)](
            slot_block, selected, k, v, b, slot_k, slot_v, slot_b,
            *slot_block.stride(), *selected.stride(), *k.stride(), *v.stride(), *b.stride(),
            *slot_k.stride(), *slot_v.stride(), *slot_b.stride(),
            Hk, S, K, P, D, first, n, a,
            BLOCK_S=max(16, next_power_of_2(S)), BLOCK_K=min(64, max(16, next_power_of_2(K))),
            BLOCK_P=max(16, next_power_of_2(P)), BLOCK_D=max(16, next_power_of_2(D)),
        )
