"""The eviction head's scale and softplus (``b = A * softplus(delta(v))``, design Sec. 3.1) in one launch.

After ``delta``'s matmul the torch form takes three launches per layer and call (the logits to float32, softplus,
the product with ``A``), which at batch 1 the prefill pays in every layer and chunk. The kernel reads the logits
``[B, T, Hk]`` in their dtype and writes the scores ``[B, Hk, T]`` float32, one program per (sequence, tile of
tokens). It has no backward: ``selection.eviction_bias`` takes it only where no gradient is wanted.

Softplus as torch computes it (``x`` above 20 passes through, else ``log1p(exp(x))``); ``log1p`` by Goldberg's
``log(u) * e / (u - 1)`` with ``u = 1 + e``, which keeps the relative precision of tiny scores (very negative
logits) that ``log(1 + e)`` would round to 0. Triton's ``exp``/``log`` are not CUDA's ``expf``/``log1pf``, so scores
may differ from the torch form in their last bits.
"""

from __future__ import annotations

import torch

from ..backend import HAS_TRITON, kernel_path, launcher, next_power_of_2, on_device, tl, triton

BLOCK_T = 128  # tokens per program
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default

if HAS_TRITON:

    @triton.jit(do_not_specialize=["T", "stride_xb", "stride_ob", "stride_oh"])
    def _eviction_scale_kernel(
        x_ptr, a_ptr, out_ptr,
        stride_xb, stride_xt, stride_xh, stride_ob, stride_oh, stride_ot,
        T, Hk, THRESHOLD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        """Program (sequence, tile of tokens): ``A[h] * softplus(x[b, t, h])`` to ``out[b, h, t]``."""
        i_b, i_t = tl.program_id(0).to(tl.int64), tl.program_id(1)
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
        o_h = tl.arange(0, BLOCK_H)
        m = (o_t < T)[:, None] & (o_h < Hk)[None, :]
        x = tl.load(x_ptr + i_b * stride_xb + o_t[:, None] * stride_xt + o_h[None, :] * stride_xh,
                    mask=m, other=0.0).to(tl.float32)
        e = tl.exp(tl.minimum(x, THRESHOLD))
        u = 1.0 + e
        tiny = u == 1.0  # e below float32's epsilon: log1p(e) is e
        log1p = tl.where(tiny, e, tl.log(u) * (e / tl.where(tiny, 1.0, u - 1.0)))
        softplus = tl.where(x > THRESHOLD, x, log1p)
        a = tl.load(a_ptr + o_h, mask=o_h < Hk, other=0.0).to(tl.float32)
        tl.store(out_ptr + i_b * stride_ob + o_h[None, :] * stride_oh + o_t[:, None] * stride_ot,
                 a[None, :] * softplus, mask=m)


def eviction_scale_ref(logits: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The torch reference (``selection.eviction_scores``)."""
    from ...rules.selection import eviction_scores  # here, not at the top: selection imports this module lazily too

    return eviction_scores(logits, A)


def eviction_scale(logits: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """``A[h] * softplus(logits[b, t, h])`` as ``[B, Hk, T]`` float32: Triton on CUDA, torch elsewhere
    (``HF_NOSA_KERNELS`` forces one, see ``backend.py``). No gradient flows through the Triton path.

    Args:
        logits: ``[B, T, Hk]`` the eviction head's ``delta`` output (any float dtype).
        A: ``[Hk]`` per-head scale.
    """
    if logits.dim() != 3 or A.dim() != 1 or A.shape[0] != logits.shape[2]:
        raise ValueError(f"eviction_scale: logits must be [B, T, Hk] and A [Hk]; got shapes {tuple(logits.shape)} "
                         f"and {tuple(A.shape)}")
    if kernel_path("eviction_bias", logits) == "torch":
        return eviction_scale_ref(logits, A)
    B, T, Hk = logits.shape
    out = torch.empty(B, Hk, T, dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    with on_device(logits):
        launcher(_eviction_scale_kernel)[(B, -(-T // BLOCK_T))](
            logits, A, out, *logits.stride(), *out.stride(), T, Hk,
            THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_T=BLOCK_T, BLOCK_H=max(16, next_power_of_2(Hk)),
        )
    return out
