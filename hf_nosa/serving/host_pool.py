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

import bisect
import itertools
import math

import torch

from ..cache.pinned import pinned_empty

MIN_BUFFER_BYTES = 1 << 16  # smaller host buffers (a store's tails, scales) are rounded up to this


def rounded_bytes(nbytes: int) -> int:
    """The size of a new pool buffer for ``nbytes``: the next power of two, at least ``MIN_BUFFER_BYTES``."""
    return max(MIN_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class HostPool:
    """Host buffers by owner (a request id); the buffers given back are reused best-fit.

    The free buffers are kept sorted by size, pinned and pageable apart, so a request's buffer is found by bisection:
    a persistent manager holds thousands of them (a request has a few per layer and store chunk), and a linear scan
    of all of them for every buffer of every new request made admission quadratic in the requests served."""

    def __init__(self):
        self._free: dict[bool, list[tuple[int, int, torch.Tensor]]] = {False: [], True: []}  # (bytes, order, buffer)
        self._order = itertools.count()  # ties go to the buffer given back first
        self._free_bytes = 0
        self.held: dict[str, list[torch.Tensor]] = {}
        self.allocated_bytes = 0  # host memory this pool ever allocated (pinned on CUDA), all of it still held

    @property
    def free(self) -> list[torch.Tensor]:
        """The buffers given back and not taken again, smallest first (pageable, then pinned)."""
        return [entry[2] for pin in (False, True) for entry in self._free[pin]]

    def take(self, owner: str, shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A ``shape`` ``dtype`` view of a buffer held for ``owner`` from now on (not cleared)."""
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        free = self._free[bool(pin)]
        i = bisect.bisect_left(free, (nbytes, -1))  # the smallest free buffer of at least nbytes
        if i < len(free):
            size, _, buffer = free.pop(i)
            self._free_bytes -= size
        else:
            size = rounded_bytes(nbytes)
            buffer = pinned_empty((size,), torch.uint8) if pin else torch.empty(size, dtype=torch.uint8)
            self.allocated_bytes += size
        self.held.setdefault(owner, []).append(buffer)
        return buffer[:nbytes].view(dtype).view(shape)

    def give_back(self, owner: str) -> None:
        """``owner``'s buffers become free for the next requests."""
        buffers = self.held.pop(owner, [])
        pinned = [b.is_pinned() for b in buffers]
        if any(pinned) and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # copies into them may still be queued on a side stream
        for buffer, pin in zip(buffers, pinned):
            bisect.insort(self._free[pin], (buffer.numel(), next(self._order), buffer))
            self._free_bytes += buffer.numel()

    def free_bytes(self) -> int:
        return self._free_bytes

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
