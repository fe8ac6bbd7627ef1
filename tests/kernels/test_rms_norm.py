"""The RMSNorm kernel against its torch reference, the reference against transformers' RMSNorm classes, and the
fused module ``to_nosa`` swaps in (same parameters, stock output where the torch path runs, the kernel only where
no gradient is wanted).

CPU cases run the kernel in the Triton interpreter (the ``interpret`` fixture); ``gpu`` cases run the compiled kernel
against the stock module on CUDA. Not bitwise: the kernel sums a row in another order than torch's mean (and its
rsqrt is not torch's), so the float32 scale may differ in its last bits; rounded to bf16/fp16 that rarely shows.
"""

import importlib

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from hf_nosa import to_nosa
from hf_nosa.modeling.llama import NosaLlamaRMSNorm
from tests.conftest import small_nosa_config, tiny_model

norm_module = importlib.import_module("hf_nosa.kernels.layers.rms_norm")
STOCK = (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)


def _inputs(shape, dtype, weight_dtype=None, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(weight_dtype or dtype).to(device)
    return x, weight


def _check_close(actual, expected):
    """Equal dtypes; bf16/fp16 within an ulp and nearly all bitwise equal; float32 within a few ulps (the mean's
    order: 3.3e-7 relative at most over 256 rows of 2048, interpreted)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual, expected, atol=0, rtol=(8 if expected.dtype == torch.float32 else 2) * eps)
    if expected.dtype != torch.float32:  # the float32 scale's last bits seldom survive rounding to bf16/fp16
        assert (actual != expected).float().mean() < 0.01


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 100), (2, 5, 3, 16), (1, 2, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference(interpret, shape, dtype):
    x, weight = _inputs(shape, dtype, seed=shape[-1])
    _check_close(norm_module.rms_norm(x, weight, 1e-6), norm_module.rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.float16, torch.bfloat16)])
def test_kernel_promotes_like_torch(interpret, dtype, weight_dtype):
    """The weight multiply in ``promote_types(weight, input)``, after the cast back to the input dtype."""
    x, weight = _inputs((3, 48), dtype, weight_dtype, seed=1)
    actual, expected = norm_module.rms_norm(x, weight, 1e-5), norm_module.rms_norm_ref(x, weight, 1e-5)
    assert actual.dtype == torch.promote_types(dtype, weight_dtype)
    _check_close(actual, expected)


def test_kernel_takes_strided_rows(interpret):
    x, weight = _inputs((4, 6, 32), torch.bfloat16, seed=2)
    rows = x.transpose(0, 1)  # not contiguous over the rows
    _check_close(norm_module.rms_norm(rows, weight, 1e-6), norm_module.rms_norm_ref(rows, weight, 1e-6))


@pytest.mark.parametrize("stock", STOCK)
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.float32)])
def test_reference_is_transformers_module(stock, dtype, weight_dtype):
    x, weight = _inputs((2, 7, 96), dtype, weight_dtype, seed=3)
    module = stock(96, eps=1e-5).to(weight_dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        expected = module(x)
    assert torch.equal(norm_module.rms_norm_ref(x, weight, 1e-5), expected)


def test_fused_module_keeps_names_and_stock_output_on_cpu():
    stock = LlamaRMSNorm(40, eps=1e-6)
    with torch.no_grad():
        stock.weight.normal_()
    fused = LlamaRMSNorm(40, eps=1e-6)
    fused.load_state_dict(stock.state_dict())
    fused.__class__ = NosaLlamaRMSNorm
    assert list(fused.state_dict()) == list(stock.state_dict()) == ["weight"]
    x = torch.randn(3, 5, 40).bfloat16()
    with torch.no_grad():
        assert torch.equal(fused(x), stock(x))


def test_kernel_only_where_no_gradient_is_wanted(interpret, monkeypatch):
    calls = []
    launch = norm_module._launch
    monkeypatch.setattr(norm_module, "_launch", lambda *a: calls.append(1) or launch(*a))
    x, weight = _inputs((2, 24), torch.float32, seed=4)
    weight.requires_grad_(True)
    out = norm_module.rms_norm(x, weight, 1e-6)
    out.sum().backward()
    assert not calls and weight.grad is not None
    with torch.no_grad():
        fused = norm_module.rms_norm(x, weight, 1e-6)
    assert calls == [1]
    _check_close(fused, out.detach())


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_gradient_path_equals_the_reference_with_gradients(dtype, weight_dtype, weight_grad):
    """With a gradient, ``RMSNormSavingInput``: the reference's output bitwise, and the gradients autograd takes
    through the reference (float32 to a few ulps; low precision within its rounding of the normalised row)."""
    x, weight = _inputs((3, 5, 96), dtype, weight_dtype, seed=7)
    grad = torch.randn(3, 5, 96, generator=torch.Generator().manual_seed(8)).to(torch.promote_types(dtype,
                                                                                                    weight_dtype))
    results = []
    for fn in (norm_module.rms_norm, norm_module.rms_norm_ref):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_(weight_grad)
        out = fn(xi, wi, 1e-6)
        out.backward(grad)
        results.append((out.detach(), xi.grad, wi.grad))
    (out, gx, gw), (ref, ref_gx, ref_gw) = results
    assert torch.equal(out, ref)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gx, ref_gx, **tol)
    assert (gw is None) == (not weight_grad)
    if weight_grad:
        torch.testing.assert_close(gw, ref_gw, **tol)


@pytest.mark.parametrize("shape", [(3, 5, 96), (2, 70, 2, 16), (1, 3, 520)])
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
@pytest.mark.parametrize("needs", ["both", "input", "weight"])
def test_backward_kernel_matches_the_torch_backward(interpret, monkeypatch, shape, dtype, weight_dtype, needs):
    """``RMSNormSavingInput``'s backward through the kernel (its rows split over several programs, each looping over
    its rows and keeping a share of the weight gradient) against its torch lines: float32 to a few ulps, low
    precision within a rounding."""
    monkeypatch.setattr(norm_module, "BACKWARD_PROGRAMS", 3)
    monkeypatch.setattr(norm_module, "TILE", 64)  # a few rows a step: each program loops over its rows
    x, weight = _inputs(shape, dtype, weight_dtype, seed=11)
    grad = (torch.randn(shape, generator=torch.Generator().manual_seed(12)) * 2).to(torch.promote_types(dtype,
                                                                                                      weight_dtype))
    results = []
    for path in ("triton", "torch"):
        monkeypatch.setenv("HF_NOSA_KERNELS", path)
        xi = x.clone().requires_grad_(needs != "weight")
        wi = weight.clone().requires_grad_(needs != "input")
        norm_module.RMSNormSavingInput.apply(xi, wi, 1e-6).backward(grad)
        results.append((xi.grad, wi.grad))
    (gx, gw), (ref_gx, ref_gw) = results
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert (gx is None) == (needs == "weight") and (gw is None) == (needs == "input")
    if gx is not None:
        assert gx.dtype == ref_gx.dtype
        torch.testing.assert_close(gx, ref_gx, **tol)
    if gw is not None:
        assert gw.dtype == ref_gw.dtype
        torch.testing.assert_close(gw, ref_gw, **tol)


def test_backward_kernel_of_no_rows(interpret):
    x, weight = _inputs((0, 5, 16), torch.float32)
    xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
    norm_module.RMSNormSavingInput.apply(xi, wi, 1e-6).backward(torch.ones(0, 5, 16))
    assert xi.grad.shape == (0, 5, 16) and torch.equal(wi.grad, torch.zeros(16))


def test_gradient_path_keeps_the_input_not_a_float32_copy():
    """What the backward holds: the input and one float32 scale per row, not the float32 rows (the step's peak)."""
    x, weight = _inputs((4, 64, 256), torch.bfloat16, seed=9)
    x.requires_grad_()
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        norm_module.rms_norm(x, weight, 1e-6)
    assert sum(t.numel() * t.element_size() for t in held) == x.numel() * 2 + 4 * 64 * 4 + 256 * 2
    held.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        norm_module.rms_norm_ref(x, weight, 1e-6)
    assert sum(t.numel() * t.element_size() for t in held) >= x.numel() * 6  # the reference's, for comparison


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_to_nosa_swaps_every_norm(family):
    """Every RMSNorm (the decoder's, the final one, Qwen3's q_norm/k_norm) becomes the fused class, and the state dict
    keeps its keys; a second conversion changes nothing."""
    model = tiny_model(family)
    keys = list(model.state_dict())
    to_nosa(model, small_nosa_config())
    norms = [m for m in model.modules() if isinstance(m, STOCK)]
    assert len(norms) == model.config.num_hidden_layers * (4 if family == "qwen3" else 2) + 1
    assert all(type(m).__name__.startswith("Nosa") for m in norms)
    assert [k for k in model.state_dict() if "eviction_head" not in k] == keys
    to_nosa(model, small_nosa_config())
    assert all(type(m).__name__.startswith("Nosa") for m in norms)


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="weight \\[N\\]"):
        norm_module.rms_norm(torch.zeros(2, 3), torch.zeros(4), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(42, 1, 2048), (1, 512, 2048), (4, 64, 32, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_stock_module_gpu(shape, dtype):
    x, weight = _inputs(shape, dtype, seed=5, device="cuda")
    module = LlamaRMSNorm(shape[-1], eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        _check_close(norm_module.rms_norm(x, weight, 1e-6), module(x))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4096, 2048), (2, 64, 32, 128)])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_backward_kernel_matches_the_torch_backward_gpu(monkeypatch, shape, weight_grad):
    """The compiled backward at the 1b shape's hidden size and at Qwen3's per-head norm, against the torch lines."""
    x, weight = _inputs(shape, torch.bfloat16, seed=13, device="cuda")
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(14)).to("cuda", torch.bfloat16)
    results = []
    for path in ("triton", "torch"):
        monkeypatch.setenv("HF_NOSA_KERNELS", path)
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_(weight_grad)
        norm_module.RMSNormSavingInput.apply(xi, wi, 1e-6).backward(grad)
        results.append((xi.grad, wi.grad))
    (gx, gw), (ref_gx, ref_gw) = results
    torch.testing.assert_close(gx, ref_gx, atol=1e-2, rtol=1e-2)
    if weight_grad:
        torch.testing.assert_close(gw, ref_gw, atol=1e-2, rtol=1e-2)
    else:
        assert gw is None


def test_forward_tiles_take_two_heights_whatever_the_rows(monkeypatch):
    """The tile height is a compile-time constant of the forward kernel: one row (a batch-1 decode step) or a full
    tile, never one per power of two of the rows, so a prompt whose last chunk has a few tokens compiles nothing new."""
    heights = []

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, ROWS, **kwargs: heights.append(ROWS)

    monkeypatch.setattr(norm_module, "launcher", lambda kernel: Recorded())
    weight = torch.randn(64)
    for rows in (1, 2, 3, 4, 5, 16, 17, 100, 4096):
        norm_module._launch(torch.randn(rows, 64), weight, 1e-6)
    assert heights[0] == 1 and set(heights[1:]) == {norm_module.TILE // 64}
