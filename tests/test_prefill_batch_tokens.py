"""prefill_batch_tokens and prefill_max_chunk_size: kept so that saved configs load, validated, warned about, and
without effect: QUOKA's chunks are prefill_chunk_size tokens at every batch, so a row's answer never depends on its
batch (tests/test_conversations.py holds rows against batches)."""

import pytest
import torch

from hf_nosa import NosaConfig, to_nosa
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import padded_batch, small_nosa_config, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:NosaConfig.prefill_:FutureWarning")


def test_the_chunk_is_the_same_at_every_batch():
    cfg = NosaConfig(prefill_chunk_size=512, prefill_batch_tokens=4096, prefill_max_chunk_size=4096)
    assert [cfg.prefill_chunk(b) for b in (1, 2, 3, 4, 8, 9, 64)] == [512] * 7
    assert [NosaConfig().prefill_chunk(b) for b in (1, 8, 38, 100)] == [NosaConfig().prefill_chunk_size] * 4


def test_a_saved_config_with_the_old_knobs_loads_and_says_they_do_nothing(monkeypatch):
    monkeypatch.setattr("hf_nosa.config._WARNED", set())
    with pytest.warns(FutureWarning, match="prefill_batch_tokens no longer changes anything"):
        old = NosaConfig.from_dict({"prefill_chunk_size": 512, "prefill_batch_tokens": 2048})
    assert [old.prefill_chunk(b) for b in (1, 2, 4)] == [512] * 3
    with pytest.warns(FutureWarning, match="prefill_max_chunk_size no longer changes anything"):
        NosaConfig(prefill_max_chunk_size=1024)


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


@pytest.mark.parametrize("pads", [(0,), (0, 9)])
def test_generate_ignores_the_old_knobs(pads):
    """QUOKA prefill, sparse budget: with prefill_batch_tokens=192 the chunks are still prefill_chunk_size tokens,
    and the tokens and logits those of the same config without it."""
    model = to_nosa(tiny_model("llama", seed=5), small_nosa_config(prefill="quoka", prefill_budget_tokens=64))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(6))
    ids, mask = padded_batch(400, pads, seed=7)
    lengths = _chunk_lengths(model)
    knobs = _generate(model, ids, mask, prefill_chunk_size=64, prefill_batch_tokens=192, prefill_max_chunk_size=256)
    assert lengths[:2] == [64] * 2 and max(lengths) == 64
    lengths.clear()
    plain = _generate(model, ids, mask, prefill_chunk_size=64)
    assert lengths[:2] == [64] * 2
    assert torch.equal(knobs.sequences, plain.sequences)
    for a, b in zip(knobs.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
