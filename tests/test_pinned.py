"""cache/pinned.py: the host stores' page-locked buffers, registered once and reused after they are freed.

On the CPU the registration is recorded instead of made (there is no device); the GPU test at the end registers for
real and reads a store built on such buffers with the fetch kernels' UVA path.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_nosa.cache import pinned
from hf_nosa.cache.host_store import HostStore

MIB = 1 << 20


@pytest.fixture
def fake_cuda(monkeypatch):
    """Registration recorded, not made; the pool emptied before and after."""
    calls = {"register": [], "unregister": [], "sync": 0}

    def register(array):
        torch.from_numpy(array).zero_()
        calls["register"].append((array.ctypes.data, array.nbytes))

    def sync():
        calls["sync"] += 1

    monkeypatch.setattr(pinned, "_register", register)
    monkeypatch.setattr(pinned, "_unregister", lambda array: calls["unregister"].append(array.ctypes.data))
    monkeypatch.setattr(pinned, "_torch_pinned", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned.torch.cuda, "synchronize", sync)
    pinned._FREE.clear()
    pinned._STATS.update(registered_bytes=0, registrations=0, reused=0)
    yield calls
    pinned._FREE.clear()


def test_a_buffer_is_registered_once_page_aligned_and_returns_to_the_pool_when_its_last_view_dies(fake_cuda):
    t = pinned.pinned_empty((3, 4, 2 * MIB), torch.bfloat16)  # 48 MiB
    assert t.shape == (3, 4, 2 * MIB) and t.dtype == torch.bfloat16
    assert t.data_ptr() % pinned.PAGE == 0 and len(fake_cuda["register"]) == 1
    t.normal_()
    part = t[1:2]  # a view keeps the buffer held
    expected = part.clone()
    del t
    gc.collect()
    assert pinned.pinned_stats()["free_bytes"] == 0
    torch.testing.assert_close(part, expected)
    del part
    gc.collect()
    assert pinned.pinned_stats()["free_bytes"] == 48 * MIB


def test_a_freed_buffer_is_reused_best_fit_after_a_device_wait_and_a_much_smaller_one_is_not(fake_cuda):
    big, small = pinned.pinned_empty((40 * MIB,), torch.uint8), pinned.pinned_empty((20 * MIB,), torch.uint8)
    big_ptr, small_ptr = big.data_ptr(), small.data_ptr()
    del big, small
    gc.collect()
    assert len(fake_cuda["register"]) == 2 and fake_cuda["sync"] == 0
    again = pinned.pinned_empty((18 * MIB,), torch.uint8)  # both fit: the smaller is taken
    assert again.data_ptr() == small_ptr and len(fake_cuda["register"]) == 2 and fake_cuda["sync"] == 1
    tiny = pinned.pinned_empty((9 * MIB,), torch.uint8)  # the 40 MiB one is more than twice this: pinned anew
    assert tiny.data_ptr() != big_ptr and len(fake_cuda["register"]) == 3
    assert pinned.pinned_stats()["reused"] == 1


def test_release_unregisters_only_the_free_buffers(fake_cuda):
    held = pinned.pinned_empty((16 * MIB,), torch.uint8)
    freed = pinned.pinned_empty((24 * MIB,), torch.uint8)
    freed_ptr = freed.data_ptr()
    del freed
    gc.collect()
    before = pinned.pinned_stats()["registered_bytes"]
    assert pinned.release_pinned_memory() == 24 * MIB
    assert fake_cuda["unregister"] == [freed_ptr]
    assert pinned.pinned_stats()["registered_bytes"] == before - 24 * MIB
    assert pinned.pinned_stats()["free_bytes"] == 0 and held.numel() == 16 * MIB


def test_a_pinned_host_store_keeps_what_it_is_given_on_registered_buffers(fake_cuda):
    # 64 tokens of 2 x 2 x 32768-dim rows: each chunk over MIN_BYTES, so drawn from the pool
    store = HostStore(2, 2, 32768, torch.float32, 16, pin=True)
    k, v = torch.randn(2, 2, 64, 32768), torch.randn(2, 2, 64, 32768)
    b = torch.randn(2, 2, 64)
    store.ensure_capacity(64)
    store.write(0, k, v, b)
    store.length = 64
    assert len(fake_cuda["register"]) >= 2  # K and V chunks
    hk, hv, hb = store.read(0, 64, "cpu")
    torch.testing.assert_close(hk, k)
    torch.testing.assert_close(hv, v)
    torch.testing.assert_close(hb, b)


def test_a_store_grows_to_a_reservation_exactly_and_by_a_share_past_it():
    store = HostStore(1, 1, 8, torch.float32, 16, pin=False)
    store.reserve(1000)
    store.ensure_capacity(10)
    assert store.capacity == 1008  # whole blocks of the reservation, no share more
    store.reserve(1100)  # a new turn says how far it goes
    store.ensure_capacity(1009)
    assert store.capacity == 1104
    store.ensure_capacity(1105)  # decoding past it: a share of what is held
    assert store.capacity == 1104 + 112


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_registered_buffers_are_pinned_and_read_by_the_kernels():
    from hf_nosa.kernels.prefill.host_read import read_span, read_span_ref

    pinned.release_pinned_memory()
    t = pinned.pinned_empty((12 * MIB,), torch.uint8)
    assert t.is_pinned()
    t.random_(0, 255)
    torch.testing.assert_close(t.to("cuda", non_blocking=True).cpu(), t)
    registrations = pinned.pinned_stats()["registrations"]
    del t
    gc.collect()
    again = pinned.pinned_empty((10 * MIB,), torch.uint8)
    assert pinned.pinned_stats()["registrations"] == registrations and again.is_pinned()
    del again
    # a store of registered chunks (each over MIN_BYTES) read through UVA equals its torch reference
    store = HostStore(2, 4, 64, torch.bfloat16, 64, pin=True)
    T = 20000
    k, v = torch.randn(2, 4, T, 64, dtype=torch.bfloat16), torch.randn(2, 4, T, 64, dtype=torch.bfloat16)
    b = torch.randn(2, 4, T)
    store.ensure_capacity(T)
    store.write(0, k, v, b)
    store.length = T
    assert all(chunk.is_pinned() for chunk in store.k_chunks)
    got = read_span(store, 1000, T - 7, torch.device("cuda"))
    want = read_span_ref(store, 1000, T - 7, torch.device("cuda"))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)
    del store
    gc.collect()
    assert pinned.release_pinned_memory() > 0
