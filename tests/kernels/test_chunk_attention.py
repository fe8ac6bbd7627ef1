"""The QUOKA chunk-attention kernel against its torch reference, and the reference against plain attention.

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` cases run
the compiled kernel at prefill-sized shapes.
"""

import importlib

import pytest
import torch

from hf_nosa.rules.attend import AttentionInputs, attend
from hf_nosa.rules.selection import MASK_VALUE

from ..utils import assert_close

# The package re-exports a function of the module's name: take the module itself.
chunk_module = importlib.import_module("hf_nosa.kernels.prefill.chunk_attention")


def _case(B, H, Hk, D, lengths, n_selected, dtype, device, seed, shift=0):
    """Chunks of ``lengths`` queries over one token sequence; each lists ``n_selected`` random earlier tokens
    (some -1, some padding) in random order, then its own tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, T + shift, D, generator=g).to(dtype)
    v = torch.randn(B, Hk, T + shift, D, generator=g).to(dtype)
    bias = torch.randn(B, Hk, T + shift, generator=g)
    R, S = len(lengths), n_selected + max(lengths)
    index = torch.full((B, Hk, R, S), -1, dtype=torch.int32)
    rows, row = [0], 0
    for r, n in enumerate(lengths):
        first = row + shift  # key row of the chunk's first query
        for b in range(B):
            for h in range(Hk):
                earlier = torch.randperm(first, generator=g)[: min(first, n_selected)]
                earlier[torch.rand(earlier.shape, generator=g) < 0.2] = -1
                index[b, h, r, : earlier.numel()] = earlier.int()
                index[b, h, r, n_selected : n_selected + n] = torch.arange(first, first + n, dtype=torch.int32)
        bias[:, :, : max(first - 1, 0)][torch.rand(B, Hk, max(first - 1, 0), generator=g) < 0.1] = MASK_VALUE
        row += n
        rows.append(row)
    to = lambda x: x.to(device)  # noqa: E731
    return to(q), to(k), to(v), to(bias), to(index), rows, [shift] * R


def _check(B, H, Hk, D, lengths, n_selected, dtype=torch.float32, device="cpu", seed=0, shift=0, rows_per_tile=32):
    q, k, v, bias, index, rows, shift = _case(B, H, Hk, D, lengths, n_selected, dtype, device, seed, shift)
    expected = torch.zeros_like(q, dtype=torch.float32)
    chunk_module.chunk_attention_ref(q.float(), k.float(), v.float(), bias, index, rows, shift, D**-0.5, expected)
    poisoned = torch.full_like(q, float("nan"))
    actual = chunk_module.chunk_attention(q, k, v, bias, index, rows, shift, D**-0.5, out=poisoned,
                                          rows_per_tile=rows_per_tile)
    assert actual is poisoned
    # Rows that see only padding hold garbage in any implementation (as in a dense prefill): skip them.
    live = _live_rows(index, bias, rows, shift).repeat_interleave(H // k.shape[1], 1)
    actual, expected = actual[live], expected[live]
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert_close(actual, expected, **tol)


def _live_rows(index, bias, rows, shift):
    """``[B, Hk, T]`` bool: the query rows that see at least one key that is not padding."""
    B, Hk, R, _ = index.shape
    live = torch.zeros(B, Hk, rows[-1], dtype=torch.bool, device=index.device)
    for r in range(R):
        idx = index[:, :, r].long()
        real = (idx >= 0) & (bias.gather(2, idx.clamp(min=0)) > MASK_VALUE / 2)  # [B, Hk, S]
        t = torch.arange(rows[r], rows[r + 1], device=index.device) + shift[r]
        live[:, :, rows[r] : rows[r + 1]] = (real[:, :, None] & (idx[:, :, None] <= t[:, None])).any(-1)
    return live


INTERPRETED_CASES = [
    # B, H, Hk, D, chunk lengths, selected rows
    dict(args=(1, 1, 1, 16, [5], 0)),
    dict(args=(2, 4, 2, 64, [16, 16, 7], 24)),
    dict(args=(1, 8, 2, 128, [9, 20], 40)),
    dict(args=(3, 3, 1, 16, [4, 17], 10)),  # a group of 3 padded to 4
    dict(args=(2, 8, 8, 64, [12], 30), kwargs=dict(shift=33)),  # the gathered form: queries after the keys
    dict(args=(1, 4, 1, 64, [21, 3], 16), kwargs=dict(dtype=torch.bfloat16)),
]


@pytest.mark.skipif(not chunk_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("case", INTERPRETED_CASES, ids=lambda case: "-".join(map(str, case["args"][:4])))
def test_kernel_matches_reference_interpreted(interpret, case):
    _check(*case["args"], **case.get("kwargs", {}))


def test_reference_with_every_earlier_token_is_causal_attention():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 30, 16, generator=g)
    k, v = torch.randn(2, 2, 30, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g)
    bias = torch.randn(2, 2, 30, generator=g)
    rows = [0, 8, 20, 30]
    index = torch.full((2, 2, 3, 30), -1, dtype=torch.int32)
    for r in range(3):  # chunk r lists tokens 0 .. its end, shuffled
        index[:, :, r, : rows[r + 1]] = torch.randperm(rows[r + 1], generator=g).int()
    out = chunk_module.chunk_attention(q, k, v, bias, index, rows, [0, 0, 0], 0.25)
    expected = attend(q, AttentionInputs(k, v, bias, None, 0, causal=True), 0.25)
    assert_close(out, expected, atol=1e-5)


def test_bad_inputs_are_errors():
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    index = torch.arange(6).expand(1, 2, 1, 6)
    with pytest.raises(ValueError, match="rows"):
        chunk_module.chunk_attention(q, k, k, torch.zeros(1, 2, 6), index, [0, 7], [0], 0.25)
    with pytest.raises(ValueError, match="index"):
        chunk_module.chunk_attention(q, k, k, torch.zeros(1, 2, 6), index, [0, 3, 6], [0], 0.25)
    with pytest.raises(ValueError, match="key_bias"):
        chunk_module.chunk_attention(q, k, k, torch.zeros(1, 2, 5), index, [0, 6], [0], 0.25)
    with pytest.raises(ValueError, match="H % Hk"):
        chunk_module.chunk_attention(q, torch.randn(1, 3, 6, 16), torch.randn(1, 3, 6, 16), torch.zeros(1, 3, 6),
                                     torch.arange(6).expand(1, 3, 1, 6), [0, 6], [0], 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_matches_reference_on_gpu(dtype, D):
    _check(2, 32, 8, D, [512, 512, 300], 1024, dtype=dtype, device="cuda", rows_per_tile=128)
    _check(3, 4, 4, D, [64, 1], 100, dtype=dtype, device="cuda", seed=1, rows_per_tile=128)
    _check(1, 16, 2, D, [77], 256, dtype=dtype, device="cuda", seed=2, shift=300, rows_per_tile=128)
