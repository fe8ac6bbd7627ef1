"""Small host tensors (lengths, row masks, block lists) moved to the device without a host sync.

Below the kernels and the attention paths, which all need it: a copy from pageable memory waits for the stream,
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
