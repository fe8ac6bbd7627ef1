"""read_span (one Triton launch reading the pinned host store through its block table) against the torch reference
``HostStore.read_torch``: bit for bit, on stores of several chunks, every host format, padded rows and spans that
start and end inside blocks."""

from __future__ import annotations

import pytest
import torch

from hf_nosa.cache.host_store import HostStore
from hf_nosa.kernels.prefill.host_read import read_span, read_span_ref


def make_store(B, Hk, D, P, T, dtype, host_dtype, offsets, pin, seed=0):
    """A store of ``T`` tokens in chunks of 3 blocks (several chunks), heavy-tailed keys, rows row-relative when
    ``offsets`` is given (a left-padded prompt): row b holds ``T - offsets[b]`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    host = HostStore(B, Hk, D, dtype, P, pin=pin, host_dtype=host_dtype)
    host.chunk_tokens = 3 * P
    k = (torch.randn(B, Hk, T, D, generator=gen) * torch.exp(torch.randn(B, Hk, T, 1, generator=gen))).to(dtype)
    v = torch.randn(B, Hk, T, D, generator=gen).to(dtype)
    b = torch.randn(B, Hk, T, generator=gen)
    if offsets is None:
        host.write(0, k, v, b)
    else:
        host.set_offsets(offsets)
        host.write_rows(-offsets, k, v, b)
    host.wait_writes()
    return host


def assert_rows_equal(host, start, end, got, want):
    """``got`` and ``want`` (k, v, b of the span) equal bit for bit on every row's written tokens (a padded row's end
    was never written)."""
    for name, g, w in zip("kvb", got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        for row, n in enumerate(host.row_lengths().tolist()):
            n = max(0, min(end, n) - start)
            torch.testing.assert_close(g[row, :, :n], w[row, :, :n], rtol=0, atol=0,
                                       msg=f"{name} span {start}..{end} row {row}")


# block size 16: empty, one token, one block, inside blocks, block-aligned, across chunks to the rows' tails (every
# block but the first: the whole store took as long as all the other spans together), a token, the rows' tails
SPANS = [(0, 0), (0, 1), (0, 16), (5, 30), (16, 80), (17, 333), (190, 191), (300, 333)]


@pytest.mark.parametrize("host_dtype", ["auto", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_read_span_matches_reference(interpret, host_dtype, dtype, padded):
    B, Hk, D, P, T = 2, 2, 16, 16, 333
    offsets = torch.tensor([0, 21]) if padded else None
    host = make_store(B, Hk, D, P, T, dtype, host_dtype, offsets, pin=False, seed=int(padded))
    assert len(host.k_chunks) > 3  # the spans cross chunks: blocks are found through the table
    for start, end in SPANS:
        got = read_span(host, start, end, "cpu")
        want = read_span_ref(host, start, end, "cpu")
        assert_rows_equal(host, start, end, got, want)


@pytest.mark.parametrize("blocks", [2, 3])
@pytest.mark.parametrize("host_dtype", ["auto", "int8"])
def test_read_span_with_several_blocks_a_program_matches_reference(interpret, monkeypatch, blocks, host_dtype):
    """``READ_BLOCKS`` blocks per program (the last program's extra blocks past the span read nothing)."""
    from hf_nosa.kernels.prefill import host_read

    monkeypatch.setattr(host_read, "READ_BLOCKS", blocks)
    B, Hk, D, P, T = 2, 2, 16, 16, 333
    offsets = torch.tensor([0, 21])
    host = make_store(B, Hk, D, P, T, torch.bfloat16, host_dtype, offsets, pin=False, seed=blocks)
    for start, end in SPANS:
        got = read_span(host, start, end, "cpu")
        want = read_span_ref(host, start, end, "cpu")
        assert_rows_equal(host, start, end, got, want)


def test_read_span_checks_the_span(interpret):
    host = make_store(1, 1, 16, 16, 40, torch.float32, "auto", None, pin=False)
    with pytest.raises(ValueError, match="start=30, end=20"):
        read_span(host, 30, 20, "cpu")
    with pytest.raises(ValueError, match="capacity"):
        read_span(host, 0, host.capacity + 1, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("host_dtype", ["auto", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("blocks", [1, 4])
def test_read_span_on_gpu_matches_reference(host_dtype, blocks, monkeypatch):
    from hf_nosa.kernels.prefill import host_read

    monkeypatch.setattr(host_read, "READ_BLOCKS", blocks)
    B, Hk, D, P, T = 3, 4, 64, 64, 64 * 11 + 7
    offsets = torch.tensor([0, 70, 3])
    host = make_store(B, Hk, D, P, T, torch.bfloat16, host_dtype, offsets, pin=True, seed=3)
    for start, end in [(0, T), (64, 640), (100, 333), (T - 80, T)]:
        got = read_span(host, start, end, "cuda")
        want = read_span_ref(host, start, end, "cuda")
        assert_rows_equal(host, start, end, got, want)


def test_tail_blocks_follow_the_row_lengths():
    """The tail block per row a quantized read needs on the device: right values, the same tensor while the lengths
    stay, a new one when they change."""
    host = make_store(3, 2, 8, 16, 70, torch.float32, "int8", torch.tensor([0, 5, 40]), pin=False)
    first = host.tail_blocks_on("cpu")
    assert first.tolist() == (host.row_lengths() // 16).tolist() == [4, 4, 1]
    assert host.tail_blocks_on("cpu") is first
    host.write_rows(torch.tensor([70, 65, 30]), *(torch.randn(3, 2, 10, 8),) * 2, torch.randn(3, 2, 10))
    host.length = 80
    moved = host.tail_blocks_on("cpu")
    assert moved is not first and moved.tolist() == (host.row_lengths() // 16).tolist() == [5, 4, 2]


@pytest.fixture
def memmove_driver(monkeypatch):
    """``cuMemcpy2DAsync`` done on the CPU, row by row with memmove, from what the struct says (so the pitches and
    offsets ``read_span_copy`` computes are what is tested); records each call."""
    import ctypes

    from hf_nosa.kernels.prefill import host_copy

    calls = []

    def copy(params_ref, stream):
        p = params_ref._obj
        assert p.srcMemoryType == host_copy.HOST and p.dstMemoryType == host_copy.HOST  # CPU memory both sides here
        assert p.srcPitch >= p.WidthInBytes and p.dstPitch >= p.WidthInBytes
        for row in range(p.Height):
            ctypes.memmove(p.dstHost + row * p.dstPitch, p.srcHost + row * p.srcPitch, p.WidthInBytes)
        calls.append((p.WidthInBytes, p.Height))
        return 0

    monkeypatch.setattr(host_copy, "driver_copy", lambda: copy)
    return calls


def test_read_span_copy_matches_reference_on_spans_across_chunks(memmove_driver):
    from hf_nosa.kernels.prefill.host_copy import read_span_copy

    B, Hk, D, P, T = 2, 3, 16, 16, 333
    host = make_store(B, Hk, D, P, T, torch.bfloat16, "auto", None, pin=False, seed=7)
    assert len(host.k_chunks) > 3
    for start, end in SPANS:
        got = read_span_copy(host, start, end, "cpu")
        want = read_span_ref(host, start, end, "cpu")
        assert_rows_equal(host, start, end, got, want)
    # three copies (K, V, b) per chunk a span touches, each of B x Hk rows
    memmove_driver.clear()
    read_span_copy(host, 17, 333, "cpu")
    chunks = len({i for i, *_ in host._spans(17, 333)})
    assert len(memmove_driver) == 3 * chunks and all(h == B * Hk for _, h in memmove_driver)


def test_read_span_copy_refuses_a_quantized_store():
    from hf_nosa.kernels.prefill.host_copy import read_span_copy

    host = make_store(1, 1, 16, 16, 40, torch.float32, "int8", None, pin=False)
    with pytest.raises(ValueError, match="host_dtype='int8' is quantized"):
        read_span_copy(host, 0, 40, "cpu")


def test_an_unknown_read_path_is_refused(monkeypatch):
    from hf_nosa.kernels.prefill import host_read

    host = make_store(1, 1, 16, 16, 40, torch.float32, "auto", None, pin=False)
    monkeypatch.setattr(host_read, "READ_PATH", "dma")
    monkeypatch.setattr(host_read, "kernel_path", lambda name, probe: "triton")
    with pytest.raises(ValueError, match="READ_PATH='dma' is invalid"):
        read_span(host, 0, 16, "cpu")


def test_the_default_reads_a_plain_store_by_the_copy_engine_and_a_quantized_one_by_the_kernel(monkeypatch, caplog):
    """``READ_PATH = "auto"`` (the default): on CUDA the copy engine for a store in the model's dtype, the kernel
    (which dequantizes) for a quantized one, without a warning; "copy" set by hand warns there; the CPU's
    interpreter always takes the kernel."""
    from hf_nosa.kernels.prefill import host_read

    plain = make_store(1, 1, 16, 16, 40, torch.float32, "auto", None, pin=False)
    quantized = make_store(1, 1, 16, 16, 40, torch.float32, "int8", None, pin=False)
    cuda = torch.device("cuda")
    assert host_read.READ_PATH == "auto"
    with caplog.at_level("WARNING", logger=host_read.logger.name):
        assert host_read.read_path(plain, cuda) == "copy"
        assert host_read.read_path(quantized, cuda) == "kernel"
        assert host_read.read_path(plain, "cpu") == "kernel"
    assert not caplog.records
    monkeypatch.setattr(host_read, "_LOGGED", set())
    for path, want in (("kernel", "kernel"), ("copy", "copy")):
        monkeypatch.setattr(host_read, "READ_PATH", path)
        assert host_read.read_path(plain, cuda) == want
    with caplog.at_level("WARNING", logger=host_read.logger.name):
        assert host_read.read_path(quantized, cuda) == "kernel"
    assert "quantized store" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["copy", "kernel", "auto"])
def test_read_span_by_either_path_on_gpu_matches_reference(path, monkeypatch):
    """The copy engine's 2D copies (and the kernel, for the same store) on a pinned store of several chunks, from the
    side stream the dense tail reads on."""
    from hf_nosa.kernels.prefill import host_read

    monkeypatch.setattr(host_read, "READ_PATH", path)
    B, Hk, D, P, T = 3, 4, 64, 64, 64 * 11 + 7
    host = make_store(B, Hk, D, P, T, torch.bfloat16, "auto", None, pin=True, seed=5)
    side = torch.cuda.Stream()
    for start, end in [(0, T), (64, 640), (100, 333), (T - 80, T)]:
        with torch.cuda.stream(side):
            got = read_span(host, start, end, "cuda")
        torch.cuda.current_stream().wait_stream(side)
        want = read_span_ref(host, start, end, "cuda")
        assert_rows_equal(host, start, end, got, want)
