"""Training-time NOSA attention: the decode rule for every query token, with the eviction bias learning (design Sec. 5).

Query token ``t`` attends to exactly what decoding token ``t`` would: the blocks ``select_blocks`` picks for it
(sink, local window, query-aware and eviction-head blocks, all before its own block ``t // block_size``) plus its
own block up to ``t``; every key ``j`` carries the eviction bias ``b_j`` in its logit. The selection is computed
without gradient (a discrete choice); ``delta`` and ``A`` learn through the bias alone.

Four backends compute the same thing:

- ``"flex"`` (CUDA): FlexAttention. The block table is built from the selected blocks (a tile is visited when
  any query of the tile selected any block in it), ``mask_mod`` reads the per-token selection bitmap, and
  ``score_mod`` adds ``b_j`` (FlexAttention differentiates through the captured bias). The query heads of a GQA
  group share their KV head's selection, so they can be folded into the query rows (``fold`` rows per token, the
  group's largest power-of-two factor up to ``FLEX_FOLD``): a 128-row tile then spans 128 / fold tokens, and the
  union of its tokens' selections, which decides the tiles visited, is over fewer tokens.
- ``"sparse"``: Triton block-sparse kernels with the rule inside, forward and backward
  (``kernels/train/sparse_train_attention.py``). Rows are (token, query head of the group) pairs, so a key block is read
  once per GQA group. By default each tile of rows splits its keys in two (``kernels/train/sparse_train_split.py``): the
  blocks every token of the tile selected, visited as whole tiles with no per-token mask, and each token's other
  blocks (its extras), visited by small tiles with one bit per token; the two are merged by log-sum-exp, and the
  backward runs each part with the global log-sum-exp. The plan is built once from the bitmap and kept for the
  backward. The bias gradient comes from the backward kernels. On CPU tensors it runs the torch reference unless
  ``HF_NOSA_KERNELS=triton`` and ``TRITON_INTERPRET=1`` (``kernels/backend.py``). The CUDA default
  (``CUDA_BACKEND``). A retrofit step of the 1b shape on an H200, split path, selection kernels and held rerun:
  1.284 s at 32K and 2.857 s at 64K against dense sdpa's 1.428 and 4.311 s
  (``docs/results/2026-12-04_train_step_4e446fe.json``; the tile-union path took 2.87 s at 32K).
- ``"explicit"`` (CPU): an additive mask per chunk of queries on sdpa (``attention.dense.biased_attention``).
- ``"reference"``: the same masks through the einsum attention of ``rules/attend.py`` (the per-token reference).

In training the selection is computed once per layer and step: under gradient checkpointing the backward reruns
the layer's forward, which finds the first forward's selection (and, on the sparse backend, its attention output)
instead of computing them again (``attention/held_forward.py``: held in pinned host memory on CUDA, found by a
fingerprint of the inputs).

Left padding (``attention_mask`` with leading zeros): every row is selected as if alone, its blocks, windows, sink
and local window counted from its first real token (``hf_nosa.rules.padding``): the selection runs on each row's tokens
moved to the front (``offsets`` = its padding length) and its blocks are row-relative; the token masks (explicit)
and ``mask_mod`` (flex) map them back to the keys' positions; the sparse kernels read each row's keys from its
first real one.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, Tq queries, T keys, D head dim, P block size, N blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import NosaConfig
from ..kernels.backend import kernel_path
from ..kernels.train.selection_bitmap import selection_bitmap
from ..kernels.train.sparse_train_attention import sparse_train_attention
from ..kernels.train.train_select import index_dtype, train_block_scores, train_select_blocks, train_select_blocks_ref
from ..rules.attend import AttentionInputs, attend
from ..rules.masks import additive_mask, padding_bias
from ..rules.padding import from_rows, leading_padding, to_rows
from ..rules.selection import MASK_VALUE, compress_keys, pool_windows_to_blocks, query_block_scores
from . import held_forward
from .dense import biased_attention

BACKENDS = ("flex", "sparse", "explicit", "reference")
# The backend CUDA tensors take when none is named. On an H200 at 32K (1b shape) a retrofit step takes 1.28 s with
# "sparse" (its first kernels: 3.67 s) against 9.59 s with "flex" (dense sdpa: 1.43 s); benchmarks/train_step.py
# times each.
CUDA_BACKEND = "sparse"

# Most fp32 elements one query chunk may hold in its largest intermediate (256 MiB): the selection scores
# ([B, H, chunk, W] in torch, [B, Hk, chunk, N] through the kernels) and the explicit path's logits [B, H, chunk, T]
# stay bounded however long the sequence is.
_CHUNK_ELEMENTS = 1 << 26

# FlexAttention tile (query and key tokens). 128 is the tile every GPU kernel configuration of FlexAttention
# divides; a NOSA block smaller than the tile is resolved inside the tile by ``mask_mod``.
FLEX_TILE = 128
# FlexAttention key tile in tokens: None for max(FLEX_TILE, block_size). A multiple of the block size; smaller tiles
# skip more of what a query tile did not select, if the kernel's configurations divide them.
FLEX_KV_TILE: int | None = None
# Most query heads of a GQA group folded into the rows of one FlexAttention call (a power of two). 1 (no folding)
# until benchmarks/train_step.py, which times fold 1 against the folded layout, has run on a GPU: raise it to 8 then
# if the folded layout is faster.
FLEX_FOLD = 1
# The selection through the kernels of kernels/train/train_select.py (block scores, then the choice; Triton on CUDA,
# their torch references elsewhere) instead of the torch rule of selection.py. None: on CUDA tensors only. The choice is
# exact given the block scores; the scores' summation order differs from torch's, so a near-tie may resolve
# differently in a few tokens (1 of 32,768 at 32K, 7 of 65,536 at 64K, 1b shape). On an H200 it takes 4.4 ms a layer
# and step at 32K and 18 ms at 64K in the retrofit step (torch: 98 and 373 ms; benchmarks/train_step_breakdown.py).
SELECTION_KERNEL: bool | None = None

_compiled_flex = None


def _query_chunk(elements_per_query: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, elements_per_query))


@torch.no_grad()
def selected_block_indices(
    query: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    *,
    q_offset: int = 0,
    chunk_size: int | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """For every query token, the blocks the decode rule selects (its own block excluded), as indices.

    Computed chunk by chunk over the queries so that the scores never exceed a fixed size. Through the kernels
    (``SELECTION_KERNEL``) a chunk's block scores ``[B, Hk, chunk, N]`` are the largest intermediate; in torch the
    window logits ``[B, H, chunk, W]``.

    Args:
        query: ``[B, H, Tq, D]`` post-RoPE queries at positions ``q_offset .. q_offset + Tq - 1``.
        keys: ``[B, Hk, T, D]`` post-RoPE keys, ``T = q_offset + Tq``.
        bias: ``[B, Hk, T]`` eviction scores (padding already folded in; windows holding padding then take no part
            in the query-aware score, as in decoding: ``selection.PADDING_WINDOW_BIAS``).
        chunk_size: queries per chunk (default: as many as fit ``2**26`` fp32 scores).
        offsets: ``[B]`` long left padding of each row (``padding.leading_padding``), or None. Blocks are then
            row-relative: block n of row b holds keys ``offsets[b] + n * P ..``.

    Returns:
        ``[B, Hk, Tq, K]`` int16 (int32 past 32767 blocks) block indices in ascending order, ``N = ceil(T / P)``
        after them where fewer than K blocks exist. Consumers use the set (``_bitmap``).
    """
    B, H, Tq, _ = query.shape
    Hk, T = keys.shape[1], keys.shape[2]
    P = cfg.block_size
    N = (T + P - 1) // P
    if offsets is not None:
        keys, bias = to_rows(keys, offsets), to_rows(bias, offsets, fill=MASK_VALUE)
    compressed_keys = compress_keys(keys, cfg)  # [B, Hk, W, D]
    compressed_bias = compress_keys(bias, cfg)  # [B, Hk, W]
    W = compressed_keys.shape[2]
    use_kernel = query.is_cuda if SELECTION_KERNEL is None else SELECTION_KERNEL
    # the chunk as the path that runs holds it: the kernels' block scores, or the torch logits (also where the
    # kernels' functions fall back to their references, on CPU tensors)
    on_chip = use_kernel and kernel_path("train_block_scores", query) == "triton"
    chunk = chunk_size or _query_chunk(B * Hk * max(N, 1) if on_chip else B * H * max(W, N, 1))
    out = torch.empty(B, Hk, Tq, cfg.budget_blocks, dtype=index_dtype(N), device=query.device)
    # The scores in fp32 like the decode path, even under bf16 autocast: the same blocks must win near-ties.
    no_autocast = torch.autocast(query.device.type, enabled=False)
    # What every chunk reads, made once: the chunks' launches are what the device waits for between them.
    all_positions = _positions(q_offset, q_offset + Tq, offsets, query.device)
    static_scores = None
    if on_chip:
        all_positions = all_positions.to(torch.int32)
        with no_autocast:
            static_scores = pool_windows_to_blocks(compressed_bias.float(), N, cfg, fill=float("-inf"))
    for lo in range(0, Tq, chunk):
        hi = min(Tq, lo + chunk)
        positions = all_positions[..., lo:hi]
        with no_autocast:
            if use_kernel:
                # only the blocks some query of the chunk can select: the choice's work grows with the blocks scored
                scored = max(1, min(N, (q_offset + hi - 1) // P))
                qs = train_block_scores(query[:, :, lo:hi], compressed_keys, positions, scored, cfg, scale,
                                        compressed_bias=compressed_bias)
                out[:, :, lo:hi] = train_select_blocks(qs, compressed_bias, positions, cfg, n_blocks=N,
                                                       static_scores=static_scores)
            else:
                qs = query_block_scores(
                    query[:, :, lo:hi], compressed_keys, positions, N, cfg, scale, compressed_bias=compressed_bias
                )
                out[:, :, lo:hi] = train_select_blocks_ref(qs, compressed_bias, positions, cfg, cfg.budget_blocks)
    return out


def _positions(lo: int, hi: int, offsets: torch.Tensor | None, device) -> torch.Tensor:
    """Query positions ``lo .. hi - 1``: ``[Tq]``, or ``[B, Tq]`` row-relative (negative inside the padding)."""
    positions = torch.arange(lo, hi, device=device)
    return positions if offsets is None else positions - offsets.to(device)[:, None]


def _bitmap(indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``[B, Hk, Tq, K]`` indices (``n_blocks`` for none) -> ``[B, Hk, Tq, N]`` bool (one kernel pass on CUDA:
    ``kernels/train/selection_bitmap.py``)."""
    return selection_bitmap(indices, n_blocks)


@torch.no_grad()
def selected_blocks(
    query: torch.Tensor,
    keys: torch.Tensor,
    bias: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    *,
    q_offset: int = 0,
    chunk_size: int | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """``selected_block_indices`` as a bitmap: ``[B, Hk, Tq, N]`` bool, True where query ``t`` selected block ``n``
    (``N = ceil(T / P)``; row-relative blocks with ``offsets``)."""
    indices = selected_block_indices(query, keys, bias, cfg, scale, q_offset=q_offset, chunk_size=chunk_size,
                                     offsets=offsets)
    return _bitmap(indices, (keys.shape[2] + cfg.block_size - 1) // cfg.block_size)


def _token_mask(bitmap: torch.Tensor, positions: torch.Tensor, T: int, P: int, offsets=None) -> torch.Tensor:
    """``[B, Hk, Tq, N]`` block bitmap -> ``[B, Hk, Tq, T]`` bool: selected blocks plus the own block up to t
    (``positions`` ``[Tq]``, or ``[B, Tq]`` row-relative with ``offsets``: the mask comes back at key positions)."""
    mask = bitmap.repeat_interleave(P, dim=-1)[..., :T]
    token = torch.arange(T, device=bitmap.device)
    pos = positions[..., None]
    own = (token // P == pos.div(P, rounding_mode="floor")) & (token <= pos)
    if offsets is None:
        return mask | own
    return from_rows(mask | own[:, None], offsets)


def _explicit(query, key, value, bias, bitmap, cfg, scale, attention_mask, q_offset, attention, offsets=None
              ) -> torch.Tensor:
    B, H, Tq, D = query.shape
    T, P = key.shape[2], cfg.block_size
    rows = attention_mask[..., -Tq:, :T] if attention_mask is not None else None
    chunk = _query_chunk(B * H * T)
    outs = []
    for lo in range(0, Tq, chunk):
        hi = min(Tq, lo + chunk)
        positions = _positions(q_offset + lo, q_offset + hi, offsets, query.device)
        mask = torch.where(_token_mask(bitmap[:, :, lo:hi], positions, T, P, offsets), 0.0, MASK_VALUE)
        if rows is not None:
            mask = mask + additive_mask(rows[..., lo:hi, :], hi - lo, T, q_offset + lo, query.device)
        inputs = AttentionInputs(key, value, bias, mask, q_offset + lo, causal=False)
        outs.append(attention(query[:, :, lo:hi], inputs, scale))
    return torch.cat(outs, dim=2)


def flex_fold(heads: int, kv_heads: int, tile: int | None = None, limit: int | None = None) -> int:
    """Query rows per token in the flex layout: the largest power of two dividing the group, the tile (default
    ``FLEX_TILE``) and ``limit`` (default ``FLEX_FOLD``)."""
    G = heads // kv_heads
    tile = FLEX_TILE if tile is None else tile
    limit = FLEX_FOLD if limit is None else limit
    fold = 1
    while fold * 2 <= limit and G % (fold * 2) == 0 and tile % (fold * 2) == 0:
        fold *= 2
    return fold


def flex_block_mask(bitmap: torch.Tensor, cfg: NosaConfig, *, heads: int, q_offset: int = 0, tile: int = FLEX_TILE,
                    fold: int = 1, kv_tile: int | None = None, offsets: torch.Tensor | None = None):
    """The FlexAttention ``BlockMask`` of a selection bitmap.

    A (query tile, key tile) pair is visited when a query of the tile selected a block in the key tile, or the key
    tile holds a query's own block; it is "full" (no ``mask_mod`` needed) when every query of the tile selected
    every block in it. ``mask_mod`` gives the exact per-token rule inside visited tiles.

    With ``fold > 1`` the rows are ``(token, member)`` pairs: ``fold`` query heads of a GQA group (they share the
    selection) in consecutive rows of one attention head, so a query tile spans ``tile / fold`` tokens. The
    attention then has ``heads / fold`` heads of ``Tq * fold`` rows (``_flex`` lays the queries out so).

    Args:
        bitmap: ``[B, Hk, Tq, N]`` from ``selected_blocks``.
        heads: H, the number of query heads.
        tile: query tile in rows (a power of two).
        fold: rows per token; it must divide both ``H / Hk`` and ``tile``.
        kv_tile: key tile in tokens, a multiple of the block size; default ``max(tile, block_size)``.
        offsets: ``[B]`` long left padding of each row when ``bitmap`` holds row-relative blocks (``selected_blocks``
            with offsets): a row's block may then straddle two key tiles, so the tiles its blocks touch are visited
            (none counts as full) and ``mask_mod`` reads the row's offset.

    Returns:
        ``BlockMask`` for ``heads / fold`` heads, queries ``[Tq * fold]`` and keys ``[T = q_offset + Tq]``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, Hk, Tq, N = bitmap.shape
    P = cfg.block_size
    G = heads // Hk
    if fold < 1 or G % fold or tile % fold:
        raise ValueError(f"fold={fold} is invalid: it must divide the group size {G} and the tile {tile}")
    G2 = G // fold  # heads of the group left as attention heads
    T = q_offset + Tq
    kv_tile = max(tile, P) if kv_tile is None else kv_tile
    if kv_tile % P:
        raise ValueError(f"key tile {kv_tile} is invalid: it must be a multiple of block_size={P} (tile={tile} must be "
                         f"a power of two)")
    per_tile = kv_tile // P
    q_tokens = tile // fold  # tokens per query tile
    n_qt, n_kt = math.ceil(Tq / q_tokens), math.ceil(T / kv_tile)
    pad_rows, pad_cols = n_qt * q_tokens - Tq, n_kt * per_tile - N
    tiles = F.pad(bitmap, (0, pad_cols, 0, pad_rows)).view(B, Hk, n_qt, q_tokens, n_kt, per_tile)
    row_ok = (torch.arange(n_qt * q_tokens, device=bitmap.device) < Tq).view(n_qt, q_tokens, 1, 1)
    col_ok = (torch.arange(n_kt * per_tile, device=bitmap.device) < N).view(n_kt, per_tile)
    starts = torch.arange(n_qt, device=bitmap.device) * q_tokens
    if offsets is None:
        any_selected = tiles.any(5).any(3)  # [B, Hk, n_qt, n_kt]
        all_selected = (tiles | ~row_ok | ~col_ok).all(5).all(3)
        first = (q_offset + starts) // kv_tile
    else:
        offsets = offsets.to(bitmap.device)
        any_selected = _row_block_tiles(tiles.flatten(4).any(3)[..., :N], offsets, P, kv_tile, n_kt)
        all_selected = torch.zeros_like(any_selected)
        # a row-relative own block begins at most P - 1 keys before its query
        first = (q_offset + starts - (P - 1)).clamp(min=0) // kv_tile
    # Key tiles holding the own block of some query of the tile: causal inside, always partial.
    last = (q_offset + torch.clamp(starts + q_tokens, max=Tq) - 1) // kv_tile
    kt = torch.arange(n_kt, device=bitmap.device)
    own = (kt >= first[:, None]) & (kt <= last[:, None])  # [n_qt, n_kt]
    full = all_selected & ~own
    partial = (any_selected | own) & ~full

    def table(visit):
        visit = visit.repeat_interleave(G2, dim=1)  # [B, H / fold, n_qt, n_kt]
        counts = visit.sum(-1, dtype=torch.int32)
        order = torch.argsort(visit.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, order

    kv_num, kv_idx = table(partial)
    full_num, full_idx = table(full)
    selected = bitmap

    if offsets is None:
        def mask_mod(b, h, q_idx, kv_idx):
            block = kv_idx // P
            token = q_idx // fold
            pos = token + q_offset
            own_block = (block == pos // P) & (kv_idx <= pos)
            return selected[b, h // G2, token, block] | own_block
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            key = kv_idx - offsets[b]  # row-relative; negative inside the padding
            real = key >= 0
            block = torch.where(real, key, 0) // P
            token = q_idx // fold
            pos = token + q_offset - offsets[b]
            own_block = real & (block == torch.where(pos >= 0, pos, -P) // P) & (key <= pos)
            return (selected[b, h // G2, token, block] & real) | own_block

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(tile, kv_tile), mask_mod=mask_mod,
        seq_lengths=(Tq * fold, T),
    )


def _row_block_tiles(blocks: torch.Tensor, offsets: torch.Tensor, P: int, kv_tile: int, n_kt: int) -> torch.Tensor:
    """``[B, Hk, n_qt, N]`` bool (a query of the tile selected row-relative block n) -> ``[B, Hk, n_qt, n_kt]``
    bool: the key tiles those blocks touch, row b's block n holding keys ``offsets[b] + n * P ..``."""
    B, Hk, n_qt, N = blocks.shape
    first = offsets[:, None] + torch.arange(N, device=blocks.device) * P  # [B, N]
    touched = torch.zeros(B, Hk, n_qt, n_kt + 1, dtype=torch.int32, device=blocks.device)
    for key in (first, first + P - 1):
        index = (key // kv_tile).clamp(max=n_kt)[:, None, None, :].expand(B, Hk, n_qt, N)
        touched.scatter_add_(-1, index, blocks.to(torch.int32))
    return touched[..., :n_kt] > 0


def _fold_queries(query: torch.Tensor, fold: int) -> torch.Tensor:
    """``[B, H, Tq, D]`` -> ``[B, H / fold, Tq * fold, D]``: head ``h = (j * fold + f)`` goes to row ``t * fold + f``
    of head ``j``."""
    B, H, Tq, D = query.shape
    return query.view(B, H // fold, fold, Tq, D).transpose(2, 3).reshape(B, H // fold, Tq * fold, D)


def _unfold_rows(out: torch.Tensor, fold: int) -> torch.Tensor:
    """Inverse of ``_fold_queries``."""
    B, Hf, rows, D = out.shape
    return out.view(B, Hf, rows // fold, fold, D).transpose(2, 3).reshape(B, Hf * fold, rows // fold, D)


def _flex(query, key, value, bias, bitmap, cfg, scale, q_offset, fold, offsets=None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    H, Hk = query.shape[1], key.shape[1]
    G2 = H // Hk // fold  # attention heads per KV head after folding
    block_mask = flex_block_mask(bitmap, cfg, heads=H, q_offset=q_offset, tile=FLEX_TILE, fold=fold,
                                 kv_tile=FLEX_KV_TILE, offsets=offsets)
    # The bias's gradient is torch's captured-buffer gradient (an atomic scatter of the score gradients). Taking it
    # from one more value column instead made the step slower on an H200 (docs/results.md, SmolLM2 section).
    key_bias = bias.float()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + key_bias[b, h // G2, kv_idx]

    run = flex_attention
    if query.is_cuda:
        # The fused kernel is the point of FlexAttention; uncompiled it materialises every score.
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        run = _compiled_flex
    # Under bf16 autocast q/k/v already arrive in bf16; the kernel accumulates in fp32 either way. Autocast is
    # switched off around it so that every torch version sees plain same-dtype inputs.
    with torch.autocast(query.device.type, enabled=False):
        out = run(_fold_queries(query, fold), key.to(query.dtype), value.to(query.dtype), score_mod=score_mod,
                  block_mask=block_mask, scale=scale, enable_gqa=G2 > 1)
    return _unfold_rows(out, fold)


def _sparse(query, key, value, bias, bitmap, cfg, scale, q_offset, offsets=None, held=None) -> torch.Tensor:
    # As for flex: autocast off, q/k/v in one dtype, the bias in fp32 (its gradient comes back in fp32).
    with torch.autocast(query.device.type, enabled=False):
        return sparse_train_attention(query, key.to(query.dtype), value.to(query.dtype), bias, bitmap, scale,
                                      block_size=cfg.block_size, q_offset=q_offset, offsets=offsets, held=held)


def nosa_training_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    *,
    attention_mask: torch.Tensor | None = None,
    q_offset: int = 0,
    backend: str | None = None,
    fold: int | None = None,
) -> torch.Tensor:
    """NOSA attention for training and sparse prefill: decode selection per query token + eviction bias.

    Args:
        query: ``[B, H, Tq, D]`` post-RoPE queries at positions ``q_offset ..``.
        key, value: ``[B, Hk, T, D]`` all keys so far (``T = q_offset + Tq``).
        bias: ``[B, Hk, T]`` eviction scores ``b_j``; gradients flow to it (and so to ``delta`` and ``A``).
        attention_mask: the model's mask (bool or additive, ``[B or 1, 1, Tq, T]``) or None for causal. Keys the
            last query row may not see are padding: like the cache, they get ``MASK_VALUE`` in their bias. The
            rule is causal by itself, so a causal + padding mask is all the flex backend honours; the explicit
            backend also adds the mask as given (flex and sparse honour causal + padding only). Left padding is
            counted out: each row selects as it would alone (module docstring). Rows of padding queries are
            arbitrary (and differ between the backends; sparse gives 0); train on packed sequences, which have none.
        backend: ``"flex"``, ``"sparse"`` (Triton block-sparse kernels, forward and backward), ``"explicit"`` or
            ``"reference"``; default ``CUDA_BACKEND`` (sparse) on CUDA, explicit elsewhere.
        fold: flex only: query heads of a GQA group folded into the rows of one attention head (it must divide the
            group and ``FLEX_TILE``); default ``flex_fold(H, Hk)``.

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype.

    Example:
        >>> from hf_nosa import NosaConfig
        >>> cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
        ...                  compress_kernel=8, compress_stride=4)
        >>> q, k, v = torch.randn(1, 4, 96, 16), torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
        >>> nosa_training_attention(q, k, v, torch.zeros(1, 2, 96), cfg, 0.25).shape
        torch.Size([1, 4, 96, 16])
    """
    if backend is None:
        backend = CUDA_BACKEND if query.is_cuda else "explicit"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed values are {BACKENDS} (or None for auto)")
    Tq, T = query.shape[2], key.shape[2]
    if T != q_offset + Tq:
        raise ValueError(f"keys hold {T} tokens but q_offset + queries = {q_offset} + {Tq}; they must be equal")
    H, Hk = query.shape[1], key.shape[1]
    if fold is None:
        fold = flex_fold(H, Hk)
    elif fold < 1 or (H // Hk) % fold or FLEX_TILE % fold:
        raise ValueError(f"fold={fold} is invalid: it must divide the group size {H // Hk} and FLEX_TILE={FLEX_TILE}")
    bias = bias.float()
    pad = padding_bias(attention_mask, 0, T)
    offsets = None
    if pad is not None:
        bias = bias + pad.to(bias.device)
        offsets = leading_padding(attention_mask).to(query.device)
        if attention_mask.dim() == 4 and attention_mask.shape[0] == 1 and query.shape[0] > 1:
            offsets = offsets.expand(query.shape[0])
    N = (T + cfg.block_size - 1) // cfg.block_size
    held = None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, bias)) and (
            held_forward.in_backward() or held_forward.rerun_expected()):
        # Gradient checkpointing: the backward reruns this forward with bitwise the same inputs. The first forward
        # holds its selection (and the sparse backend its output), the rerun finds them (held_forward.py).
        meta, numbers = held_forward.fingerprint(query, key, bias, (q_offset, scale, *sorted(cfg.to_dict().items())))
        if held_forward.in_backward():
            held = held_forward.find(meta, numbers)
        else:
            indices = selected_block_indices(query, key, bias, cfg, scale, q_offset=q_offset, offsets=offsets)
            held = held_forward.HeldForward(indices, meta, numbers)
            query = held_forward.Hold.apply(query, held)
    if held is not None:
        bitmap = _bitmap(held.take_indices(query.device), N)
    else:
        bitmap = _bitmap(selected_block_indices(query, key, bias, cfg, scale, q_offset=q_offset, offsets=offsets), N)
    if backend == "flex":
        return _flex(query, key, value, bias, bitmap, cfg, scale, q_offset, fold, offsets)
    if backend == "sparse":
        return _sparse(query, key, value, bias, bitmap, cfg, scale, q_offset, offsets, held)
    attention = biased_attention if backend == "explicit" else attend
    return _explicit(query, key, value, bias, bitmap, cfg, scale, attention_mask, q_offset, attention, offsets)
