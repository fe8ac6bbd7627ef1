"""FlexAttention's training backward against the explicit backend on the CPU: outputs and every gradient (queries,
keys, values and the eviction bias, whose gradient torch scatters from the captured bias tensor), with GQA, folded
heads and left padding. tests/test_training.py compares only the bias gradient on the CPU (flex refuses the others
there), and the rest only on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from hf_nosa.attention.training import nosa_training_attention

from .conftest import SPARSE, small_nosa_config


def _run(backend, *, H, padded, fold, seed):
    cfg = small_nosa_config(**SPARSE)
    g = torch.Generator().manual_seed(seed)
    B, Hk, T, D = 2, 2, 150, 16
    q = torch.randn(B, H, T, D, generator=g).requires_grad_()
    k, v = (torch.randn(B, Hk, T, D, generator=g).requires_grad_() for _ in range(2))
    bias = (torch.randn(B, Hk, T, generator=g) * 2).requires_grad_()
    mask = None
    if padded:  # row 1 starts 21 tokens late, as a left-padded batch
        keep = torch.ones(B, T, dtype=torch.bool)
        keep[1, :21] = False
        mask = (torch.ones(T, T, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None]
    upstream = torch.randn(B, H, T, D, generator=g)
    out = nosa_training_attention(q, k, v, bias, cfg, 0.25, attention_mask=mask, backend=backend, fold=fold)
    rows = slice(None) if not padded else slice(21, None)  # padding queries are arbitrary (training packs)
    (out[..., rows, :] * upstream[..., rows, :]).sum().backward()
    return out.detach()[..., rows, :], [x.grad for x in (q, k, v, bias)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("H,fold,padded", [(2, 1, False), (8, 1, False), (8, 4, False), (8, 2, True)])
def test_flex_gradients_equal_explicit(monkeypatch, H, fold, padded):
    """Flex runs eagerly on the CPU (its dense math, scores materialised; torch refuses its backward there only by a
    device check, lifted here): the same rule, the same gradients as the explicit backend."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    out_ref, grads_ref = _run("explicit", H=H, padded=padded, fold=fold, seed=H + fold)
    out, grads = _run("flex", H=H, padded=padded, fold=fold, seed=H + fold)
    assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    for name, got, want in zip(("q", "k", "v", "bias"), grads, grads_ref):
        assert got.abs().sum() > 0, f"d{name} is zero: the comparison would prove nothing"
        assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"d{name}")
