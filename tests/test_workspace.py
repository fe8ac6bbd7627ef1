"""DeviceWorkspace: the host pool (one grow-only buffer per key, so a call of another shape pins nothing new) and the
capacity buffers that only grow (a shorter request decodes on a longer one's, unchanged)."""

import pytest
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



class _Oversized(DeviceWorkspace):
    """Every capacity buffer (``grow``) comes 4x larger than asked along its capacity dimension, as a longer earlier
    request leaves it; everything else is new and exact."""

    def take(self, key, shape, dtype, device, *, pin=False, grow=None):
        shape = list(shape)
        if grow is not None:
            shape[grow] *= 4
        return torch.zeros(shape, dtype=dtype, device=device)


def _decode_with(workspace, kernels: bool, monkeypatch):
    from hf_nosa import NosaCache, to_nosa
    from hf_nosa.modeling import randomize_eviction_heads

    from .conftest import SPARSE, small_nosa_config, tiny_model

    if kernels:  # the device kernels on CPU tensors, in the Triton interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    model = to_nosa(tiny_model("llama", seed=6), small_nosa_config(**SPARSE, prefill_chunk_size=64))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(7))
    ids = torch.randint(3, 97, (2, 90), generator=torch.Generator().manual_seed(8))
    cache = NosaCache(model.config, max_cache_len=100)
    if workspace is not None:
        cache.attach_workspace(workspace)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=5,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits), cache


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_decoding_on_capacity_buffers_larger_than_asked_changes_nothing(kernels, monkeypatch, prompt_rotary_on_torch):
    """A request after a longer one decodes on the longer one's compressed keys and block table (larger than it
    needs): tokens and logits equal a cache whose buffers are exactly its own, on the torch path and the kernels."""
    tokens, logits, _ = _decode_with(None, kernels, monkeypatch)
    big_tokens, big_logits, cache = _decode_with(_Oversized(), kernels, monkeypatch)
    layer = cache.layers[0]
    assert layer.compressed.keys.shape[2] >= 4 * 256
    assert layer.compressed.bias.shape[2] == layer.compressed.keys.shape[2]
    assert torch.equal(big_tokens, tokens)
    torch.testing.assert_close(big_logits, logits, atol=1e-5, rtol=1e-5)
