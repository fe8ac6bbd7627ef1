"""The eviction head's scale-and-softplus kernel against its torch reference (``selection.eviction_scores``), and
``attention.eviction_bias``'s choice between them (the kernel only where no gradient is wanted).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` case runs the
compiled kernel.
"""

import importlib

import pytest
import torch

from hf_nosa.rules import selection
from hf_nosa.modeling.attention import eviction_bias
from hf_nosa.rules.selection import eviction_scores

eviction_module = importlib.import_module("hf_nosa.kernels.layers.eviction_bias")


def _logits(B, T, Hk, dtype, seed, device="cpu"):
    """Random logits over softplus's whole range: tiny scores (-30), the threshold's two sides (20), ordinary ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, Hk, generator=g) * 6
    x.view(-1)[:4] = torch.tensor([-30.0, 19.99, 20.0, 20.01])
    return x.to(dtype).to(device), torch.randn(Hk, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("B,T,Hk,dtype", [(1, 5, 2, torch.float32), (2, 300, 8, torch.bfloat16),
                                          (3, 129, 3, torch.float16)])
def test_kernel_matches_reference(interpret, B, T, Hk, dtype):
    logits, A = _logits(B, T, Hk, dtype, seed=T)
    expected = eviction_module.eviction_scale_ref(logits, A)
    actual = eviction_module.eviction_scale(logits, A)
    assert actual.shape == expected.shape == (B, Hk, T) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=0, rtol=2e-6)  # relative: tiny scores stay precise


def test_reference_is_A_times_softplus():
    logits, A = _logits(2, 7, 3, torch.float32, seed=0)
    expected = (A[:, None] * torch.log1p(torch.exp(logits.double())).transpose(1, 2)).float()
    torch.testing.assert_close(eviction_scores(logits, A), expected, atol=0, rtol=1e-5)


def test_eviction_bias_takes_the_kernel_only_without_gradients(interpret):
    """With a gradient wanted the torch form runs (the kernel has no backward), and it reaches A and delta."""
    g = torch.Generator().manual_seed(1)
    value = torch.randn(2, 9, 4 * 8, generator=g)
    delta = torch.nn.Linear(4 * 8, 4)
    A = torch.nn.Parameter(torch.randn(4, generator=g))
    scores = eviction_bias(value, delta.weight, delta.bias, A)
    scores.sum().backward()
    assert A.grad is not None and delta.weight.grad is not None
    with torch.no_grad():
        fused = eviction_bias(value, delta.weight, delta.bias, A)
    assert fused.is_contiguous() and not scores.is_contiguous()  # the kernel's layout, the torch form's view
    torch.testing.assert_close(fused, scores.detach(), atol=0, rtol=2e-6)
    torch.testing.assert_close(selection.eviction_bias(value, delta.weight, delta.bias, A).detach(), scores.detach(),
                               atol=0, rtol=0)  # the rule in selection.py: the same values, in torch


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="logits must be"):
        eviction_module.eviction_scale(torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="logits must be"):
        eviction_module.eviction_scale(torch.zeros(1, 2, 3), torch.zeros(4))


@pytest.mark.gpu
def test_kernel_matches_reference_gpu():
    logits, A = _logits(4, 512, 8, torch.bfloat16, seed=3, device="cuda")
    torch.testing.assert_close(eviction_module.eviction_scale(logits, A), eviction_module.eviction_scale_ref(logits, A),
                               atol=0, rtol=1e-5)
