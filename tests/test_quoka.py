"""QUOKA chunked prefill: identity with dense prefill, the query choice, the device-memory bound, generate."""

import math

import pytest
import torch

from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.modeling import attention as attention_module
from hf_nosa.prefill import chunked as prefill_module
from hf_nosa.rules.attend import with_prefix_read
from hf_nosa.kernels.backend import HAS_TRITON
from hf_nosa.kernels.prefill.quoka_score import quoka_score
from hf_nosa.modeling import randomize_eviction_heads
from hf_nosa.rules.selection import (
    MASK_VALUE,
    compress_keys,
    num_windows,
    quoka_query_choice,
    quoka_scores,
    quoka_select_blocks,
)

from .conftest import small_nosa_config, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _model(family, seed=0, **overrides):
    model = to_nosa(tiny_model(family, seed=seed, **overrides), small_nosa_config())
    return randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 7))


def _prompt(batch, length, seed, left_pad=()):
    ids = torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, n in enumerate(left_pad):
        ids[row, :n] = 0
        mask[row, :n] = 0
    return ids, mask


def _run(model, cache, ids, mask, steps):
    """Prefill, then greedy decoding one token per forward: every step's logits of the real positions."""
    outs = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
        outs.append(logits)
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            logits = model(nxt, attention_mask=mask, past_key_values=cache).logits
            outs.append(logits)
    return outs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("left_pad", [(), (0, 37, 70)], ids=["batch1", "leftpad3"])
def test_quoka_equals_dense_when_the_budget_covers_the_prompt(family, left_pad):
    model = _model(family)
    ids, mask = _prompt(max(1, len(left_pad)), 150, seed=1, left_pad=left_pad)
    # The decode budget covers the sequence too: decoding then sees every real token whatever the padding holds.
    base = dict(budget_tokens=256, prefill_budget_tokens=256, prefill_chunk_size=32, quoka_queries=3)
    dense = NosaCache(model.config, small_nosa_config(prefill="dense", **base))
    quoka = NosaCache(model.config, small_nosa_config(prefill="quoka", **base))
    expected, actual = _run(model, dense, ids, mask, 4), _run(model, quoka, ids, mask, 4)
    real = mask.bool()
    torch.testing.assert_close(actual[0][real], expected[0][real], atol=1e-4, rtol=1e-4)
    for step_actual, step_expected in zip(actual[1:], expected[1:]):  # decoding continues exactly as after dense
        torch.testing.assert_close(step_actual, step_expected, atol=1e-4, rtol=1e-4)
    assert quoka.stats()["seen_tokens"] == dense.stats()["seen_tokens"] == 154


def test_layer_state_after_quoka_prefill_is_the_dense_state():
    # No padding: what padded positions hold (keys of padding tokens) is garbage in either mode.
    model = _model("llama", seed=3)
    ids, mask = _prompt(2, 141, seed=2)
    caches = {}
    for mode in ("dense", "quoka"):
        caches[mode] = NosaCache(model.config, small_nosa_config(prefill=mode, prefill_chunk_size=48))
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=caches[mode])
    for dense, quoka in zip(caches["dense"].layers, caches["quoka"].layers):
        n = dense.compressed.n
        assert quoka.compressed.n == n == num_windows(141, dense.cfg)
        for name in ("keys", "bias"):
            actual, expected = getattr(quoka.compressed, name), getattr(dense.compressed, name)
            torch.testing.assert_close(actual[:, :, :n], expected[:, :, :n])
        for name in ("ring_k", "ring_b", "slot_block", "tail_slot"):
            torch.testing.assert_close(getattr(quoka.compressed if "ring" in name else quoka, name),
                                       getattr(dense.compressed if "ring" in name else dense, name))
        torch.testing.assert_close(quoka.slot_k[:, :, 0, : 141 % 16], dense.slot_k[:, :, 0, : 141 % 16])
        for a, b in zip(quoka.host.read(0, 141, "cpu"), dense.host.read(0, 141, "cpu")):
            torch.testing.assert_close(a, b)


def test_tokens_after_the_prompt_attend_by_the_decode_rule():
    """A second call of several tokens after a prompt (assisted-decoding candidates, up to decode_rule_tokens) sees,
    token by token, exactly what decoding each token alone would select."""
    model = _model("qwen3", seed=4)
    ids, mask = _prompt(2, 150, seed=3, left_pad=(0, 30))
    # 81 tokens after the prompt: the decode rule up to decode_rule_tokens (a longer new turn is prefilled)
    config = small_nosa_config(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32, decode_rule_tokens=96)
    together, one_by_one = NosaCache(model.config, config), NosaCache(model.config, config)
    with torch.no_grad():
        model(ids[:, :69], attention_mask=mask[:, :69], past_key_values=together)
        second = model(ids[:, 69:], attention_mask=mask, past_key_values=together).logits
        model(ids[:, :69], attention_mask=mask[:, :69], past_key_values=one_by_one)
        steps = [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=one_by_one).logits
                 for t in range(69, 150)]
    torch.testing.assert_close(second, torch.cat(steps, 1), atol=1e-4, rtol=1e-4)
    assert together.get_seq_length() == one_by_one.get_seq_length() == 150

def test_query_choice_keeps_the_lowest_cosine_queries_hand_checked():
    # Head 0: mean (1.5, 1/3); cosines 0.976 (x3), 0.217, -0.976, 0.844 -> keep tokens 4, 3.
    # Head 1: the same queries negated but for token 0 -> a different mean and choice.
    head0 = torch.tensor([[3.0, 0], [3, 0], [3, 0], [0, 1], [-1, 0], [1, 1]])
    head1 = torch.tensor([[0.0, 5], [-3, 0], [-3, 0], [0, -1], [1, 0], [-1, -1]])
    query = torch.stack([head0, head1])[None]  # [1, 2, 6, 2]
    kept = quoka_query_choice(query, 2)
    mean1 = head1.mean(0)
    cos1 = torch.nn.functional.cosine_similarity(head1, mean1[None], dim=-1)
    assert kept[0, 0].tolist() == [4, 3]
    assert kept[0, 1].tolist() == torch.argsort(cos1)[:2].tolist()
    # Padding (token 4) leaves the mean and is kept last: mean (2, 0.4) -> cosines 0.98, 0.196, 0.832.
    valid = torch.tensor([[True, True, True, True, False, True]])[:, None]
    assert quoka_query_choice(query, 2, valid)[0, 0].tolist() == [3, 5]
    assert quoka_query_choice(query, 6, valid)[0, 0, -1].item() == 4
    assert quoka_query_choice(query, 10).shape == (1, 2, 6)  # never more than the chunk has


def test_query_choice_matches_a_brute_force_sort():
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 3, 20, 8, generator=g)
    kept = quoka_query_choice(query, 5)
    for index in torch.cartesian_prod(torch.arange(2), torch.arange(4), torch.arange(3)).tolist():
        q = query[tuple(index)]
        cos = torch.nn.functional.cosine_similarity(q, q.mean(0, keepdim=True), dim=-1)
        assert kept[tuple(index)].tolist() == torch.argsort(cos)[:5].tolist()


def test_scores_are_the_kept_queries_mean_attention_mass_summed_over_the_group():
    cfg = small_nosa_config()  # block 16, windows of 8 every 4: block b pools windows 4b-1 .. 4b+3
    # One KV head, group of two query heads, two kept queries; keys along the axes, a sharp one (0, 10) in window 6.
    kept = torch.tensor([[[[2.0, 0], [0, 3]]], [[[0.0, 1], [0, 1]]]])[None]  # [1, 2, 1, 2, 2]
    keys = torch.tensor([[1.0, 0], [0, 1], [-1, 0]] + [[-1.0, -1]] * 3 + [[0, 10], [-1, -1]])[None, None]  # [1, 1, 8, 2]

    def by_hand(n_windows, n_queries):
        """Per head and kept query a softmax over the windows of q.k / sqrt(D); summed over heads, mean over queries."""
        mass = [0.0] * n_windows
        for g in range(2):
            for i in range(n_queries):
                logits = [float(kept[0, g, 0, i] @ keys[0, 0, w]) / math.sqrt(2) for w in range(n_windows)]
                total = sum(math.exp(x) for x in logits)
                for w in range(n_windows):
                    mass[w] += math.exp(logits[w]) / total / n_queries
        return torch.tensor(mass)

    scores = quoka_scores(kept, keys, torch.tensor([8]), 2, cfg)
    window = by_hand(8, 2)
    assert torch.allclose(scores[0, 0, 0], torch.stack([window[0:4].max(), window[3:8].max()]))
    assert scores[0, 0, 0, 1] > 1.0 > scores[0, 0, 0, 0]  # the sharp key draws the mass of three of four queries
    only_first = quoka_scores(kept, keys, torch.tensor([8]), 2, cfg, n_valid=torch.tensor([[1]]))
    assert torch.allclose(only_first[0, 0, 0], torch.stack([by_hand(8, 1)[0:4].max(), by_hand(8, 1)[3:8].max()]))
    cut = quoka_scores(kept, keys, torch.tensor([2]), 2, cfg)  # windows 2.. not complete: neither scored nor in the softmax
    assert cut[0, 0, 0, 1] == float("-inf") and torch.allclose(cut[0, 0, 0, 0], by_hand(2, 2).max())
    none = quoka_scores(kept, keys, torch.tensor([8]), 2, cfg, n_valid=torch.tensor([[0]]))
    assert torch.isneginf(none).all()  # no real kept query: nothing to score


def test_selection_forces_sink_and_local_then_takes_the_top_scores():
    cfg = small_nosa_config(sink_tokens=16, local_tokens=32, prefill_budget_tokens=80)  # K = 5
    scores = torch.tensor([0.0, 0.9, 0.1, 0.8, 0.7, 0.2, -0.5, 0.95, 0.99, 0.3])[None, None, None].repeat(1, 1, 2, 1)
    chosen = quoka_select_blocks(scores, torch.tensor([8, 3]), cfg)
    assert sorted(chosen[0, 0, 0].tolist()) == [0, 1, 3, 6, 7]  # sink 0, local 6 7, then 0.9 and 0.8
    assert sorted(chosen[0, 0, 1].tolist()) == [-1, -1, 0, 1, 2]  # only 3 candidates before block 3


@pytest.mark.parametrize("chunk, budget", [(32, 64), (48, 96)])
def test_device_kv_never_exceeds_budget_plus_chunk(monkeypatch, chunk, budget):
    # Without a dense tail: the bound then holds whatever the prompt length (test_dense_tail_* below cover the tail).
    model = _model("llama", seed=5)
    cfg = small_nosa_config(budget_tokens=96, query_tokens=16, prefill_budget_tokens=budget, prefill_chunk_size=chunk,
                            prefill_dense_tail_tokens=0)
    seen = []
    original = attention_module.attend_cache_inputs

    def spy(query, inputs, scale):
        if query.shape[2] > 1:  # a prefill chunk: the keys it can attend to (the rest carry MASK_VALUE)
            whole = with_prefix_read(inputs)  # the chunk's blocks fetched for every row, before its own keys
            seen.append(int((whole.key_bias > MASK_VALUE / 2).sum(-1).amax()))
        return original(query, inputs, scale)

    monkeypatch.setattr(attention_module, "attend_cache_inputs", spy)
    ids, mask = _prompt(2, 700, seed=6, left_pad=(0, 50))
    cache = NosaCache(model.config, cfg)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
    stats = cache.stats()
    assert torch.isfinite(logits).all()
    assert stats["seen_tokens"] == stats["host_tokens"] == 700
    assert max(seen) <= budget + chunk and stats["device_tokens"] <= budget + chunk
    assert len(seen) == 2 * -(-700 // chunk)  # every chunk of both layers went through the budget
    # Decoding continues from the host store within the decode budget.
    with torch.no_grad():
        model(logits[:, -1:].argmax(-1), attention_mask=torch.cat([mask, mask[:, :1]], 1), past_key_values=cache)
    assert cache.stats()["seen_tokens"] == 701


def test_auto_is_dense_while_the_prompt_fits_and_quoka_beyond(monkeypatch):
    cfg = small_nosa_config(prefill_budget_tokens=64, prefill_chunk_size=32)
    assert cfg.prefill == "auto" and NosaConfig().prefill == "auto"
    assert (cfg.prefill_mode(64), cfg.prefill_mode(65)) == ("dense", "quoka")
    assert small_nosa_config(prefill="nosa").prefill_mode(10**6) == "nosa"
    model = _model("llama")
    calls = []
    original = prefill_module.quoka_select
    monkeypatch.setattr("hf_nosa.prefill.chunked.quoka_select", lambda *a: calls.append(1) or original(*a))
    for length, used in ((60, False), (100, True)):
        calls.clear()
        cache = NosaCache(model.config, cfg)
        with torch.no_grad():
            model(_prompt(1, length, seed=0)[0], past_key_values=cache)
        assert bool(calls) == used
        assert cache.stats()["device_tokens"] == (64 + 32 if used else 60) or used


def test_generate_on_a_long_prompt_with_the_default_config():
    model = to_nosa(tiny_model("llama", seed=2, max_position_embeddings=8192))
    cfg = NosaConfig()  # prefill="auto": the prompt is longer than the budget, so QUOKA runs
    ids, _ = _prompt(1, cfg.budget_tokens + 700, seed=9)
    out = model.generate(ids, cache_implementation="nosa", max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True)
    assert out.sequences.shape == (1, ids.shape[1] + 3)
    stats = out.past_key_values.stats()
    assert stats["seen_tokens"] == ids.shape[1] + 2 and stats["decode_steps"] == 2
    # the last chunk holds the prompt's tail and attends to the whole prompt (prefill_dense_tail_tokens), read a
    # prefill budget at a time: the device still holds at most the budget and the chunk
    assert cfg.budget_tokens < stats["device_tokens"] <= cfg.budget_tokens + cfg.prefill_chunk(1)


def test_quoka_outside_a_nosa_cache_says_it_attends_fully(caplog, monkeypatch):
    import hf_nosa.modeling.attention as attention

    monkeypatch.setattr(attention, "_warned_quoka", False)
    model = to_nosa(tiny_model("llama"), small_nosa_config(prefill="quoka"))
    ids = _prompt(1, 40, seed=0)[0]
    with caplog.at_level("WARNING"), torch.no_grad():
        model(ids, use_cache=False)
        model(ids, use_cache=False)
    assert sum("only inside a NosaCache" in r.message for r in caplog.records) == 1


def test_compressed_keys_extend_like_a_rebuild():
    cfg = small_nosa_config()
    g = torch.Generator().manual_seed(1)
    keys, bias = torch.randn(2, 2, 90, 8, generator=g), torch.randn(2, 2, 90, generator=g)
    from hf_nosa.cache.compressed_keys import CompressedKeys

    whole, pieces = CompressedKeys(cfg, keys), CompressedKeys(cfg, keys)
    whole.rebuild(keys, bias)
    for a, b in ((0, 3), (3, 21), (21, 22), (22, 64), (64, 90)):
        pieces.extend(keys[:, :, a:b], bias[:, :, a:b], a)
    assert pieces.n == whole.n == num_windows(90, cfg)
    torch.testing.assert_close(pieces.keys[:, :, : whole.n], compress_keys(keys, cfg))
    torch.testing.assert_close(pieces.bias[:, :, : whole.n], whole.bias[:, :, : whole.n])
    torch.testing.assert_close(pieces.ring_k, whole.ring_k)


@pytest.mark.parametrize("kernel, stride", [(16, 8), (8, 4), (8, 8), (4, 2)])
def test_compressed_keys_extend_like_a_rebuild_at_random_splits(kernel, stride):
    """Random cut points (runs shorter and longer than a window, ring wrap-arounds) and window shapes."""
    from hf_nosa.cache.compressed_keys import CompressedKeys

    cfg = small_nosa_config(compress_kernel=kernel, compress_stride=stride)
    g = torch.Generator().manual_seed(kernel * 100 + stride)
    keys, bias = torch.randn(2, 2, 157, 8, generator=g), torch.randn(2, 2, 157, generator=g)
    cuts = sorted(set(torch.randint(1, 157, (9,), generator=g).tolist())) + [157]
    whole, pieces = CompressedKeys(cfg, keys), CompressedKeys(cfg, keys)
    whole.rebuild(keys, bias)
    a = 0
    for b in cuts:
        pieces.extend(keys[:, :, a:b], bias[:, :, a:b], a)
        a = b
    assert pieces.n == whole.n == num_windows(157, cfg)
    torch.testing.assert_close(pieces.keys[:, :, : whole.n], whole.keys[:, :, : whole.n])
    torch.testing.assert_close(pieces.bias[:, :, : whole.n], whole.bias[:, :, : whole.n])
    torch.testing.assert_close(pieces.ring_k, whole.ring_k)
    torch.testing.assert_close(pieces.ring_b, whole.ring_b)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("quoka_queries", 0, "at least 1"),
        ("quoka_queries", 2.5, "integer"),
        ("prefill", "QUOKA", "allowed values"),
        ("prefill", None, "allowed values"),
        ("prefill_chunk_size", 0, "at least one block"),
        ("prefill_chunk_size", 100, "multiple of block_size"),
        ("prefill_budget_tokens", 0, "positive multiple"),
        ("prefill_budget_tokens", 64, "sink_tokens + local_tokens"),
        ("prefill_budget_tokens", True, "integer or None"),
    ],
)
def test_bad_prefill_settings_are_errors(field, value, words):
    with pytest.raises(ValueError) as info:
        NosaConfig(**{field: value})
    assert f"NosaConfig.{field}={value!r}" in str(info.value) and words in str(info.value)


def test_bad_score_inputs_are_errors(monkeypatch):
    cfg = small_nosa_config()
    kept, keys, n_windows = torch.randn(1, 4, 2, 3, 8), torch.randn(1, 2, 10, 8), torch.tensor([3, 10])
    with pytest.raises(ValueError, match=r"\[B, H, R, n, D\]"):
        quoka_score(kept[0], keys, n_windows, 3, cfg)
    with pytest.raises(ValueError, match="multiple of Hk"):
        quoka_score(torch.randn(1, 3, 2, 3, 8), keys, n_windows, 3, cfg)
    with pytest.raises(ValueError, match="n_windows"):
        quoka_score(kept, keys, n_windows[:1], 3, cfg)
    with pytest.raises(ValueError, match="n_valid"):
        quoka_score(kept, keys, n_windows, 3, cfg, n_valid=torch.ones(2, 2))
    with pytest.raises(TypeError, match="NosaConfig"):
        quoka_score(kept, keys, n_windows, 3, {"block_size": 16})
    monkeypatch.setenv("HF_NOSA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="HF_NOSA_KERNELS='cuda'"):
        quoka_score(kept, keys, n_windows, 3, cfg)
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError if HAS_TRITON else RuntimeError, match="TRITON_INTERPRET|triton package"):
        quoka_score(kept, keys, n_windows, 3, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quoka_on_gpu_equals_dense_with_full_budget_and_the_torch_path_with_a_small_one(family, monkeypatch):
    model = _model(family).cuda()
    ids, mask = _prompt(3, 600, seed=11, left_pad=(0, 37, 200))
    ids, mask = ids.cuda(), mask.cuda()
    real = mask.bool()

    def prefill(**overrides):
        cache = NosaCache(model.config, small_nosa_config(**overrides))
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, past_key_values=cache).logits
        return logits, cache

    full = dict(budget_tokens=640, prefill_budget_tokens=640, prefill_chunk_size=64)
    dense, _ = prefill(prefill="dense", **full)
    quoka, _ = prefill(prefill="quoka", **full)
    torch.testing.assert_close(quoka[real], dense[real], atol=1e-4, rtol=1e-4)

    small = dict(prefill="quoka", prefill_budget_tokens=96, prefill_chunk_size=64)
    triton_logits, cache = prefill(**small)
    assert cache.stats()["device_tokens"] <= 96 + 64
    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    torch_logits, _ = prefill(**small)
    torch.testing.assert_close(triton_logits[real], torch_logits[real], atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_quoka_with_interpreted_kernels_equals_the_torch_path(monkeypatch, prompt_rotary_on_torch):
    """Both chunk-attention call sites (one forward; a continuing call that reads earlier blocks from the host store)
    through the Triton kernels in the interpreter, against the torch references, with a budget smaller than the
    prompt (so selected blocks come first in every chunk's key list). One layer: every kernel runs once a chunk, but
    the rotary embedding of a forward of several tokens (a program per token, bitwise its reference:
    tests/conftest.py ``prompt_rotary_on_torch``); the decode step's runs the kernel."""
    # The interpreter runs every kernel of a chunk program by program, so the prompt is short: 72
    # tokens in 32-token chunks with a 32-token dense tail (the first chunk; one attending to its selected blocks
    # with row 0's tail from its 9th query and the padded row's from its first; tail queries over the prefix alone),
    # then 24 tokens by the decode rule over the host store, whose budget of 4 blocks makes row 0's tokens from its
    # 9th on (position 80) attend sparsely, as the decode-rule continuation did in the longer prompt this replaced.
    # One decode step after it reads back what the continuation wrote to the store (the padded row's tokens at its
    # row-relative places); the longer prompt wrote past the store's blocks instead, which only showed by chance.
    model = _model("llama", seed=5, num_hidden_layers=1)
    ids, mask = _prompt(2, 96, seed=6, left_pad=(0, 21))
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    config = small_nosa_config(prefill="quoka", prefill_budget_tokens=48, prefill_chunk_size=32,
                               prefill_dense_tail_tokens=32, budget_tokens=64, query_tokens=16)

    def run():
        cache = NosaCache(model.config, config)
        with torch.no_grad():
            first = model(ids[:, :72], attention_mask=mask[:, :72], past_key_values=cache).logits
            second = model(ids[:, 72:], attention_mask=mask[:, :96], past_key_values=cache).logits
            step = model(ids[:, :1], attention_mask=mask, past_key_values=cache).logits
        return torch.cat([first, second, step], 1)

    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    expected = run()
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    actual = run()
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], atol=1e-4, rtol=1e-4)
    assert prompt_rotary_on_torch == [32, 32, 8, 24]  # the prompt's chunks, the continuation; the step on the kernel


# ----- the prompt's tail attends densely (prefill_dense_tail_tokens) -----


def _chunk_inputs(monkeypatch):
    """Per prefill chunk, in call order: (queries, keys the chunk's own rule lets it see in the widest row and KV
    head, each row's first dense-tail query or None)."""
    seen = []
    original = attention_module.attend_cache_inputs

    def spy(query, inputs, scale):
        if query.shape[2] > 1:
            whole = with_prefix_read(inputs._replace(tail=None))  # blocks or a prefix, read whole to count them
            first = None if inputs.tail is None else inputs.tail.first_query.tolist()
            seen.append((query.shape[2], int((whole.key_bias > MASK_VALUE / 2).sum(-1).amax()), first))
        return original(query, inputs, scale)

    monkeypatch.setattr(attention_module, "attend_cache_inputs", spy)
    return seen


def test_only_the_tails_queries_attend_to_every_earlier_token(monkeypatch):
    model = _model("llama", seed=8)
    cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32,
                            prefill_dense_tail_tokens=40)
    seen = _chunk_inputs(monkeypatch)
    cache = NosaCache(model.config, cfg)
    with torch.no_grad():
        model(_prompt(1, 300, seed=4)[0], past_key_values=cache)
    starts = list(range(0, 300, 32))
    per_layer = [seen[i :: 2] for i in range(2)]  # two layers, chunk by chunk
    for layer in per_layer:
        for start, (n_queries, visible, first) in zip(starts, layer):
            if start == 256:  # holds tokens 260 .. 287 of the tail: QUOKA's budget, then queries 4 .. 31 again
                assert visible <= 64 + n_queries and first == [4]
            elif start == 288:  # every query in the tail: the whole prompt, no QUOKA
                assert visible == start + n_queries and first is None
            else:
                assert visible <= 64 + n_queries and first is None
    # the tail's prefix came a prefill budget (64 tokens) at a time: the device never held more than 64 + 32
    assert cache.stats()["device_tokens"] == 64 + 32


def test_the_tail_leaves_earlier_chunks_as_quoka_prefills_them():
    # Chunks before the one holding the tail are QUOKA's alone; the last 40 tokens see more. (Tokens 256 .. 259
    # share their chunk's QUOKA selection with the tail's queries, which differ from layer 1 on.)
    model = _model("llama", seed=8)
    ids = _prompt(1, 300, seed=4)[0]
    logits = {}
    for tail in (0, 40):
        cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32,
                                prefill_dense_tail_tokens=tail)
        with torch.no_grad():
            logits[tail] = model(ids, past_key_values=NosaCache(model.config, cfg)).logits
    torch.testing.assert_close(logits[40][:, :256], logits[0][:, :256], atol=1e-5, rtol=1e-5)
    assert (logits[40][:, 260:] - logits[0][:, 260:]).abs().amax() > 1e-3


@pytest.mark.parametrize("left_pad", [(), (0, 45)], ids=["batch1", "leftpad2"])
def test_a_tail_covering_the_prompt_is_dense_prefill(left_pad):
    # Every chunk in the tail: each attends to everything before it, whatever the small budget.
    model = _model("qwen3", seed=6)
    ids, mask = _prompt(max(1, len(left_pad)), 200, seed=5, left_pad=left_pad)
    base = dict(prefill_budget_tokens=48, prefill_chunk_size=32)
    dense = NosaCache(model.config, small_nosa_config(prefill="dense", **base))
    tail = NosaCache(model.config, small_nosa_config(prefill="quoka", prefill_dense_tail_tokens=200, **base))
    expected, actual = _run(model, dense, ids, mask, 3), _run(model, tail, ids, mask, 3)
    real = mask.bool()
    torch.testing.assert_close(actual[0][real], expected[0][real], atol=1e-4, rtol=1e-4)
    for step_actual, step_expected in zip(actual[1:], expected[1:]):
        torch.testing.assert_close(step_actual, step_expected, atol=1e-4, rtol=1e-4)


def test_the_tails_host_reads_are_counted():
    # Tail over the whole prompt: chunk i reads tokens 0 .. 32 i of every layer, nothing else comes from the host.
    model = _model("llama", seed=2)
    cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=48, prefill_chunk_size=32,
                            prefill_dense_tail_tokens=1000)
    cache = NosaCache(model.config, cfg)
    with torch.no_grad():
        model(_prompt(2, 130, seed=7)[0], past_key_values=cache)
    layer = cache.layers[0]
    per_token = 2 * layer.kv_heads * (2 * layer.head_dim * 4 + 4)  # batch 2; K, V fp32 and the fp32 score
    assert cache.stats()["bytes_to_device"] == len(cache.layers) * per_token * sum(range(0, 130, 32))


def test_padded_rows_get_the_tail_they_would_alone():
    # The 90- and 45-token rows' tails fall in chunks the 150-token row takes by QUOKA: one chunk serves both rules.
    model = _model("llama", seed=9)
    cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=48, prefill_chunk_size=32,
                            prefill_dense_tail_tokens=20)
    pads = (0, 60, 105)
    ids, mask = _prompt(3, 150, seed=8, left_pad=pads)
    with torch.no_grad():
        together = model(ids, attention_mask=mask, past_key_values=NosaCache(model.config, cfg)).logits
        for row, pad in enumerate(pads):
            alone = model(ids[row : row + 1, pad:], past_key_values=NosaCache(model.config, cfg)).logits
            torch.testing.assert_close(together[row, pad:], alone[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_dense_tail_must_be_a_non_negative_integer(value):
    with pytest.raises(ValueError, match="prefill_dense_tail_tokens"):
        NosaConfig(prefill_dense_tail_tokens=value)
    saved = NosaConfig(prefill_dense_tail_tokens=0).to_dict()
    assert NosaConfig.from_dict(saved).prefill_dense_tail_tokens == 0


@pytest.mark.parametrize("chunk, local", [(32, 64), (64, 32)], ids=["chunk-inside-local", "chunk-beyond-local"])
@pytest.mark.parametrize("host_dtype", ["auto", "int8"])
def test_previous_chunk_moves_into_the_pool_from_the_device(monkeypatch, chunk, local, host_dtype):
    """The previous chunk's blocks that enter the local window are copied on the device, not fetched: the same
    attention (with an unquantized store up to the order of the slots, within the format's rounding with a quantized
    one), fewer bytes over PCIe, and every move-in lands where the fetch finds it resident."""
    model = _model("llama", seed=11)
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32, local_tokens=local, prefill="quoka",
                            prefill_budget_tokens=96, prefill_chunk_size=chunk, host_dtype=host_dtype)
    ids, mask = _prompt(2, 420, seed=12, left_pad=(0, 45))
    moved = []
    original = prefill_module.PrefillPaths._move_in_previous_chunk

    def counting(self, start, selected):
        before = self.slot_block.clone()
        original(self, start, selected)
        moved.append(int((self.slot_block != before).sum()))

    monkeypatch.setattr(prefill_module.PrefillPaths, "_move_in_previous_chunk", counting)
    with_move = NosaCache(model.config, cfg)
    expected_steps = _run(model, with_move, ids, mask, 3)
    monkeypatch.setattr(prefill_module.PrefillPaths, "_move_in_previous_chunk",
                        lambda self, start, selected: setattr(self, "previous_chunk", None))
    without = NosaCache(model.config, cfg)
    actual_steps = _run(model, without, ids, mask, 3)
    for a, b in zip(expected_steps, actual_steps):
        if host_dtype == "auto":
            torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
        else:
            torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)
    blocks = min(chunk, local) // cfg.block_size  # what each (row, KV head) gains per chunk in steady state
    assert sum(moved) > 0 and max(moved) <= 2 * model.config.num_key_value_heads * blocks
    saved = without.stats()["blocks_loaded"] - with_move.stats()["blocks_loaded"]
    assert saved == sum(moved)  # every block moved in was one the fetch would have brought over PCIe


def test_tail_pieces_shrink_with_the_batch_past_a_few_rows():
    """Up to TAIL_PIECE_ROWS rows a dense-tail piece is the prefill budget; beyond, rows x piece stays within
    TAIL_PIECE_ROWS budgets, in whole blocks, at least one."""
    rows = prefill_module.TAIL_PIECE_ROWS
    for batch in (1, rows, rows + 1, 38, 1000):
        piece = prefill_module.tail_piece_tokens(4096, batch, 64)
        assert piece % 64 == 0 and 64 <= piece <= 4096
        assert piece == 4096 if batch <= rows else batch * piece <= max(rows * 4096, batch * 64)
    assert prefill_module.tail_piece_tokens(4096, 38, 64) > prefill_module.tail_piece_tokens(4096, 76, 64)


def test_smaller_tail_pieces_give_the_same_prefill(monkeypatch):
    """Three padded rows with TAIL_PIECE_ROWS = 1: pieces of a third of the budget (one block of 16) give the same
    logits as budget-sized pieces."""
    model = _model("llama", seed=12)
    ids, mask = _prompt(3, 260, seed=13, left_pad=(0, 37, 5))
    cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=48, prefill_chunk_size=32,
                            prefill_dense_tail_tokens=100)

    sizes = []
    original = prefill_module.Prefix

    def spy(read, length, piece_tokens):
        sizes.append(piece_tokens)
        return original(read, length, piece_tokens)

    monkeypatch.setattr(prefill_module, "Prefix", spy)

    def run():
        sizes.clear()
        cache = NosaCache(model.config, cfg)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, past_key_values=cache).logits
        return logits[mask.bool()], set(sizes)

    whole, whole_sizes = run()
    monkeypatch.setattr(prefill_module, "TAIL_PIECE_ROWS", 1)
    pieces, piece_sizes = run()
    assert whole_sizes == {48} and piece_sizes == {16}
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)


def test_an_unpadded_prompt_skips_the_padding_work_with_the_same_result(monkeypatch):
    """generate's all-ones mask: no layer does padding work in any chunk, and the prefill is what the padding
    path gives; a mask with padding still takes that path."""
    model = _model("llama", seed=14)
    cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=48, prefill_chunk_size=32,
                            prefill_dense_tail_tokens=40)
    padded_chunks = []
    original = prefill_module.PrefillPaths._prompt_padding

    def counted(self, *args):
        pad, mask = original(self, *args)
        padded_chunks.append(pad is not None)
        return pad, mask

    monkeypatch.setattr(prefill_module.PrefillPaths, "_prompt_padding", counted)

    def run(ids, mask, force_padded=False):
        cache = NosaCache(model.config, cfg)
        if force_padded:
            begin = cache.begin_prefill
            monkeypatch.setattr(cache, "begin_prefill", lambda end, offsets=None, padding=True:
                                begin(end, offsets, padding=torch.ones(ids.shape[0], end, dtype=torch.bool)))
        padded_chunks.clear()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, past_key_values=cache).logits
        return logits, sum(padded_chunks)

    ids, mask = _prompt(2, 200, seed=15)
    assert bool(mask.all())
    skipped, n_skipped = run(ids, mask)
    padded_path, n_padded = run(ids, mask, force_padded=True)
    assert n_skipped == 0 and n_padded > 0
    torch.testing.assert_close(skipped, padded_path, atol=1e-5, rtol=1e-5)
    ids, mask = _prompt(2, 200, seed=15, left_pad=(0, 9))
    assert run(ids, mask)[1] > 0


@pytest.mark.parametrize("mode", ["quoka", "dense", "nosa"])
def test_a_padded_prompt_never_reaches_the_layers_as_a_batch_mask(mode):
    """A 2D padding mask stays with the cache: every layer of every chunk sees at most a causal mask shared by
    the batch (transformers would build ``[B, 1, chunk, context]``). In "dense" mode the logits are those of the
    same prompt given as the 4D mask the model would have built, which the layers then apply chunk by chunk (the
    other modes count a row given a 4D mask from its padding, not from its first real token: ``test_padding``
    holds them to the row alone)."""
    model = _model("llama", seed=16)
    cfg = small_nosa_config(prefill=mode, prefill_budget_tokens=48, prefill_chunk_size=32,
                            prefill_dense_tail_tokens=40)
    ids, mask = _prompt(3, 150, seed=17, left_pad=(0, 11, 70))
    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs.get("attention_mask"))

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        out = model(ids, attention_mask=mask, past_key_values=NosaCache(model.config, cfg)).logits
    for hook in hooks:
        hook.remove()
    assert len(seen) >= len(model.model.layers) * 5
    assert all(m is None or m.shape[0] == 1 or m.stride(0) == 0 for m in seen)  # one mask, expanded
    assert torch.isfinite(out).all()
    if mode != "dense":
        return
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask_4d = causal[None, None] & mask.bool()[:, None, None, :]
    with torch.no_grad():
        ref = model(ids, attention_mask=mask_4d, past_key_values=NosaCache(model.config, cfg)).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-4, rtol=1e-4)
