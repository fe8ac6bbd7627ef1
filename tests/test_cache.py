"""NosaCache on its own: device budget, locality, host store, and the cache protocol generate relies on."""

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.cache.host_store import HostStore
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model


def _decode(model, cache, prompt, steps):
    """Greedy decoding by hand, one token per forward, so every step goes through the decode path."""
    ids = prompt
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[:, -1:]
        for _ in range(steps):
            nxt = logits.argmax(-1)
            ids = torch.cat([ids, nxt], 1)
            logits = model(nxt, past_key_values=cache).logits
    return ids, logits


@pytest.fixture
def sparse_model():
    model = to_nosa(tiny_model("llama", seed=1), small_nosa_config(budget_tokens=128, query_tokens=32))
    return randomize_eviction_heads(model, generator=torch.Generator().manual_seed(5))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_device_budget_and_host_store_with_a_long_decode(sparse_model, monkeypatch):
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32)
    cache = NosaCache(sparse_model.config, cfg)
    prompt = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    ids, _ = _decode(sparse_model, cache, prompt, 240)
    layer = cache.layers[0]
    first_chunk = layer.host.k_chunks[0]
    stats = cache.stats()
    assert stats["seen_tokens"] == stats["host_tokens"] == ids.shape[1] == 264
    assert stats["device_tokens"] <= cfg.budget_tokens + cfg.block_size
    assert stats["blocks_loaded"] > 0 and stats["bytes_to_device"] > 0
    # grown chunk by chunk (never re-copied), never more than 1.1x what it stores plus one block
    assert len(layer.host.k_chunks) > 1 and layer.host.k_chunks[0] is first_chunk
    assert layer.host.capacity <= 1.1 * 264 + cfg.block_size
    assert stats["host_bytes"] <= (1.1 * 264 + cfg.block_size) * layer.host.token_bytes() * 2 * len(cache.layers)
    # the host store holds exactly the keys the model produced: compare with a plain cache's keys
    from transformers import DynamicCache

    plain = DynamicCache(config=sparse_model.config)
    with torch.no_grad():
        sparse_model(ids[:, :-1], past_key_values=plain)
    host_keys, _, _ = layer.host.read(0, 263, "cpu")
    torch.testing.assert_close(host_keys, plain.layers[0].keys, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_locality_bound_with_trained_like_eviction_head(sparse_model):
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32)
    cache = NosaCache(sparse_model.config, cfg)
    prompt = torch.randint(3, 97, (3, 20), generator=torch.Generator().manual_seed(1))
    _decode(sparse_model, cache, prompt, 200)
    stats = cache.stats()
    bound = 1 - (cfg.query_tokens + cfg.block_size) / cfg.budget_tokens
    assert stats["decode_steps"] == 200
    assert stats["locality"] >= bound, stats


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_batch_reordering_matches_running_the_sequences_alone(sparse_model):
    cfg = small_nosa_config(budget_tokens=64, query_tokens=0, local_tokens=32)
    prompt = torch.randint(3, 97, (3, 70), generator=torch.Generator().manual_seed(2))
    together = NosaCache(sparse_model.config, cfg)
    _decode(sparse_model, together, prompt, 5)
    together.batch_select_indices(torch.tensor([2, 0]))
    together.reorder_cache(torch.tensor([1, 0]))  # now [0, 2]
    together.batch_repeat_interleave(2)  # now [0, 0, 2, 2]
    assert together.layers[0].batch == 4
    step = prompt[[0, 0, 2, 2], :1]
    with torch.no_grad():
        logits = sparse_model(step, past_key_values=together).logits
    for row, seq in ((0, 0), (2, 2)):
        alone = NosaCache(sparse_model.config, cfg)
        _decode(sparse_model, alone, prompt[seq : seq + 1], 5)
        with torch.no_grad():
            expected = sparse_model(prompt[seq : seq + 1, :1], past_key_values=alone).logits
        torch.testing.assert_close(logits[row], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[row + 1], expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_crop_rewinds_to_an_earlier_state(sparse_model):
    cfg = small_nosa_config(budget_tokens=64, query_tokens=0, local_tokens=32)
    prompt = torch.randint(3, 97, (1, 50), generator=torch.Generator().manual_seed(4))
    cache = NosaCache(sparse_model.config, cfg)
    ids, _ = _decode(sparse_model, cache, prompt, 30)
    cache.crop(-13)
    assert cache.get_seq_length() == ids.shape[1] - 13
    replay = NosaCache(sparse_model.config, cfg)
    with torch.no_grad():
        sparse_model(ids[:, : cache.get_seq_length()], past_key_values=replay)
        nxt = ids[:, cache.get_seq_length() : cache.get_seq_length() + 1]
        a = sparse_model(nxt, past_key_values=cache).logits
        b = sparse_model(nxt, past_key_values=replay).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_reset_and_mask_sizes(sparse_model):
    cache = NosaCache(sparse_model.config, small_nosa_config())
    prompt = torch.randint(3, 97, (1, 10))
    _decode(sparse_model, cache, prompt, 3)
    assert cache.get_seq_length() == 13
    assert cache.get_mask_sizes(1, 0) == (14, 0)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stats()["host_tokens"] == 0
    _decode(sparse_model, cache, prompt, 2)
    assert cache.get_seq_length() == 12


def test_nosa_cache_constructor_errors():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="unexpected"):
        NosaCache(model.config, budget=3)
    with pytest.raises(ValueError, match="Unknown NosaConfig"):
        model.config.nosa = {"budget": 1}
        NosaCache(model.config)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_slot_pool_widened_mid_block_keeps_the_block_being_written(sparse_model):
    """A cache of unknown length starts with its budget cut to the prompt and widens the slot pool as the sequence
    grows, also in the middle of a block: the block being written stays in its slot, so one-token decoding keeps
    equal to the decode rule applied to the whole sequence at once (prefill="nosa")."""
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32)
    ids = torch.randint(3, 97, (2, 130), generator=torch.Generator().manual_seed(6))
    cache = NosaCache(sparse_model.config, cfg)  # no max_cache_len: the pool grows
    with torch.no_grad():
        steps = [sparse_model(ids[:, :39], past_key_values=cache).logits[:, -1:]]
        steps += [sparse_model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(39, 129)]
        rule = sparse_model(ids[:, :129], past_key_values=NosaCache(sparse_model.config, cfg.replace(prefill="nosa")))
    assert cache.layers[0].n_slots > 1 + cfg.sized_for(39).budget_blocks  # it did widen
    torch.testing.assert_close(torch.cat(steps, 1), rule.logits[:, 38:], atol=1e-4, rtol=1e-4)


def test_compressed_keys_are_sized_for_a_known_length_and_double_for_an_unknown_one(sparse_model):
    """A cache that knows its length (``max_cache_len``) keeps compressed keys for it rounded up to 256 windows, not
    to a power of two (which could hold twice the windows); one that does not know it grows by powers of two."""
    from hf_nosa.kernels.decode.block_scores import window_capacity_for, window_capacity_grown
    from hf_nosa.rules.selection import num_windows

    assert [window_capacity_for(n) for n in (1, 256, 257, 749, 4160)] == [256, 256, 512, 768, 4352]
    assert [window_capacity_grown(n) for n in (1, 257, 749, 4160)] == [256, 512, 1024, 8192]
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32)
    prompt = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    known = NosaCache(sparse_model.config, cfg, max_cache_len=3000)
    with torch.no_grad():
        sparse_model(prompt, past_key_values=known)
    windows = num_windows(3000, known.layers[0].cfg)
    assert windows == 749
    assert known.layers[0].compressed.keys.shape[2] == known.layers[0].compressed.bias.shape[2] == 768
    unknown = NosaCache(sparse_model.config, cfg)
    with torch.no_grad():
        sparse_model(prompt, past_key_values=unknown)
    compressed = unknown.layers[0].compressed
    assert compressed.keys.shape[2] == 256
    held = compressed.keys[:, :, :compressed.n].clone()
    assert compressed.n > 0 and held.abs().sum() > 0
    compressed.reserve(windows)  # outgrown: the next power of two, what was held kept
    assert compressed.keys.shape[2] == 1024 and torch.equal(compressed.keys[:, :, :compressed.n], held)
