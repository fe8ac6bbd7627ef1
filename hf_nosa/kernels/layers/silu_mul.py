"""The gated MLP's ``act_fn(gate) * up`` with SiLU in one launch, as torch computes ``silu(gate) * up``.

In ``LlamaMLP`` / ``Qwen2MLP`` / ``Qwen3MLP`` (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``) these are two
launches over the ``[B, T, intermediate]`` activations. The kernel does what torch's CUDA kernels do: ``silu`` in
float32 as ``g / (1 + exp(-g))`` (IEEE division), rounded to the storage dtype, then the product with ``up`` in
float32, rounded again. With CUDA's ``expf`` (libdevice's ``exp``, what torch's kernel calls) the result is meant to
be bitwise torch's on the GPU; under the Triton interpreter ``exp`` is numpy's, which differs from the CPU torch's in
float32's last bit now and then, so there silu may differ by an ulp of float32 (and then rarely by one of bf16).
It has no backward: ``silu_mul`` takes it only where no gradient is wanted.
"""

from __future__ import annotations

import torch

from ..backend import HAS_TRITON, inference_kernel_path, interpreting, launcher, log_fallback, on_device, tl, triton
from ..host_format import cast_rtne

BLOCK = 2048  # elements per program
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAS_TRITON:
    try:  # CUDA's expf; the interpreter has no libdevice and takes tl.exp (numpy's) instead
        from triton.language.extra.cuda import libdevice
    except ImportError:
        libdevice = None

    @triton.jit(do_not_specialize=["n"])
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, CUDA_EXP: tl.constexpr):
        """Program (tile of ``BLOCK`` elements): ``(silu(g) rounded) * u``, rounded to the output dtype."""
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        b_g = tl.load(g_ptr + o, mask=m, other=0.0).to(tl.float32)
        b_u = tl.load(u_ptr + o, mask=m, other=0.0).to(tl.float32)
        if CUDA_EXP:
            e = libdevice.exp(-b_g)
        else:
            e = tl.exp(-b_g)
        dtype = out_ptr.dtype.element_ty
        b_s = cast_rtne(tl.math.div_rn(b_g, 1.0 + e), dtype).to(tl.float32)
        tl.store(out_ptr + o, cast_rtne(b_s * b_u, dtype), mask=m)


def _launch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    n = gate.numel()
    if n == 0:
        return out
    with on_device(gate):
        launcher(_silu_mul_kernel)[(-(-n // BLOCK),)](
            gate, up, out, n, BLOCK=BLOCK, CUDA_EXP=libdevice is not None and not interpreting(),
            enable_fp_fusion=False,
        )
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The torch reference: ``act_fn(gate) * up`` with ``act_fn`` SiLU, as the stock MLP computes it."""
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: Triton on CUDA where no gradient is wanted, the torch reference elsewhere
    (``HF_NOSA_KERNELS`` forces one, see ``backend.py``).

    Args:
        gate, up: ``[..., I]`` of one shape and dtype (``gate_proj(x)`` and ``up_proj(x)``).

    Returns:
        ``[..., I]`` in their dtype.

    Example:
        >>> g, u = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
        >>> torch.equal(silu_mul(g, u), silu_mul_ref(g, u))
        True
    """
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate and up must have one shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    if inference_kernel_path("silu_mul", gate, up) == "torch":
        return silu_mul_ref(gate, up)
    if gate.dtype not in DTYPES or up.dtype != gate.dtype or not (gate.is_contiguous() and up.is_contiguous()):
        log_fallback("silu_mul", gate.device.type, f"gate and up ({gate.dtype}, {up.dtype}) are not contiguous "
                     f"tensors of one dtype in {DTYPES}")
        return silu_mul_ref(gate, up)
    return _launch(gate, up)
