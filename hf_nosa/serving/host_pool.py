"""Host memory shared by the requests of one continuous-batching manager: pinned once, reused request after request.

Each request's NosaCache keeps its K/V in a host store (``cache.host_store``), pinned on CUDA so the kernels read
it over PCIe. Pinning costs about a second per 1.5 GB; a 40K-token request of the 1b shape holds 1.3 GB, so a
request that pinned its own store paid most of a second before its first token. ``HostPool`` keeps the buffers of
finished requests and hands them to the next ones: a request pins memory only when no buffer given back is large
enough (best fit; new buffers are rounded up to a power of two bytes, as torch's pinned allocator does).

``RequestWorkspace`` is what a request's NosaCache draws its buffers from (``NosaCache.attach_workspace``): host
buffers from the pool; its slot pool, compressed keys, rings and block table as its row of the manager's shared
tensors (``row_pool.RowPool``, so the decode tokens of all requests run as one batch); other device buffers new (the
model's ``DeviceWorkspace`` serves one cache at a time). ``HostPool.give_back`` returns a request's buffers when it is
released; on CUDA it first waits for the device, so that no copy still queued on a side stream writes into a buffer
the next request already holds.
"""

from __future__ import annotations

import math

import torch

from ..cache.pinned import pinned_empty

MIN_BUFFER_BYTES = 1 << 16  # smaller host buffers (a store's tails, scales) are rounded up to this


def rounded_bytes(nbytes: int) -> int:
    """The size of a new pool buffer for ``nbytes``: the next power of two, at least ``MIN_BUFFER_BYTES``."""
    return max(MIN_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class HostPool:
    """Host buffers by owner (a request id); ``free`` holds those given back, reused best-fit."""

    def __init__(self):
        self.free: list[torch.Tensor] = []
        self.held: dict[str, list[torch.Tensor]] = {}
        self.allocated_bytes = 0  # host memory this pool ever allocated (pinned on CUDA), all of it still held

    def take(self, owner: str, shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A ``shape`` ``dtype`` view of a buffer held for ``owner`` from now on (not cleared)."""
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        fits = [b for b in self.free if b.numel() >= nbytes and b.is_pinned() == pin]
        if fits:
            buffer = min(fits, key=lambda b: b.numel())
            self.free = [b for b in self.free if b is not buffer]
        else:
            size = rounded_bytes(nbytes)
            buffer = pinned_empty((size,), torch.uint8) if pin else torch.empty(size, dtype=torch.uint8)
            self.allocated_bytes += size
        self.held.setdefault(owner, []).append(buffer)
        return buffer[:nbytes].view(dtype).view(shape)

    def give_back(self, owner: str) -> None:
        """``owner``'s buffers become free for the next requests."""
        buffers = self.held.pop(owner, [])
        pinned = any(b.is_pinned() for b in buffers)
        if pinned and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # copies into them may still be queued on a side stream
        self.free.extend(buffers)

    def free_bytes(self) -> int:
        return sum(b.numel() for b in self.free)

    def held_bytes(self, owner: str | None = None) -> int:
        owners = self.held.values() if owner is None else [self.held.get(owner, [])]
        return sum(b.numel() for buffers in owners for b in buffers)


class RequestWorkspace:
    """The workspace one request's NosaCache draws from: host buffers from the manager's ``HostPool`` under the
    request's id, device buffers new (the interface of ``cache.workspace.DeviceWorkspace`` that NosaCache uses)."""

    decode_graph = None  # requests decode inside transformers' step, never through a NOSA decode graph

    def __init__(self, pool: HostPool, owner: str, rows=None, row: int | None = None):
        """``rows``, ``row``: the manager's ``RowPool`` and the request's row in it (None: no row, buffers new)."""
        self.pool, self.owner = pool, owner
        self.rows, self.row = rows, row

    def take(self, key: tuple, shape: tuple, dtype: torch.dtype, device, *, pin: bool = False,
             grow: int | None = None) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        if self.row is not None and not pin:
            view = self.rows.take(self.row, key, shape, dtype, device)
            if view is not None:
                return view
        if torch.device(device).type == "cpu":
            return self.pool.take(self.owner, shape, dtype, pin)
        return torch.empty(shape, dtype=dtype, device=device)

    def host_bytes(self) -> int:
        """Host memory already allocated that this request may draw on (what the pool holds free)."""
        return self.pool.free_bytes()

    def claim(self, cache) -> None:
        """Each request has its own workspace: nothing to take from another cache."""
