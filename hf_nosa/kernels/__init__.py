"""Device kernels of the decode path, each with a torch reference beside it.

Dispatch: Triton on CUDA tensors, the torch reference on CPU tensors; ``HF_NOSA_KERNELS=torch|triton`` forces one
(``backend.py``). Each module: the ``@triton.jit`` kernel(s), a launcher, the torch reference, the public function.
"""

from .block_scores import NewToken, append_token, block_select
from .decode_attention import decode_attention
from .fetch import FetchPlan, SlotPool, StepCounters, fetch_blocks, fetch_blocks_ref, fetch_step, plan_fetch

__all__ = [
    "FetchPlan",
    "NewToken",
    "SlotPool",
    "StepCounters",
    "append_token",
    "block_select",
    "decode_attention",
    "fetch_blocks",
    "fetch_blocks_ref",
    "fetch_step",
    "plan_fetch",
]
