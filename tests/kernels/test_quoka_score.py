"""The QUOKA scoring kernel against its torch reference (``selection.quoka_scores``).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` cases run
the compiled kernel at prefill-sized shapes.
"""

import importlib

import pytest
import torch

from hf_nosa.rules.selection import MASK_VALUE, QUOKA_PADDING_SCORE, quoka_scores

from ..conftest import small_nosa_config
from ..utils import assert_close

# The package re-exports a function of the module's name: take the module itself.
quoka_score_module = importlib.import_module("hf_nosa.kernels.prefill.quoka_score")


def _inputs(B, H, Hk, R, n, D, W, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    kept = torch.randn(B, H, R, n, D, generator=g, device=device).to(dtype)
    keys = torch.randn(B, Hk, W + 3, D, generator=g, device=device).to(dtype)  # spare windows past W
    n_windows = torch.randint(0, W + 1, (R,), generator=g, device=device)
    n_windows[0] = W
    n_valid = torch.randint(0, n + 1, (B, R), generator=g, device=device)
    n_valid[0] = n
    return kept, keys, n_windows, n_valid


def _padded_bias(B, Hk, W, device, seed):
    """``[B, Hk, W + 3]`` compressed eviction scores of left-padded rows: row b's first windows (a random number,
    whole rows of them included) hold padding, so their mean score is a fraction of MASK_VALUE."""
    g = torch.Generator(device=device).manual_seed(seed + 100)
    bias = torch.randn(B, Hk, W + 3, generator=g, device=device)
    n_pad = torch.randint(0, W + 4, (B,), generator=g, device=device)
    n_pad[0] = min(W // 2, 6)
    padding = torch.arange(W + 3, device=device) < n_pad[:, None]  # [B, W + 3]
    return torch.where(padding[:, None], MASK_VALUE / 8 + bias, bias)


def _check(module, shape, cfg, dtype=torch.float32, device="cpu", seed=0, with_valid=True, with_bias=False):
    B, H, Hk, R, n, D, W, N = shape
    kept, keys, n_windows, n_valid = _inputs(B, H, Hk, R, n, D, W, dtype, device, seed)
    n_valid = n_valid if with_valid else None
    bias = _padded_bias(B, Hk, W, device, seed) if with_bias else None
    actual = module.quoka_score(kept, keys, n_windows, N, cfg, n_valid=n_valid, compressed_bias=bias)
    expected = quoka_scores(kept.float(), keys.float(), n_windows, N, cfg, n_valid, compressed_bias=bias)
    if with_bias:
        assert (expected == QUOKA_PADDING_SCORE).any(), "no block of padding windows alone: a weak case"
    assert actual.dtype == torch.float32 and actual.shape == (B, Hk, R, N)
    assert torch.equal(actual.isneginf(), expected.isneginf()), "blocks without a window or real query differ"
    finite = expected.isfinite()
    assert_close(actual[finite], expected[finite], atol=2e-5, rtol=1e-5)


INTERPRETED_CASES = [
    # B, H, Hk, R, n, D, W, N
    dict(shape=(1, 1, 1, 1, 1, 64, 5, 1)),
    dict(shape=(2, 4, 1, 2, 5, 64, 63, 17)),
    dict(shape=(3, 8, 2, 2, 16, 128, 65, 33)),
    dict(shape=(1, 8, 8, 1, 3, 64, 40, 9)),
    dict(shape=(2, 4, 2, 3, 4, 64, 30, 9), dtype=torch.bfloat16, with_valid=False,
         cfg=dict(block_size=32, compress_kernel=16, compress_stride=8, sink_tokens=32, local_tokens=32,
                  query_tokens=32)),  # 4 windows per block, offsets -1 .. 3
]


@pytest.mark.skipif(not quoka_score_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("case", INTERPRETED_CASES, ids=lambda case: "x".join(map(str, case["shape"])))
def test_kernel_matches_reference_interpreted(interpret, case):
    cfg = small_nosa_config(**case.get("cfg", {}))
    _check(quoka_score_module, case["shape"], cfg, dtype=case.get("dtype", torch.float32),
           with_valid=case.get("with_valid", True))


@pytest.mark.skipif(not quoka_score_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("case", INTERPRETED_CASES[1:], ids=lambda case: "x".join(map(str, case["shape"])))
def test_kernel_matches_reference_with_padding_windows_interpreted(interpret, case):
    """Left-padded rows: padding windows score QUOKA_PADDING_SCORE (below every cosine) in the kernel too."""
    cfg = small_nosa_config(**case.get("cfg", {}))
    _check(quoka_score_module, case["shape"], cfg, dtype=case.get("dtype", torch.float32),
           with_valid=case.get("with_valid", True), with_bias=True)


@pytest.mark.skipif(not quoka_score_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("with_bias", [False, True])
def test_normaliser_splits_merge_like_one_pass_interpreted(interpret, monkeypatch, with_bias):
    """Windows split over several normaliser programs (16 a split here, so 5 splits; chunks with fewer windows leave
    later splits empty, and padding windows leave some splits with nothing usable): the merged softmax equals the
    reference's."""
    monkeypatch.setattr(quoka_score_module, "SPLIT_W", 16)
    cfg = small_nosa_config()
    _check(quoka_score_module, (2, 4, 2, 3, 4, 64, 70, 17), cfg, seed=3, with_bias=with_bias)


def test_dispatch_follows_the_device_and_the_environment(monkeypatch):
    cfg = small_nosa_config()
    kept, keys, n_windows, n_valid = _inputs(1, 2, 1, 1, 2, 16, 9, torch.float32, "cpu", 0)
    expected = quoka_scores(kept, keys, n_windows, 3, cfg, n_valid)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    assert torch.equal(quoka_score_module.quoka_score(kept, keys, n_windows, 3, cfg, n_valid=n_valid), expected)
    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    assert torch.equal(quoka_score_module.quoka_score(kept, keys, n_windows, 3, cfg, n_valid=n_valid), expected)
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises((ValueError, RuntimeError), match="TRITON_INTERPRET|triton package"):
        quoka_score_module.quoka_score(kept, keys, n_windows, 3, cfg, n_valid=n_valid)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_matches_reference_on_gpu(dtype, D):
    cfg = small_nosa_config(block_size=64, compress_kernel=32, compress_stride=16, sink_tokens=64, local_tokens=64,
                            query_tokens=64, budget_tokens=256)
    _check(quoka_score_module, (3, 32, 8, 16, 16, D, 4095, 1024), cfg, dtype=dtype, device="cuda")
    _check(quoka_score_module, (2, 4, 4, 5, 1, D, 100, 26), cfg, dtype=dtype, device="cuda", seed=1)
    _check(quoka_score_module, (4, 32, 8, 8, 16, D, 2047, 512), cfg, dtype=dtype, device="cuda", seed=2, with_bias=True)
