"""Triton helpers for the quantized host store (``hf_nosa.cache.host_quant``): quantize a block, dequantize a tile.

The fetch and host-write kernels call these, so that what a kernel stores and what it loads into the slot pool
are bit for bit what the torch reference (``quantize_blocks``, ``dequantize_blocks``) gives. Every rounding is done
with integer operations on the fp32 bit pattern (round to nearest, ties to even): Triton's own float casts round
differently under the interpreter (its fp32 -> bf16 and fp32 -> fp8 casts truncate there), and an integer
operation is exact on every backend. Divisions use ``div_rn`` (IEEE, as torch divides).

Quantized values travel as ``uint8`` bits (fp8 e4m3fn, or int8 two's complement), whatever the format.
"""

from __future__ import annotations

from .backend import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _round_half_even(y):
        """int32: fp32 ``y`` (``|y| < 2^23``) rounded to the nearest integer, ties to even (``torch.round``)."""
        t = y.to(tl.int32)  # truncates toward zero
        frac = tl.abs(y - t.to(tl.float32))  # exact
        up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) != 0))
        return t + tl.where(up, tl.where(y < 0, -1, 1), 0)

    @triton.jit
    def _fp8_bits(y):
        """int32 e4m3fn bits of fp32 ``y`` (``|y| <= 448``), round to nearest even, as torch's cast."""
        u = y.to(tl.int32, bitcast=True)
        a = u & 0x7FFFFFFF
        e = a >> 23
        # normal (|y| >= 2^-6): drop 20 mantissa bits with rounding; a carry moves into the exponent by itself
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal: |y| / 2^-9 rounded to an integer 0..8 (8 is 2^-6, whose bits are those of the first normal)
        shift = tl.minimum(tl.maximum(141 - e, 21), 31)  # in range for the shifts below whatever e (e >= 121: unused)
        sig = (a & 0x7FFFFF) | 0x800000
        q = sig >> shift
        rem = sig & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        q = q + ((rem > half) | ((rem == half) & ((q & 1) != 0))).to(tl.int32)
        bits = tl.where(e >= 121, normal, tl.where(e == 0, 0, q))
        return bits | tl.where(u < 0, 0x80, 0)

    @triton.jit
    def _fp8_value(bits):
        """fp32 value of e4m3fn ``bits`` (int32 0..255)."""
        e = (bits >> 3) & 15
        m = bits & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
        return tl.where((bits & 0x80) != 0, -magnitude, magnitude)

    @triton.jit
    def quantize_block(x, FP8: tl.constexpr, QMAX: tl.constexpr):
        """``x`` fp32 ``[P, D]`` (zeros where masked) -> (uint8 bits ``[P, D]``, fp32 scale): ``quantize_blocks``."""
        amax = tl.max(tl.max(tl.abs(x), 1), 0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        if FP8:
            bits = _fp8_bits(y)
        else:
            bits = _round_half_even(y) & 0xFF
        return bits.to(tl.uint8), scale

    @triton.jit
    def store_quantized(x, p_bits, p_scale, mask, FP8: tl.constexpr, QMAX: tl.constexpr):
        """Quantize the block ``x`` (fp32 ``[P, D]``, zeros where masked): its bits to ``p_bits`` (``[P, D]``
        uint8 pointers, ``mask``), its scale to ``p_scale``."""
        bits, scale = quantize_block(x, FP8, QMAX)
        tl.store(p_bits, bits, mask=mask)
        tl.store(p_scale, scale)

    @triton.jit
    def dequantize(bits, scale, FP8: tl.constexpr):
        """fp32 ``q * scale`` for uint8 ``bits`` (``scale`` broadcast to them): ``dequantize_blocks`` before its
        final cast."""
        b = bits.to(tl.int32)
        if FP8:
            q = _fp8_value(b)
        else:
            q = tl.where(b >= 128, b - 256, b).to(tl.float32)
        return q * scale

    @triton.jit
    def cast_rtne(x, DTYPE: tl.constexpr):
        """fp32 ``x`` in ``DTYPE`` rounded to nearest even (bf16 by its bits: the interpreter's bf16 cast truncates)."""
        if DTYPE == tl.bfloat16:
            u = x.to(tl.int32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(DTYPE)
