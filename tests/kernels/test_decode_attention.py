"""decode_attention (Triton) against its torch reference (attend with one query token).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` cases run
the compiled kernel at decode-sized shapes.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_nosa.kernels.decode.decode_attention import decode_attention, decode_attention_ref
from hf_nosa.rules.selection import MASK_VALUE
from tests.utils import assert_close

mod = importlib.import_module("hf_nosa.kernels.decode.decode_attention")  # the package re-exports a function of that name
TOL = {torch.float32: dict(atol=3e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launcher allocates starts as NaN, so a value the kernel forgets to write shows."""

    def empty(*shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(mod, "_empty", empty)


def make_inputs(B, H, Hk, D, S, dtype, device="cpu", seed=0):
    """Keys/values as views of a slot pool (strided, like the cache hands them), the query in the model's layout."""
    g = torch.Generator().manual_seed(seed)
    pool_k = torch.randn(B, Hk, S + 17, D, generator=g).to(dtype)
    pool_v = torch.randn(B, Hk, S + 17, D, generator=g).to(dtype)
    pool_b = 2 * torch.randn(B, Hk, S + 17, generator=g)
    pool_b[torch.rand(B, Hk, S + 17, generator=g) < 0.3] = MASK_VALUE  # empty slot positions
    pool_b[:, :, 0] = 0.5  # every row keeps at least one key
    q = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)  # [B, H, 1, D], non-contiguous
    to = lambda x: x.to(device)  # noqa: E731
    return to(q), to(pool_k)[:, :, :S], to(pool_v)[:, :, :S], to(pool_b)[:, :, :S]


CPU_CASES = [  # B, H, Hk, D, S, dtype, num_splits
    (3, 8, 2, 64, 65, torch.float32, None),
    (1, 8, 8, 128, 63, torch.bfloat16, 2),
    (2, 8, 1, 64, 300, torch.float32, 3),
    (5, 4, 2, 128, 1, torch.float32, None),
    (1, 6, 2, 64, 64, torch.bfloat16, 1),
    (3, 7, 7, 64, 130, torch.float32, 2),
]


@pytest.mark.parametrize("B,H,Hk,D,S,dtype,num_splits", CPU_CASES)
def test_matches_reference_interpreted(interpret, poison, B, H, Hk, D, S, dtype, num_splits):
    q, k, v, b = make_inputs(B, H, Hk, D, S, dtype)
    scale = D**-0.5
    out = decode_attention(q, k, v, b, scale, num_splits=num_splits)
    assert out.shape == (B, H, 1, D) and out.dtype == dtype
    assert_close(out, decode_attention_ref(q, k, v, b, scale), **TOL[dtype])


def test_masked_keys_get_no_weight(interpret):
    q, k, v, b = make_inputs(2, 4, 2, 64, 80, torch.float32, seed=1)
    b = torch.full_like(b, MASK_VALUE)
    b[:, :, 37] = 0.0  # the only key left
    out = decode_attention(q, k, v, b, 0.125, num_splits=2)
    expected = v[:, :, 37][:, :, None, :].repeat_interleave(2, 1)  # [B, H, 1, D]
    assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_cpu_tensors_use_the_reference_by_default(monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    monkeypatch.setattr(mod, "_decode_attention_triton", lambda *a, **k: pytest.fail("Triton path taken on CPU"))
    q, k, v, b = make_inputs(1, 4, 2, 64, 20, torch.float32)
    assert_close(decode_attention(q, k, v, b, 0.125), decode_attention_ref(q, k, v, b, 0.125), atol=0, rtol=0)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, b = make_inputs(1, 4, 2, 64, 20, torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        decode_attention(q, k, v, b, 0.125)


def test_bad_env_value(monkeypatch):
    monkeypatch.setenv("HF_NOSA_KERNELS", "cuda")
    q, k, v, b = make_inputs(1, 4, 2, 64, 20, torch.float32)
    with pytest.raises(ValueError, match="HF_NOSA_KERNELS"):
        decode_attention(q, k, v, b, 0.125)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, b: (q.expand(-1, -1, 2, -1), k, v, b), "query"),
        (lambda q, k, v, b: (q, k[:, :1].expand(-1, 3, -1, -1), v, b), "keys"),
        (lambda q, k, v, b: (q, k, v[:, :, :-1], b), "values"),
        (lambda q, k, v, b: (q, k, v, b.double()), "key_bias"),
        (lambda q, k, v, b: (q, k.transpose(2, 3), v, b), "keys"),
    ],
)
def test_bad_input(change, message):
    q, k, v, b = make_inputs(1, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        decode_attention(*change(q, k, v, b), 0.25)


GPU_CASES = [  # decode-sized: the slot pool of budget 4096 (65 slots of 64 tokens)
    (16, 32, 8, 128, 65 * 64, torch.bfloat16),
    (1, 32, 8, 128, 65 * 64, torch.bfloat16),
    (3, 32, 8, 64, 65 * 64, torch.bfloat16),
    (7, 28, 4, 128, 2000, torch.float32),
    (2, 16, 16, 64, 333, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Hk,D,S,dtype", GPU_CASES)
def test_matches_reference_gpu(monkeypatch, poison, B, H, Hk, D, S, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    q, k, v, b = make_inputs(B, H, Hk, D, S, dtype, device="cuda")
    out = decode_attention(q, k, v, b, D**-0.5)
    tol = TOL.get(dtype, TOL[torch.bfloat16])
    assert_close(out, decode_attention_ref(q, k, v, b, D**-0.5), **tol)
    for splits in (1, 5):
        assert_close(decode_attention(q, k, v, b, D**-0.5, num_splits=splits), out, **tol)
