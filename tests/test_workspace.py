"""DeviceWorkspace's host pool: one grow-only buffer per key, so a call of another shape pins nothing new."""

import torch

from hf_nosa.cache.workspace import HOST_GROWTH, DeviceWorkspace


def test_a_smaller_or_other_shaped_host_buffer_reuses_the_same_memory():
    ws = DeviceWorkspace()
    first = ws.take(("layer0", "host_k_0"), (1, 8, 4096, 64), torch.bfloat16, "cpu")
    first.normal_()
    for shape, dtype in (((1, 8, 1024, 64), torch.bfloat16), ((2, 8, 2048, 64), torch.bfloat16),
                         ((1, 8, 4096), torch.float32)):
        again = ws.take(("layer0", "host_k_0"), shape, dtype, "cpu")
        assert again.data_ptr() == first.data_ptr() and tuple(again.shape) == shape and again.dtype == dtype
        assert again.is_contiguous()
    assert ws.host_bytes() == first.numel() * 2


def test_a_larger_host_buffer_grows_the_pool_geometrically_and_keys_stay_apart():
    ws = DeviceWorkspace()
    small = ws.take(("l", "k"), (1, 2, 100, 4), torch.float32, "cpu")
    other = ws.take(("l", "v"), (1, 2, 100, 4), torch.float32, "cpu")
    assert other.data_ptr() != small.data_ptr()
    grown = ws.take(("l", "k"), (1, 2, 120, 4), torch.float32, "cpu")
    assert ws.host[("l", "k")].numel() == int(small.numel() * 4 * HOST_GROWTH)  # room for the next growth too
    again = ws.take(("l", "k"), (1, 2, 200, 4), torch.float32, "cpu")
    assert again.data_ptr() == grown.data_ptr()
    huge = ws.take(("l", "k"), (1, 2, 1000, 4), torch.float32, "cpu")
    assert ws.host[("l", "k")].numel() == huge.numel() * 4  # more than the growth asks: exactly what is asked
    ws.release_host()
    assert ws.host_bytes() == 0


def test_a_capacity_buffer_is_reused_by_any_shorter_request_and_replaced_by_a_longer_one():
    """``grow``: after the longest request, a shorter one gets the same buffer whole (so a decode graph captured on
    it replays); a longer one gets a new buffer; the other dimensions and the dtype must still match."""
    ws = DeviceWorkspace()
    key = (0, "compressed_keys")
    big = ws.take(key, (1, 8, 4096, 64), torch.bfloat16, "meta", grow=2)
    for windows in (256, 1024, 4096):
        again = ws.take(key, (1, 8, windows, 64), torch.bfloat16, "meta", grow=2)
        assert again is big and tuple(again.shape) == (1, 8, 4096, 64)
    assert ws.take(key, (2, 8, 1024, 64), torch.bfloat16, "meta", grow=2).shape == (2, 8, 1024, 64)  # another batch
    longer = ws.take(key, (2, 8, 8192, 64), torch.bfloat16, "meta", grow=2)
    assert tuple(longer.shape) == (2, 8, 8192, 64)
    assert ws.take(key, (2, 8, 1024, 64), torch.float32, "meta", grow=2).dtype == torch.float32
    exact = ws.take((0, "slot_k"), (1, 8, 65, 64, 64), torch.bfloat16, "meta")
    assert ws.take((0, "slot_k"), (1, 8, 33, 64, 64), torch.bfloat16, "meta").shape[2] == 33  # no grow: exact
    assert exact.shape[2] == 65

