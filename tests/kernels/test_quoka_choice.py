"""The QUOKA kept-queries kernel against its torch reference (``selection.quoka_query_choice`` and the gather).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` case runs the
compiled kernel at the 1b shape's sizes.
"""

import importlib

import pytest
import torch

choice_module = importlib.import_module("hf_nosa.kernels.prefill.quoka_choice")


def _case(B, H, T, D, dtype, seed, pad=None, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    query = (torch.randn(B, H, T, D, generator=g) + 0.5 * torch.randn(1, H, 1, D, generator=g)).to(dtype)
    valid = None
    if pad is not None:  # per row, that many padding tokens at the end (modeling.chunked moves padding last)
        valid = torch.arange(T)[None, :] < (T - torch.tensor(pad))[:, None]
        valid = valid.to(device)
    return query.to(device), valid


@pytest.mark.parametrize(
    "B,H,T,D,n_keep,dtype,pad",
    [
        (1, 2, 40, 16, 8, torch.float32, None),  # one step of queries
        (2, 4, 300, 24, 16, torch.float32, None),  # several steps, the last partial; D not a power of 2
        (2, 3, 100, 16, 16, torch.bfloat16, None),
        (3, 2, 130, 16, 16, torch.float32, (0, 30, 120)),  # padding: out of the mean, after every real query
        (1, 2, 10, 16, 16, torch.float32, None),  # fewer queries than n_keep
        (2, 2, 20, 8, 16, torch.float32, (0, 20)),  # a row of padding only
    ],
)
@pytest.mark.parametrize("row", ["registers", "memory"])
def test_kernel_matches_reference(interpret, monkeypatch, B, H, T, D, n_keep, dtype, pad, row):
    if row == "memory":  # the n passes over the row in memory, BLOCK_T at a time (chunks over REGISTER_ROW)
        monkeypatch.setattr(choice_module, "REGISTER_ROW", 0)
    query, valid = _case(B, H, T, D, dtype, seed=T + D, pad=pad)
    expected = choice_module.quoka_kept_queries_ref(query, n_keep, valid)
    actual = choice_module.quoka_kept_queries(query, n_keep, valid)
    assert actual.shape == expected.shape == (B, H, 1, min(n_keep, T), D) and actual.dtype == dtype
    if pad is not None:  # padding queries tie at +inf: their order is open, compare the real ones only
        for b in range(B):
            real = min(int(valid[b].sum()), n_keep)
            assert torch.equal(actual[b, :, :, :real], expected[b, :, :, :real])
            if real < actual.shape[3]:  # the rest are padding queries
                pads = query[b, :, int(valid[b].sum()) :]  # [H, n_pad, D]
                tail = actual[b, :, 0, real:]
                assert all(any(torch.equal(row, p) for p in pads[h]) for h in range(H) for row in tail[h])
    else:
        assert torch.equal(actual, expected)


def test_reference_keeps_the_queries_least_like_the_mean():
    """The reference's contract by hand: three queries along the mean, one against it, one across."""
    q = torch.tensor([[1.0, 0.0], [2.0, 0.1], [1.0, -0.1], [-1.0, 0.0], [0.0, 1.0]])[None, None]  # [1, 1, 5, 2]
    kept = choice_module.quoka_kept_queries_ref(q, 2)
    assert torch.equal(kept[0, 0, 0], q[0, 0, [3, 4]])


def test_bad_arguments_are_value_errors():
    query = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="query must be"):
        choice_module.quoka_kept_queries(query[0], 2)
    with pytest.raises(ValueError, match="n_keep"):
        choice_module.quoka_kept_queries(query, 0)
    with pytest.raises(ValueError, match="valid must be bool"):
        choice_module.quoka_kept_queries(query, 2, torch.ones(1, 7, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [512, 2048, 8192])
def test_kernel_matches_reference_gpu(T):
    query, valid = _case(4, 32, T, 64, torch.bfloat16, seed=2, pad=(0, 0, 100, T - 12), device="cuda")
    expected = choice_module.quoka_kept_queries_ref(query, 16, valid)
    actual = choice_module.quoka_kept_queries(query, 16, valid)
    for b in range(4):
        real = min(int(valid[b].sum()), 16)
        assert torch.equal(actual[b, :, :, :real], expected[b, :, :, :real])
