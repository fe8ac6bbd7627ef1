"""The flash-style biased attention kernel against its torch reference (``attend.attend``).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test) at small sizes with
16-wide tiles, so several key tiles, the diagonal loop and the ragged last tiles all run; the ``gpu`` cases run
the compiled kernel at prefill-sized shapes in bf16 and fp16.
"""

import importlib

import pytest
import torch

from hf_nosa.selection import MASK_VALUE

from ..utils import assert_close

flash_module = importlib.import_module("hf_nosa.kernels.flash_biased")


def _inputs(B, H, Hk, Tq, S, D, dtype, device, seed, extreme=False, hidden=0.0):
    """Random q, k, v and a nonzero per-key bias; ``extreme``: biases up to +-80; ``hidden``: that share of the keys
    past the first get MASK_VALUE (padding), so every query still sees key 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    bias = torch.randn(B, Hk, S, generator=g) * (40.0 if extreme else 1.0)
    if extreme:
        bias = bias.clamp(-80, 80)
        bias[..., 1::7] = 80.0
        bias[..., 2::5] = -80.0
    if hidden:
        drop = torch.rand(B, Hk, S, generator=g) < hidden
        drop[..., 0] = False
        bias = torch.where(drop, MASK_VALUE, bias)
    return q, k, v, bias.to(device)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")


CASES = [
    # B, H, Hk, Tq, S, D, q_offset, causal
    (1, 2, 2, 40, 40, 16, 0, True),  # a causal prompt, ragged last tiles
    (2, 4, 1, 20, 70, 32, 50, True),  # a chunk after 50 earlier keys (lower-right), GQA 4
    (1, 4, 2, 33, 47, 16, 0, False),  # every query sees every key
    (2, 2, 1, 16, 64, 16, 30, True),  # queries in the middle of the keys: later keys hidden by the causal rule
]


@pytest.mark.skipif(not flash_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("extreme", [False, True], ids=["bias", "extreme-bias"])
def test_kernel_matches_attend_interpreted(interpret, case, extreme):
    B, H, Hk, Tq, S, D, q_offset, causal = case
    q, k, v, bias = _inputs(B, H, Hk, Tq, S, D, torch.float32, "cpu", seed=Tq + S, extreme=extreme, hidden=0.2)
    out = flash_module.flash_biased(q, k, v, bias, D**-0.5, q_offset=q_offset, causal=causal)
    expected = flash_module.flash_biased_ref(q, k, v, bias, D**-0.5, q_offset=q_offset, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not flash_module.HAS_TRITON, reason="needs the triton package")
def test_each_tile_configuration_is_exact_interpreted(interpret):
    """Tiles of 16 and 32 keys and queries give the same result (the full-tile loop, the diagonal loop and their
    boundary move with the tile sizes)."""
    q, k, v, bias = _inputs(1, 2, 1, 48, 80, 16, torch.float32, "cpu", seed=5)
    outs = [flash_module.flash_biased(q, k, v, bias, 0.25, q_offset=32, config=config)
            for config in ((16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1))]
    expected = flash_module.flash_biased_ref(q, k, v, bias, 0.25, q_offset=32)
    for out in outs:
        assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_bad_inputs_are_refused_by_name():
    q, k, v, bias = _inputs(1, 4, 2, 8, 8, 16, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="bias must be float32"):
        flash_module.flash_biased(q, k, v, bias.double(), 0.25)
    with pytest.raises(ValueError, match="H % Hk"):
        flash_module.flash_biased(q[:, :3], k, v, bias, 0.25)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_module.flash_biased(q, k.double(), v, bias, 0.25)


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    q, k, v, bias = _inputs(1, 4, 2, 10, 30, 16, torch.float32, "cpu", seed=1)
    out = flash_module.flash_biased(q, k, v, bias, 0.25, q_offset=20)
    assert torch.equal(out, flash_module.flash_biased_ref(q, k, v, bias, 0.25, q_offset=20))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_matches_attend_on_gpu(dtype, D):
    tol = dict(atol=2e-2, rtol=2e-2)
    for Tq, S, q_offset, causal, extreme in ((1000, 1000, 0, True, False), (512, 4608, 4096, True, True),
                                             (300, 1111, 0, False, True)):
        q, k, v, bias = _inputs(2, 32, 8, Tq, S, D, dtype, "cuda", seed=Tq, extreme=extreme, hidden=0.1)
        out = flash_module.flash_biased(q, k, v, bias, D**-0.5, q_offset=q_offset, causal=causal)
        expected = flash_module.flash_biased_ref(q.float(), k.float(), v.float(), bias, D**-0.5, q_offset=q_offset,
                                                 causal=causal)
        assert_close(out, expected, **tol, msg=f"Tq={Tq} S={S} {dtype}")


def test_docstring_example():
    import doctest

    assert doctest.testmod(flash_module, raise_on_error=True).attempted > 0
