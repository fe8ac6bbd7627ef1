"""generate() with a NosaCache: model-level chunked prefill, memory sized to need, and the errors around them."""

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.cache import host_store
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import padded_batch, small_nosa_config, tiny_model


def _batch(length, pads, seed=0):
    return padded_batch(length, pads, seed)


def _generate(model, ids, mask, chunk, **kwargs):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True,
        return_dict_in_generate=True, cache_implementation="nosa", cache_config={"prefill_chunk_size": chunk},
        **kwargs,
    )


def _layer_input_lengths(model):
    """Token counts every decoder layer is called with (a hook on the first layer)."""
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True)
    return seen


@pytest.mark.parametrize("num_beams", [1, 2])
def test_chunked_prefill_equals_one_shot_dense_prefill(family, num_beams):
    """Full budget, "dense": a prompt sent through the model 32 tokens at a time gives the tokens and logits of
    one forward over the whole prompt, with left padding of 0, 13 and 40 tokens."""
    model = to_nosa(tiny_model(family, seed=2), small_nosa_config(budget_tokens=512, prefill="dense"))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(3))
    ids, mask = _batch(150, (0, 13, 40))
    lengths = _layer_input_lengths(model)
    one_shot = _generate(model, ids, mask, chunk=256, num_beams=num_beams)
    assert max(lengths) == 150
    lengths.clear()
    chunked = _generate(model, ids, mask, chunk=32, num_beams=num_beams)
    assert max(lengths) == 32 and lengths[:5] == [32, 32, 32, 32, 22]  # the prompt, chunk by chunk
    assert torch.equal(chunked.sequences, one_shot.sequences)
    for a, b in zip(chunked.logits, one_shot.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prefill", ["nosa", "quoka"])
def test_chunked_prefill_of_the_sparse_modes_runs_and_stays_within_the_chunk(prefill):
    model = to_nosa(tiny_model("qwen2", seed=1), small_nosa_config(prefill=prefill, prefill_budget_tokens=64))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(1))
    ids, mask = _batch(200, (0, 21))
    lengths = _layer_input_lengths(model)
    out = _generate(model, ids, mask, chunk=48)
    assert max(lengths) == 48 and out.sequences.shape == (2, 212)
    assert torch.isfinite(torch.stack(out.logits)).all()


def test_direct_forward_is_chunked_and_keeps_every_logit_by_default():
    """model(ids, cache=...) outside generate: chunked too, all positions' logits (logits_to_keep=0), the same as
    one forward."""
    model = to_nosa(tiny_model("llama", seed=5), small_nosa_config(budget_tokens=512, prefill="dense",
                                                                    prefill_chunk_size=32))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(4))
    ids, mask = _batch(100, (0, 9))
    with torch.no_grad():
        chunked = model(ids, attention_mask=mask, past_key_values=NosaCache(model.config)).logits
        last = model(ids, attention_mask=mask, past_key_values=NosaCache(model.config), logits_to_keep=3).logits
        whole = model(ids, attention_mask=mask, past_key_values=NosaCache(
            model.config, small_nosa_config(budget_tokens=512, prefill="dense", prefill_chunk_size=128))).logits
    real = mask.bool()
    torch.testing.assert_close(chunked[real], whole[real], atol=1e-4, rtol=1e-4)
    assert last.shape == (2, 3, 97)
    torch.testing.assert_close(last, chunked[:, -3:], atol=1e-5, rtol=1e-5)


def test_host_store_and_slot_pool_are_sized_to_need():
    """A 16-token prompt at batch 8 reserves what it stores (not 8K tokens), and budget_tokens=1<<30 on a 40-token
    prompt allocates what a budget of prompt + new tokens would."""
    model = to_nosa(tiny_model("llama"), small_nosa_config())
    ids, mask = _batch(16, (0,) * 8)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         cache_implementation="nosa", return_dict_in_generate=True)
    cache = out.past_key_values if hasattr(out, "past_key_values") and out.past_key_values is not None else out.cache
    layer, stats = cache.layers[0], cache.stats()
    stored = stats["host_tokens"]
    assert stored == 16 + 20 - 1
    P = layer.cfg.block_size
    assert layer.host.capacity <= 1.1 * stored + P
    assert stats["host_bytes"] <= len(cache.layers) * (1.1 * stored + P) * layer.host.token_bytes() * 8

    ids, mask = _batch(40, (0, 0))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                  cache_implementation="nosa")
    huge = model.generate(**kwargs, cache_config={"budget_tokens": 1 << 30})
    fitted = model.generate(**kwargs, cache_config={"budget_tokens": 48, "query_tokens": 0})
    assert torch.equal(huge.sequences, fitted.sequences)
    huge_cache = getattr(huge, "past_key_values", None) or huge.cache
    fitted_cache = getattr(fitted, "past_key_values", None) or fitted.cache
    assert huge_cache.stats()["device_kv_bytes"] <= fitted_cache.stats()["device_kv_bytes"]


def test_explicit_cache_without_a_known_length_grows_within_the_bound():
    model = to_nosa(tiny_model("qwen3"), small_nosa_config(budget_tokens=1 << 20, query_tokens=32))
    cache = NosaCache(model.config)
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[:, -1:]
        for _ in range(200):
            logits = model(logits.argmax(-1), past_key_values=cache).logits
    layer = cache.layers[0]
    assert cache.get_seq_length() == 230
    assert layer.host.capacity <= 1.1 * 230 + layer.cfg.block_size
    assert layer.n_slots <= 2 * 230 // layer.cfg.block_size + 2  # the pool grew with the sequence, not to 1<<20


@pytest.mark.parametrize("host_dtype", ["auto", "int8"])
def test_not_enough_host_memory_is_a_clear_error_before_any_work(monkeypatch, host_dtype):
    """The error names batch, context and the bytes needed and available (exact: a small shortfall is still legible),
    and comes before the store allocates anything (a quantized store's tails included)."""
    model = to_nosa(tiny_model("llama"), small_nosa_config(host_dtype=host_dtype))
    monkeypatch.setattr(host_store, "available_host_memory", lambda: 1000)
    allocated = []
    monkeypatch.setattr(host_store.HostStore, "_chunk", lambda self, *a: allocated.append(a) or pytest.fail("allocated"))
    ids, mask = _batch(64, (0, 0, 0))
    with pytest.raises(MemoryError, match=r"batch 3 x context 96 tokens needs [\d,]+ bytes .* only 1,000 bytes"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, cache_implementation="nosa")
    assert not allocated


@pytest.mark.parametrize("search", ["greedy", "beam", "prompt_lookup", "assistant"])
def test_output_attentions_with_a_nosa_cache_is_refused_by_name(search):
    """Greedy, beam and assisted generate all get the documented ValueError (never an internal crash or empty
    per-step tuples)."""
    model = to_nosa(tiny_model("llama"), small_nosa_config())
    ids, mask = _batch(20, (0,))
    extra = {"greedy": {}, "beam": {"num_beams": 2}, "prompt_lookup": {"prompt_lookup_num_tokens": 3},
             "assistant": {"assistant_model": tiny_model("llama", seed=9)}}[search]
    with pytest.raises(ValueError, match="output_attentions=True is not supported by NOSA attention"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, cache_implementation="nosa",
                       output_attentions=True, return_dict_in_generate=True, do_sample=False, **extra)


def test_locality_is_undefined_until_a_step_could_reuse_a_block():
    """A prompt shorter than one block and a few new tokens: no decode step selected a block that could have been
    resident, so locality is NaN (not 0, and not a share of nothing); once blocks exist it is a share in [0, 1]."""
    model = to_nosa(tiny_model("qwen2", seed=4), small_nosa_config(budget_tokens=96))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(4))
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(5))
    cache = NosaCache(model.config)
    model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=cache)
    stats = cache.stats()
    assert stats["seen_tokens"] == 13 and stats["blocks_loaded"] == 0
    assert stats["locality"] != stats["locality"]  # NaN
    cache = NosaCache(model.config)
    model.generate(ids, max_new_tokens=120, do_sample=False, past_key_values=cache)
    stats = cache.stats()
    assert stats["blocks_loaded"] > 0 and 0.0 <= stats["locality"] <= 1.0


@pytest.mark.parametrize("value", [0, 40, -64])
def test_bad_prefill_chunk_size_names_the_field(value):
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        small_nosa_config(prefill_chunk_size=value)
    model = to_nosa(tiny_model("llama"), small_nosa_config())
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, cache_implementation="nosa",
                       cache_config={"prefill_chunk_size": value})


def test_the_cache_layer_reads_back_its_keys_and_values():
    model = to_nosa(tiny_model("llama"), small_nosa_config(budget_tokens=64, query_tokens=0, local_tokens=32))
    cache = NosaCache(model.config)
    ids = torch.randint(3, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    from transformers import DynamicCache

    plain = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=plain)
    assert cache.layers[1].keys.shape == (2, 2, 70, 16)
    torch.testing.assert_close(cache.layers[1].keys, plain.layers[1].keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.layers[0].values, plain.layers[0].values, atol=1e-5, rtol=1e-5)


def test_a_cache_used_by_another_model_names_both_values():
    small = to_nosa(tiny_model("llama"), small_nosa_config())
    other = to_nosa(tiny_model("llama", num_key_value_heads=4), small_nosa_config())
    cache = NosaCache(small.config)
    ids = torch.randint(3, 97, (1, 20))
    with torch.no_grad():
        small(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="KV heads 2, but this update has KV heads 4"):
            other(ids[:, :1], past_key_values=cache)
    deeper = to_nosa(tiny_model("llama", num_hidden_layers=3), small_nosa_config())
    with pytest.raises(ValueError, match="built for 2 layers, but this model has 3"):
        with torch.no_grad():
            deeper(ids, past_key_values=NosaCache(small.config))
    with pytest.raises(ValueError, match="built for 3 layers, but this model has 2"):  # fewer layers: caught too
        small.generate(ids, max_new_tokens=2, past_key_values=NosaCache(deeper.config))



@pytest.mark.parametrize("name", ["A", "delta.weight", "delta.bias"])
def test_non_finite_eviction_heads_are_refused_at_conversion_and_generate(name):
    model = to_nosa(tiny_model("qwen2"), small_nosa_config())
    head = model.model.layers[1].self_attn.eviction_head
    param = head.A if name == "A" else getattr(head.delta, name.split(".")[1])
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=rf"layer 1: eviction_head.{name} holds NaN"):
        model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, cache_implementation="nosa")
    with pytest.raises(ValueError, match=rf"layer 1: eviction_head.{name} holds NaN"):
        to_nosa(model)


def test_output_attentions_without_a_nosa_cache_is_refused_too():
    model = to_nosa(tiny_model("qwen3"), small_nosa_config())
    with pytest.raises(ValueError, match="output_attentions"):
        model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, output_attentions=True,
                       return_dict_in_generate=True)


def test_non_finite_eviction_heads_are_refused_at_load(tmp_path):
    from hf_nosa.modeling.remote import NosaLlamaConfig, NosaLlamaForCausalLM

    from .conftest import COMMON

    config = NosaLlamaConfig(**COMMON, nosa=small_nosa_config().to_dict())
    model = NosaLlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].self_attn.eviction_head.A[0] = float("inf")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="layer 0: eviction_head.A holds NaN or inf"):
        NosaLlamaForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("how", ["assistant", "prompt_lookup"])
def test_assisted_decoding_equals_plain_greedy_under_a_sparse_budget(family, how):
    """Candidates verified several at a time attend by the decode rule: the output is plain greedy's."""
    model = to_nosa(tiny_model(family, seed=6), small_nosa_config(budget_tokens=80, query_tokens=32))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(6))
    ids = torch.randint(3, 97, (1, 160), generator=torch.Generator().manual_seed(2))
    ids[0, 130:150] = ids[0, 40:60]  # repeats for prompt lookup to find
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                  cache_implementation="nosa")
    plain = model.generate(**kwargs)
    extra = ({"assistant_model": tiny_model(family, seed=9)} if how == "assistant"
             else {"prompt_lookup_num_tokens": 4})
    assisted = model.generate(**kwargs, **extra)
    assert torch.equal(assisted, plain)
