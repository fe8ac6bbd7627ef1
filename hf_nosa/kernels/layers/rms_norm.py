"""RMSNorm forward in one launch, as transformers' ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` / ``Qwen3RMSNorm`` compute it.

The stock forward is eight launches per call (to float32, pow, mean, add eps, rsqrt, mul, back to the input dtype,
the weight multiply); a decoder layer calls it twice (Qwen3 four times: ``q_norm`` and ``k_norm`` on every head),
which the decode graph pays in GPU time and a batch-1 prefill chunk in host time. The kernel does the same steps in
the same dtypes: the row in float32, ``variance = mean(x * x)``, ``x * rsqrt(variance + eps)`` rounded to the input
dtype, then ``weight * that`` in the promoted dtype of the two (a bf16 weight on bf16 rows gives bf16; an fp32
weight gives fp32). It is not bitwise equal to torch: the mean sums the row in another order, so a row's scale may
differ in float32's last bits, which rounding to bf16/fp16 hides nearly always (Triton's rsqrt compiles to the same
approximate instruction as CUDA's ``rsqrtf``, with denormals flushed, which ``variance + eps`` never is).
It has no backward: ``rms_norm`` takes it only where no gradient is wanted. Where one is, the forward is the torch
reference's lines under ``RMSNormSavingInput``, which keeps the input and one float32 scale per row for the backward
instead of what autograd keeps of the reference (the row in float32 and the normalised row: 6 bytes per element of
a bf16 input, 0.38 GB for the final norm of a 32K-token step in the 1b shape, held at the loss, the step's peak).
That backward recomputes from the input: in torch a dozen passes over float32 rows, on CUDA one kernel
(``_rms_norm_backward_kernel``, held against the torch lines in tests/kernels/test_rms_norm.py).
"""

from __future__ import annotations

import torch

from ..backend import (HAS_TRITON, inference_kernel_path, kernel_path, launcher, log_fallback, next_power_of_2,
                       on_device, tl, triton)
from ..host_format import cast_rtne

TILE = 4096  # elements per program: rows of a short norm (Qwen3's per-head norm, D = 128) share a program
BACKWARD_PROGRAMS = 1024  # most programs of a backward: each writes a float32 share of the weight gradient
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if HAS_TRITON:

    @triton.jit(do_not_specialize=["R"])
    def _rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, stride_x, stride_o, R, N, inv_n, eps,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Program (tile of ``ROWS`` rows): ``w * (x * rsqrt(mean(x * x) + eps)).to(x.dtype)`` per row."""
        o_r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        o_n = tl.arange(0, BLOCK_N)
        m_n = o_n < N
        m = (o_r < R)[:, None] & m_n[None, :]
        b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_n[None, :], mask=m, other=0.0).to(tl.float32)
        variance = tl.sum(b_x * b_x, axis=1) * inv_n  # torch's mean on CUDA multiplies by 1/N too
        b_h = cast_rtne(b_x * tl.math.rsqrt(variance + eps)[:, None], x_ptr.dtype.element_ty)  # .to(input_dtype)
        b_w = tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_o = cast_rtne(b_w[None, :] * b_h.to(tl.float32), out_ptr.dtype.element_ty)
        tl.store(out_ptr + o_r[:, None] * stride_o + o_n[None, :], b_o, mask=m)


    @triton.jit
    def _rms_norm_backward_kernel(
        x_ptr, g_ptr, w_ptr, scale_ptr, dx_ptr, dw_ptr, stride_x, stride_g, stride_dx, R, N, inv_n,
        rows_per_program, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
    ):
        """``RMSNormSavingInput.backward``'s torch lines for ``rows_per_program`` rows, ``ROWS`` at a time, in one pass
        (each torch line is a pass over float32 rows: about 130 ms of a 64K retrofit step's 33 norms in the 1b shape),
        rounding where they round; with ``WEIGHT_GRAD`` the program's share of the weight gradient (float32)."""
        pid = tl.program_id(0)
        o_n = tl.arange(0, BLOCK_N)
        m_n = o_n < N
        b_w = tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = pid.to(tl.int64) * rows_per_program
        end = tl.minimum(first + rows_per_program, R)
        for r0 in range(first, end, ROWS):
            o_r = r0 + tl.arange(0, ROWS)
            m_r = o_r < end
            m = m_r[:, None] & m_n[None, :]
            b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_n[None, :], mask=m, other=0.0).to(tl.float32)
            b_g = tl.load(g_ptr + o_r[:, None] * stride_g + o_n[None, :], mask=m, other=0.0).to(tl.float32)
            b_s = tl.load(scale_ptr + o_r, mask=m_r, other=0.0)
            if WEIGHT_GRAD:  # grad * normed, normed = (hidden * scale).to(x.dtype): products in grad's dtype
                b_normed = cast_rtne(b_x * b_s[:, None], x_ptr.dtype.element_ty).to(tl.float32)
                b_dw += tl.sum(cast_rtne(b_g * b_normed, g_ptr.dtype.element_ty).to(tl.float32), axis=0)
            b_gw = cast_rtne(b_g * b_w[None, :], g_ptr.dtype.element_ty).to(tl.float32)  # (grad * weight).float()
            dot = tl.sum(b_gw * b_x, axis=1) * inv_n
            b_dx = b_gw * b_s[:, None] - b_x * (b_s * b_s * b_s * dot)[:, None]
            tl.store(dx_ptr + o_r[:, None] * stride_dx + o_n[None, :], cast_rtne(b_dx, dx_ptr.dtype.element_ty),
                     mask=m)
        if WEIGHT_GRAD:
            tl.store(dw_ptr + pid.to(tl.int64) * N + o_n, b_dw, mask=m_n)


def _launch_backward(x, weight, scale, grad, weight_grad: bool):
    """``RMSNormSavingInput.backward`` through ``_rms_norm_backward_kernel``: (grad_x, grad_weight or None)."""
    N = x.shape[-1]
    rows, grads = x.reshape(-1, N), grad.reshape(-1, N)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    grads = grads if grads.stride(-1) == 1 else grads.contiguous()
    R = rows.shape[0]
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return grad_x, (torch.zeros_like(weight) if weight_grad else None)
    block_n = next_power_of_2(N)
    tile_rows = max(1, min(TILE // block_n, next_power_of_2(R)))
    # enough programs to fill the GPU, few enough that their weight-gradient shares stay small
    programs = max(1, min(-(-R // tile_rows), BACKWARD_PROGRAMS))
    per_program = -(-R // programs)
    per_program = -(-per_program // tile_rows) * tile_rows
    programs = -(-R // per_program)
    shares = torch.empty(programs, N, dtype=torch.float32, device=x.device) if weight_grad else grad_x
    with on_device(x):
        launcher(_rms_norm_backward_kernel)[(programs,)](
            rows, grads, weight, scale.reshape(-1).contiguous(), grad_x, shares, rows.stride(0), grads.stride(0), N,
            R, N, 1.0 / N, per_program, ROWS=tile_rows, BLOCK_N=block_n, WEIGHT_GRAD=weight_grad,
            num_warps=4 if tile_rows * block_n <= 4096 else 8,
        )
    if not weight_grad:
        return grad_x, None
    return grad_x, shares.sum(0).to(grad.dtype).to(weight.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    rows = x.reshape(-1, N)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    R = rows.shape[0]
    if out.numel() == 0:
        return out
    block_n = next_power_of_2(N)
    # Two tile heights only, one row (a batch-1 decode step) or a full tile (masked past R): a height per power of
    # two of R was a compile-time constant per size class, so a prompt whose last chunk had 3 or 4 tokens compiled
    # a variant of its own in the middle of serving (no warm-up per shape).
    tile_rows = 1 if R == 1 else max(1, TILE // block_n)
    with on_device(x):
        launcher(_rms_norm_kernel)[(-(-R // tile_rows),)](
            rows, weight, out, rows.stride(0), N, R, N, 1.0 / N, eps,
            ROWS=tile_rows, BLOCK_N=block_n, num_warps=4 if tile_rows * block_n <= 4096 else 8,
            enable_fp_fusion=False,
        )
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference: ``LlamaRMSNorm.forward`` (Qwen2's and Qwen3's are the same lines)."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


class RMSNormSavingInput(torch.autograd.Function):
    """``rms_norm_ref`` with a backward that keeps only its input and per-row scale (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        scale = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        out = weight * (hidden * scale).to(input_dtype)
        ctx.save_for_backward(x, weight, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, scale = ctx.saved_tensors
        if not torch.is_grad_enabled() and x.dtype in DTYPES and weight.dtype in DTYPES and grad.dtype in DTYPES \
                and kernel_path("rms_norm_backward", x) == "triton":
            grad_x, grad_weight = _launch_backward(x, weight, scale, grad, ctx.needs_input_grad[1])
            return (grad_x if ctx.needs_input_grad[0] else None), grad_weight, None
        hidden = x.to(torch.float32)
        normed = (hidden * scale).to(x.dtype)  # what the weight multiplied
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d(hidden * scale)/d(hidden) with scale = (mean(hidden^2) + eps)^(-1/2)
            g = (grad * weight).to(torch.float32)
            dot = (g * hidden).mean(-1, keepdim=True)
            grad_x = (g * scale - hidden * scale.pow(3) * dot).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: Triton on CUDA where no gradient is wanted, the torch reference elsewhere
    (``HF_NOSA_KERNELS`` forces one, see ``backend.py``); with a gradient, the reference's forward under
    ``RMSNormSavingInput``.

    Args:
        x: ``[..., N]`` float32, bfloat16 or float16 (e.g. ``[B, T, hidden]``, or ``[B, T, H, D]`` for Qwen3's
            per-head ``q_norm``/``k_norm``).
        weight: ``[N]``.
        eps: added to the mean square (the module's ``variance_epsilon``).

    Returns:
        ``[..., N]`` in ``promote_types(weight.dtype, x.dtype)``, as the stock module returns.

    Example:
        >>> x, w = torch.randn(2, 3, 8), torch.ones(8)
        >>> torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
        True
    """
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: x must be [..., N] and weight [N]; got shapes {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormSavingInput.apply(x, weight, eps)
    if inference_kernel_path("rms_norm", x, weight) == "torch":
        return rms_norm_ref(x, weight, eps)
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        log_fallback("rms_norm", x.device.type, f"its dtypes ({x.dtype}, weight {weight.dtype}) are not in {DTYPES}")
        return rms_norm_ref(x, weight, eps)
    return _launch(x, weight, eps)
