"""The copy half of a decode fetch: missing blocks from pinned host memory into their slots, several programs a row.

``fetch.fetch_step`` plans and copies in one launch, one program per (sequence, KV head). A program reads the host
through PCIe a few blocks at a time, each round waiting for its loads, so the fetch's rate grows with the number of
programs: on an H200 at 64K tokens a fetch over 8 rows x 8 KV heads ran at 48 GB/s (PCIe's rate), one over 4 rows
took as long for half the bytes (``docs/results/2026-12-02_decode_parts_*.json``, eager breakdown). When a step
runs a part of the batch at a time (``hf_nosa.cache.decode_parts``) each part's fetch has only its rows' programs,
so the plan launch writes each row's copy list (block and destination slot, by rank) and this launch copies it with
``split`` programs per (sequence, KV head), program j taking the ranks j, j + split, ... ``_copy_blocks`` is the copy
both use.
"""

from __future__ import annotations

from ..backend import HAS_TRITON, tl, triton
from ..host_format import cast_rtne, dequantize

if HAS_TRITON:

    @triton.jit
    def _copy_blocks(blk, dst, m_n, table_ptr, table_stride, i_row, p_k_slots, p_v_slots, p_b_slots,
                     stride_k_s, stride_v_s, stride_b_s,
                     P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr,
                     FP8: tl.constexpr):
        """Copy blocks ``blk [NB]`` of host row ``i_row`` into slots ``dst [NB]`` where ``m_n``."""
        o_p = tl.arange(0, P)
        o_d = tl.arange(0, D_PAD)
        m_d = o_d < D
        # The block table gives the block's first token in row 0 of its chunk and the chunk's row length.
        row_len = tl.load(table_ptr + 3 * table_stride + blk, mask=m_n, other=0)
        tok = (i_row * row_len)[:, None] + o_p[None, :]  # [NB, P] token offset from the block's address
        m_nd = m_n[:, None, None] & m_d[None, None, :]
        # Chunk addresses are page-aligned pinned allocations: saying so lets the loads be vectorised.
        host_b = tl.multiple_of(tl.load(table_ptr + 2 * table_stride + blk, mask=m_n, other=0), 16).to(
            p_b_slots.dtype)
        kv_off = tok[:, :, None] * D + o_d[None, None, :]  # [NB, P, D_PAD]
        if QUANT:  # the block's bytes and scales; dequantized here, into the slot pool's dtype
            host_k = tl.multiple_of(tl.load(table_ptr + blk, mask=m_n, other=0), 16).to(tl.pointer_type(tl.uint8))
            host_v = tl.multiple_of(tl.load(table_ptr + table_stride + blk, mask=m_n, other=0),
                                    16).to(tl.pointer_type(tl.uint8))
            scale_off = i_row * (row_len // P)
            p_ks = tl.load(table_ptr + 4 * table_stride + blk, mask=m_n, other=0).to(tl.pointer_type(tl.float32))
            p_vs = tl.load(table_ptr + 5 * table_stride + blk, mask=m_n, other=0).to(tl.pointer_type(tl.float32))
            s_k = tl.load(p_ks + scale_off, mask=m_n, other=1.0)
            s_v = tl.load(p_vs + scale_off, mask=m_n, other=1.0)
            b_k = tl.load(host_k[:, None, None] + kv_off, mask=m_nd, other=0)
            b_v = tl.load(host_v[:, None, None] + kv_off, mask=m_nd, other=0)
            b_k = cast_rtne(dequantize(b_k, s_k[:, None, None], FP8), p_k_slots.dtype.element_ty)
            b_v = cast_rtne(dequantize(b_v, s_v[:, None, None], FP8), p_v_slots.dtype.element_ty)
        else:
            host_k = tl.multiple_of(tl.load(table_ptr + blk, mask=m_n, other=0), 16).to(p_k_slots.dtype)
            host_v = tl.multiple_of(tl.load(table_ptr + table_stride + blk, mask=m_n, other=0),
                                    16).to(p_v_slots.dtype)
            b_k = tl.load(host_k[:, None, None] + kv_off, mask=m_nd)
            b_v = tl.load(host_v[:, None, None] + kv_off, mask=m_nd)
        b_b = tl.load(host_b[:, None] + tok, mask=m_n[:, None])
        slot_off = dst[:, None, None] * stride_k_s + o_p[None, :, None] * D + o_d[None, None, :]
        tl.store(p_k_slots + slot_off, b_k, mask=m_nd)
        slot_off = dst[:, None, None] * stride_v_s + o_p[None, :, None] * D + o_d[None, None, :]
        tl.store(p_v_slots + slot_off, b_v, mask=m_nd)
        tl.store(p_b_slots + dst[:, None] * stride_b_s + o_p[None, :], b_b, mask=m_n[:, None])

    @triton.jit(do_not_specialize=["table_stride", "table_row_stride", "row0"])
    def _fetch_copy_kernel(
        copy_blk_ptr, copy_dst_ptr, n_copy_ptr, slot_k_ptr, slot_v_ptr, slot_b_ptr, table_ptr,
        stride_k_b, stride_k_h, stride_k_s, stride_v_b, stride_v_h, stride_v_s, stride_b_b, stride_b_h, stride_b_s,
        table_stride, table_row_stride, row0,
        HK: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
        D_PAD: tl.constexpr, NB: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_j = tl.program_id(1)
        i_b = i_bh // HK
        i_h = i_bh % HK
        n = tl.load(n_copy_ptr + i_bh)
        # one store per row (table_row_stride > 0): the row's own table, where it is sequence 0 (fetch.py's kernel)
        table_ptr += (i_b + row0).to(tl.int64) * table_row_stride
        i_row = (tl.where(table_row_stride == 0, i_b + row0, 0) * HK + i_h).to(tl.int64)
        p_k_slots = slot_k_ptr + i_b.to(tl.int64) * stride_k_b + i_h * stride_k_h
        p_v_slots = slot_v_ptr + i_b.to(tl.int64) * stride_v_b + i_h * stride_v_h
        p_b_slots = slot_b_ptr + i_b.to(tl.int64) * stride_b_b + i_h * stride_b_h
        o_n = tl.arange(0, NB)
        for r0 in range(i_j * NB, n, SPLIT * NB):
            rank = r0 + o_n
            m_n = rank < n
            blk = tl.load(copy_blk_ptr + i_bh * K + rank, mask=m_n, other=0)
            dst = tl.load(copy_dst_ptr + i_bh * K + rank, mask=m_n, other=0)
            _copy_blocks(blk, dst, m_n, table_ptr, table_stride, i_row, p_k_slots, p_v_slots, p_b_slots,
                         stride_k_s, stride_v_s, stride_b_s, P, D, D_PAD, QUANT, FP8)
