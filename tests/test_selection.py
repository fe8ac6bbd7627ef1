"""The reference rules of selection.py on hand-checked cases."""

import pytest
import torch

from hf_nosa.rules.selection import (
    favour_resident,
    MASK_VALUE,
    PADDING_WINDOW_BIAS,
    QUOKA_PADDING_SCORE,
    blocks_to_token_mask,
    compress_keys,
    eviction_block_scores,
    nosa_token_mask,
    num_windows,
    pool_windows_to_blocks,
    query_block_scores,
    quoka_query_choice,
    quoka_scores,
    quoka_select_blocks,
    select_blocks,
    topk_recent_first,
    window_offsets,
    windows_available,
    windows_before,
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


# ----- padding windows (left-padded batches) -----


def _padded(real: torch.Tensor, pad: int, pad_value: torch.Tensor) -> torch.Tensor:
    """``real [B, Hk, T, ...]`` with ``pad`` copies of ``pad_value`` in front (dim 2)."""
    front = pad_value.expand(*real.shape[:2], pad, *real.shape[3:])
    return torch.cat([front, real], 2)


def test_padding_windows_get_no_query_score_and_leave_real_blocks_unchanged():
    cfg = small_nosa_config()  # block 16, windows of 8 every 4: block b pools windows 4b-1 .. 4b+3
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 32, 4, generator=g)  # 32 real tokens: blocks 0, 1 when alone
    q = torch.randn(1, 2, 1, 4, generator=g)  # one KV head, group of two
    # 16 tokens of padding in front (one block); pad keys point along the queries, so they would score high.
    pad_key = 5 * q[0, :, 0].sum(0)
    padded_keys = _padded(keys, 16, pad_key)
    padded_bias = _padded(torch.zeros(1, 1, 32), 16, torch.tensor(MASK_VALUE))
    ck, cb = compress_keys(padded_keys, cfg), compress_keys(padded_bias, cfg)  # 11 windows
    # Windows 0..2 are all padding, window 3 (tokens 12..19) holds four pad tokens: all four are padding windows.
    assert (cb < PADDING_WINDOW_BIAS).squeeze().tolist() == [True] * 4 + [False] * 7

    scores = query_block_scores(q, ck, torch.tensor([47]), 3, cfg, 0.5, compressed_bias=cb)[0, 0, 0]
    # By hand: per head, softmax over the real windows 4..10 only; summed over the group; block 1 (the first real
    # block) pools windows 3..7, block 2 windows 7..10; block 0 (padding) gets 0.
    logits = torch.einsum("hd,wd->hw", q[0, :, 0], ck[0, 0, 4:11]) * 0.5
    probs = torch.softmax(logits, -1).sum(0)  # windows 4..10
    expected = torch.stack([torch.tensor(0.0), probs[0:4].max(), probs[3:7].max()])
    torch.testing.assert_close(scores, expected)
    assert torch.allclose(probs.sum(), torch.tensor(2.0))  # no mass went to the padding
    # The same sequence without padding scores its blocks alike.
    alone = query_block_scores(q, compress_keys(keys, cfg), torch.tensor([31]), 2, cfg, 0.5,
                               compressed_bias=compress_keys(torch.zeros(1, 1, 32), cfg))[0, 0, 0]
    torch.testing.assert_close(scores[1:], alone)
    # Without the bias the padding windows are scored and take mass from every real window.
    unmasked = query_block_scores(q, ck, torch.tensor([47]), 3, cfg, 0.5)[0, 0, 0]
    assert unmasked[0] > 0 and (unmasked[1:] < alone).all()


def test_quoka_scores_put_padding_windows_below_every_cosine():
    cfg = small_nosa_config()
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 1, 32, 4, generator=g)
    kept = torch.randn(1, 2, 1, 3, 4, generator=g)
    padded_keys = _padded(keys, 16, kept[0, 0, 0, 0])  # pad keys point along a kept query: cosine 1 if scored
    padded_bias = _padded(torch.zeros(1, 1, 32), 16, torch.tensor(MASK_VALUE))
    ck, cb = compress_keys(padded_keys, cfg), compress_keys(padded_bias, cfg)
    scores = quoka_scores(kept, ck, torch.tensor([11]), 3, cfg, compressed_bias=cb)[0, 0, 0]
    alone = quoka_scores(kept, compress_keys(keys, cfg), torch.tensor([7]), 2, cfg)[0, 0, 0]
    assert scores[0] == QUOKA_PADDING_SCORE < -1
    torch.testing.assert_close(scores[1:], alone)
    # Not complete yet stays -inf; no real kept query stays -inf too.
    early = quoka_scores(kept, ck, torch.tensor([3]), 3, cfg, compressed_bias=cb)[0, 0, 0]
    assert early[0] == QUOKA_PADDING_SCORE and early[1:].isneginf().all()
    none = quoka_scores(kept, ck, torch.tensor([11]), 3, cfg, torch.tensor([[0]]), compressed_bias=cb)
    assert none.isneginf().all()


def test_blocks_without_a_real_window_tie_at_the_bottom_most_recent_first():
    """30 pad tokens: block 1 holds two real tokens (30, 31) but every window over it holds padding, so it scores
    like the padding block 0 in the query-aware rules, and ties go to the more recent block 1."""
    cfg = small_nosa_config(sink_tokens=0, prefill_budget_tokens=64)
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 1, 96, 4, generator=g)
    bias = torch.randn(1, 1, 96, generator=g)
    bias[:, :, :30] = MASK_VALUE
    ck, cb = compress_keys(keys, cfg), compress_keys(bias, cfg)
    q = torch.randn(1, 2, 1, 4, generator=g)
    qs = query_block_scores(q, ck, torch.tensor([95]), 5, cfg, 0.5, compressed_bias=cb)[0, 0, 0]
    assert qs[0] == qs[1] == 0 and (qs[2:] > 0).all()
    scores = quoka_scores(q[:, :, None], ck, torch.tensor([19]), 5, cfg, compressed_bias=cb)  # windows before 80
    assert scores[0, 0, 0, 0] == scores[0, 0, 0, 1] == QUOKA_PADDING_SCORE
    # Budget 4 of the 5 blocks before block 5: the real blocks 2..4, then block 1 before block 0.
    assert quoka_select_blocks(scores, torch.tensor([5]), cfg)[0, 0, 0].tolist()[-1] == 1
    es = eviction_block_scores(cb, torch.tensor([95]), 5, cfg)
    picked = select_blocks(qs[None, None, None], es, torch.tensor([5]), cfg.replace(budget_tokens=64))
    assert sorted(picked[0, 0, 0].tolist()) == [1, 2, 3, 4]


def test_training_rule_of_a_padded_row_is_the_rule_of_the_row_alone():
    """nosa_token_mask and training.selected_blocks (the rule every query token applies) see a row padded by whole
    blocks as the row alone, shifted (no sink blocks: those are absolute, padding in a padded row)."""
    from hf_nosa.attention.training import selected_blocks

    cfg = small_nosa_config(budget_tokens=64, query_tokens=16, sink_tokens=0, local_tokens=32)
    g = torch.Generator().manual_seed(3)
    T, pad = 160, 32
    q, k = torch.randn(1, 4, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)
    b = torch.randn(1, 2, T, generator=g)
    pq, pk = torch.randn(1, 4, pad, 8, generator=g), torch.randn(1, 2, pad, 8, generator=g)  # garbage padding
    padded = (torch.cat([pq, q], 2), torch.cat([pk, k], 2), torch.cat([torch.full((1, 2, pad), MASK_VALUE), b], 2))
    mask = nosa_token_mask(*padded, 0, cfg, 0.35)
    assert torch.equal(mask[:, :, pad:, pad:], nosa_token_mask(q, k, b, 0, cfg, 0.35))
    bitmap = selected_blocks(*padded, cfg, 0.35)
    assert torch.equal(bitmap[:, :, pad:, pad // 16 :], selected_blocks(q, k, b, cfg, 0.35))


@pytest.mark.parametrize("current", [0, 2, 5, 9, 13])
def test_quoka_selection_at_one_int_block_equals_the_mask_path(current):
    """The prefill passes its chunk's first block as an int (slices force the sink and local window); the blocks are
    those of the tensor path, ties (integer scores) included."""
    cfg = small_nosa_config(prefill_budget_tokens=48)
    g = torch.Generator().manual_seed(current)
    scores = torch.randint(0, 4, (2, 3, 1, 13), generator=g).float()
    for K in (1, 3, 6):
        expected = quoka_select_blocks(scores, torch.tensor([current]), cfg, budget_blocks=K)
        torch.testing.assert_close(quoka_select_blocks(scores, current, cfg, budget_blocks=K), expected)
    before = scores.clone()
    quoka_select_blocks(scores, current, cfg)
    assert torch.equal(scores, before)  # the caller's scores are left as they were


def test_windows_before_is_windows_available_of_the_previous_token():
    cfg = small_nosa_config()
    starts = list(range(0, 200, 3))
    expected = windows_available(torch.tensor(starts) - 1, cfg).tolist()
    assert [windows_before(start, cfg) for start in starts] == expected


def test_quoka_query_choice_ranks_by_cosine_with_the_mean_query():
    """Against the definition (both sides normalised), with padding and with a head whose queries sum to zero."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 40, 16, generator=g)
    q[1, 2] = torch.cat([q[1, 2, :20], -q[1, 2, :20]])  # mean query zero: every cosine 0, ties resolved alike
    valid = torch.rand(2, 1, 40, generator=g) > 0.2

    def reference(queries, real):
        if real is None:
            mean = queries.mean(-2, keepdim=True)
        else:
            w = real.float()[..., None]
            mean = (queries * w).sum(-2, keepdim=True) / w.sum(-2, keepdim=True).clamp(min=1)
        cosine = (torch.nn.functional.normalize(queries, dim=-1) * torch.nn.functional.normalize(mean, dim=-1)).sum(-1)
        if real is not None:
            cosine = cosine.masked_fill(~real, float("inf"))
        return cosine

    for real in (None, valid):
        chosen = quoka_query_choice(q, 8, real)
        cosine = reference(q, real)
        picked = cosine.gather(-1, chosen)
        # the picks are the 8 lowest cosines, lowest first (compared by value: equal cosines may swap)
        torch.testing.assert_close(picked, cosine.sort(-1).values[..., :8], atol=1e-6, rtol=0)


def test_favour_resident_keeps_a_held_block_within_the_margin():
    """Blocks 3 and 5 compete for the one query-aware place: 5 scores higher, 3 is held (last step's choice)."""
    cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                     compress_kernel=8, compress_stride=4)
    qs = torch.zeros(1, 1, 1, 8)
    qs[..., 3], qs[..., 5] = 0.6, 0.7
    es = torch.zeros(1, 1, 1, 8)
    es[..., 1] = 1.0  # the eviction head's one place goes to block 1
    current = torch.tensor([8])
    held = torch.tensor([[[3, 0, 7, -1, 12]]])  # -1: an empty slot; 12: not a candidate
    query_part = lambda scores: set(select_blocks(scores, es, current, cfg)[0, 0, 0].tolist()) - {0, 7, 1}  # noqa: E731
    assert query_part(qs) == {5}
    assert query_part(favour_resident(qs, held, 0.1)) == {5}  # 0.66 < 0.7
    assert query_part(favour_resident(qs, held, 0.25)) == {3}  # 0.75 > 0.7
    favoured = favour_resident(qs, held, 0.25)
    assert favoured[..., 0] == 0.0 and favoured[..., 5] == qs[..., 5]  # a held block the query ignores stays at 0
