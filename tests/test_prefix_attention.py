"""Attention over a prefix read in pieces (``prefix_attention``) against the reference that reads it whole."""

import pytest
import torch

from hf_nosa.rules.attend import AttentionInputs, attend
from hf_nosa.kernels.backend import HAS_TRITON
from hf_nosa.attention.dispatch import attend_cache_inputs
from hf_nosa.attention.pool import PoolBlocks
from hf_nosa.attention.prefix import DenseTail, Prefix, attend_with_prefix, attention_with_lse
from hf_nosa.rules.selection import MASK_VALUE

from .utils import assert_close


def _tensors(B, H, Hk, Tq, S, D, dtype, seed, extreme=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    b = torch.randn(B, Hk, S, generator=g) * (30.0 if extreme else 1.0)
    if extreme:
        b = b.clamp(-80, 80)
        b[..., 3::11] = MASK_VALUE  # hidden keys (padding, unselected blocks)
    return q.to(device), k.to(device), v.to(device), b.to(device)


def _prefix(k, v, b, piece, reads=None):
    def read(lo, hi):
        if reads is not None:
            reads.append((lo, hi))
        return k[:, :, lo:hi], v[:, :, lo:hi], b[:, :, lo:hi]

    return Prefix(read, k.shape[2], piece)


KERNELS = ["sdpa", pytest.param("flash_biased", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton"))]


def _use(kernel, monkeypatch):
    """``flash_biased``: the Triton kernel (CUDA's path) in the interpreter; ``sdpa``: the CPU's route."""
    if kernel == "flash_biased":
        monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_lse_matches_the_logits(monkeypatch, causal, dtype, kernel):
    _use(kernel, monkeypatch)
    q, k, v, b = _tensors(2, 4, 2, 9, 9, 16, dtype, seed=1, extreme=True)
    out, lse = attention_with_lse(q, k, v, b, 0.25, causal=causal)
    ref = attend(q, AttentionInputs(k, v, b, None, 0, causal=causal), 0.25)
    logits = torch.einsum("bkgtd,bksd->bkgts", q.float().view(2, 2, 2, 9, 16), k.float()) * 0.25
    logits = logits + b[:, :, None, None, :]
    if causal:
        logits = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(out, ref, atol=tol, rtol=tol)
    assert_close(lse, logits.logsumexp(-1).view(2, 4, 9), atol=1e-4 * 30, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("piece", [7, 16, 100])
@pytest.mark.parametrize("kernel", KERNELS)
def test_pieces_merge_to_one_softmax(monkeypatch, dtype, piece, kernel):
    """A chunk of 12 queries over a 45-token prefix (pieces of 7, 16, or all of it) and itself."""
    _use(kernel, monkeypatch)
    q, k, v, b = _tensors(2, 8, 2, 12, 57, 16, dtype, seed=piece, extreme=True)
    reads = []
    prefix = _prefix(k[:, :, :45], v[:, :, :45], b[:, :, :45], piece, reads)
    out = attend_with_prefix(q, k[:, :, 45:], v[:, :, 45:], b[:, :, 45:], prefix, 0.3)
    ref = attend(q, AttentionInputs(k, v, b, None, 45, causal=True), 0.3)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert_close(out, ref, atol=tol, rtol=tol)
    assert max(hi - lo for lo, hi in reads) == min(piece, 45) and reads[-1][1] == 45


def test_cache_inputs_with_a_prefix_route_to_the_pieces():
    q, k, v, b = _tensors(1, 4, 1, 10, 40, 16, torch.float32, seed=3)
    inputs = AttentionInputs(k[:, :, 30:], v[:, :, 30:], b[:, :, 30:], None, 0, True,
                             _prefix(k[:, :, :30], v[:, :, :30], b[:, :, :30], 8))
    expected = attend(q, AttentionInputs(k, v, b, None, 30, causal=True), 0.25)
    assert_close(attend_cache_inputs(q, inputs, 0.25), expected, atol=1e-5, rtol=1e-5)
    assert_close(attend(q, inputs, 0.25), expected, atol=1e-6, rtol=1e-6)  # the reference reads it whole
    with pytest.raises(ValueError, match="prefix goes with a causal chunk"):
        attend_cache_inputs(q, inputs._replace(causal=False), 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", KERNELS)
def test_queries_after_the_first_see_the_chunks_earlier_keys(monkeypatch, dtype, kernel):
    """Queries 5 .. 11 of a 12-token chunk over a 30-token prefix: the chunk's keys 0 .. 4 are one more piece."""
    _use(kernel, monkeypatch)
    q, k, v, b = _tensors(2, 4, 2, 12, 42, 16, dtype, seed=9, extreme=True)
    prefix = _prefix(k[:, :, :30], v[:, :, :30], b[:, :, :30], 16)
    out = attend_with_prefix(q[:, :, 5:], k[:, :, 30:], v[:, :, 30:], b[:, :, 30:], prefix, 0.3, first_query=5)
    ref = attend(q, AttentionInputs(k, v, b, None, 30, causal=True), 0.3)[:, :, 5:]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert_close(out, ref, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="keys for queries"):
        attend_with_prefix(q[:, :, 4:], k[:, :, 30:], v[:, :, 30:], b[:, :, 30:], prefix, 0.3, first_query=5)


def _tail_reference(q, own, blocks, prefix, first, scale):
    """Row by row and query by query: a query before its row's first tail query sees the blocks and the chunk up to
    itself; one from it on sees the whole prefix and the chunk up to itself."""
    (k, v, b), (bk, bv, bb), (pk, pv, pb) = own, blocks, prefix
    B, H, Tq, D = q.shape
    out = torch.empty(B, H, Tq, D)
    for row in range(B):
        for i in range(Tq):
            before = (pk, pv, pb) if i >= first[row] else (bk, bv, bb)
            keys, values, bias = (torch.cat([x[row : row + 1], y[row : row + 1, :, : i + 1]], 2)
                                  for x, y in zip(before, (k, v, b)))
            out[row, :, i] = attend(q[row : row + 1, :, i : i + 1], AttentionInputs(keys, values, bias, None, 0, False),
                                    scale)[0, :, 0].float()
    return out


@pytest.mark.parametrize("with_blocks", [True, False], ids=["pool", "no-blocks"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_dense_tail_replaces_only_its_rows_queries(monkeypatch, kernel, with_blocks):
    """Three rows whose tails start at query 2, 9 and nowhere (12 >= the chunk) of a 12-query chunk that otherwise
    attends to 20 pool tokens (or only to itself): the tail's queries see the 37-token prefix, the others not."""
    _use(kernel, monkeypatch)
    q, k, v, b = _tensors(3, 4, 2, 12, 12 + 20 + 37, 16, torch.float32, seed=11, extreme=True)
    own = k[:, :, :12], v[:, :, :12], b[:, :, :12]
    pool = k[:, :, 12:32], v[:, :, 12:32], b[:, :, 12:32]
    prompt = k[:, :, 32:], v[:, :, 32:], b[:, :, 32:]
    if not with_blocks:
        pool = tuple(x[:, :, :0] for x in pool)
    first = torch.tensor([2, 9, 12])
    tail = DenseTail(_prefix(*prompt, piece=16), first)
    blocks = PoolBlocks(lambda b0, b1: tuple(x[b0:b1] for x in pool), parts=2) if with_blocks else None
    inputs = AttentionInputs(*own, None, 0, True, blocks=blocks, tail=tail)
    expected = _tail_reference(q, own, pool, prompt, first.tolist(), 0.3)
    assert_close(attend_cache_inputs(q, inputs, 0.3), expected, atol=1e-5, rtol=1e-5)
    assert_close(attend(q, inputs, 0.3), expected, atol=1e-5, rtol=1e-5)  # the reference reads everything whole
    none = DenseTail(tail.prefix, torch.tensor([12, 12, 12]))  # no tail query in this chunk: the chunk's own rule
    assert_close(attend_cache_inputs(q, inputs._replace(tail=none), 0.3),
                 attend(q, inputs._replace(tail=None), 0.3), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="dense tail goes with a causal chunk"):
        attend_cache_inputs(q, inputs._replace(causal=False), 0.3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_on_gpu(dtype):
    q, k, v, b = _tensors(3, 32, 8, 512, 512 + 5000, 64, dtype, seed=4, extreme=True, device="cuda")
    prefix = _prefix(k[:, :, :5000], v[:, :, :5000], b[:, :, :5000], 2048)
    out = attend_with_prefix(q, k[:, :, 5000:], v[:, :, 5000:], b[:, :, 5000:], prefix, 0.125)
    ref = attend(q.float(), AttentionInputs(k.float(), v.float(), b, None, 5000, causal=True), 0.125)
    assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pieces_on_gpu_are_read_ahead_on_a_side_stream():
    """Each piece after the first is read on another stream while the previous one is attended to; the pieces are
    fresh tensors made on that stream (as the host store's reads are), and the result equals the reference."""
    q, k, v, b = _tensors(2, 16, 4, 256, 256 + 9000, 64, torch.bfloat16, seed=5, extreme=True, device="cuda")
    streams = []

    def read(lo, hi):
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(2_000_000)  # a slow read: a missing wait would let the attention see unwritten memory
        return k[:, :, lo:hi] * 1, v[:, :, lo:hi] * 1, b[:, :, lo:hi] + 0.0

    out = attend_with_prefix(q, k[:, :, 9000:], v[:, :, 9000:], b[:, :, 9000:], Prefix(read, 9000, 2048), 0.125)
    ref = attend(q.float(), AttentionInputs(k.float(), v.float(), b, None, 9000, causal=True), 0.125)
    assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert len(streams) == 5 and all(s != torch.cuda.current_stream() for s in streams)
