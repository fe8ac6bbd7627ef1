"""The CUDA caching allocator's setting for a retrofit run: expandable segments, unless the user chose a setting.

A retrofit step at long context allocates tensors of many sizes (a layer's selection, its float32 partial output,
the kernels' plan, the MLP's activations) between the checkpointed hidden states it keeps. With the default allocator
a freed stretch of a segment that still holds a kept tensor can only serve smaller requests: in the 8b shape at 64K
up to 36 GB sits stranded that way during the backward's reruns (``benchmarks/train_memory.py``), and whether the
step fits then depends on what ran before it in the process.
Expandable segments map memory into one growing range per stream and unmap what is freed, which removes that
stranding (PyTorch's notes on ``PYTORCH_CUDA_ALLOC_CONF``). The setting is process-wide, so hf-nosa applies it only
where it starts the training itself (``retrofit``), and never over a user's own ``PYTORCH_ALLOC_CONF`` /
``PYTORCH_CUDA_ALLOC_CONF``.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the first is torch's name since 2.9
EXPANDABLE_SEGMENTS = "expandable_segments:True"


_applied: str | None = None  # what ``use_expandable_segments`` set in this process


def user_setting() -> str | None:
    """The allocator setting the user gave through the environment (``NAME=value``), or None."""
    for name in ALLOCATOR_ENV:
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return None


def allocator_setting() -> str:
    """The allocator setting this process runs with, as recorded beside a measurement: the user's, hf-nosa's, or
    ``default``."""
    return user_setting() or _applied or "default"


def set_allocator_settings(settings: str) -> None:
    """Apply ``settings`` (``PYTORCH_ALLOC_CONF``'s syntax) to the running process's allocator."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before 2.9
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def use_expandable_segments(device: torch.device) -> bool:
    """Turn on expandable segments for ``device``'s allocator (CUDA only), unless the user set the allocator through
    the environment; return whether they were turned on. Segments made before the call keep their kind."""
    if device.type != "cuda":
        return False
    given = user_setting()
    if given is not None:
        logger.info("allocator: keeping %s (hf-nosa would use %s)", given, EXPANDABLE_SEGMENTS)
        return False
    set_allocator_settings(EXPANDABLE_SEGMENTS)
    global _applied
    _applied = EXPANDABLE_SEGMENTS
    logger.info("allocator: %s for this process (set PYTORCH_ALLOC_CONF to choose another setting)",
                EXPANDABLE_SEGMENTS)
    return True
