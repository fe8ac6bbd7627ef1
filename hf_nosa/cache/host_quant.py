"""Quantized K/V blocks for the host store: one scale per (block, KV head), the torch reference of the format.

The host store is what bounds a long-context batch (1b shape: 32 KB per token per sequence in bf16) and its blocks
are what crosses PCIe at every decode step, so halving their bytes halves both. A block of ``P`` tokens of one KV
head is quantized as a whole: ``scale = amax(|x|) / qmax`` over its ``P x D`` values, ``q = x / scale`` rounded
to the format, ``x ~ q * scale``. One fp32 scale per (block, KV head) adds ``4 / (P * D)`` bytes per value (0.1%
at 64 x 64). Only complete blocks are quantized: the block being written stays in the model's dtype until its last
token arrives, so its scale sees every value once and nothing is quantized twice.

Formats (``HOST_FORMATS``): ``float8_e4m3fn`` (3 mantissa bits, range 448: relative error at most 2^-4 per
value, absolute error at most 2^-10 * scale below the normal range) and ``int8`` (uniform steps of ``scale``:
absolute error at most scale / 2 = amax / 254). fp8 keeps small values relative to the block's largest; int8
keeps large values more precisely. ``quantization_error_bound`` states both bounds; the tests hold the reference to
them on random and outlier-heavy data.

``NosaConfig.host_dtype`` picks the format of a NosaCache's host store (``hf_nosa.cache.host_store``): its torch paths
call these functions, and the host-write and fetch kernels compute the same bits (``kernels/host_format.py``).

Shapes: ``x [..., P, D]`` (any leading dims: batch, KV head, block), ``scale [...]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class HostFormat(NamedTuple):
    dtype: torch.dtype
    qmax: float  # the largest magnitude the format holds
    integer: bool  # values are rounded to integers (else the float format rounds them itself)


HOST_FORMATS: dict[str, HostFormat] = {
    "float8_e4m3fn": HostFormat(torch.float8_e4m3fn, 448.0, False),
    "int8": HostFormat(torch.int8, 127.0, True),
}


def host_format(name: str) -> HostFormat:
    """The format called ``name``; a ValueError listing the allowed names otherwise."""
    if name not in HOST_FORMATS:
        raise ValueError(f"host_dtype {name!r} is not a quantized host format; allowed: {sorted(HOST_FORMATS)}")
    return HOST_FORMATS[name]


def block_scales(x: torch.Tensor, fmt: HostFormat) -> torch.Tensor:
    """``[...]`` fp32: amax over each block's ``P x D`` values over ``fmt.qmax``; 1 for an all-zero block."""
    amax = x.detach().abs().amax(dim=(-2, -1)).float()
    # Divided by a tensor, not a Python number: on CUDA torch turns a division by a scalar into a product with its
    # reciprocal (one bit off the IEEE quotient), which the kernels' div_rn and the CPU path do not.
    return torch.where(amax > 0, amax / torch.full_like(amax, fmt.qmax), torch.ones_like(amax))


def quantize_blocks(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize complete blocks ``x [..., P, D]`` to the host format ``name``.

    Returns:
        ``q [..., P, D]`` in the format's dtype and ``scale [...]`` fp32, with ``dequantize_blocks(q, scale) ~ x``.

    Example:
        >>> x = torch.randn(2, 3, 4, 64, 64)
        >>> q, scale = quantize_blocks(x, "float8_e4m3fn")
        >>> q.dtype, tuple(scale.shape)
        (torch.float8_e4m3fn, (2, 3, 4))
        >>> bool(((dequantize_blocks(q, scale, torch.float32) - x).abs() <= quantization_error_bound(x, "float8_e4m3fn")).all())
        True
    """
    fmt = host_format(name)
    scale = block_scales(x, fmt)
    y = (x.float() / scale[..., None, None]).clamp(-fmt.qmax, fmt.qmax)
    if fmt.integer:
        return y.round().to(fmt.dtype), scale
    if y.device.type != "cpu":
        # The CPU cast rounds fp32 to nearest even once, as the kernels do (host_format._fp8_bits); the device cast
        # is not known to (a conversion through half would round twice), and the reference must not depend on it.
        return y.cpu().to(fmt.dtype).to(y.device), scale
    return y.to(fmt.dtype), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., P, D]`` times its block's ``scale [...]``, in ``dtype`` (the slot pool's)."""
    return (q.float() * scale[..., None, None]).to(dtype)


def quantization_error_bound(x: torch.Tensor, name: str) -> torch.Tensor:
    """``[..., P, D]``: the largest ``|dequantize(quantize(x)) - x|`` the format allows per value (fp32 math).

    float8_e4m3fn rounds to 3 mantissa bits (half a step: 2^-4 of the value) and, below its smallest normal
    2^-6, to steps of 2^-9 (half: 2^-10), both in units of the block's scale; int8 rounds to steps of the scale.
    For fp32 output; dequantizing into bf16 adds bf16's own rounding (2^-9 of the value).
    """
    fmt = host_format(name)
    scale = block_scales(x, fmt)[..., None, None]
    if fmt.integer:
        bound = (scale / 2).expand(x.shape)
    else:
        bound = torch.maximum(x.float().abs() * 2.0**-4, scale * 2.0**-10)
    # The fp32 division rounds y = x / scale (up to qmax = 127) by 2^-24 of itself: up to 2^-16 of a half step.
    return bound * (1 + 2.0**-14)
