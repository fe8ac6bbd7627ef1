"""generate() with cache_implementation="nosa": identity with the default cache, batch ops, bad input."""

import pytest
import torch

import hf_nosa
from hf_nosa import NosaCache, to_nosa

from .conftest import padded_batch, small_nosa_config, tiny_model


def _padded_batch(seed=0, length=40, pads=(0, 7, 20)):
    return padded_batch(length, pads, seed)


def _greedy(model, ids, mask, **kwargs):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
        output_logits=True, return_dict_in_generate=True, **kwargs,
    )


@pytest.mark.parametrize("prefill", ["dense", "nosa"])
@pytest.mark.parametrize("batch", [1, 3])
def test_identity_with_full_budget(family, prefill, batch):
    model = to_nosa(tiny_model(family), small_nosa_config(budget_tokens=256, prefill=prefill))
    ids, mask = _padded_batch(pads=(0, 7, 20)[:batch])
    reference = _greedy(model, ids, mask)
    nosa = _greedy(model, ids, mask, cache_implementation="nosa")
    assert torch.equal(nosa.sequences, reference.sequences)
    torch.testing.assert_close(nosa.logits[-1], reference.logits[-1], atol=1e-4, rtol=0)


def test_converted_model_equals_stock_model():
    stock = tiny_model("qwen3")
    ids, mask = _padded_batch()
    before = _greedy(stock, ids, mask)
    after = _greedy(to_nosa(stock, small_nosa_config(budget_tokens=256)), ids, mask, cache_implementation="nosa")
    assert torch.equal(before.sequences, after.sequences)


@pytest.mark.filterwarnings("ignore:.past_key_values. is deprecated:FutureWarning")
def test_explicit_cache_object_and_cache_config_overrides():
    model = to_nosa(tiny_model("llama"), small_nosa_config(budget_tokens=256))
    ids, mask = _padded_batch(pads=(0, 3), length=80)
    reference = _greedy(model, ids, mask).sequences
    cache = NosaCache(model.config)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, past_key_values=cache)
    assert torch.equal(out, reference)
    assert cache.stats()["seen_tokens"] == ids.shape[1] + 23
    # cache_config reaches the cache: a budget far below the context changes what is attended
    small = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
        cache_implementation="nosa", cache_config={"budget_tokens": 64, "local_tokens": 32, "query_tokens": 16},
        return_dict_in_generate=True, output_logits=True,
    )
    full = _greedy(model, ids, mask)
    assert not torch.allclose(small.logits[-1], full.logits[-1])


def test_beam_search_keeps_identity():
    model = to_nosa(tiny_model("llama"), small_nosa_config(budget_tokens=256))
    ids, mask = _padded_batch(pads=(0, 5))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=2, do_sample=False)
    assert torch.equal(model.generate(**kwargs, cache_implementation="nosa"), model.generate(**kwargs))


def test_prompt_lookup_decoding_crops_and_keeps_identity():
    model = to_nosa(tiny_model("qwen2"), small_nosa_config(budget_tokens=256))
    pattern = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    ids = pattern.repeat(1, 4)  # repetitive prompt: prompt lookup proposes candidates, some get rejected
    kwargs = dict(input_ids=ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=4)
    assert torch.equal(model.generate(**kwargs, cache_implementation="nosa"), model.generate(**kwargs))


def test_unknown_cache_config_key_fails_before_work():
    model = to_nosa(tiny_model("llama"), small_nosa_config())
    ids, mask = _padded_batch(pads=(0,))
    with pytest.raises(ValueError, match="budget_token"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                       cache_implementation="nosa", cache_config={"budget_token": 64})
    with pytest.raises(ValueError, match="NosaConfig.budget_tokens"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2,
                       cache_implementation="nosa", cache_config={"budget_tokens": 63})


def test_unconverted_model_is_refused():
    model = tiny_model("llama")
    ids, mask = _padded_batch(pads=(0,))
    with pytest.raises(ValueError, match="to_nosa"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache_implementation="nosa")
    with pytest.raises(TypeError, match="to_nosa"):
        model(ids, past_key_values=NosaCache(model.config, small_nosa_config()))


def test_unsupported_architecture_lists_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(TypeError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        to_nosa(model)


def test_unsupported_attention_implementation():
    model = tiny_model("llama", attn="flex_attention")
    with pytest.raises(ValueError, match="attn_implementation"):
        to_nosa(model)


def test_register_is_idempotent():
    from transformers import GenerationMixin
    from transformers.generation import configuration_utils

    wrapped = GenerationMixin._prepare_cache_for_generation
    hf_nosa.generation.register()
    hf_nosa.generation.register()
    assert GenerationMixin._prepare_cache_for_generation is wrapped
    assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS.count("nosa") == 1
