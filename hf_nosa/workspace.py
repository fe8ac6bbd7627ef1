"""Device buffers a model's NosaCaches share across ``generate`` calls.

A captured decode graph (``kernels.cuda_graph.DecodeGraph``) bakes in the addresses of every buffer it touches.
``generate(cache_implementation="nosa")`` builds a new NosaCache per call; drawing its slot pools, compressed keys,
counters and block tables from one workspace per model keeps those addresses, so a graph captured in one call is
replayed in the next with the same shapes. Only one cache can hold the buffers at a time: when a newer cache takes
them, the older one is marked, and using it again raises instead of reading another sequence's state.
"""

from __future__ import annotations

import weakref

import torch


class DeviceWorkspace:
    """Buffers by key, reused when the shape, dtype and device match; plus the model's decode graph."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.decode_graph = None
        self._owner: weakref.ref | None = None

    def take(self, key: tuple, shape: tuple, dtype: torch.dtype, device, *, pin: bool = False) -> torch.Tensor:
        """The buffer stored under ``key`` if it matches, else a new one (kept for the next cache). Not cleared.

        ``pin`` asks for pinned host memory (``device`` "cpu"): pinning tens of GiB takes tens of seconds, so the
        host store's chunks are reused across calls like the device buffers.
        """
        shape = tuple(int(s) for s in shape)
        device = torch.device(device)
        found = self.buffers.get(key)
        if (found is None or tuple(found.shape) != shape or found.dtype != dtype or found.device != device
                or found.is_pinned() != pin):
            self.buffers.pop(key, None)  # free the old buffer before allocating its replacement
            found = self.buffers[key] = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
        return found

    def host_bytes(self) -> int:
        """Bytes of host memory the workspace holds (reusable by the next cache)."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values() if t.device.type == "cpu")

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
