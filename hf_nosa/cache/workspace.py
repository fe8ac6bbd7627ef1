"""Device buffers a model's NosaCaches share across ``generate`` calls.

A captured decode graph (``modeling.cuda_graph.DecodeGraph``) bakes in the addresses of every buffer it touches.
``generate(cache_implementation="nosa")`` builds a new NosaCache per call; drawing its slot pools, compressed keys,
counters and block tables from one workspace per model keeps those addresses, so a graph captured in one call is
replayed in the next with the same shapes. Only one cache can hold the buffers at a time: when a newer cache takes
them, the older one is marked, and using it again raises instead of reading another sequence's state.
"""

from __future__ import annotations

import math
import weakref

import torch

from .pinned import pinned_empty


HOST_GROWTH = 2.0  # a host buffer that must grow takes this many times its old size (or what is asked, if more)


class DeviceWorkspace:
    """Buffers by key, reused when the shape, dtype and device match; plus the model's decode graph.

    Host buffers (the host store's chunks, pinned on CUDA) are pooled by key whatever their shape: each key holds
    one flat byte buffer that only grows, and a request gets a view of its first bytes. Pinning costs about a second
    per 1.5 GB, and the chunks' shapes follow the prompt length, batch and max_new_tokens of each call: without the
    pool every call of a new shape pinned its whole host store again.
    """

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.host: dict[tuple, torch.Tensor] = {}  # flat uint8 host buffers by key (``take`` on the CPU)
        self.decode_graph = None
        self._owner: weakref.ref | None = None

    def take(self, key: tuple, shape: tuple, dtype: torch.dtype, device, *, pin: bool = False,
             grow: int | None = None) -> torch.Tensor:
        """The buffer stored under ``key`` if it matches, else a new one (kept for the next cache). Not cleared.

        ``pin`` asks for pinned host memory (``device`` "cpu"). Host buffers come from the grow-only pool (see the
        class docstring): a view of ``key``'s flat buffer, regrown to ``HOST_GROWTH`` times its size when too small.
        ``grow``: a dimension the caller takes as a capacity (the compressed keys' windows, a block table's
        blocks): a stored buffer at least as large there is returned whole, so after the longest request a shorter
        one finds the same buffer, and a decode graph captured on it replays (``modeling.cuda_graph``).
        """
        shape = tuple(int(s) for s in shape)
        device = torch.device(device)
        if device.type == "cpu":
            return self._take_host(key, shape, dtype, pin)
        found = self.buffers.get(key)
        if grow is not None and found is not None and found.dim() == len(shape):
            found_shape = list(found.shape)
            if found_shape[grow] >= shape[grow]:
                found_shape[grow] = shape[grow]
                if tuple(found_shape) == shape:
                    shape = tuple(found.shape)
        if (found is None or tuple(found.shape) != shape or found.dtype != dtype or found.device != device
                or found.is_pinned() != pin):
            self.buffers.pop(key, None)  # free the old buffer before allocating its replacement
            found = self.buffers[key] = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        return found

    def _take_host(self, key: tuple, shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        flat = self.host.get(key)
        if flat is None or flat.numel() < nbytes or flat.is_pinned() != pin:
            grown = nbytes if flat is None or flat.is_pinned() != pin else max(nbytes, int(flat.numel() * HOST_GROWTH))
            self.host.pop(key, None)  # free the old buffer before pinning its replacement
            flat = pinned_empty((grown,), torch.uint8) if pin else torch.empty(grown, dtype=torch.uint8)
            self.host[key] = flat
        return flat[:nbytes].view(dtype).view(shape)

    def host_bytes(self) -> int:
        """Bytes of host memory the workspace holds (reusable by the next cache)."""
        return sum(t.numel() for t in self.host.values())

    def release_host(self) -> None:
        """Give the pooled host buffers back (the next cache pins its own again)."""
        self.host.clear()

    def claim(self, cache) -> None:
        """``cache`` starts using the buffers; the cache that held them before can no longer be used."""
        previous = self._owner() if self._owner is not None else None
        if previous is not None and previous is not cache:
            previous.workspace_lost = True
        self._owner = weakref.ref(cache)


def workspace_of(model) -> DeviceWorkspace:
    """The workspace of ``model`` (created on first use; not a module, so never saved with the weights)."""
    workspace = model.__dict__.get("_nosa_workspace")
    if workspace is None:
        workspace = model.__dict__["_nosa_workspace"] = DeviceWorkspace()
    return workspace
