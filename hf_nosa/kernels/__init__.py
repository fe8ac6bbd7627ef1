"""Device kernels, each with a torch reference beside it, by the phase that calls them: ``decode/`` (a step's
selection, fetch and attention), ``prefill/`` (QUOKA's choice, chunk attention, host writes and reads), ``train/``
(the training selection and block-sparse attention), ``layers/`` (a model layer's small ops in one launch).

Dispatch: Triton on CUDA tensors, the torch reference on CPU tensors; ``HF_NOSA_KERNELS=torch|triton`` forces one
(``backend.py``). Each module: the ``@triton.jit`` kernel(s), a launcher, the torch reference, the public function.

Lengths are not specialized on: Triton compiles a variant of a kernel for every integer argument's being 1 or a
multiple of 16, so a prompt of a new length (a chunk's token count, a position, a store's capacity, a bias row's
stride) would compile new variants in the middle of a request. Those arguments are listed in each kernel's
``do_not_specialize``, so the first call of any length compiles every variant a later one needs; the head
dimension, block size and tile sizes stay ``tl.constexpr``. For the same reason a pointer to a view that starts at a
length-dependent offset (a bias row from a chunk's first key) is in ``do_not_specialize_on_alignment``.
"""

from .decode.block_scores import NewToken, append_token, block_select
from .decode.decode_attention import decode_attention
from .decode.fetch import FetchPlan, SlotPool, StepCounters, fetch_blocks, fetch_blocks_ref, fetch_step, plan_fetch
from .layers.rms_norm import rms_norm
from .layers.rotary import apply_rotary
from .layers.silu_mul import silu_mul
from .prefill.chunk_attention import chunk_attention
from .prefill.host_read import read_span
from .prefill.quoka_score import quoka_score
from .train.sparse_train_attention import sparse_train_attention
from .train.train_select import train_block_scores, train_select_blocks

__all__ = [
    "FetchPlan",
    "NewToken",
    "SlotPool",
    "StepCounters",
    "append_token",
    "apply_rotary",
    "block_select",
    "chunk_attention",
    "decode_attention",
    "fetch_blocks",
    "fetch_blocks_ref",
    "fetch_step",
    "plan_fetch",
    "quoka_score",
    "read_span",
    "rms_norm",
    "silu_mul",
    "sparse_train_attention",
    "train_block_scores",
    "train_select_blocks",
]
