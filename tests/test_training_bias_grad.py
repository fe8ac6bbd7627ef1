"""The eviction bias's gradient through FlexAttention's value gradient (``training.FLEX_BIAS_GRAD =
"value_column"``) against the explicit backend and against torch's own captured-buffer gradient ("scatter"):
outputs and every gradient (queries, keys, values, bias), with GQA, folded heads and left padding."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from hf_nosa import training
from hf_nosa.training import _BiasFromValueGrad, _OutputWithDelta, nosa_training_attention

from .conftest import small_nosa_config

SPARSE = dict(budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16)


def test_value_column_gradient_equals_the_bias_gradient_of_softmax_attention():
    """The identity behind it, on plain dense attention in fp64: d/db of softmax(q.k s + b) v."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = (torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 3).requires_grad_()
    upstream = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)

    def attention(values, b):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.3 + b[:, :, None, :], -1) @ values

    want = torch.autograd.grad((attention(v, bias) * upstream).sum(), bias)[0]
    wide = _BiasFromValueGrad.apply(v, bias)
    assert wide.shape[-1] == 16 and torch.equal(wide[..., :8], v) and not wide[..., 8:].any()
    out = _OutputWithDelta.apply(attention(wide, bias.detach()), 8)
    got = torch.autograd.grad((out * upstream).sum(), bias)[0]
    assert_close(got, want, rtol=1e-10, atol=1e-10)


def _run(backend, bias_grad, monkeypatch, *, H, padded, fold, seed):
    monkeypatch.setattr(training, "FLEX_BIAS_GRAD", bias_grad)
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


@pytest.mark.parametrize("H,fold,padded", [(2, 1, False), (8, 1, False), (8, 4, False), (8, 2, True)])
def test_flex_value_column_equals_explicit_and_scatter(monkeypatch, H, fold, padded):
    """Flex runs eagerly on the CPU (its dense math, scores materialised; torch refuses its backward there only by a
    device check, lifted here): the same rule, the same gradients as the other paths."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    out_ref, grads_ref = _run("explicit", "scatter", monkeypatch, H=H, padded=padded, fold=fold, seed=H + fold)
    for bias_grad in ("scatter", "value_column"):
        out, grads = _run("flex", bias_grad, monkeypatch, H=H, padded=padded, fold=fold, seed=H + fold)
        assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
        for name, got, want in zip(("q", "k", "v", "bias"), grads, grads_ref):
            assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{bias_grad}: d{name}")


def test_bad_bias_grad(monkeypatch):
    monkeypatch.setattr(training, "FLEX_BIAS_GRAD", "atomic")
    cfg = small_nosa_config(**SPARSE)
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    with pytest.raises(ValueError, match="bias_grad='atomic'.*value_column"):
        nosa_training_attention(q, k, v, torch.zeros(1, 2, 40, requires_grad=True), cfg, 0.25, backend="flex")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_value_column_on_gpu_equals_scatter(monkeypatch, dtype):
    cfg = small_nosa_config(block_size=64, budget_tokens=512, query_tokens=128, sink_tokens=64, local_tokens=128,
                            compress_kernel=32, compress_stride=16)
    results = {}
    for bias_grad in ("scatter", "value_column"):
        monkeypatch.setattr(training, "FLEX_BIAS_GRAD", bias_grad)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, 1000, 64, generator=g).to("cuda", dtype).requires_grad_() for h in (8, 2, 2))
        bias = (torch.randn(2, 2, 1000, generator=g) * 2).cuda().requires_grad_()
        out = nosa_training_attention(q, k, v, bias, cfg, 0.125, backend="flex")
        out.float().pow(2).sum().backward()
        results[bias_grad] = (out.detach(), [x.grad for x in (q, k, v, bias)])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(results["value_column"][0], results["scatter"][0], atol=tol, rtol=tol)
    for name, a, b in zip("qkvb", results["value_column"][1], results["scatter"][1]):
        assert_close(a.float(), b.float(), atol=tol * 10, rtol=tol * 10, msg=f"d{name}")
