"""Span read: tokens ``start .. end - 1`` of every (sequence, KV head) of the host store, onto the device.

What a dense read of the store needs (the QUOKA prefill's dense tail reads the whole prompt a piece at a time,
``hf_nosa.attention.prefix``): ``k, v [B, Hk, T, D]`` in the model's dtype and ``b [B, Hk, T]`` fp32.

- ``read_span_ref``: the torch reference, ``HostStore.read_torch`` (slices of each chunk moved with ``.to``; a slice
  ``[:, :, a:b]`` of a ``[B, Hk, C, D]`` chunk is not contiguous, so torch first copies it into pageable memory on
  the CPU and then copies that synchronously: on a 64K prompt at batch 38 this moved 76 GB at CPU-copy speed).
- ``read_span_copy`` (``host_copy.py``): the copy engine's 2D copies instead, for a store in the model's dtype (the
  default, ``READ_PATH = "auto"``, on CUDA);
- ``read_span``'s kernel: one Triton launch on CUDA (a quantized store, or ``READ_PATH = "kernel"``). Each program
  copies one block of one (sequence, KV head) straight from pinned host memory through the store's block table
  (UVA, as ``fetch_step`` does), dequantizing a quantized store's bytes with their block scale, and taking each
  row's incomplete block from the store's tail. No host sync: the launch is ordered after the store's writes on the
  device (the caller's stream waits for the writer stream; an asynchronous write's event is waited on by the
  stream, not by the host).
"""

from __future__ import annotations

import logging

import torch

from ..backend import HAS_TRITON, kernel_path, launcher, log_fallback, next_power_of_2, on_device, tl, triton
from ..host_format import cast_rtne, dequantize
from .host_copy import read_span_copy, span_outputs

# Blocks each program copies and its warps (``python -m benchmarks prefill read`` sweeps them: the dense tail of a
# new turn at batch 8 read at 26-29 GB/s with one block and 4 warps, about half the link's copy rate).
READ_BLOCKS = 1
READ_WARPS = 4
# "kernel": the Triton kernel below; "copy": 2D copies by the copy engine (``host_copy.read_span_copy``) for a store
# in the model's dtype (a quantized one still takes the kernel, which dequantizes, with a warning); "auto": the copy
# engine for a store in the model's dtype and the kernel for a quantized one, without a warning. Chosen by
# measurement: on an H100 the copy engine read a batch-8 turn's dense tail at 54.7 GB/s and the kernel at 50.0-50.4
# GB/s whatever its blocks and warps (2026-12-07, docs/benchmarks.md).
READ_PATHS = ("auto", "kernel", "copy")
READ_PATH = "auto"
_LOGGED: set = set()
logger = logging.getLogger(__name__)

if HAS_TRITON:

    @triton.jit(do_not_specialize=["start", "end", "first_block", "n_blocks", "table_stride"])
    def _read_span_kernel(
        table_ptr, tail_block_ptr, k_out_ptr, v_out_ptr, b_out_ptr,
        start, end, first_block, n_blocks, table_stride,
        HK: tl.constexpr, P: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCKS: tl.constexpr,
        QUANT: tl.constexpr, FP8: tl.constexpr,
    ):
        i_bh = tl.program_id(0).to(tl.int64)  # this (sequence, KV head)'s row in a host chunk
        o_p = tl.arange(0, P)
        o_d = tl.arange(0, D_PAD)
        m_d = o_d < D
        T = end - start
        for i in tl.static_range(BLOCKS):  # BLOCKS blocks a program: more bytes in flight per program over PCIe
            j = tl.program_id(1) * BLOCKS + i
            # the last program's blocks past the span read no token (and the table at the span's last block)
            stop = tl.where(j < n_blocks, end, start)
            blk = first_block + tl.minimum(j, n_blocks - 1)
            tok = blk.to(tl.int64) * P + o_p  # [P]
            m_t = (tok >= start) & (tok < stop)
            m_td = m_t[:, None] & m_d[None, :]
            # The table gives the block's first token in row 0 of its chunk and the chunk's row length.
            row_len = tl.load(table_ptr + 3 * table_stride + blk)
            src = (i_bh * row_len)[None] + o_p  # [P] tokens from the block's address
            kv_off = src[:, None] * D + o_d[None, :]
            host_b = tl.multiple_of(tl.load(table_ptr + 2 * table_stride + blk), 16).to(b_out_ptr.dtype)
            b_b = tl.load(host_b + src, mask=m_t)
            if QUANT:
                # complete blocks: the stored bytes times the block's scale; the row's incomplete block: its tail
                tail_block = tl.load(tail_block_ptr + i_bh // HK)
                in_tail = (tok // P) == tail_block  # [P], all equal: per token keeps the masks' dtype
                m_q = m_td & (in_tail == 0)[:, None]
                host_k = tl.multiple_of(tl.load(table_ptr + blk), 16).to(tl.pointer_type(tl.uint8))
                host_v = tl.multiple_of(tl.load(table_ptr + table_stride + blk), 16).to(tl.pointer_type(tl.uint8))
                scale_off = i_bh * (row_len // P)
                s_k = tl.load(tl.load(table_ptr + 4 * table_stride + blk).to(tl.pointer_type(tl.float32)) + scale_off)
                s_v = tl.load(tl.load(table_ptr + 5 * table_stride + blk).to(tl.pointer_type(tl.float32)) + scale_off)
                b_k = dequantize(tl.load(host_k + kv_off, mask=m_q, other=0), s_k, FP8)
                b_v = dequantize(tl.load(host_v + kv_off, mask=m_q, other=0), s_v, FP8)
                b_k = cast_rtne(b_k, k_out_ptr.dtype.element_ty)
                b_v = cast_rtne(b_v, v_out_ptr.dtype.element_ty)
                m_tail = m_td & in_tail[:, None]
                tail_off = (i_bh * P + o_p)[:, None] * D + o_d[None, :]
                tail_k = tl.load(table_ptr + 6 * table_stride).to(k_out_ptr.dtype)
                tail_v = tl.load(table_ptr + 7 * table_stride).to(v_out_ptr.dtype)
                b_k = tl.where(m_tail, tl.load(tail_k + tail_off, mask=m_tail, other=0.0), b_k)
                b_v = tl.where(m_tail, tl.load(tail_v + tail_off, mask=m_tail, other=0.0), b_v)
            else:
                host_k = tl.multiple_of(tl.load(table_ptr + blk), 16).to(k_out_ptr.dtype)
                host_v = tl.multiple_of(tl.load(table_ptr + table_stride + blk), 16).to(v_out_ptr.dtype)
                b_k = tl.load(host_k + kv_off, mask=m_td)
                b_v = tl.load(host_v + kv_off, mask=m_td)
            out = i_bh * T + (tok - start)  # [P] token rows of the [B, Hk, T] output
            tl.store(k_out_ptr + out[:, None] * D + o_d[None, :], b_k, mask=m_td)
            tl.store(v_out_ptr + out[:, None] * D + o_d[None, :], b_v, mask=m_td)
            tl.store(b_out_ptr + out, b_b, mask=m_t)


def read_span_ref(host, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of ``read_span``."""
    return host.read_torch(start, end, device)


def _read_span_triton(host, start: int, end: int, device: torch.device):
    B, Hk, D, P = host.batch, host.kv_heads, host.head_dim, host.block_size
    T = end - start
    k, v, b = span_outputs(host, T, device)
    if T == 0:
        return k, v, b
    table = host.block_table(device)
    if host.format is not None:
        tail_block = host.tail_blocks_on(device)
    else:
        tail_block = table  # not read
    if device.type == "cuda":
        host.order_after_writes(device)
    first = start // P
    n_blocks = (end - 1) // P - first + 1
    fmt = host.format
    blocks = READ_BLOCKS
    with on_device(k):
        launcher(_read_span_kernel)[(B * Hk, triton.cdiv(n_blocks, blocks))](
            table, tail_block, k, v, b, start, end, first, n_blocks, table.stride(0),
            HK=Hk, P=P, D=D, D_PAD=next_power_of_2(D), BLOCKS=blocks,
            QUANT=fmt is not None, FP8=fmt is not None and not fmt.integer,
            num_warps=READ_WARPS,
        )
    return k, v, b


def read_path(host, device) -> str:
    """Which device path reads ``host`` onto ``device`` under ``READ_PATH``: "copy" (the copy engine, CUDA and a
    store in the model's dtype) or "kernel" (the Triton kernel; the interpreter on the CPU)."""
    if READ_PATH not in READ_PATHS:
        raise ValueError(f"host_read.READ_PATH={READ_PATH!r} is invalid: allowed {READ_PATHS}")
    if READ_PATH == "kernel" or torch.device(device).type != "cuda":
        return "kernel"
    if host.format is None:
        return "copy"
    if READ_PATH == "copy" and host.host_dtype not in _LOGGED:
        _LOGGED.add(host.host_dtype)
        logger.warning("hf_nosa host_read: READ_PATH='copy' reads a quantized store (host_dtype=%r) with the kernel, "
                       "which dequantizes it", host.host_dtype)
    return "kernel"


def read_span(host, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``start .. end - 1`` of ``host`` (a ``HostStore``) on ``device``: ``k, v [B, Hk, T, D]`` in the
    model's dtype, ``b [B, Hk, T]`` fp32; one launch reading pinned memory on CUDA, the torch reference elsewhere.

    ``0 <= start <= end <= host.capacity``; the tokens must have been written (on the device: by work the current
    stream is ordered after)."""
    device = torch.device(device)
    if not 0 <= start <= end <= host.capacity:
        raise ValueError(f"read_span: start={start}, end={end} must satisfy 0 <= start <= end <= capacity "
                         f"({host.capacity} tokens)")
    probe = torch.empty(0, device=device)
    path = kernel_path("host_read", probe)
    if path == "triton" and device.type == "cuda" and not host.pin:
        from ..backend import forced_path

        if forced_path() == "triton":
            raise ValueError("host_read on CUDA with HF_NOSA_KERNELS=triton needs a pinned host store "
                             "(NosaConfig.offload=True): the kernel reads host memory through its device address.")
        log_fallback("host_read", "cuda", "the host store is not pinned (NosaConfig.offload=False)")
        path = "torch"
    if path == "torch":
        return read_span_ref(host, start, end, device)
    if read_path(host, device) == "copy":
        return read_span_copy(host, start, end, device)
    if device.type != "cuda":  # the interpreter reads the CPU store as the GPU reads pinned memory
        host.wait_writes()
    return _read_span_triton(host, start, end, device)
