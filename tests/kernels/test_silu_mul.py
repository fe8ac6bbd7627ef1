"""The SiLU-product kernel against its torch reference, the reference against transformers' MLP, and the fused MLP
``to_nosa`` swaps in.

On CUDA the kernel computes silu with CUDA's ``expf`` and IEEE division, as torch's kernel does, and the ``gpu``
cases hold it bitwise to torch. Under the interpreter ``exp`` is numpy's, whose float32 results differ from the CPU
torch's in the last bit now and then: there the kernel is bitwise the same formula with numpy's ``exp``, and within
an ulp of the storage dtype of torch's.
"""

import importlib

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

from hf_nosa import to_nosa
from hf_nosa.modeling.llama import NosaLlamaMLP
from tests.conftest import small_nosa_config, tiny_model

silu_module = importlib.import_module("hf_nosa.kernels.layers.silu_mul")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(shape, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(shape, generator=g) * 4
    gate.view(-1)[:4] = torch.tensor([-90.0, 90.0, 0.0, -1e-3])  # exp overflowing, vanishing; silu's zero
    return gate.to(dtype).to(device), torch.randn(shape, generator=g).to(dtype).to(device)


def _numpy_formula(gate, up):
    """silu as the kernel computes it under the interpreter (numpy's exp, IEEE division), rounded as torch rounds."""
    g = gate.float()
    with np.errstate(over="ignore"):  # exp(90) is inf, as in torch
        e = torch.from_numpy(np.exp(-g.numpy()))
    return (g / (1 + e)).to(gate.dtype) * up


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy, at exp(90)
@pytest.mark.parametrize("shape", [(1, 1, 7), (2, 3, 300), (1, 2049)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(interpret, shape, dtype):
    gate, up = _inputs(shape, dtype, seed=shape[-1])
    actual, expected = silu_module.silu_mul(gate, up), silu_module.silu_mul_ref(gate, up)
    assert actual.dtype == expected.dtype == dtype and actual.shape == expected.shape
    assert torch.equal(actual, _numpy_formula(gate, up))  # the roundings are torch's
    eps = torch.finfo(dtype).eps  # the exps are not: float32 within a few ulps, bf16/fp16 within one
    torch.testing.assert_close(actual, expected, atol=1e-30, rtol=(8 if dtype == torch.float32 else 2) * eps)


@pytest.mark.parametrize("family,mlp_class", [("llama", LlamaMLP), ("qwen2", Qwen2MLP), ("qwen3", Qwen3MLP)])
def test_reference_is_transformers_mlp(family, mlp_class):
    config = tiny_model(family).config
    mlp = mlp_class(config).to(torch.bfloat16)
    gate, up = _inputs((2, 5, config.intermediate_size), torch.bfloat16, seed=1)
    assert torch.equal(silu_module.silu_mul_ref(gate, up), mlp.act_fn(gate) * up)


def test_fused_mlp_keeps_names_and_stock_output_on_cpu():
    config = tiny_model("llama").config
    stock = LlamaMLP(config)
    fused = LlamaMLP(config)
    fused.load_state_dict(stock.state_dict())
    fused.__class__ = NosaLlamaMLP
    assert list(fused.state_dict()) == list(stock.state_dict())
    x = torch.randn(2, 3, config.hidden_size)
    with torch.no_grad():
        assert torch.equal(fused(x), stock(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_kernel_only_where_no_gradient_is_wanted(interpret, monkeypatch):
    calls = []
    launch = silu_module._launch
    monkeypatch.setattr(silu_module, "_launch", lambda *a: calls.append(1) or launch(*a))
    gate, up = _inputs((3, 40), torch.float32, seed=2)
    gate.requires_grad_(True)
    out = silu_module.silu_mul(gate, up)
    out.sum().backward()
    assert not calls and gate.grad is not None
    with torch.no_grad():
        fused = silu_module.silu_mul(gate, up)
    assert calls == [1]
    torch.testing.assert_close(fused, out.detach(), atol=1e-30, rtol=8 * torch.finfo(torch.float32).eps)


def test_to_nosa_swaps_silu_mlps_only():
    model = tiny_model("qwen2")
    to_nosa(model, small_nosa_config())
    assert all(type(layer.mlp).__name__ == "NosaQwen2MLP" for layer in model.model.layers)
    gelu = tiny_model("llama", hidden_act="gelu")
    to_nosa(gelu, small_nosa_config())
    assert all(type(layer.mlp) is LlamaMLP for layer in gelu.model.layers)


def test_converted_model_matches_stock_with_kernels(interpret):
    """The three kernels interpreted inside a converted model (grad off): logits within float32's last bits."""
    model = tiny_model("qwen3")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        to_nosa(model, small_nosa_config(budget_tokens=4096))
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="one shape"):
        silu_module.silu_mul(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(42, 1, 8192), (1, 512, 8192), (3, 5, 1000)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_bitwise_torch_gpu(shape, dtype):
    gate, up = _inputs(shape, dtype, seed=4, device="cuda")
    actual, expected = silu_module.silu_mul(gate, up), torch.nn.functional.silu(gate) * up
    assert torch.equal(actual, expected), f"max abs diff {(actual.float() - expected.float()).abs().max().item():.3e}"
