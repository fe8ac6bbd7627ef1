"""prefill_batch_tokens and prefill_max_chunk_size: longer prefill chunks while the batch allows, the same tokens and
logits as that fixed chunk."""

import pytest
import torch

from hf_nosa import NosaConfig, to_nosa
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import padded_batch, small_nosa_config, tiny_model


def test_the_chunk_grows_at_small_batches_in_whole_blocks():
    cfg = NosaConfig(prefill_chunk_size=512, prefill_batch_tokens=4096, prefill_max_chunk_size=4096)
    assert [cfg.prefill_chunk(b) for b in (1, 2, 3, 4, 8, 9, 64)] == [4096, 2048, 1344, 1024, 512, 512, 512]
    assert NosaConfig(prefill_chunk_size=512, prefill_batch_tokens=0).prefill_chunk(1) == 512  # 0: off
    # the default: 4096-token chunks up to 8 rows, then shorter, prefill_chunk_size from 64 rows on
    assert [NosaConfig().prefill_chunk(b) for b in (1, 2, 4, 8, 9, 16, 17, 38, 64, 100)] == [
        4096, 4096, 4096, 4096, 3584, 2048, 1920, 832, 512, 512]
    assert NosaConfig(prefill_chunk_size=512, prefill_batch_tokens=256).prefill_chunk(1) == 512  # never shorter


def test_the_chunk_stops_at_its_maximum():
    cfg = NosaConfig(prefill_chunk_size=512, prefill_batch_tokens=65536, prefill_max_chunk_size=1024)
    assert [cfg.prefill_chunk(b) for b in (1, 32, 64, 128, 200)] == [1024, 1024, 1024, 512, 512]
    # a floor above the maximum wins: chunks are never shorter than prefill_chunk_size
    assert NosaConfig(prefill_chunk_size=4096, prefill_max_chunk_size=2048).prefill_chunk(1) == 4096
    # a configuration saved before the maximum existed keeps its chunks (the default maximum is above its batch-1 chunk)
    old = NosaConfig.from_dict({"prefill_chunk_size": 512, "prefill_batch_tokens": 2048})
    assert [old.prefill_chunk(b) for b in (1, 2, 4)] == [2048, 1024, 512]


@pytest.mark.parametrize("bad", [0, -64, 100, True, 1.5])
def test_bad_prefill_max_chunk_size_is_named(bad):
    with pytest.raises(ValueError, match="NosaConfig.prefill_max_chunk_size"):
        NosaConfig(prefill_max_chunk_size=bad)


@pytest.mark.parametrize("bad", [-64, 100, True, 1.5])
def test_bad_prefill_batch_tokens_is_named(bad):
    with pytest.raises(ValueError, match="NosaConfig.prefill_batch_tokens"):
        NosaConfig(prefill_batch_tokens=bad)


def _chunk_lengths(model):
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True)
    return seen


def _generate(model, ids, mask, **cache_config):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, cache_implementation="nosa", cache_config=cache_config)


@pytest.mark.parametrize("pads,chunk", [((0,), 192), ((0, 9), 96)])
def test_generate_takes_the_grown_chunk(pads, chunk):
    """QUOKA prefill, sparse budget: with prefill_batch_tokens=192 and 64-token chunks, one row prefills in chunks of
    192 tokens and two rows (one left-padded) in chunks of 96 (whole 16-token blocks); either way the tokens and logits
    are those of the fixed chunk it chose."""
    model = to_nosa(tiny_model("llama", seed=5), small_nosa_config(prefill="quoka", prefill_budget_tokens=64))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(6))
    ids, mask = padded_batch(400, pads, seed=7)
    lengths = _chunk_lengths(model)
    grown = _generate(model, ids, mask, prefill_chunk_size=64, prefill_batch_tokens=192)
    assert lengths[:2] == [chunk] * 2 and max(lengths) == chunk
    lengths.clear()
    fixed = _generate(model, ids, mask, prefill_chunk_size=chunk)
    assert lengths[:2] == [chunk] * 2
    assert torch.equal(grown.sequences, fixed.sequences)
    for a, b in zip(grown.logits, fixed.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
