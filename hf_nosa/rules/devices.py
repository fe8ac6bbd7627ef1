"""Small host tensors (lengths, row masks, block lists) moved to the device without a host sync, and the device memory
a process may still take.

Below the kernels and the attention paths, which all need them: a copy from pageable memory waits for the stream,
and in the middle of a layer that drains the queue of launches.
"""

from __future__ import annotations

import torch


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small CPU tensor on ``device`` without a host sync: on CUDA through pinned memory, non-blocking (a copy from
    pageable memory waits for the stream, and in the middle of a layer that drains the queue of launches)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":  # only a CPU tensor can be pinned
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def available_device_memory(device) -> int:
    """Bytes this process may still allocate on a CUDA ``device``: the device's free bytes plus the allocator's
    cached ones, within the process' memory fraction (``torch.cuda.set_per_process_memory_fraction``, which
    ``torch.cuda.mem_get_info`` does not see: a server capped at 24 GB on an 80 GB card has 24 GB, not 76)."""
    device = torch.device(device)
    if device.index is None:  # "cuda" means the current device; the memory-fraction query wants an index
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    available = free + reserved - allocated
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        available = min(available, int(fraction * total) - allocated)
    return max(0, available)
