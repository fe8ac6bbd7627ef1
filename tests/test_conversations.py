"""Conversations on a reused NosaCache: a new turn is prefilled like a new prompt (within the same device bound), a
row's answer does not depend on its batch, a call that raises leaves the cache as it was, and non-finite eviction
heads are refused on every path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import SPARSE, small_nosa_config, tiny_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

# The reproducer: block 16, a budget of 6 blocks, windows 8/4; everything else NosaConfig's defaults.
INVARIANCE = dict(block_size=16, budget_tokens=96, query_tokens=32, sink_tokens=16, local_tokens=32,
                  compress_kernel=8, compress_stride=4)


def _model(family: str, cfg: NosaConfig, seed: int = 0, **overrides):
    model = to_nosa(tiny_model(family, seed=seed, **overrides), cfg)
    return randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 100))


def _greedy(model, ids, new_tokens, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **kwargs)  # min_new_tokens: a row that meets EOS alone goes on as it does in a batch
    return out.sequences, torch.stack(out.logits, 1)  # [B, T + new], [B, new, vocab]


# ----- batch invariance -----

@pytest.mark.parametrize("path", ["whole", "chunked"])
def test_a_row_gives_the_same_answer_alone_and_in_batches_of_3_and_16(family, path):
    """Default prefill settings (chunks of prefill_chunk_size, whole-prompt threshold), a sparse budget: every row of
    a batch of 16 and of 3 gives the tokens of the same prompt alone, logits within 1e-4."""
    whole = {} if path == "whole" else {"prefill_whole_prompt_tokens": 0}
    model = _model(family, NosaConfig(**INVARIANCE, **whole), seed=3, vocab_size=128)
    ids = torch.randint(3, 128, (16, 2400), generator=torch.Generator().manual_seed(4))
    kwargs = dict(cache_implementation="nosa")
    batch_tokens, batch_logits = _greedy(model, ids, 12, **kwargs)
    three_tokens, three_logits = _greedy(model, ids[[2, 7, 11]], 12, **kwargs)
    for i, row in enumerate([2, 7, 11]):
        assert torch.equal(three_tokens[i], batch_tokens[row])
        torch.testing.assert_close(three_logits[i], batch_logits[row], atol=1e-4, rtol=0)
    for row in (0, 5, 11, 15):
        tokens, logits = _greedy(model, ids[row : row + 1], 12, **kwargs)
        assert torch.equal(tokens[0], batch_tokens[row])
        torch.testing.assert_close(logits[0], batch_logits[row], atol=1e-4, rtol=0)


def test_the_chunk_never_depends_on_the_batch():
    cfg = NosaConfig()
    assert {cfg.prefill_chunk(batch) for batch in (1, 3, 16, 64)} == {cfg.prefill_chunk_size}


def test_the_retired_batch_knobs_warn_that_they_do_nothing(monkeypatch):
    monkeypatch.setattr("hf_nosa.config._WARNED", set())
    with pytest.warns(FutureWarning, match="prefill_batch_tokens no longer changes anything"):
        cfg = NosaConfig(prefill_batch_tokens=0)
    assert cfg.prefill_chunk(64) == cfg.prefill_chunk_size


# ----- a new turn on a reused cache -----

def _turns(model, first: int, second: int, seed: int, new_tokens: int = 6):
    """Two turns on one NosaCache: a prompt of ``first`` tokens, the answer, then ``second`` more tokens."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    cache = NosaCache(model.config)
    turn1 = torch.randint(3, 97, (1, first), generator=g).to(device)
    answer1, _ = _greedy(model, turn1, new_tokens, past_key_values=cache)
    held = cache.get_seq_length()
    turn2 = torch.cat([answer1, torch.randint(3, 97, (1, second), generator=g).to(device)], 1)
    answer2, logits2 = _greedy(model, turn2, new_tokens, past_key_values=cache)
    return cache, held, turn2, answer2, logits2


def test_a_new_turn_is_prefilled_within_the_budget_bound(family):
    """Several hundred tokens after a conversation, sparse budget: the turn goes through QUOKA's chunks, so the
    device never holds more than a prefill budget + a chunk + one block per (sequence, KV head), where the decode rule
    would read the whole conversation back."""
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model(family, cfg, seed=1)
    cache, held, turn2, answer2, _ = _turns(model, 300, 400, seed=2)
    assert held == 305 and cache.get_seq_length() == turn2.shape[1] + 5
    bound = cfg.prefill_budget_blocks * cfg.block_size + cfg.prefill_chunk_size + cfg.block_size
    assert cache.stats()["device_tokens"] <= bound < turn2.shape[1]
    assert answer2.shape[1] == turn2.shape[1] + 6


def test_a_new_turn_reads_only_its_chunks_blocks_not_the_conversation(monkeypatch):
    """The per-token decode rule is what reads every earlier token back; a long new turn never takes it."""
    from hf_nosa.prefill.chunked import PrefillPaths

    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model("llama", cfg, seed=1)
    calls = []
    original = PrefillPaths._extend_by_decode_rule
    monkeypatch.setattr(PrefillPaths, "_extend_by_decode_rule",
                        lambda self, k, *a: calls.append(k.shape[2]) or original(self, k, *a))
    _turns(model, 200, 100, seed=5)
    assert calls == []


@pytest.mark.parametrize("second", [3, 200, 333])
def test_a_new_turn_at_a_budget_covering_the_context_equals_stock_generate(family, second):
    """Full budget, untrained heads (A = 0): turn 2 on the reused cache gives stock generate's tokens and logits on
    the whole conversation, for a turn under decode_rule_tokens (decode rule), one chunk and several chunks, each
    starting inside a block."""
    stock = tiny_model(family, seed=7)
    model = to_nosa(tiny_model(family, seed=7), small_nosa_config(budget_tokens=1024, prefill_chunk_size=128))
    cache, held, turn2, answer2, logits2 = _turns(model, 150, second, seed=8)
    expected, expected_logits = _greedy(stock, turn2, 6)
    assert torch.equal(answer2, expected)
    torch.testing.assert_close(logits2, expected_logits, atol=1e-4, rtol=1e-4)


def test_the_chat_pattern_with_crop(family):
    """transformers' chat pattern: generate on the whole conversation, crop the answer away, continue with another
    message; the same as a cache that never held the dropped answer."""
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model(family, cfg, seed=2)
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 97, (1, 260), generator=g)
    message = torch.cat([prompt, torch.randint(3, 97, (1, 150), generator=g)], 1)
    cropped = NosaCache(model.config)
    _greedy(model, prompt, 5, past_key_values=cropped)
    cropped.crop(prompt.shape[1])
    tokens, logits = _greedy(model, message, 5, past_key_values=cropped)
    never = NosaCache(model.config)
    _greedy(model, prompt, 1, past_key_values=never)  # holds the prompt only: the last new token is never fed
    expected, expected_logits = _greedy(model, message, 5, past_key_values=never)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)


def test_a_continued_padded_batch_is_refused_before_any_work():
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model("llama", cfg, seed=2)
    ids = torch.randint(3, 97, (2, 150), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    cache = NosaCache(model.config)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)
    held = cache.get_seq_length()
    more = torch.cat([out, torch.randint(3, 97, (2, 100))], 1)
    with pytest.raises(ValueError, match="left-padded batch"):
        model.generate(input_ids=more, attention_mask=torch.cat([mask, torch.ones(2, 103, dtype=mask.dtype)], 1),
                       past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.get_seq_length() == held


# ----- atomic turns -----

class _Boom(RuntimeError):
    pass


def _state_of(stats: dict) -> dict:
    """A cache's stats as comparable values: locality's NaN as None, and without host_bytes (the host store keeps the
    room a failed call allocated, for the retry to use)."""
    return {key: (None if value != value else value) for key, value in stats.items() if key != "host_bytes"}


def _state(cache) -> dict:
    return _state_of(cache.stats())


def _raise_on_call(model, layer: int, when) -> list:
    """Make layer ``layer``'s attention raise on the calls ``when(n_tokens, call_index)`` is true for."""
    calls = []  # the number of tokens of every call so far, this one included

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        calls.append(hidden.shape[1])
        if when(hidden.shape[1], len(calls) - 1):
            raise _Boom(f"raised at call {len(calls) - 1}")

    return calls, model.model.layers[layer].self_attn.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("where", ["decode step 3", "inside a continued prompt", "first prompt"])
def test_a_generate_that_raises_leaves_the_cache_as_it_was(family, where):
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model(family, cfg, seed=4)
    g = torch.Generator().manual_seed(11)
    turn1 = torch.randint(3, 97, (1, 230), generator=g)

    def conversation(cache, fail):
        answer, _ = _greedy(model, turn1, 6, past_key_values=cache)
        turn2 = torch.cat([answer, torch.randint(3, 97, (1, 170), generator=torch.Generator().manual_seed(12))], 1)
        if fail:
            decode = where == "decode step 3"
            # layer 1 (not 0): layer 0 has already stored the tokens, so the layers' lengths differ when it raises
            calls, handle = _raise_on_call(model, 1, (lambda n, i: n == 1 and calls.count(1) == 3) if decode
                                           else (lambda n, i: n > 1 and i == 1))
            before = cache.stats()
            with pytest.raises(_Boom):
                _greedy(model, turn2, 6, past_key_values=cache)
            handle.remove()
            assert _state(cache) == _state_of(before)  # every layer, the host store and the counters as they were
            assert [layer.seen for layer in cache.layers] == [before["seen_tokens"]] * len(cache.layers)
        return _greedy(model, turn2, 6, past_key_values=cache)

    if where == "first prompt":
        cache = NosaCache(model.config)
        calls, handle = _raise_on_call(model, 1, lambda n, i: i == 2)
        with pytest.raises(_Boom):
            _greedy(model, turn1, 6, past_key_values=cache)
        handle.remove()
        assert cache.get_seq_length() == 0 and not any(layer.is_initialized for layer in cache.layers)
        retried = _greedy(model, turn1, 6, past_key_values=cache)
        clean = _greedy(model, turn1, 6, past_key_values=NosaCache(model.config))
    else:
        retried = conversation(NosaCache(model.config), fail=True)
        clean = conversation(NosaCache(model.config), fail=False)
    assert torch.equal(retried[0], clean[0])
    torch.testing.assert_close(retried[1], clean[1], atol=1e-5, rtol=0)


def _interrupt_at(step: int):
    """A stopping criterion that raises KeyboardInterrupt at generate's ``step``-th check (a user's Ctrl-C)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Interrupt(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.calls += 1
            if self.calls == step:
                raise KeyboardInterrupt
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Interrupt()])


def test_an_interrupted_generate_leaves_the_cache_as_it_was():
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model("qwen2", cfg, seed=4)
    g = torch.Generator().manual_seed(5)
    turn1 = torch.randint(3, 97, (1, 200), generator=g)
    cache = NosaCache(model.config)
    answer, _ = _greedy(model, turn1, 4, past_key_values=cache)
    before = _state(cache)
    turn2 = torch.cat([answer, torch.randint(3, 97, (1, 90), generator=g)], 1)
    with pytest.raises(KeyboardInterrupt):
        _greedy(model, turn2, 8, past_key_values=cache, stopping_criteria=_interrupt_at(3))
    assert _state(cache) == before
    retried = _greedy(model, turn2, 8, past_key_values=cache)
    clean_cache = NosaCache(model.config)
    _greedy(model, turn1, 4, past_key_values=clean_cache)
    clean = _greedy(model, turn2, 8, past_key_values=clean_cache)
    assert torch.equal(retried[0], clean[0])
    torch.testing.assert_close(retried[1], clean[1], atol=1e-5, rtol=0)


def test_a_forward_that_raises_leaves_the_cache_as_it_was():
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model("llama", cfg, seed=4)
    ids = torch.randint(3, 97, (1, 200), generator=torch.Generator().manual_seed(3))
    cache = NosaCache(model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :150], past_key_values=cache)
        before = cache.stats()
        _, handle = _raise_on_call(model, 1, lambda n, i: True)
        with pytest.raises(_Boom):
            model(input_ids=ids[:, 150:], past_key_values=cache)
        handle.remove()
        assert _state(cache) == _state_of(before)
        retried = model(input_ids=ids[:, 150:], past_key_values=cache).logits
        clean_cache = NosaCache(model.config)
        model(input_ids=ids[:, :150], past_key_values=clean_cache)
        clean = model(input_ids=ids[:, 150:], past_key_values=clean_cache).logits
    torch.testing.assert_close(retried, clean, atol=1e-5, rtol=0)


def test_a_cache_that_could_not_be_restored_says_so_until_reset(monkeypatch):
    from hf_nosa.cache.nosa_cache import NosaLayer

    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model("llama", cfg, seed=4)
    ids = torch.randint(3, 97, (1, 200), generator=torch.Generator().manual_seed(3))
    cache = NosaCache(model.config)
    _greedy(model, ids, 3, past_key_values=cache)
    _, handle = _raise_on_call(model, 1, lambda n, i: True)
    monkeypatch.setattr(NosaLayer, "rewind", lambda self, length: (_ for _ in ()).throw(OSError("host store gone")))
    with pytest.raises(_Boom):
        _greedy(model, torch.cat([ids, ids], 1), 3, past_key_values=cache)
    handle.remove()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="raised _Boom .* restoring the 202 tokens it held before failed too"):
        _greedy(model, torch.cat([ids, ids], 1), 3, past_key_values=cache)
    cache.reset()
    tokens, _ = _greedy(model, ids, 3, past_key_values=cache)
    assert tokens.shape == (1, 203)


# ----- non-finite eviction heads, every path -----

def _poison(model, layer: int, name: str):
    head = model.model.layers[layer].self_attn.eviction_head
    with torch.no_grad():
        if name == "A":
            head.A[1] = float("nan")
        else:
            head.delta.weight[0, 3] = float("inf")


@pytest.mark.parametrize("name", ["A", "delta.weight"])
@pytest.mark.parametrize("path", ["plain forward", "DynamicCache generate", "between turns", "one-token turn"])
def test_non_finite_heads_are_refused_on_every_path(name, path):
    model = _model("llama", small_nosa_config(**SPARSE), seed=5)
    ids = torch.randint(3, 97, (1, 80), generator=torch.Generator().manual_seed(2))
    cache = NosaCache(model.config)
    if path in ("between turns", "one-token turn"):
        out, _ = _greedy(model, ids, 3, past_key_values=cache)
        ids = out if path == "one-token turn" else torch.cat([out, ids], 1)
    _poison(model, 1, name)
    with pytest.raises(ValueError, match=f"layer 1: eviction_head.{name} holds NaN or inf"):
        if path == "plain forward":
            with torch.no_grad():
                model(input_ids=ids)
        elif path == "DynamicCache generate":
            _greedy(model, ids, 3, past_key_values=DynamicCache(config=model.config))
        else:
            _greedy(model, ids, 3, past_key_values=cache)


# ----- on the GPU: the kernels' paths (fetch, flash_biased with the partial block, graph-replayed decode) -----

def _gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@_gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("second", [40, 333])
def test_a_new_turn_on_the_gpu_equals_stock_generate_at_full_budget(family, second, monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    stock = tiny_model(family, seed=7).cuda()
    model = to_nosa(tiny_model(family, seed=7), small_nosa_config(budget_tokens=1024, prefill_chunk_size=128)).cuda()
    g = torch.Generator().manual_seed(8)
    cache = NosaCache(model.config)
    turn1 = torch.randint(3, 97, (2, 150), generator=g).cuda()
    answer1, _ = _greedy(model, turn1, 6, past_key_values=cache)
    turn2 = torch.cat([answer1, torch.randint(3, 97, (2, second), generator=g).cuda()], 1)
    answer2, logits2 = _greedy(model, turn2, 6, past_key_values=cache)
    expected, expected_logits = _greedy(stock, turn2, 6)
    assert torch.equal(answer2, expected)
    torch.testing.assert_close(logits2, expected_logits, atol=1e-3, rtol=1e-3)


@_gpu
def test_a_sparse_turn_on_the_gpu_equals_the_cpu_and_survives_a_failed_decode(monkeypatch):
    """Sparse budget: the GPU's kernels give the CPU reference's tokens for both turns; a generate interrupted after
    graph-replayed decode steps is rolled back, and the retry gives the same answer again."""
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model("llama", cfg, seed=1)
    results = {}
    for device in ("cpu", "cuda"):
        model = model.to(device)
        cache, held, turn2, answer2, logits2 = _turns(model, 300, 400, seed=2)
        results[device] = (answer2.cpu(), logits2.cpu(), cache.stats()["device_tokens"])
    assert torch.equal(results["cpu"][0], results["cuda"][0])
    torch.testing.assert_close(results["cpu"][1], results["cuda"][1], atol=2e-3, rtol=2e-3)
    assert results["cuda"][2] <= cfg.prefill_budget_blocks * 16 + cfg.prefill_chunk_size + 16
    g = torch.Generator().manual_seed(2)
    cache = NosaCache(model.config)
    turn1 = torch.randint(3, 97, (1, 300), generator=g).cuda()
    answer1, _ = _greedy(model, turn1, 6, past_key_values=cache)
    turn2 = torch.cat([answer1, torch.randint(3, 97, (1, 400), generator=g).cuda()], 1)
    with pytest.raises(KeyboardInterrupt):
        _greedy(model, turn2, 6, past_key_values=cache, stopping_criteria=_interrupt_at(4))
    assert cache.get_seq_length() == answer1.shape[1] - 1
    retried, retried_logits = _greedy(model, turn2, 6, past_key_values=cache)
    assert torch.equal(retried.cpu(), results["cuda"][0])
    torch.testing.assert_close(retried_logits.cpu(), results["cuda"][1], atol=1e-3, rtol=1e-3)


def _variant_keys() -> set:
    """``kernel: specialization key`` of every Triton variant hf_nosa's kernels compiled so far."""
    import sys

    found = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("hf_nosa.kernels.") and module is not None:
            for attr, value in vars(module).items():
                for cache in getattr(value, "device_caches", {}).values():
                    found.update(f"{name}.{attr}: {key}" for key in cache[0])
    return found


@_gpu
def test_a_stream_of_new_lengths_compiles_and_captures_nothing_after_the_longest(monkeypatch):
    """No warm-up per shape: after a first request (the longest), requests of other lengths (not multiples of 16
    or 4, shorter, longer by a few tokens) compile no Triton variant and capture no decode graph: lengths are not
    specialized on (nor the alignment of a view that starts at a length-dependent offset), the workspace's capacity
    buffers only grow, graphs are kept by key (a first decode step's graph is captured beside the second's). Tokens
    equal a fresh model's."""
    from hf_nosa.modeling.cuda_graph import compiled_kernel_variants
    from hf_nosa.cache.workspace import workspace_of

    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=128, prefill_budget_tokens=64)

    def run(model, length):
        ids = torch.randint(3, 97, (1, length), generator=torch.Generator().manual_seed(length)).cuda()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, cache_implementation="nosa")
        return out[:, length:]

    model = _model("llama", cfg, seed=5).cuda()
    run(model, 1000)
    variants, graph = compiled_kernel_variants(), workspace_of(model).decode_graph
    captures = graph.captures
    keys = _variant_keys()
    answers = {length: run(model, length) for length in (517, 150, 333, 1003, 771)}
    assert compiled_kernel_variants() == variants, sorted(_variant_keys() - keys)
    assert graph.captures == captures, graph.recaptures
    for length in (333, 1003):
        assert torch.equal(answers[length], run(_model("llama", cfg, seed=5).cuda(), length))


def test_a_new_turn_is_cut_on_blocks_with_its_dense_tail_in_one_chunk():
    from hf_nosa.modeling.chunked import chunk_edges

    assert chunk_edges(0, 5000, 2048, 64, 64) == [0, 2048, 4096, 5000]  # a new prompt: multiples of the chunk
    # 61439 held: the first chunk ends on the next block boundary, the 63 tokens left join the chunk before them
    assert chunk_edges(61439, 4096, 2048, 64, 64) == [0, 1985, 4096]
    assert chunk_edges(61439, 4200, 2048, 64, 64) == [0, 1985, 4033, 4200]
    assert chunk_edges(61440, 4096, 2048, 64, 64) == [0, 2048, 4096]
    assert chunk_edges(100, 30, 2048, 64, 64) == [0, 30]
    assert chunk_edges(61439, 4096, 2048, 64, 0) == [0, 1985, 4033, 4096]  # no dense tail: nothing to keep together
    assert chunk_edges(310, 300, 64, 16, 64) == [0, 58, 122, 186, 250, 300]  # 50 tokens left: a block or more


def test_restoring_reads_a_prefill_budget_at_a_time_and_only_the_layers_a_call_touched(monkeypatch):
    """The repair never holds a layer's whole K/V on the device (as a crop does not), and a layer the failed call
    never reached is left as it is."""
    from hf_nosa.cache.nosa_cache import NosaLayer
    from hf_nosa.cache.host_store import HostStore

    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64, prefill_budget_tokens=64)
    model = _model("llama", cfg, seed=4)
    ids = torch.randint(3, 97, (1, 300), generator=torch.Generator().manual_seed(3))
    cache = NosaCache(model.config)
    _greedy(model, ids, 3, past_key_values=cache)
    reads, rewound = [], []
    original_read, original_rewind = HostStore.read, NosaLayer.rewind
    monkeypatch.setattr(HostStore, "read", lambda self, lo, hi, device: reads.append(hi - lo) or
                        original_read(self, lo, hi, device))
    monkeypatch.setattr(NosaLayer, "rewind", lambda self, n: rewound.append(self.layer_idx) or original_rewind(self, n))
    _, handle = _raise_on_call(model, 0, lambda n, i: True)  # before layer 0 stores anything: nothing to repair
    with pytest.raises(_Boom):
        _greedy(model, torch.cat([ids, ids], 1), 3, past_key_values=cache)
    handle.remove()
    assert rewound == []
    _, handle = _raise_on_call(model, 1, lambda n, i: True)  # layer 0 stored the turn's first chunk
    with pytest.raises(_Boom):
        _greedy(model, torch.cat([ids, ids], 1), 3, past_key_values=cache)
    handle.remove()
    assert rewound == [0]
    assert reads and max(reads) <= cfg.prefill_budget_blocks * cfg.block_size
    retried, _ = _greedy(model, torch.cat([ids, ids], 1), 3, past_key_values=cache)
    assert retried.shape == (1, 603)


@pytest.mark.parametrize("how", ["generate", "nosa generate", "forward"])
def test_an_empty_prompt_is_a_clear_error(how):
    model = _model("llama", small_nosa_config(), seed=1)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="input_ids has no tokens"):
        if how == "forward":
            with torch.no_grad():
                model(input_ids=empty, past_key_values=NosaCache(model.config))
        else:
            nosa = {"cache_implementation": "nosa"} if how == "nosa generate" else {}
            model.generate(empty, max_new_tokens=3, **nosa)


def test_a_cache_generate_built_for_one_call_is_not_restored(monkeypatch):
    """cache_implementation="nosa" builds a cache no one holds after the call: a failure is not repaired."""
    from hf_nosa.cache.nosa_cache import NosaLayer

    model = _model("llama", small_nosa_config(**SPARSE), seed=4)
    rewound = []
    monkeypatch.setattr(NosaLayer, "rewind", lambda self, n: rewound.append(n))
    _, handle = _raise_on_call(model, 1, lambda n, i: n == 1)
    with pytest.raises(_Boom):
        _greedy(model, torch.randint(3, 97, (1, 100)), 4, cache_implementation="nosa")
    handle.remove()
    assert rewound == []


def test_a_new_turn_grows_each_host_store_once_to_its_prompt_and_answer():
    """generate reserves prompt + max_new_tokens; on a cache that already holds a conversation the host stores grow
    to that in one growth (one pinning a turn), not by a share of what they hold."""
    cfg = small_nosa_config(**SPARSE, prefill="quoka", prefill_chunk_size=64)
    model = _model("llama", cfg, seed=5)
    cache, held, turn2, answer2, _ = _turns(model, 600, 100, seed=6)
    P = cfg.block_size
    want = -(-(turn2.shape[1] + 6) // P) * P  # the turn's max_length, in whole blocks
    for layer in cache.layers:
        assert layer.host.capacity == want, (layer.host.capacity, want)
        assert len(layer.host.k_chunks) == 2  # the first turn's chunk and the turn's growth
