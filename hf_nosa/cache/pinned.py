"""Pinned host memory for the host stores: pinned from several threads, and kept for the next cache when freed.

A host store's K/V live in page-locked memory, so the fetch kernels read it over PCIe (UVA) and copies to it do not
wait. torch pins with ``cudaHostAlloc`` at about 2.6 GB/s on an H200: one thread faults in and locks every page
(``docs/results/2026-12-02_pinning.json``). A new turn on a user-held cache grows its store by the turn's tokens, so
at batch 8 a 4096-token turn of the 1b shape pinned about 1.6 GB before its first chunk. torch's own faster mode
(``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16``, 9.6 GB/s) touches
the pages from several threads and then registers them with ``cudaHostRegister``, but it changes every pinned
allocation of the process, which a library should not do for its user. ``pinned_empty`` does the same for the host
stores' own buffers only: pageable memory, its pages faulted in by a parallel fill (torch's intra-op threads), then
one ``cudaHostRegister``.

Freed buffers stay registered in a process-wide pool, as torch's pinned allocator keeps its blocks: a buffer returns
when the last tensor over it is freed, and the next request of at most its size and more than half of it takes it
(best fit) instead of pinning again. ``release_pinned_memory()`` unregisters and frees what the pool holds (as
``torch._C._host_emptyCache()`` does for torch's). Buffers under ``MIN_BYTES`` come from torch's allocator.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import torch

MIN_BYTES = 8 << 20  # smaller buffers (tails, scales, staging) are torch's: pinning them is quick, and torch pools them
PAGE = 4096
_LOCK = threading.RLock()  # a buffer given back by the garbage collector may arrive while the pool is being read
_FREE: list[np.ndarray] = []  # registered buffers no tensor uses, page-aligned uint8 arrays
_STATS = {"registered_bytes": 0, "registrations": 0, "reused": 0}


def _register(array: np.ndarray) -> None:
    """Fault the pages in from torch's intra-op threads, then page-lock them for the device (mapped and portable on
    a system with unified addressing: the kernels read the host pointer as it is)."""
    torch.from_numpy(array).zero_()  # a parallel fill: each thread faults in its own pages
    code = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    code = int(getattr(code, "value", code))
    if code != 0:
        raise RuntimeError(f"hf_nosa: cudaHostRegister of {array.nbytes / 2**30:.2f} GiB of host memory failed (CUDA "
                           f"error {code}); the host store needs page-locked memory (check `ulimit -l` and free host "
                           "memory)")


def _unregister(array: np.ndarray) -> None:
    torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)


def _new_buffer(nbytes: int) -> np.ndarray:
    size = -(-nbytes // PAGE) * PAGE
    raw = np.empty(size + PAGE, dtype=np.uint8)  # large: mmap'd, so its pages are not touched yet
    start = (-raw.ctypes.data) % PAGE  # page-aligned (the kernels' host pointers are asked to be 16-byte aligned)
    array = raw[start:start + size]
    _register(array)
    with _LOCK:
        _STATS["registered_bytes"] += size
        _STATS["registrations"] += 1
    return array


def _torch_pinned(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _take(nbytes: int) -> np.ndarray:
    with _LOCK:
        fits = [a for a in _FREE if nbytes <= a.nbytes <= 2 * nbytes]
        if fits:
            best = min(fits, key=lambda a: a.nbytes)
            _FREE[:] = [a for a in _FREE if a is not best]
            _STATS["reused"] += 1
    if fits:
        # the cache that held it may have left kernels queued that read or write it through its pointer (UVA)
        torch.cuda.synchronize()
        return best
    return _new_buffer(nbytes)


def _give_back(array: np.ndarray) -> None:
    with _LOCK:
        _FREE.append(array)


def pinned_empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized page-locked host tensor (CUDA only): registered here when it is ``MIN_BYTES`` or larger, a
    freed buffer of the pool reused where one fits."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not torch.cuda.is_available():
        return _torch_pinned(shape, dtype)
    buffer = _take(nbytes)
    view = buffer[:nbytes]  # its own array object: it lives exactly as long as the tensors over it
    weakref.finalize(view, _give_back, buffer)
    return torch.from_numpy(view).view(dtype).view(shape)


def release_pinned_memory() -> int:
    """Unregister and free the buffers no tensor uses; returns their bytes."""
    with _LOCK:
        free, _FREE[:] = list(_FREE), []
    if free:
        torch.cuda.synchronize()
    for array in free:
        _unregister(array)
    released = sum(a.nbytes for a in free)
    with _LOCK:
        _STATS["registered_bytes"] -= released
    return released


def pinned_stats() -> dict:
    """``registered_bytes`` (held by live tensors and the pool), ``free_bytes`` (the pool's), ``registrations``
    (buffers pinned here so far), ``reused`` (requests served from the pool)."""
    with _LOCK:
        return dict(_STATS, free_bytes=sum(a.nbytes for a in _FREE))
