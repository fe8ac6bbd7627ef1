"""The rotary kernel against its torch reference, bitwise (bf16, fp16, fp32, mixed), and the reference against
transformers' own ``apply_rotary_pos_emb`` of each family, bitwise.

CPU cases run the kernel in the Triton interpreter (the ``interpret`` fixture); ``gpu`` cases run the compiled kernel
against transformers' function on CUDA. Queries and keys come as the attention passes them: transposed views
``[B, H, T, D]`` of ``[B, T, H, D]`` projections.
"""

import importlib

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb as qwen2_rotary
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb as qwen3_rotary

rotary_module = importlib.import_module("hf_nosa.kernels.layers.rotary")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(B, H, Hk, T, D, dtype, cos_batch=None, cos_dtype=None, seed=0, device="cpu"):
    """q ``[B, H, T, D]`` and k ``[B, Hk, T, D]`` as transposed views; cos and sin of real rotary angles."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, H, D, generator=g) * 2).to(dtype).to(device).transpose(1, 2)
    k = (torch.randn(B, T, Hk, D, generator=g) * 2).to(dtype).to(device).transpose(1, 2)
    positions = torch.randint(0, 70000, (cos_batch or B, T, 1), generator=g).float()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
    angles = torch.cat([positions * inv_freq] * 2, dim=-1)
    cd = cos_dtype or dtype
    return q, k, angles.cos().to(cd).to(device), angles.sin().to(cd).to(device)


def _layout(t):
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]  # a size-1 dimension's stride means nothing


def _check_equal(actual, expected):
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape and _layout(a) == _layout(e)
        assert torch.equal(a, e), f"max abs diff {(a.float() - e.float()).abs().max().item():.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hk,T,D", [(1, 4, 4, 1, 64), (2, 8, 2, 3, 16), (1, 3, 1, 5, 80), (3, 32, 8, 1, 64)])
def test_kernel_is_bitwise_reference(interpret, B, H, Hk, T, D, dtype):
    q, k, cos, sin = _inputs(B, H, Hk, T, D, dtype, seed=H * T + D)
    _check_equal(rotary_module.apply_rotary(q, k, cos, sin), rotary_module.apply_rotary_ref(q, k, cos, sin))


@pytest.mark.parametrize("dtype,cos_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                             (torch.float32, torch.bfloat16)])
def test_kernel_promotes_like_torch(interpret, dtype, cos_dtype):
    q, k, cos, sin = _inputs(2, 4, 2, 2, 32, dtype, cos_dtype=cos_dtype, seed=1)
    actual = rotary_module.apply_rotary(q, k, cos, sin)
    assert actual[0].dtype == torch.promote_types(dtype, cos_dtype)
    _check_equal(actual, rotary_module.apply_rotary_ref(q, k, cos, sin))


def test_kernel_broadcasts_cos_over_batch_and_takes_contiguous_inputs(interpret):
    q, k, cos, sin = _inputs(3, 4, 2, 2, 32, torch.bfloat16, cos_batch=1, seed=2)
    _check_equal(rotary_module.apply_rotary(q, k, cos, sin), rotary_module.apply_rotary_ref(q, k, cos, sin))
    q, k = q.contiguous(), k.contiguous()
    _check_equal(rotary_module.apply_rotary(q, k, cos, sin), rotary_module.apply_rotary_ref(q, k, cos, sin))


@pytest.mark.parametrize("stock", [llama_rotary, qwen2_rotary, qwen3_rotary])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_transformers_function(stock, dtype):
    q, k, cos, sin = _inputs(2, 8, 2, 7, 64, dtype, seed=3)
    _check_equal(rotary_module.apply_rotary_ref(q, k, cos, sin), stock(q, k, cos, sin))
    _check_equal(rotary_module.apply_rotary(q, k, cos, sin), stock(q, k, cos, sin))  # CPU: the torch path


def test_kernel_only_where_no_gradient_is_wanted(interpret, monkeypatch):
    calls = []
    launch = rotary_module._launch
    monkeypatch.setattr(rotary_module, "_launch", lambda *a: calls.append(1) or launch(*a))
    q, k, cos, sin = _inputs(1, 2, 1, 2, 16, torch.float32, seed=4)
    q.requires_grad_(True)
    out = rotary_module.apply_rotary(q, k, cos, sin)
    out[0].sum().backward()
    assert not calls and q.grad is not None
    # another unsqueeze_dim (heads after tokens) runs the reference too
    q2, k2 = q.detach().transpose(1, 2), k.transpose(1, 2)
    _check_equal(rotary_module.apply_rotary(q2, k2, cos, sin, unsqueeze_dim=2), llama_rotary(q2, k2, cos, sin, 2))
    assert not calls
    with torch.no_grad():
        fused = rotary_module.apply_rotary(q, k, cos, sin)
    assert calls == [1]
    _check_equal(fused, [t.detach() for t in out])


def test_bad_shapes_are_value_errors(interpret):
    q, k, cos, sin = _inputs(1, 2, 1, 3, 16, torch.float32)
    with pytest.raises(ValueError, match="cos and sin must be"):
        rotary_module.apply_rotary(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="q must be"):
        rotary_module.apply_rotary(q, k[:, :, :2], cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hk,T,D", [(42, 32, 8, 1, 64), (1, 32, 8, 512, 64), (4, 28, 4, 33, 128)])
def test_kernel_is_bitwise_transformers_gpu(B, H, Hk, T, D, dtype):
    q, k, cos, sin = _inputs(B, H, Hk, T, D, dtype, seed=5, device="cuda")
    _check_equal(rotary_module.apply_rotary(q, k, cos, sin), llama_rotary(q, k, cos, sin))
