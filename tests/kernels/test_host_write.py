"""host_write (one Triton launch writing tokens into the pinned host store through its block table) against
HostStore.write, the torch copy."""

import pytest
import torch

from hf_nosa.host_store import HostStore
from hf_nosa.kernels.host_write import host_write


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")


def _stores(B, Hk, D, P, dtype, device, chunk_blocks):
    stores = []
    for _ in range(2):
        host = HostStore(B, Hk, D, dtype, P, pin=device.type == "cuda")
        host.chunk_tokens = chunk_blocks * P  # several chunks: tokens are placed through the block table
        stores.append(host)
    return stores


def _check(B, Hk, D, P, dtype, device, pieces, chunk_blocks=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ref, ker = _stores(B, Hk, D, P, dtype, device, chunk_blocks)
    start = 0
    for n in pieces:
        k = torch.randn(B, n, Hk, D, generator=gen).to(dtype).to(device).transpose(1, 2)  # the model's layout
        v = torch.randn(B, Hk, n, D, generator=gen).to(dtype).to(device)
        b = torch.randn(B, Hk, n, generator=gen).to(device)
        ref.write(start, k, v, b)
        host_write(ker, start, k, v, b)
        start += n
    assert ker.length == ref.length == start
    for which in range(3):
        torch.testing.assert_close(ker.read(0, start, "cpu")[which], ref.read(0, start, "cpu")[which], rtol=0, atol=0)


@pytest.mark.parametrize("B,Hk,D,P,dtype,pieces", [
    (2, 3, 16, 16, torch.float32, (37, 50, 1, 20)),  # unaligned starts, runs across blocks and chunks
    (1, 2, 64, 32, torch.bfloat16, (64, 31, 33)),
    (3, 1, 24, 16, torch.float16, (5, 5, 40)),  # a head dim that is not a power of two
])
def test_matches_the_torch_copy_interpreted(interpret, B, Hk, D, P, dtype, pieces):
    _check(B, Hk, D, P, dtype, torch.device("cpu"), pieces)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_row_offsets_store_each_row_from_its_first_real_token(interpret, monkeypatch, path):
    """With ``offsets`` (rows of a left-padded batch) row b's token ``start + i`` lands at ``start + i - offsets[b]``
    and tokens before the row's first real one are dropped, on both paths."""
    monkeypatch.setenv("HF_NOSA_KERNELS", path)
    gen = torch.Generator().manual_seed(1)
    B, Hk, D, P = 3, 2, 16, 16
    offsets = torch.tensor([0, 13, 40])
    (host,) = _stores(B, Hk, D, P, torch.float32, torch.device("cpu"), 2)[:1]
    expected = [torch.zeros(Hk, 200, D) for _ in range(B)]
    start = 0
    for n in (30, 27, 1, 50):  # the first pieces are partly padding for rows 1 and 2
        k = torch.randn(B, Hk, n, D, generator=gen)
        host_write(host, start, k, k + 1, torch.randn(B, Hk, n, generator=gen), offsets=offsets)
        for row, off in enumerate(offsets.tolist()):
            for i in range(n):
                if start + i >= off:
                    expected[row][:, start + i - off] = k[row, :, i]
        start += n
    keys, values, _ = host.read(0, start, "cpu")
    for row, off in enumerate(offsets.tolist()):
        torch.testing.assert_close(keys[row, :, : start - off], expected[row][:, : start - off], rtol=0, atol=0)
        torch.testing.assert_close(values[row, :, : start - off], expected[row][:, : start - off] + 1, rtol=0, atol=0)


def test_bad_input(interpret):
    host = HostStore(1, 2, 16, torch.float32, 16, pin=False)
    k = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="k, v must be"):
        host_write(host, 0, k.half(), k, torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match="b must be float32"):
        host_write(host, 0, k, k, torch.randn(1, 2, 4).double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_the_torch_copy_gpu(monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check(4, 8, 64, 64, torch.bfloat16, torch.device("cuda"), (512, 512, 300, 1, 700), chunk_blocks=8)
