"""Host write: store a run of new tokens' K, V and eviction scores into the pinned host store, from the device.

A prefill chunk's keys sit on the device as ``[B, Hk, T, D]``; in the store each (sequence, KV head) row of a
chunk is contiguous, so the tokens of one update land in B * Hk separate runs. ``torch.Tensor.copy_`` into such a
strided pinned slice goes through a pageable temporary and blocks the host until the device has caught up. This
kernel writes the tokens straight into pinned memory through the store's block table (UVA), like the decode
step's fetch kernel reads it: no host sync, no temporary. One program per (sequence, KV head, tile of tokens).

A quantized store (``HostStore.format``, ``hf_nosa.cache.host_quant``) takes one program per (sequence, KV head, block
the update touches): a block the update completes is assembled from the row's tail (its tokens written before)
and the new tokens, its amax gives the scale, and its bytes and scale go to the store; the new tokens of the block
left incomplete go to the row's tail, written by the program of the first block, after that one has read the
tail's earlier tokens (so no two programs touch the tail). The values are read once, from the device.

The reference is ``HostStore.write`` (the torch copy), which every CPU path uses.
"""

from __future__ import annotations

import os

import torch

from ..backend import (HAS_TRITON, kernel_path, launcher, log_fallback, next_power_of_2, on_device, shared_zeros,
                       tl, triton)
from ..host_format import store_quantized

# ``host`` arguments are a ``hf_nosa.cache.host_store.HostStore``. The cache is the layer above the kernels, so its
# name stays in the (string) annotations and is not imported: imports only go down the layers.

BLOCK_T = 32  # tokens per tile
WRITE_PROGRAMS_ENV_VAR = "HF_NOSA_WRITE_PROGRAMS"


def write_programs() -> int:
    """Programs of a host write in the model's dtype, all rows together (``HF_NOSA_WRITE_PROGRAMS``, default 32).

    The write is bound by PCIe, not by the SMs; on the side stream beside a layer's compute, one program per tile
    (16K programs for a 64K prompt at batch 1) took the SMs from the main stream's kernels: at 64K, batch 1, the
    query choice that runs beside it stretched from 16 to 50 ms (H200, docs/results/
    2026-12-03_prefill_breakdown_64k_b1_whole_593d5b9.json). Each program loops over tiles instead.
    """
    value = os.environ.get(WRITE_PROGRAMS_ENV_VAR, "32")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{WRITE_PROGRAMS_ENV_VAR}={value!r} is invalid: it must be a positive integer (programs)")
    return int(value)

if HAS_TRITON:

    @triton.jit(do_not_specialize=["start", "n_tokens", "table_stride", "stride_b_b", "stride_b_h"])
    def _host_write_kernel(
        k_ptr, v_ptr, b_ptr, table_ptr, offset_ptr, limit_ptr,
        stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t, stride_b_b, stride_b_h, stride_b_t,
        table_stride, start, n_tokens,
        HK: tl.constexpr, P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BT: tl.constexpr,
        QUANT: tl.constexpr, FP8: tl.constexpr, QMAX: tl.constexpr,
    ):
        if QUANT:
            _host_write_quantized(
                k_ptr, v_ptr, b_ptr, table_ptr, offset_ptr, limit_ptr,
                stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t, stride_b_b, stride_b_h,
                stride_b_t, table_stride, start, n_tokens, HK, P, D, D_PAD, FP8, QMAX,
            )
        else:
            _host_write_tokens(
                k_ptr, v_ptr, b_ptr, table_ptr, offset_ptr,
                stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t, stride_b_b, stride_b_h,
                stride_b_t, table_stride, start, n_tokens, HK, P, D, D_PAD, BT,
            )

    @triton.jit
    def _host_write_tokens(
        k_ptr, v_ptr, b_ptr, table_ptr, offset_ptr,
        stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t, stride_b_b, stride_b_h, stride_b_t,
        table_stride, start, n_tokens,
        HK: tl.constexpr, P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BT: tl.constexpr,
    ):
        """Program (row, KV head, every n-th tile of BT tokens of the update, n the grid's second size): the tokens as
        they are."""
        i_bh = tl.program_id(0)
        i_b = i_bh // HK
        i_h = i_bh % HK
        o_d = tl.arange(0, D_PAD)
        for i_t in range(tl.program_id(1), tl.cdiv(n_tokens, BT), tl.num_programs(1)):
            _host_write_tile(k_ptr, v_ptr, b_ptr, table_ptr, offset_ptr, stride_k_b, stride_k_h, stride_k_t, stride_v_b,
                             stride_v_h, stride_v_t, stride_b_b, stride_b_h, stride_b_t, table_stride, start, n_tokens,
                             i_b, i_h, i_t * BT + tl.arange(0, BT), o_d, HK, P, D)

    @triton.jit
    def _host_write_tile(
        k_ptr, v_ptr, b_ptr, table_ptr, offset_ptr,
        stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t, stride_b_b, stride_b_h, stride_b_t,
        table_stride, start, n_tokens, i_b, i_h, o_t, o_d,
        HK: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
    ):
        t = start + o_t.to(tl.int64) - tl.load(offset_ptr + i_b)  # row-relative index of each token
        m_t = (o_t < n_tokens) & (t >= 0)  # a token before the row's first real one is padding: not stored
        m_td = m_t[:, None] & (o_d < D)[None, :]
        blk = tl.where(m_t, t, 0) // P
        row_len = tl.load(table_ptr + 3 * table_stride + blk, mask=m_t, other=0)
        row = (i_b * HK + i_h).to(tl.int64) * row_len + t % P  # token offset from its block's address
        b_k = tl.load(k_ptr + i_b.to(tl.int64) * stride_k_b + i_h * stride_k_h + o_t[:, None] * stride_k_t + o_d[None, :],
                      mask=m_td)
        b_v = tl.load(v_ptr + i_b.to(tl.int64) * stride_v_b + i_h * stride_v_h + o_t[:, None] * stride_v_t + o_d[None, :],
                      mask=m_td)
        b_b = tl.load(b_ptr + i_b.to(tl.int64) * stride_b_b + i_h * stride_b_h + o_t * stride_b_t, mask=m_t)
        host_k = tl.load(table_ptr + blk, mask=m_t, other=0).to(k_ptr.dtype)
        host_v = tl.load(table_ptr + table_stride + blk, mask=m_t, other=0).to(v_ptr.dtype)
        host_b = tl.load(table_ptr + 2 * table_stride + blk, mask=m_t, other=0).to(b_ptr.dtype)
        tl.store(host_k[:, None] + row[:, None] * D + o_d[None, :], b_k, mask=m_td)
        tl.store(host_v[:, None] + row[:, None] * D + o_d[None, :], b_v, mask=m_td)
        tl.store(host_b + row, b_b, mask=m_t)

    @triton.jit
    def _host_write_quantized(
        k_ptr, v_ptr, b_ptr, table_ptr, offset_ptr, limit_ptr,
        stride_k_b, stride_k_h, stride_k_t, stride_v_b, stride_v_h, stride_v_t, stride_b_b, stride_b_h, stride_b_t,
        table_stride, start, n_tokens,
        HK: tl.constexpr, P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr,
        QMAX: tl.constexpr,
    ):
        """Program (row, KV head, j): block ``c0 + j`` of the row, c0 the block of its first stored token."""
        i_bh = tl.program_id(0)
        i_j = tl.program_id(1)
        i_b = i_bh // HK
        i_h = i_bh % HK
        r0 = start - tl.load(offset_ptr + i_b)  # row-relative index of the update's token 0 (negative: padding)
        first = tl.maximum(r0, 0)
        c0 = first // P
        c = c0 + i_j
        end = r0 + n_tokens  # the row's length after the update
        tail_end = tl.minimum(end, tl.load(limit_ptr + i_b))  # the row's end for its tail (HostStore.set_limits)
        o_p = tl.arange(0, P)
        o_d = tl.arange(0, D_PAD)
        m_d = (o_d < D)[None, :]
        i_row = (i_b * HK + i_h).to(tl.int64)
        p_k = k_ptr + i_b.to(tl.int64) * stride_k_b + i_h * stride_k_h
        p_v = v_ptr + i_b.to(tl.int64) * stride_v_b + i_h * stride_v_h
        tail_off = (i_row * P + o_p)[:, None] * D + o_d[None, :]  # tails are [B, Hk, P, D]
        tail_k = tl.load(table_ptr + 6 * table_stride).to(k_ptr.dtype)
        tail_v = tl.load(table_ptr + 7 * table_stride).to(v_ptr.dtype)
        if c * P < end:  # the block holds new tokens
            t = c * P + o_p  # row-relative index of each position
            i_in = t - r0  # its index in the update
            new = (t >= first) & (t < end)
            row_len = tl.load(table_ptr + 3 * table_stride + c)
            tok = i_row * row_len + o_p  # token offset from the block's address
            b_b = tl.load(b_ptr + i_b.to(tl.int64) * stride_b_b + i_h * stride_b_h + i_in * stride_b_t, mask=new)
            tl.store(tl.load(table_ptr + 2 * table_stride + c).to(b_ptr.dtype) + tok, b_b, mask=new)
            if c * P + P <= end:  # complete: the tail's tokens before the update, then the new ones
                old = (t < first)[:, None] & m_d
                in_off = i_in[:, None] * stride_k_t + o_d[None, :]
                b_k = tl.where(old, tl.load(tail_k + tail_off, mask=old, other=0.0),
                               tl.load(p_k + in_off, mask=new[:, None] & m_d, other=0.0)).to(tl.float32)
                in_off = i_in[:, None] * stride_v_t + o_d[None, :]
                b_v = tl.where(old, tl.load(tail_v + tail_off, mask=old, other=0.0),
                               tl.load(p_v + in_off, mask=new[:, None] & m_d, other=0.0)).to(tl.float32)
                store_off = tok[:, None] * D + o_d[None, :]
                scale_off = i_row * (row_len // P)
                for which in tl.static_range(2):  # K, then V: bytes in table rows 0 / 1, scales in rows 4 / 5
                    p_bits = tl.load(table_ptr + which * table_stride + c).to(tl.pointer_type(tl.uint8))
                    p_scale = tl.load(table_ptr + (4 + which) * table_stride + c).to(tl.pointer_type(tl.float32))
                    store_quantized(b_k if which == 0 else b_v, p_bits + store_off, p_scale + scale_off, m_d, FP8, QMAX)
        if (i_j == 0) & (tail_end % P != 0) & (tail_end > first):
            # the block left incomplete: its new tokens go to the tail, after this program read the tail above
            t = tail_end // P * P + o_p
            i_in = t - r0
            m = ((t >= first) & (t < tail_end))[:, None] & m_d
            tl.store(tail_k + tail_off, tl.load(p_k + i_in[:, None] * stride_k_t + o_d[None, :], mask=m), mask=m)
            tl.store(tail_v + tail_off, tl.load(p_v + i_in[:, None] * stride_v_t + o_d[None, :], mask=m), mask=m)


def host_write(host: HostStore, start: int, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, *,
               offsets: torch.Tensor | None = None) -> None:
    """Store tokens ``start .. start + T - 1`` (``k, v [B, Hk, T, D]``, ``b [B, Hk, T]`` float32) in ``host``.

    ``offsets``: ``[B]`` long on k's device, each row's left padding: row b's token ``start + i`` then goes to
    row-relative index ``start + i - offsets[b]`` (``hf_nosa.rules.padding``; negative ones are not stored). None:
    zeros.

    On CUDA with a pinned store: one launch, asynchronous, on the current stream (the store's ``wait_writes``
    synchronises before the CPU reads it); on CPU under ``HF_NOSA_KERNELS=triton`` and ``TRITON_INTERPRET=1``
    the same kernel; elsewhere ``HostStore.write`` (an unpinned store on CUDA too, logged once).
    """
    B, Hk, T, D = k.shape
    if (host.batch, host.kv_heads, host.head_dim, host.dtype) != (B, Hk, D, k.dtype) or v.shape != k.shape:
        raise ValueError(
            f"host_write: k, v must be {host.dtype} [B={host.batch}, Hk={host.kv_heads}, T, D={host.head_dim}]; "
            f"got {k.dtype} {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if b.shape != (B, Hk, T) or b.dtype != torch.float32:
        raise ValueError(f"host_write: b must be float32 [B, Hk, T] = {(B, Hk, T)}; got {b.dtype} {tuple(b.shape)}")
    if T == 0:
        return
    path = kernel_path("host_write", k)
    if path == "triton" and k.is_cuda and not host.pin:
        log_fallback("host_write", "cuda", "the host store is not pinned (NosaConfig.offload=False)")
        path = "torch"
    if path == "torch":
        if offsets is None:
            host.write(start, k, v, b)
        else:
            host.write_rows(start - offsets.to("cpu", torch.long), k, v, b)
        return
    if offsets is None:
        offsets = shared_zeros((B,), torch.long, k.device)
    elif tuple(offsets.shape) != (B,) or offsets.dtype != torch.long or offsets.device != k.device:
        raise ValueError(f"host_write: offsets must be long [B={B}] on {k.device}; got {offsets.dtype} "
                         f"{tuple(offsets.shape)} on {offsets.device}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    host.ensure_capacity(start + T)
    table = host.block_table(k.device)
    fmt = host.format
    if fmt is None:  # at most write_programs() programs, each looping over tiles
        grid = (B * Hk, min(triton.cdiv(T, BLOCK_T), max(1, write_programs() // (B * Hk))))
    else:  # a quantized store: a program per block touched (an unaligned row start adds one)
        grid = (B * Hk, triton.cdiv(T, host.block_size) + 1)
    with on_device(k):
        launcher(_host_write_kernel)[grid](
            k, v, b, table, offsets, host.limits_on(k.device),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            b.stride(0), b.stride(1), b.stride(2),
            table.stride(0), start, T,
            HK=Hk, P=host.block_size, D=D, D_PAD=next_power_of_2(D), BT=BLOCK_T,
            QUANT=fmt is not None, FP8=fmt is not None and not fmt.integer, QMAX=fmt.qmax if fmt is not None else 1.0,
            num_warps=4,
        )
    host.mark_device_written(start + T, k.device)
