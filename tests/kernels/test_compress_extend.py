"""The compressed keys' extension kernel against its torch reference (``CompressedKeys.extend``'s torch form).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` case runs the
compiled kernel at the 1b shape's sizes.
"""

import pytest
import torch

from hf_nosa.cache.compressed_keys import CompressedKeys
from hf_nosa.kernels.prefill.compress_extend import extend_windows
from hf_nosa.rules.selection import num_windows

from ..conftest import small_nosa_config


def _extend(monkeypatch, path, cfg, keys, bias, cuts, starts=None):
    """Compressed keys built by extending with ``keys[:, :, a:b]`` for consecutive cuts, on ``path``."""
    monkeypatch.setenv("HF_NOSA_KERNELS", path)
    if path == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    state = CompressedKeys(cfg, keys, tokens=keys.shape[2])
    a = 0
    for b in cuts:
        start = a if starts is None else starts + a
        state.extend(keys[:, :, a:b], bias[:, :, a:b], start)
        a = b
    return state


def _assert_same(actual, expected, atol):
    assert actual.n == expected.n
    n = expected.n
    torch.testing.assert_close(actual.keys[:, :, :n].float(), expected.keys[:, :, :n].float(), atol=atol, rtol=atol)
    torch.testing.assert_close(actual.bias[:, :, :n], expected.bias[:, :, :n], atol=1e-6, rtol=1e-6)
    assert torch.equal(actual.ring_k, expected.ring_k)  # copies: exact
    assert torch.equal(actual.ring_b, expected.ring_b)


@pytest.mark.parametrize("kernel, stride", [(8, 4), (16, 8), (8, 8), (4, 2), (12, 4)])
def test_kernel_matches_reference_at_random_splits(monkeypatch, kernel, stride):
    """Runs shorter and longer than a window, ring wrap-arounds, more windows than one program's tile (a 100-token
    run at stride 2), a window of three strides (12/4)."""
    cfg = small_nosa_config(compress_kernel=kernel, compress_stride=stride)
    g = torch.Generator().manual_seed(kernel * 10 + stride)
    keys, bias = torch.randn(2, 3, 157, 12, generator=g), torch.randn(2, 3, 157, generator=g)
    cuts = [3, 103] + sorted(set(torch.randint(104, 157, (5,), generator=g).tolist())) + [157]
    expected = _extend(monkeypatch, "torch", cfg, keys, bias, cuts)
    actual = _extend(monkeypatch, "triton", cfg, keys, bias, cuts)
    assert actual.n == num_windows(157, cfg)
    _assert_same(actual, expected, atol=1e-6)


def test_kernel_matches_reference_in_bfloat16_and_per_row_starts(monkeypatch):
    """bf16 keys (means rounded once, from float32, as the reference) and rows of a left-padded batch, which
    extend one row at a time from their own starts."""
    cfg = small_nosa_config()
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(3, 2, 90, 16, generator=g).to(torch.bfloat16)
    bias = torch.randn(3, 2, 90, generator=g)
    starts = torch.tensor([0, 5, 13])
    expected = _extend(monkeypatch, "torch", cfg, keys, bias, [20, 21, 64, 90], starts)
    actual = _extend(monkeypatch, "triton", cfg, keys, bias, [20, 21, 64, 90], starts)
    _assert_same(actual, expected, atol=1e-2)  # at most a bf16 rounding step where float32 sums differ by an ulp


def test_a_window_the_ring_cannot_hold_is_a_value_error():
    cfg = small_nosa_config()
    state = CompressedKeys(cfg, torch.zeros(1, 1, 1, 8), tokens=64)
    new = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="n_old=0 must end at or after start=20"):
        extend_windows(state.keys, state.bias, state.ring_k, state.ring_b, new, new[..., 0], 20, 0, 5, cfg)


@pytest.mark.gpu
def test_kernel_matches_reference_gpu(monkeypatch):
    from hf_nosa import NosaConfig

    cfg = NosaConfig()
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(4, 8, 2048, 64, generator=g).to(torch.bfloat16).cuda()
    bias = torch.randn(4, 8, 2048, generator=g).cuda()
    cuts = [512, 1024, 1536, 2048]
    expected = _extend(monkeypatch, "torch", cfg, keys, bias, cuts)
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    state = CompressedKeys(cfg, keys, tokens=2048)
    for a, b in zip([0] + cuts[:-1], cuts):
        state.extend(keys[:, :, a:b], bias[:, :, a:b], a)
    _assert_same(state, expected, atol=1e-2)
