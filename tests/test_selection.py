"""The reference rules of selection.py on hand-checked cases."""

import torch

from hf_nosa.selection import (
    blocks_to_token_mask,
    compress_keys,
    num_windows,
    pool_windows_to_blocks,
    query_block_scores,
    select_blocks,
    topk_recent_first,
    window_offsets,
)

from .conftest import small_nosa_config
from hf_nosa import NosaConfig


def test_compressed_keys_are_window_means():
    cfg = small_nosa_config()  # kernel 8, stride 4
    x = torch.randn(2, 3, 21, 5)
    out = compress_keys(x, cfg)
    assert out.shape == (2, 3, num_windows(21, cfg), 5) == (2, 3, 4, 5)
    for w in range(4):
        torch.testing.assert_close(out[:, :, w], x[:, :, 4 * w : 4 * w + 8].mean(2))
    assert compress_keys(x[:, :, :7], cfg).shape[2] == 0


def test_window_offsets_match_the_paper():
    per_block, offsets = window_offsets(NosaConfig())  # block 64, kernel 32, stride 16
    assert per_block == 4 and offsets.tolist() == [-1, 0, 1, 2, 3]


def test_pooling_takes_the_max_over_overlapping_windows():
    cfg = small_nosa_config()  # block 16: block b <- windows 4b-1 .. 4b+3
    scores = torch.arange(10, dtype=torch.float32)  # 10 windows
    pooled = pool_windows_to_blocks(scores, 3, cfg, fill=float("-inf"))
    assert pooled.tolist() == [3.0, 7.0, 9.0]  # block 2: windows 7..11, only 7..9 exist
    spiky = torch.zeros(10)
    spiky[3] = 5.0  # window 3 (tokens 12..19) overlaps blocks 0 and 1
    assert pool_windows_to_blocks(spiky, 3, cfg, fill=0.0).tolist() == [5.0, 5.0, 0.0]


def test_topk_ties_go_to_the_most_recent_block():
    scores = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, float("-inf")])
    assert topk_recent_first(scores, 3).tolist() == [4, 2, 1]
    assert topk_recent_first(scores, 7).tolist() == [4, 2, 1, 3, 0, -1, -1]


def _select(qs, es, current, **cfg):
    cfg = small_nosa_config(**cfg)
    qs = torch.as_tensor(qs, dtype=torch.float32)[None, None, None]
    es = torch.as_tensor(es, dtype=torch.float32)[None, None, None]
    return select_blocks(qs, es, torch.tensor([current]), cfg)[0, 0, 0].tolist()


def test_sink_and_local_are_always_selected():
    # budget 4 blocks = 1 sink + 2 local + 1 query-aware, nothing left for the eviction head
    qs = [0.0, 0.9, 0.1, 0.8, 0.2, 0.0, 0.0, 0.0]
    es = [0.0] * 8
    chosen = _select(qs, es, current=7, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=32)
    assert sorted(chosen) == [0, 1, 5, 6]  # sink 0, local 5-6, query-aware best among 1..4 is block 1


def test_eviction_head_fills_the_rest_of_the_budget():
    qs = [0.0, 0.9, 0.1, 0.8, 0.2, 0.7, 0.0, 0.0, 0.0]
    es = [0.0, -5.0, 4.0, -1.0, 3.0, -2.0, 0.0, 0.0, 0.0]
    # budget 6 = sink 1 + local 2 + query 1 + 2 from the eviction score
    chosen = _select(qs, es, current=8, budget_tokens=96, query_tokens=16, sink_tokens=16, local_tokens=32)
    assert sorted(chosen) == [0, 1, 2, 4, 6, 7]
    # blocks at or after the current one are never chosen, and short histories leave empty (-1) entries
    short = _select(qs, es, current=3, budget_tokens=96, query_tokens=16, sink_tokens=16, local_tokens=32)
    assert sorted(short) == [-1, -1, -1, 0, 1, 2]


def test_eviction_constraint_dropped_blocks_never_return():
    """The blocks guaranteed by the eviction head form a cache: once out, a block never comes back."""
    torch.manual_seed(0)
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32, sink_tokens=16, local_tokens=32)  # K=8
    n_blocks = 60
    es_fixed = torch.randn(n_blocks)
    r = cfg.budget_blocks - cfg.sink_blocks - cfg.local_blocks - cfg.query_blocks
    guaranteed_before, dropped = None, set()
    for current in range(cfg.sink_blocks + cfg.local_blocks + 1, n_blocks):
        qs = torch.rand(n_blocks)  # the query changes every step
        chosen = set(_select(qs, es_fixed, current, budget_tokens=128, query_tokens=32, sink_tokens=16, local_tokens=32))
        eligible = torch.arange(cfg.sink_blocks, current - cfg.local_blocks)
        top = eligible[torch.topk(es_fixed[eligible], min(r, eligible.numel())).indices]
        guaranteed = set(top.tolist())
        assert guaranteed <= chosen
        assert not (guaranteed & dropped)
        if guaranteed_before is not None:
            dropped |= guaranteed_before - guaranteed
        guaranteed_before = guaranteed
    assert dropped, "the scenario should evict something"


def test_query_scores_sum_softmax_over_the_group():
    cfg = small_nosa_config()
    torch.manual_seed(1)
    q = torch.randn(1, 4, 1, 8)  # 2 KV heads, group of 2
    ck = torch.randn(1, 2, 6, 8)
    positions = torch.tensor([31])  # windows complete at token 31: (32 - 8) // 4 + 1 = 7 >= 6
    scores = query_block_scores(q, ck, positions, 2, cfg, scale=0.5)
    probs = torch.softmax(torch.einsum("hd,hwd->hw", q[0, :, 0], ck[0].repeat_interleave(2, 0)) * 0.5, -1)
    group = probs.view(2, 2, 6).sum(1)
    expected = torch.stack([group[:, 0:4].amax(-1), group[:, 3:6].amax(-1)], -1)
    torch.testing.assert_close(scores[0, :, 0], expected)
    assert torch.allclose(group.sum(-1), torch.tensor(2.0))


def test_token_mask_covers_selected_blocks_and_current_prefix():
    cfg = small_nosa_config()
    selected = torch.tensor([[[[0, 2, -1]]]])
    mask = blocks_to_token_mask(selected, torch.tensor([50]), 60, cfg)[0, 0, 0]
    expected = torch.zeros(60, dtype=torch.bool)
    expected[0:16] = True
    expected[32:48] = True
    expected[48:51] = True  # current block 3 up to the token itself
    assert torch.equal(mask, expected)
