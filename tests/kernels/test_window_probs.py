"""The window-probability kernel of training's selection against its torch reference, and the reference against
``selection.query_block_scores``.

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` cases run
the compiled kernel at training-sized shapes.
"""

import importlib

import pytest
import torch

from hf_nosa.selection import (
    PADDING_WINDOW_BIAS,
    compress_keys,
    pool_windows_to_blocks,
    query_block_scores,
    windows_available,
)

from ..conftest import small_nosa_config
from ..utils import assert_close

window_module = importlib.import_module("hf_nosa.kernels.window_probs")


def _case(B, H, Hk, T, D, dtype, device, seed, q_offset=0, padded=False):
    cfg = small_nosa_config()
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, T - q_offset, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, T, D, generator=g).to(dtype)
    bias = torch.randn(B, Hk, T, generator=g)
    if padded:
        bias[-1, :, : T // 3] = -1e30  # a left-padded row
    ck, cb = compress_keys(k, cfg), compress_keys(bias, cfg)
    positions = torch.arange(q_offset, T)
    n_windows = windows_available(positions, cfg)
    padding = cb < PADDING_WINDOW_BIAS if padded else None
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return cfg, to(q), to(ck), to(cb), to(n_windows), to(padding), positions


@pytest.mark.parametrize("padded", [False, True])
def test_reference_is_the_first_stage_of_query_block_scores(padded):
    cfg, q, ck, cb, n_windows, padding, positions = _case(2, 4, 2, 150, 16, torch.float32, "cpu", 0, padded=padded)
    N = -(-150 // cfg.block_size)
    probs = window_module.window_probs_ref(q, ck, n_windows, padding, 0.25)
    expected = query_block_scores(q, ck, positions, N, cfg, 0.25, compressed_bias=cb if padded else None)
    assert torch.equal(pool_windows_to_blocks(probs, N, cfg, fill=0.0), expected)


@pytest.mark.parametrize(
    "B,H,Hk,T,D,q_offset,padded",
    [(1, 1, 1, 20, 16, 0, False), (2, 4, 2, 150, 16, 0, False), (2, 8, 2, 97, 24, 30, True),
     (1, 2, 2, 64, 64, 0, True)],
)
def test_kernel_matches_reference(interpret, B, H, Hk, T, D, q_offset, padded):
    _, q, ck, _, n_windows, padding, _ = _case(B, H, Hk, T, D, torch.float32, "cpu", T + H, q_offset, padded)
    actual = window_module.window_probs(q, ck, n_windows, 0.25, padding=padding)
    expected = window_module.window_probs_ref(q, ck, n_windows, padding, 0.25)
    assert actual.shape == expected.shape
    assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def test_row_positions_match_reference_and_query_block_scores(interpret):
    """``n_windows [B, Tq]``: rows of a left-padded batch at their own row-relative positions (one with no window
    yet), in the kernel as in the reference, and the reference as ``query_block_scores`` with ``[B, Tq]``."""
    cfg, q, ck, _, _, _, _ = _case(3, 4, 2, 90, 16, torch.float32, "cpu", 11)
    positions = torch.arange(90)[None, :] - torch.tensor([0, 13, 85])[:, None]  # [B, Tq]; negative in the padding
    n_windows = windows_available(positions, cfg)
    actual = window_module.window_probs(q, ck, n_windows, 0.25)
    expected = window_module.window_probs_ref(q, ck, n_windows, None, 0.25)
    assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    N = -(-90 // cfg.block_size)
    scores = query_block_scores(q, ck, positions, N, cfg, 0.25)
    assert_close(pool_windows_to_blocks(expected, N, cfg, fill=0.0), scores, atol=1e-6, rtol=1e-6)
    for row in range(3):  # and each row as if alone, at shared positions
        alone = window_module.window_probs_ref(q[row : row + 1], ck[row : row + 1], n_windows[row], None, 0.25)
        assert torch.equal(expected[row : row + 1], alone)


def test_bf16_inputs_in_the_interpreter(interpret):
    _, q, ck, _, n_windows, _, _ = _case(1, 4, 2, 80, 16, torch.bfloat16, "cpu", 3)
    actual = window_module.window_probs(q, ck, n_windows, 0.25)
    assert_close(actual, window_module.window_probs_ref(q, ck, n_windows, None, 0.25), atol=1e-5, rtol=1e-4)


def test_torch_path_and_bad_shapes():
    _, q, ck, _, n_windows, _, _ = _case(1, 4, 2, 60, 16, torch.float32, "cpu", 4)
    assert torch.equal(window_module.window_probs(q, ck, n_windows, 0.25),
                       window_module.window_probs_ref(q, ck, n_windows, None, 0.25))
    with pytest.raises(ValueError, match="n_windows"):
        window_module.window_probs(q, ck, n_windows[:-1], 0.25)
    with pytest.raises(ValueError, match="H % Hk"):
        window_module.window_probs(q[:, :3], ck, n_windows, 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_on_gpu(dtype, padded):
    _, q, ck, _, n_windows, padding, _ = _case(2, 32, 8, 3000, 64, dtype, "cuda", 1, 500, padded)
    actual = window_module.window_probs(q, ck, n_windows, 0.125, padding=padding)
    expected = window_module.window_probs_ref(q, ck, n_windows, padding, 0.125)
    assert_close(actual, expected, atol=1e-5, rtol=1e-4)
