"""host_write (one Triton launch writing tokens into the pinned host store through its block table) against
HostStore.write, the torch copy."""

import pytest
import torch
import triton
import triton.language as tl

from hf_nosa.cache.host_quant import HOST_FORMATS, dequantize_blocks, quantize_blocks
from hf_nosa.cache.host_store import HostStore
from hf_nosa.kernels.backend import launcher
from hf_nosa.kernels.host_format import cast_rtne, dequantize, quantize_block
from hf_nosa.kernels.prefill.host_write import WRITE_PROGRAMS_ENV_VAR, host_write, write_programs


# The checks read stores with ``read_torch`` (the reference of ``kernels.host_read``, tested against it in
# test_host_read): the interpreted read kernel would cost more than the writes under test.


def _stores(B, Hk, D, P, dtype, device, chunk_blocks, host_dtype="auto"):
    stores = []
    for _ in range(2):
        host = HostStore(B, Hk, D, dtype, P, pin=device.type == "cuda", host_dtype=host_dtype)
        host.chunk_tokens = chunk_blocks * P  # several chunks: tokens are placed through the block table
        stores.append(host)
    return stores


def assert_same_store(ker: HostStore, ref: HostStore) -> None:
    """Bit for bit: every chunk (K, V bytes, scores, scales) up to the stored length, and every row's tail where it
    holds tokens."""
    P = ref.block_size
    quantized = ref.format is not None
    for row, length in enumerate(ref.row_lengths().tolist()):
        for name in ("k_chunks", "v_chunks", "b_chunks", "ks_chunks", "vs_chunks"):
            # a quantized store's chunks hold complete blocks of K, V (and their scales) only
            held = length // P * P if quantized and name != "b_chunks" else length
            for i, (a, b) in enumerate(zip(getattr(ker, name), getattr(ref, name))):
                if a.element_size() == 1:
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                n = max(0, held - ref.starts[i]) // (P if name in ("ks_chunks", "vs_chunks") else 1)
                torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=0, atol=0, msg=f"{name}[{i}] row {row}")
    if quantized:
        n_tail = ref.row_lengths() % P
        for row, n in enumerate(n_tail.tolist()):
            torch.testing.assert_close(ker.tail_k[row, :, :n], ref.tail_k[row, :, :n], rtol=0, atol=0)
            torch.testing.assert_close(ker.tail_v[row, :, :n], ref.tail_v[row, :, :n], rtol=0, atol=0)


def _check(B, Hk, D, P, dtype, device, pieces, chunk_blocks=2, seed=0, host_dtype="auto"):
    gen = torch.Generator().manual_seed(seed)
    ref, ker = _stores(B, Hk, D, P, dtype, device, chunk_blocks, host_dtype)
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
        torch.testing.assert_close(ker.read_torch(0, start, "cpu")[which], ref.read_torch(0, start, "cpu")[which], rtol=0, atol=0)
    assert_same_store(ker, ref)


@pytest.mark.parametrize("B,Hk,D,P,dtype,pieces", [
    (2, 3, 16, 16, torch.float32, (37, 50, 1, 20)),  # unaligned starts, runs across blocks and chunks
    (1, 2, 64, 32, torch.bfloat16, (64, 31, 33)),
    (3, 1, 24, 16, torch.float16, (5, 5, 40)),  # a head dim that is not a power of two
])
def test_matches_the_torch_copy_interpreted(interpret, B, Hk, D, P, dtype, pieces):
    _check(B, Hk, D, P, dtype, torch.device("cpu"), pieces)


@pytest.mark.parametrize("host_dtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("B,Hk,D,P,dtype,pieces", [
    (2, 3, 16, 16, torch.float32, (37, 50, 1, 20)),  # complete blocks from the tail and the update, then a tail
    (1, 2, 24, 16, torch.bfloat16, (16, 5, 11, 40)),  # block-aligned updates; a head dim that is not a power of 2
    (2, 1, 32, 32, torch.float16, (3, 1, 70)),
])
def test_quantized_store_matches_the_torch_reference_interpreted(interpret, host_dtype, B, Hk, D, P, dtype, pieces):
    """A quantized store written by the kernel equals the torch reference bit for bit: the bytes and scales of
    every complete block, the scores, and each row's tail."""
    _check(B, Hk, D, P, dtype, torch.device("cpu"), pieces, host_dtype=host_dtype)


@pytest.mark.parametrize("host_dtype", ["auto", "float8_e4m3fn"])
def test_row_offsets_quantized_interpreted(interpret, monkeypatch, host_dtype):
    """Rows of a left-padded batch, each stored from its first real token: kernel and torch reference agree bit for
    bit, rows ending in different blocks (their tails at different positions)."""
    gen = torch.Generator().manual_seed(2)
    B, Hk, D, P = 3, 2, 16, 16
    offsets = torch.tensor([0, 13, 40])
    ref, ker = _stores(B, Hk, D, P, torch.float32, torch.device("cpu"), 2, host_dtype)
    for store in (ref, ker):
        store.set_offsets(offsets)  # where each row's stored tokens end (its tail)
    start = 0
    for n in (30, 27, 1, 50, 17):
        k, v = torch.randn(B, Hk, n, D, generator=gen), torch.randn(B, Hk, n, D, generator=gen)
        b = torch.randn(B, Hk, n, generator=gen)
        monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
        host_write(ref, start, k, v, b, offsets=offsets)
        monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
        host_write(ker, start, k, v, b, offsets=offsets)
        start += n
    assert_same_store(ker, ref)
    for which in range(3):
        for row, length in enumerate(ref.row_lengths().tolist()):  # past a row's length the store holds anything
            torch.testing.assert_close(ker.read_torch(0, start, "cpu")[which][row, :, :length],
                                       ref.read_torch(0, start, "cpu")[which][row, :, :length], rtol=0, atol=0)


def test_limits_keep_the_last_real_block_of_a_row_exact_interpreted(interpret, monkeypatch):
    """A padded prompt arrives with each row's padding after its real tokens (``set_limits``): in the kernel as in the
    reference, the block holding a row's last real token stays in its tail, exact, though the padding completes it;
    every block is stored (a chunk of padding may fetch it)."""
    gen = torch.Generator().manual_seed(3)
    B, Hk, D, P = 3, 2, 16, 16
    limits = torch.tensor([70, 57, 30])
    ref, ker = _stores(B, Hk, D, P, torch.float32, torch.device("cpu"), 2, "int8")
    keys = []
    for store in (ref, ker):
        store.set_limits(limits)
    start = 0
    for n in (32, 32, 6):
        k, v = torch.randn(B, Hk, n, D, generator=gen), torch.randn(B, Hk, n, D, generator=gen)
        b = torch.randn(B, Hk, n, generator=gen)
        monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
        host_write(ref, start, k, v, b)
        monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
        host_write(ker, start, k, v, b)
        keys.append(k)
        start += n
    assert ker.row_lengths().tolist() == limits.tolist()
    assert_same_store(ker, ref)
    # the padding's complete blocks too (blocks 0-3 of 70 tokens): finite values for whoever fetches them
    rows, heads, blocks = (x.flatten() for x in torch.meshgrid(torch.arange(B), torch.arange(Hk), torch.arange(4),
                                                                indexing="ij"))
    held = ker.gather_blocks(rows, heads, blocks)[0]
    assert torch.equal(held, ref.gather_blocks(rows, heads, blocks)[0]) and bool(held.isfinite().all())
    keys = torch.cat(keys, 2)
    for row, n in enumerate(limits.tolist()):
        full = n // P * P
        assert torch.equal(ker.tail_k[row, :, : n - full], keys[row, :, full:n])  # the row's last block, exact
        torch.testing.assert_close(ker.read_torch(0, n, "cpu")[0][row], ref.read_torch(0, n, "cpu")[0][row], rtol=0, atol=0)


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
    keys, values, _ = host.read_torch(0, start, "cpu")
    for row, off in enumerate(offsets.tolist()):
        torch.testing.assert_close(keys[row, :, : start - off], expected[row][:, : start - off], rtol=0, atol=0)
        torch.testing.assert_close(values[row, :, : start - off], expected[row][:, : start - off] + 1, rtol=0, atol=0)


@triton.jit
def _round_trip_kernel(x_ptr, q_ptr, s_ptr, y_ptr, P: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr,
                       QMAX: tl.constexpr):
    o = tl.program_id(0) * P * D + tl.arange(0, P)[:, None] * D + tl.arange(0, D)[None, :]
    bits, scale = quantize_block(tl.load(x_ptr + o).to(tl.float32), FP8, QMAX)
    tl.store(q_ptr + o, bits)
    tl.store(s_ptr + tl.program_id(0), scale)
    tl.store(y_ptr + o, cast_rtne(dequantize(bits, scale, FP8), y_ptr.dtype.element_ty))


@pytest.mark.parametrize("name", sorted(HOST_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_rounding_equals_torch_interpreted(interpret, name, dtype):
    """The kernels' quantize / dequantize helpers give torch's bits: on heavy-tailed blocks, on exact ties of the
    format (a block whose amax is qmax has scale 1, so its values are rounded as they are), on every fp8 value and
    on fp8 subnormals; and the dequantized value rounds to bf16/fp16 as torch does."""
    fmt = HOST_FORMATS[name]
    gen = torch.Generator().manual_seed(1)
    P, D = 16, 32
    x = torch.randn(4, P, D, generator=gen) * torch.exp(3 * torch.randn(4, P, 1, generator=gen))
    x[1] *= 1e-3
    x[2] = 0.0
    if fmt.integer:
        ties = torch.arange(-127, 127).float() + 0.5
    else:
        values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        values = values[values.isfinite()].unique()
        ties = torch.cat([values, (values[1:] + values[:-1]) / 2, values * 0.9999])  # subnormals 2^-9 .. included
    ties = torch.cat([ties, torch.full((-ties.numel() % (P * D),), fmt.qmax)]).view(-1, P, D)
    x = torch.cat([x, ties]).to(dtype)
    n = x.shape[0]
    q, s, y = torch.empty(n, P, D, dtype=torch.uint8), torch.empty(n), torch.empty(n, P, D, dtype=dtype)
    launcher(_round_trip_kernel)[(n,)](x, q, s, y, P=P, D=D, FP8=not fmt.integer, QMAX=fmt.qmax)
    ref_q, ref_s = quantize_blocks(x, name)
    assert torch.equal(q, ref_q.view(torch.uint8))
    assert torch.equal(s, ref_s)
    assert torch.equal(y, dequantize_blocks(ref_q, ref_s, dtype))


@pytest.mark.parametrize("programs", ["1", "8"])
def test_fewer_programs_than_tiles_each_loop_over_tiles_interpreted(interpret, monkeypatch, programs):
    # 2 x 2 rows: 1 program per row writes all 5 tiles of the 130-token piece; 8: 2 per row, every other tile each
    monkeypatch.setenv(WRITE_PROGRAMS_ENV_VAR, programs)
    assert write_programs() == int(programs)
    _check(2, 2, 16, 16, torch.float32, torch.device("cpu"), (130, 1, 70), seed=3)


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_write_programs_must_be_a_positive_integer(monkeypatch, value):
    monkeypatch.setenv(WRITE_PROGRAMS_ENV_VAR, value)
    with pytest.raises(ValueError, match=WRITE_PROGRAMS_ENV_VAR):
        write_programs()


def test_bad_input(interpret):
    host = HostStore(1, 2, 16, torch.float32, 16, pin=False)
    k = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="k, v must be"):
        host_write(host, 0, k.half(), k, torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match="b must be float32"):
        host_write(host, 0, k, k, torch.randn(1, 2, 4).double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("host_dtype", ["auto", "float8_e4m3fn", "int8"])
def test_matches_the_torch_copy_gpu(monkeypatch, host_dtype):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check(4, 8, 64, 64, torch.bfloat16, torch.device("cuda"), (512, 512, 300, 1, 700), chunk_blocks=8,
           host_dtype=host_dtype)
