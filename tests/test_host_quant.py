"""The quantized host format's torch reference (``hf_nosa.cache.host_quant``): error bounds, scales per block and head."""

import doctest

import pytest
import torch

from hf_nosa.cache import host_quant
from hf_nosa.cache.host_quant import (
    HOST_FORMATS,
    block_scales,
    dequantize_blocks,
    host_format,
    quantization_error_bound,
    quantize_blocks,
)

FORMATS = sorted(HOST_FORMATS)


def _blocks(kind: str, seed: int, dtype=torch.float32) -> torch.Tensor:
    """``[2, 3, 5, 64, 64]`` (batch, KV head, block, token, dim): Gaussian, or heavy-tailed with outlier channels
    (as real keys have: a few dimensions carry values 10-100x the rest)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 64, 64, generator=g)
    if kind == "outliers":
        x = x * torch.exp(2 * torch.randn(2, 3, 5, 64, 1, generator=g))  # tokens of very different norms
        x[..., torch.randperm(64, generator=g)[:3]] *= 60.0  # outlier channels
        x[0, 1, 2] *= 1e-4  # a block far smaller than its neighbours
    return x.to(dtype)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["gaussian", "outliers"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_the_stated_bound(name, kind, dtype):
    x = _blocks(kind, seed=3, dtype=dtype)
    q, scale = quantize_blocks(x, name)
    assert q.dtype == HOST_FORMATS[name].dtype and q.element_size() == 1
    assert scale.shape == x.shape[:3] and scale.dtype == torch.float32
    error = (dequantize_blocks(q, scale, torch.float32) - x.float()).abs()
    assert bool((error <= quantization_error_bound(x, name)).all())
    # Every block uses its format's full range: its largest value maps to qmax (int8 exactly; fp8 448 is a value).
    assert torch.equal(q.float().abs().amax(dim=(-2, -1)), torch.full(scale.shape, HOST_FORMATS[name].qmax))


@pytest.mark.parametrize("name", FORMATS)
def test_typical_error_is_small(name):
    """Relative RMS error on Gaussian blocks: a few percent for fp8 (3 mantissa bits), under 1% for int8."""
    x = _blocks("gaussian", seed=4)
    q, scale = quantize_blocks(x, name)
    rel = (dequantize_blocks(q, scale, torch.float32) - x).norm() / x.norm()
    assert float(rel) < (0.03 if name == "float8_e4m3fn" else 0.01)
    assert float(rel) > 0  # quantization does lose something: the test sees the format, not a copy


@pytest.mark.parametrize("name", FORMATS)
def test_scales_are_per_block_and_head(name):
    """Scaling one (block, KV head) by 1000 changes its own scale by 1000 and nothing else of the result."""
    x = _blocks("gaussian", seed=5)
    q, scale = quantize_blocks(x, name)
    y = x.clone()
    y[1, 2, 3] *= 1000.0
    q2, scale2 = quantize_blocks(y, name)
    touched = torch.zeros(scale.shape, dtype=torch.bool)
    touched[1, 2, 3] = True
    assert torch.equal(q2.view(torch.uint8)[~touched], q.view(torch.uint8)[~touched])
    assert torch.equal(scale2[~touched], scale[~touched])
    assert torch.allclose(scale2[1, 2, 3], scale[1, 2, 3] * 1000.0, rtol=1e-6)


@pytest.mark.parametrize("name", FORMATS)
def test_zero_block_stays_zero(name):
    x = _blocks("gaussian", seed=6)
    x[0, 0, 1] = 0.0
    q, scale = quantize_blocks(x, name)
    assert float(scale[0, 0, 1]) == 1.0
    assert torch.equal(dequantize_blocks(q, scale, torch.bfloat16)[0, 0, 1], torch.zeros(64, 64, dtype=torch.bfloat16))


def test_bad_format_names_the_allowed_ones():
    for bad in ("fp8", "float16", "auto"):
        with pytest.raises(ValueError, match="allowed: \\['float8_e4m3fn', 'int8'\\]"):
            host_format(bad)
        with pytest.raises(ValueError, match="host_dtype"):
            quantize_blocks(torch.randn(1, 1, 1, 4, 4), bad)


def test_docstring_examples():
    assert doctest.testmod(host_quant, raise_on_error=True).attempted > 0


@pytest.mark.parametrize("name", sorted(HOST_FORMATS))
def test_scales_are_the_ieee_quotient(name):
    """scale = amax / qmax rounded once (IEEE division, as the kernels' div_rn): not amax times a rounded 1 / qmax,
    which is what torch computes on CUDA for a division by a Python number."""
    x = torch.randn(64, 3, 16, 64, generator=torch.Generator().manual_seed(7)) * torch.rand(64, 3, 1, 1) * 10
    amax = x.abs().amax(dim=(-2, -1))
    exact = (amax.double() / HOST_FORMATS[name].qmax).float()
    assert torch.equal(block_scales(x, HOST_FORMATS[name]), exact)
    by_reciprocal = amax * torch.tensor(1 / HOST_FORMATS[name].qmax, dtype=torch.float32)
    assert not torch.equal(by_reciprocal, exact), "a weak case: the reciprocal's product is exact here too"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(HOST_FORMATS))
def test_quantized_blocks_are_the_same_on_cuda_and_cpu(name):
    x = torch.randn(64, 3, 16, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    q_cpu, s_cpu = quantize_blocks(x, name)
    q_gpu, s_gpu = quantize_blocks(x.cuda(), name)
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
