"""Span read through the copy engine: ``read_span``'s other design, 2D DMA copies instead of a kernel's loads.

A new turn's dense tail reads the whole conversation from the host store a piece at a time
(``hf_nosa.attention.prefix``). ``read_span``'s kernel reads the pinned store with loads issued by the SMs (UVA): at
batch 8 and 64K in the 1b shape it moved 16 GB at 26-29 GB/s in the turn's profile, about half the link's copy rate,
and took half of the turn's kernel time (docs/benchmarks.md, 2026-12-07). A piece of a store kept in the model's
dtype is, in each chunk it touches, ``B x Hk`` rows of ``(end - start) x D`` contiguous elements at the chunk's
row pitch: one 2D copy per chunk and tensor (``cuMemcpy2DAsync``) moves it with the copy engine, which reads pinned
memory at the link's rate and leaves the SMs to the attention. A quantized store's bytes need the kernel, which
dequantizes them.

``host_read``'s default (``READ_PATH = "auto"``) reads unquantized stores with it on CUDA; ``python -m benchmarks
prefill read`` measures it beside the kernel's settings. ``read_span_ref`` (``HostStore.read_torch``) is the
reference of both.
"""

from __future__ import annotations

import ctypes

import torch

HOST, DEVICE = 1, 2  # CUmemorytype


class Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D``."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


_DRIVER = []


def driver_copy():
    """``cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *, CUstream) -> CUresult`` from the driver torch and Triton use."""
    if not _DRIVER:
        function = ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2
        function.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]
        function.restype = ctypes.c_int
        _DRIVER.append(function)
    return _DRIVER[0]


def copy_rows(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, *, dst_on_device: bool,
              stream: int) -> None:
    """``height`` rows of ``width`` bytes from pinned host memory at ``src`` (rows ``src_pitch`` apart) to ``dst``
    (rows ``dst_pitch`` apart), queued on ``stream``."""
    params = Memcpy2D(srcMemoryType=HOST, srcHost=src, srcPitch=src_pitch, WidthInBytes=width, Height=height,
                      dstPitch=dst_pitch)
    if dst_on_device:
        params.dstMemoryType, params.dstDevice = DEVICE, dst
    else:
        params.dstMemoryType, params.dstHost = HOST, dst
    code = driver_copy()(ctypes.byref(params), ctypes.c_void_p(stream))
    if code != 0:
        raise RuntimeError(f"read_span_copy: cuMemcpy2DAsync failed with CUDA error {code} ({height} rows of {width} "
                           "bytes)")


def span_outputs(host, T: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialized ``k, v [B, Hk, T, D]`` (the model's dtype) and ``b [B, Hk, T]`` fp32 for a span of ``host``."""
    k = torch.empty(host.batch, host.kv_heads, T, host.head_dim, dtype=host.dtype, device=device)
    return k, torch.empty_like(k), torch.empty(host.batch, host.kv_heads, T, dtype=torch.float32, device=device)


def read_span_copy(host, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``read_span`` through the copy engine: ``k, v [B, Hk, T, D]`` and ``b [B, Hk, T]`` fp32 on ``device`` for the
    store's tokens ``start .. end - 1``, three 2D copies per chunk the span touches, on the current stream, after the
    store's pending writes. An unquantized store only (``host.format is None``)."""
    if host.format is not None:
        raise ValueError(f"read_span_copy: host_dtype={host.host_dtype!r} is quantized; only a store in the model's "
                         "dtype can be copied as it is (read_span's kernel dequantizes)")
    device = torch.device(device)
    B, Hk, D = host.batch, host.kv_heads, host.head_dim
    T = end - start
    k, v, b = span_outputs(host, T, device)
    if T == 0:
        return k, v, b
    on_device = device.type == "cuda"
    if on_device:
        host.order_after_writes(device)
        stream = torch.cuda.current_stream(device).cuda_stream
    else:
        host.wait_writes()
        stream = 0
    kv_size = k.element_size()
    for chunk, first, at, n in host._spans(start, end):  # chunk index, token in it, token of the span, tokens
        rows = host.k_chunks[chunk].shape[2]  # tokens per (sequence, KV head) row of this chunk
        for out, source in ((k, host.k_chunks[chunk]), (v, host.v_chunks[chunk])):
            copy_rows(out.data_ptr() + at * D * kv_size, T * D * kv_size,
                      source.data_ptr() + first * D * kv_size, rows * D * kv_size, n * D * kv_size, B * Hk,
                      dst_on_device=on_device, stream=stream)
        copy_rows(b.data_ptr() + at * 4, T * 4, host.b_chunks[chunk].data_ptr() + first * 4, rows * 4, n * 4, B * Hk,
                  dst_on_device=on_device, stream=stream)
    return k, v, b
