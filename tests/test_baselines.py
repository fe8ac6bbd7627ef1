"""Training-free selectors on the NosaCache engine: valid budgets, their scoring rules, identity at full budget."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.eval.baselines import BASELINES, QueryOnlySelector, QuestSelector, ShadowKVSelector, make_selector
from hf_nosa.cache.nosa_cache import NosaLayer

from .conftest import small_nosa_config, tiny_model


def _decode_layer(selector, cfg, *, B=2, Hk=2, G=2, D=8, prompt=150, steps=40, seed=0, pad=0):
    """A NosaLayer fed random keys: a prefill of ``prompt`` tokens (first ``pad`` of row 0 are padding), then
    ``steps`` decode tokens. Yields (layer, query, t, selection) for every decode step."""
    g = torch.Generator().manual_seed(seed)
    layer = NosaLayer(cfg, selector)
    k = torch.randn(B, Hk, prompt, D, generator=g)
    v = torch.randn(B, Hk, prompt, D, generator=g)
    q = torch.randn(B, Hk * G, prompt, D, generator=g)
    mask = None
    if pad:
        keep = torch.ones(B, prompt, dtype=torch.bool)
        keep[0, :pad] = False
        causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()
        mask = (causal[None] & keep[:, None, :])[:, None]  # [B, 1, T, T] bool, True = attend
    layer.update(k, v, query=q, bias=torch.zeros(B, Hk, prompt), attention_mask=mask, scaling=D**-0.5)
    keys = [k]
    for i in range(steps):
        t = prompt + i
        k1 = torch.randn(B, Hk, 1, D, generator=g)
        q1 = torch.randn(B, Hk * G, 1, D, generator=g)
        keys.append(k1)
        layer.update(k1, torch.randn(B, Hk, 1, D, generator=g), query=q1, bias=torch.zeros(B, Hk, 1), scaling=D**-0.5)
        yield layer, q1, t, torch.cat(keys, 2), selector.select(layer, q1, t, D**-0.5)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_selection_is_valid_within_budget_and_keeps_sink_and_local(name):
    cfg = small_nosa_config(budget_tokens=96, sink_tokens=16, local_tokens=32, query_tokens=16)
    K = cfg.budget_blocks
    for layer, _, t, _, chosen in _decode_layer(make_selector(name), cfg):
        c = t // cfg.block_size
        assert chosen.shape == (2, 2, K) and chosen.dtype == torch.long
        for row in chosen.reshape(-1, K).tolist():
            real = [b for b in row if b >= 0]
            assert len(real) == len(set(real)) == min(K, c)
            assert all(0 <= b < c for b in real)
            must = set(range(cfg.sink_blocks)) | set(range(c - cfg.local_blocks, c))
            assert must <= set(real)


def test_query_only_equals_nosa_with_the_whole_budget_query_aware():
    cfg = small_nosa_config(budget_tokens=96, sink_tokens=16, local_tokens=32, query_tokens=16)
    all_query = cfg.replace(query_tokens=cfg.budget_tokens - cfg.sink_tokens - cfg.local_tokens)
    for layer, q, t, _, chosen in _decode_layer(QueryOnlySelector(), cfg, seed=1):
        reference = copy.copy(layer)  # the same compressed keys, the NOSA rule with every free block query-aware
        reference.cfg, reference.selector = all_query, None
        expected = reference.select(q, t, 8**-0.5)
        assert torch.equal(chosen.sort(-1).values, expected.sort(-1).values)


def test_quest_bounds_are_the_per_block_key_min_max_and_pick_the_top_bounds():
    cfg = small_nosa_config(budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=0)
    P = cfg.block_size
    for layer, q, t, keys, chosen in _decode_layer(QuestSelector(), cfg, seed=2, steps=20):
        c = t // P
        blocks = keys[:, :, : c * P].unflatten(2, (c, P))  # [B, Hk, c, P, D]
        lo, hi = blocks.amin(3), blocks.amax(3)
        torch.testing.assert_close(layer.selector_state["kmin"][:, :, :c], lo)
        torch.testing.assert_close(layer.selector_state["kmax"][:, :, :c], hi)
        B, H, _, D = q.shape
        qq = q[:, :, 0].view(B, 2, H // 2, 1, D)
        bound = torch.maximum(qq * lo[:, :, None], qq * hi[:, :, None]).sum(-1).amax(2)  # [B, Hk, c]
        free = bound.clone()
        free[..., : cfg.sink_blocks] = float("-inf")
        free[..., c - cfg.local_blocks :] = float("-inf")
        n_free = cfg.budget_blocks - cfg.sink_blocks - cfg.local_blocks
        expected = free.topk(n_free, -1).indices
        for b in range(B):
            for h in range(2):
                assert set(expected[b, h].tolist()) <= set(chosen[b, h].tolist())


def test_shadowkv_landmarks_are_block_key_means_and_outliers_are_kept():
    cfg = small_nosa_config(budget_tokens=128, sink_tokens=16, local_tokens=16, query_tokens=0)
    P = cfg.block_size
    selector = ShadowKVSelector(outlier_fraction=0.25)
    for step, (layer, _, t, keys, chosen) in enumerate(_decode_layer(selector, cfg, seed=3, steps=20)):
        c = t // P
        means = keys[:, :, : c * P].unflatten(2, (c, P)).mean(3)
        state = layer.selector_state
        torch.testing.assert_close(state["ksum"][:, :, :c] / state["kcount"][:, :, :c, None], means)
        prefill_blocks = 150 // P
        k = keys[:, :, : prefill_blocks * P].unflatten(2, (prefill_blocks, P))
        cos = torch.nn.functional.cosine_similarity(k, k.mean(3, keepdim=True), dim=-1).amin(-1)
        outliers = (-cos).topk(int(cfg.budget_blocks * 0.25), -1).indices
        for b in range(2):
            for h in range(2):
                assert set(outliers[b, h].tolist()) <= set(chosen[b, h].tolist())


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_blocks_of_padding_are_never_selected(name):
    cfg = small_nosa_config(budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=0)
    for _, _, _, _, chosen in _decode_layer(make_selector(name), cfg, pad=48, seed=4, steps=5):
        # row 0 starts with 3 blocks of padding: block 0 is the sink (kept), blocks 1 and 2 have no key to score
        assert not ({1, 2} & set(chosen[0].flatten().tolist()))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_every_selector_at_full_budget_generates_what_the_default_cache_does(family):
    model = tiny_model(family, seed=5)
    cfg = small_nosa_config(budget_tokens=512)
    to_nosa(model, cfg)
    ids = torch.randint(3, 97, (2, 100), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for name in sorted(BASELINES):
        cache = NosaCache(model.config, cfg, selector=make_selector(name))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, past_key_values=cache)
        assert torch.equal(out, reference), name
        assert cache.stats()["locality"] == pytest.approx(1.0)


def test_selectors_run_generate_under_a_small_budget_with_bounded_device_memory():
    model = tiny_model("llama", seed=7)
    cfg = small_nosa_config(budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=16)
    to_nosa(model, cfg)
    ids = torch.randint(3, 97, (1, 200), generator=torch.Generator().manual_seed(8))
    for name in sorted(BASELINES):
        cache = NosaCache(model.config, cfg, selector=make_selector(name))
        model.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=cache)
        layer = cache.layers[0]
        assert layer.device_tokens() <= cfg.budget_tokens + cfg.block_size
        stats = cache.stats()
        assert stats["blocks_loaded"] > 0 and 0.0 < stats["locality"] <= 1.0


def test_bad_selector_input():
    with pytest.raises(ValueError, match="allowed values"):
        make_selector("h2o")
    with pytest.raises(ValueError, match="outlier_fraction"):
        ShadowKVSelector(outlier_fraction=1.5)


@pytest.mark.gpu
def test_selectors_on_cuda_generate_what_the_default_cache_does_at_full_budget():
    model = tiny_model("llama", seed=9).cuda()
    cfg = small_nosa_config(budget_tokens=512)
    to_nosa(model, cfg)
    ids = torch.randint(3, 97, (3, 150), generator=torch.Generator().manual_seed(10)).cuda()
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    for name in sorted(BASELINES):
        cache = NosaCache(model.config, cfg, selector=make_selector(name))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             past_key_values=cache)
        assert torch.equal(out, reference), name
