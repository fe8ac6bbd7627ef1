"""The plan of the sparse training attention (``sparse_train_attention``): which key blocks each tile of query rows
visits, and which tiles visit each key block, read from the selection bitmap.

Rows are (token, query head of the group) pairs, row ``t * G + g`` for token ``t`` and head ``Hk_index * G + g``: a
tile of ``tile`` rows holds ``tokens = max(1, tile // G)`` whole tokens with the G query heads of one KV head, so a
key block is read once for the whole group. A tile visits block ``n`` when a token of the tile selected it
(``bitmap``), or ``n`` is the own block of a token of the tile (the block of its position, which it sees up to
itself). With ``offsets`` positions and blocks are row-relative: block n of row b holds keys ``offsets[b] + n * P
..``, and a query inside the padding (negative position) has no own block.

Built in torch from the bitmap alone, with no host sync and no loop over blocks; the forward builds it and the
backward reuses it. Lists are N (or n_qt) entries long, the visited entries first in ascending order, as
FlexAttention's block tables: their used length is the count beside them, known on the device only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..backend import HAS_TRITON, launcher, next_power_of_2, on_device, tl, triton

# Query rows per tile of the plan: 128 / G tokens of a GQA group of G heads.
TILE_ROWS = 128


class SparsePlan(NamedTuple):
    """Visit lists of one call (B batch, Hk KV heads, n_qt query tiles, N key blocks)."""

    tokens: int  # query tokens per tile
    counts: torch.Tensor  # [B, Hk, n_qt] int32: blocks each tile visits
    blocks: torch.Tensor  # [B, Hk, n_qt, N] int16 (int32 past 32767): the visited blocks first, ascending
    tile_counts: torch.Tensor  # [B, Hk, N] int32: tiles visiting each block
    tiles: torch.Tensor  # [B, Hk, N, n_qt] int16 (int32 past 32767): the visiting tiles first, ascending


def tile_tokens(heads: int, kv_heads: int, tile: int = TILE_ROWS) -> int:
    """Query tokens per tile of ``tile`` rows when H = ``heads`` query heads share Hk = ``kv_heads`` KV heads."""
    return max(1, tile // (heads // kv_heads))


def tile_visits(bitmap: torch.Tensor, *, heads: int, block_size: int, q_offset: int = 0,
                offsets: torch.Tensor | None = None, tile: int = TILE_ROWS) -> torch.Tensor:
    """``[B, Hk, Tq, N]`` bool selection bitmap -> ``[B, Hk, n_qt, N]`` bool: the blocks each tile visits.

    A block counts when a token of the tile selected it or it is a token's own block (``offsets``: ``[B]`` left
    padding, blocks row-relative; None: none).
    """
    B, Hk, Tq, N = bitmap.shape
    P = block_size
    tokens = tile_tokens(heads, Hk, tile)
    n_qt = -(-Tq // tokens)
    selected = _tiles_of_tokens(bitmap, n_qt, tokens).any(3)
    starts = torch.arange(n_qt, device=bitmap.device) * tokens
    ends = torch.clamp(starts + tokens, max=Tq) - 1
    off = torch.zeros(B, dtype=torch.long, device=bitmap.device) if offsets is None else offsets.to(bitmap.device)
    first = q_offset + starts[None, :] - off[:, None]  # [B, n_qt] row-relative position of a tile's first token
    last = q_offset + ends[None, :] - off[:, None]
    n = torch.arange(N, device=bitmap.device)
    own = (n >= (first.clamp(min=0) // P)[..., None]) & (n <= (last // P)[..., None]) & (last >= 0)[..., None]
    return selected | own[:, None]


def _tiles_of_tokens(bitmap: torch.Tensor, n_qt: int, tokens: int) -> torch.Tensor:
    """``[B, Hk, Tq, N]`` -> ``[B, Hk, n_qt, tokens, N]``, the last tile padded with False rows: a view where no
    padding is needed (at 64K in the 1b shape the bitmap is 0.5 GB, and a copy of it cost 1.4 ms a layer)."""
    B, Hk, Tq, N = bitmap.shape
    pad = n_qt * tokens - Tq
    return (F.pad(bitmap, (0, 0, 0, pad)) if pad else bitmap).view(B, Hk, n_qt, tokens, N)


def _compact(visit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., M]`` bool -> counts ``[...]`` int32 and the indices of the True entries first, ascending."""
    dtype = torch.int16 if visit.shape[-1] < 2**15 else torch.int32
    counts = visit.sum(-1, dtype=torch.int32)
    order = torch.argsort(visit.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(dtype).contiguous()


def sparse_train_plan(bitmap: torch.Tensor, *, heads: int, block_size: int, q_offset: int = 0,
                      offsets: torch.Tensor | None = None, tile: int = TILE_ROWS) -> SparsePlan:
    """The visit lists of ``tile_visits`` and their transpose (the tiles visiting each block, for the backward).

    Args:
        bitmap: ``[B, Hk, Tq, N]`` bool, True where query ``t`` selected block ``n``.
        heads: H, the query heads (a multiple of Hk).
        block_size: P, keys per block.
        q_offset: position of the first query.
        offsets: ``[B]`` left padding of each row (blocks row-relative), or None.
        tile: query rows per tile.

    Returns:
        ``SparsePlan``.

    Example:
        >>> bitmap = torch.zeros(1, 1, 4, 2, dtype=torch.bool)
        >>> bitmap[0, 0, 3, 0] = True  # the last token selected block 0; tokens 2, 3 are in block 1
        >>> plan = sparse_train_plan(bitmap, heads=2, block_size=2, tile=4)  # 2 tokens x 2 heads per tile
        >>> plan.counts.tolist(), plan.blocks[..., :1].tolist(), plan.tile_counts.tolist()
        ([[[1, 2]]], [[[[0], [0]]]], [[[2, 1]]])
    """
    visit = tile_visits(bitmap, heads=heads, block_size=block_size, q_offset=q_offset, offsets=offsets, tile=tile)
    counts, blocks = _compact(visit)
    tile_counts, tiles = _compact(visit.transpose(-1, -2))
    return SparsePlan(tile_tokens(heads, bitmap.shape[1], tile), counts, blocks, tile_counts, tiles)


# Query rows per tile of the extras part of the split plan: 16 / G tokens, the smallest tile ``tl.dot`` takes. The
# extras differ between tokens, so the fewer tokens share a tile, the less of their union each token pays for.
EXTRA_ROWS = 16
# Most tokens an extras tile holds: their visibility bits fit one int32 word per (tile, block).
EXTRA_TOKENS_MAX = 31
# Extras tiles x blocks per program of the extras words kernel: a [tiles, blocks] tile of words stored in both layouts.
EXTRA_WORD_TILES, EXTRA_WORD_BLOCKS = 32, 64
# Shared tiles x blocks per program of the shared blocks kernel: 128 contiguous bytes of a token's bitmap row a load.
SHARED_TILES, SHARED_BLOCKS = 16, 128


class SplitPlan(NamedTuple):
    """The split plan of one call: each shared tile's keys in two disjoint parts, merged by log-sum-exp.

    The shared part: per tile of ``tokens`` tokens, the blocks every token of the tile selected, minus the tile's own
    blocks (the blocks of its tokens' positions), visited whole; the own blocks are visited too, with the per-row rule
    (their range is known from the tile's positions, so it is not listed). The extras part: per tile of
    ``extra_tokens`` tokens, each token's other selected blocks, with one bit per token of the tile.
    """

    tokens: int  # query tokens per shared tile
    extra_tokens: int  # query tokens per extras tile
    counts: torch.Tensor  # [B, Hk, n_qt] int32: shared blocks (own blocks not counted)
    blocks: torch.Tensor  # [B, Hk, n_qt, N] int16/int32: the shared blocks first, ascending
    tile_counts: torch.Tensor  # [B, Hk, N] int32: shared tiles holding each block whole
    tiles: torch.Tensor  # [B, Hk, N, n_qt] int16/int32
    extra_counts: torch.Tensor  # [B, Hk, n_et] int32: blocks some token of the extras tile sees as an extra
    extra_blocks: torch.Tensor  # [B, Hk, n_et, N] int16/int32
    extra_bits: torch.Tensor  # [B, Hk, n_et, N] uint8/int32: bit k set when token k of the tile sees the block
    extra_tile_counts: torch.Tensor  # [B, Hk, N] int32
    extra_tiles: torch.Tensor  # [B, Hk, N, n_et] int16/int32
    extra_tile_bits: torch.Tensor  # [B, Hk, N, n_et] uint8/int32


if HAS_TRITON:

    @triton.jit
    def _own_range(i_t, Tq, q_offset, off, TOKENS: tl.constexpr, P: tl.constexpr):
        """The own blocks of shared tile ``i_t`` (a scalar or a vector of tiles): ``lo .. hi``, empty for a tile
        inside the padding."""
        first = q_offset + i_t * TOKENS - off
        last = q_offset + tl.minimum(Tq, i_t * TOKENS + TOKENS) - 1 - off
        lo = tl.maximum(first, 0) // P
        hi = tl.where(last >= 0, tl.maximum(last, 0) // P, lo - 1)
        return lo, hi

    @triton.jit
    def _program_tiles(sel_ptr, off_ptr, Hk, N, n_tiles, stride_sb, stride_sh, BLOCK_T: tl.constexpr,
                       BLOCK: tl.constexpr):
        """A program's ``BLOCK_T`` tiles by ``BLOCK`` blocks (grid: tiles, blocks, sequence x KV head), their masks,
        its row's left padding and the row's bitmap."""
        i_t, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b = i_bh // Hk
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
        o_n = i_c * BLOCK + tl.arange(0, BLOCK)
        p_sel = sel_ptr + i_b.to(tl.int64) * stride_sb + (i_bh % Hk).to(tl.int64) * stride_sh
        return i_bh, tl.load(off_ptr + i_b), o_t, o_n, o_t < n_tiles, o_n < N, p_sel

    @triton.jit
    def _extras_words_kernel(
        sel_ptr, shared_ptr, off_ptr, word_ptr, tword_ptr, Hk, Tq, N, n_qt, n_et, q_offset,
        stride_sb, stride_sh, stride_st, P: tl.constexpr, TOKENS: tl.constexpr, ETOKENS: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """The extras words of ``BLOCK_E`` extras tiles over ``BLOCK`` blocks: bit k for token k's extras (its
        selection outside its shared tile's own blocks and, for a real token, outside the tile's shared blocks),
        stored per tile (``[n_et, N]``) and per block (``[N, n_et]``, the backward's lists): the transposed copy in
        torch was a strided pass over the words, 0.4 ms a layer at 64K."""
        i_bh, off, o_e, o_n, m_e, m_n, p_sel = _program_tiles(sel_ptr, off_ptr, Hk, N, n_et, stride_sb, stride_sh,
                                                              BLOCK_E, BLOCK)
        word = tl.zeros([BLOCK_E, BLOCK], dtype=tl.int32)
        for k in tl.static_range(ETOKENS):
            t = o_e * ETOKENS + k  # [BLOCK_E]
            i_t = t // TOKENS
            lo, hi = _own_range(i_t, Tq, q_offset, off, TOKENS, P)
            m = (m_e & (t < Tq))[:, None] & m_n[None, :]
            b_sel = tl.load(p_sel + t[:, None].to(tl.int64) * stride_st + o_n[None, :], mask=m, other=0) != 0
            b_shared = tl.load(shared_ptr + (i_bh.to(tl.int64) * n_qt + i_t)[:, None] * N + o_n[None, :], mask=m,
                               other=0) != 0
            own = (o_n[None, :] >= lo[:, None]) & (o_n[None, :] <= hi[:, None])
            taken = own | (b_shared & (q_offset + t - off >= 0)[:, None])
            word = word | ((b_sel & ~taken).to(tl.int32) << k)
        word = word.to(word_ptr.dtype.element_ty)
        m = m_e[:, None] & m_n[None, :]
        tl.store(word_ptr + (i_bh.to(tl.int64) * n_et + o_e)[:, None] * N + o_n[None, :], word, mask=m)
        tl.store(tword_ptr + (i_bh.to(tl.int64) * N + o_n)[:, None] * n_et + o_e[None, :], tl.trans(word),
                 mask=tl.trans(m))

    @triton.jit
    def _shared_blocks_kernel(
        sel_ptr, off_ptr, shared_ptr, whole_ptr, twhole_ptr, Hk, Tq, N, n_qt, q_offset,
        stride_sb, stride_sh, stride_st, P: tl.constexpr, TOKENS: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """The blocks every real token of ``BLOCK_T`` shared tiles selected (none for a tile without a real token),
        over ``BLOCK`` blocks; and without the tiles' own blocks (``whole``), stored per tile (``[n_qt, N]``) and per
        block (``[N, n_qt]``). In torch: an AND over the bitmap's token axis, an or with the padded tokens and a pad
        copy where rows are padded, and a strided transposed copy (1.7 ms a layer at 64K)."""
        i_bh, off, o_t, o_n, m_t, m_n, p_sel = _program_tiles(sel_ptr, off_ptr, Hk, N, n_qt, stride_sb, stride_sh,
                                                              BLOCK_T, BLOCK)
        every = tl.full([BLOCK_T, BLOCK], 1, dtype=tl.int32)
        any_real = tl.zeros([BLOCK_T], dtype=tl.int32)
        for k in range(TOKENS):
            t = o_t * TOKENS + k  # [BLOCK_T]
            real = m_t & (t < Tq) & (q_offset + t - off >= 0)
            b_sel = tl.load(p_sel + t[:, None].to(tl.int64) * stride_st + o_n[None, :],
                            mask=real[:, None] & m_n[None, :], other=0).to(tl.int32)
            # a token that is not real takes part as if it had selected everything
            every = every & tl.where(real[:, None], b_sel, 1)
            any_real = any_real | real.to(tl.int32)
        shared = every & any_real[:, None]
        lo, hi = _own_range(o_t, Tq, q_offset, off, TOKENS, P)
        own = (o_n[None, :] >= lo[:, None]) & (o_n[None, :] <= hi[:, None])
        whole = tl.where(own, 0, shared)
        m = m_t[:, None] & m_n[None, :]
        o_tile = (i_bh.to(tl.int64) * n_qt + o_t)[:, None] * N + o_n[None, :]
        tl.store(shared_ptr + o_tile, shared.to(tl.uint8), mask=m)
        tl.store(whole_ptr + o_tile, whole.to(tl.uint8), mask=m)
        tl.store(twhole_ptr + (i_bh.to(tl.int64) * N + o_n)[:, None] * n_qt + o_t[None, :],
                 tl.trans(whole.to(tl.uint8)), mask=tl.trans(m))

    @triton.jit
    def _compact_kernel(x_ptr, count_ptr, index_ptr, value_ptr, M, HAS_VALUES: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``i`` of ``[rows, M]``: its nonzero entries' indices (and values) first, ascending, and their count;
        entries past the count are left as they were."""
        i = tl.program_id(0)
        row = i.to(tl.int64) * M
        base = 0
        for c in range(0, M, BLOCK):
            o = c + tl.arange(0, BLOCK)
            b_x = tl.load(x_ptr + row + o, mask=o < M, other=0)
            m = b_x != 0
            rank = base + tl.cumsum(m.to(tl.int32), 0) - 1
            tl.store(index_ptr + row + rank, o.to(index_ptr.dtype.element_ty), mask=m)
            if HAS_VALUES:
                tl.store(value_ptr + row + rank, b_x, mask=m)
            base += tl.sum(m.to(tl.int32), 0)
        tl.store(count_ptr + i, base)


def _compact_kernels(x: torch.Tensor, values: bool):
    """``_compact_values`` of ``x != 0`` (and ``x``'s values) by ``_compact_kernel``, one program per row."""
    x = x.contiguous()
    M = x.shape[-1]
    rows = x.numel() // max(1, M)
    counts = torch.empty(x.shape[:-1], dtype=torch.int32, device=x.device)
    index = torch.empty(x.shape, dtype=torch.int16 if M < 2**15 else torch.int32, device=x.device)
    out = torch.empty_like(x) if values else None
    if rows and M:
        with on_device(x):
            launcher(_compact_kernel)[(rows,)](x, counts, index, out if values else index, M, HAS_VALUES=values,
                                               BLOCK=min(1024, next_power_of_2(M)))
    elif rows:
        counts.zero_()
    return counts, index, out


def extra_tokens(heads: int, kv_heads: int, extra_tile: int = EXTRA_ROWS) -> int:
    """Query tokens per extras tile of ``extra_tile`` rows (at most ``EXTRA_TOKENS_MAX``)."""
    return min(EXTRA_TOKENS_MAX, max(1, extra_tile // (heads // kv_heads)))


def _compact_values(visit: torch.Tensor, values: torch.Tensor | None = None):
    """``[..., M]`` bool -> counts ``[...]`` int32, the indices of the True entries first, ascending, and ``values``
    at those entries (or None). By a running count and a scatter: no sort."""
    M = visit.shape[-1]
    dtype = torch.int16 if M < 2**15 else torch.int32
    rank = visit.cumsum(-1, dtype=torch.int32)
    counts = rank[..., -1].contiguous() if M else rank.sum(-1)
    slot = torch.where(visit, rank - 1, M).long()  # entries not visited land in a spare column, cut off after
    index = torch.zeros(*visit.shape[:-1], M + 1, dtype=dtype, device=visit.device)
    index.scatter_(-1, slot, torch.arange(M, dtype=dtype, device=visit.device).expand_as(slot))
    if values is None:
        return counts, index[..., :M].contiguous(), None
    out = torch.zeros(*visit.shape[:-1], M + 1, dtype=values.dtype, device=visit.device)
    out.scatter_(-1, slot, values)
    return counts, index[..., :M].contiguous(), out[..., :M].contiguous()


def _own_blocks(B: int, Tq: int, N: int, tokens: int, P: int, q_offset: int, offsets, device) -> torch.Tensor:
    """``[B, n_qt, N]`` bool: the own blocks of each tile's tokens (a contiguous range; none for a tile inside the
    padding)."""
    n_qt = -(-Tq // tokens)
    starts = torch.arange(n_qt, device=device) * tokens
    ends = torch.clamp(starts + tokens, max=Tq) - 1
    off = torch.zeros(B, dtype=torch.long, device=device) if offsets is None else offsets.to(device).long()
    first = q_offset + starts[None, :] - off[:, None]
    last = q_offset + ends[None, :] - off[:, None]
    n = torch.arange(N, device=device)
    return (n >= (first.clamp(min=0) // P)[..., None]) & (n <= (last // P)[..., None]) & (last >= 0)[..., None]


def split_plan(bitmap: torch.Tensor, *, heads: int, block_size: int, q_offset: int = 0,
               offsets: torch.Tensor | None = None, tile: int = TILE_ROWS, extra_tile: int = EXTRA_ROWS,
               kernels: bool | None = None) -> SplitPlan:
    """Split each tile's keys into the blocks all its tokens share and each token's extras (``SplitPlan``).

    A token takes part in its tile's shared blocks when its position is real (``>= 0``); a query inside the padding
    keeps its whole selection as extras. Whatever a token sees is in exactly one part: a shared block whole; an own
    block by the per-row rule (the part of the shared tile); any other selected block as an extra.

    Args:
        bitmap: ``[B, Hk, Tq, N]`` bool, True where query ``t`` selected block ``n``.
        heads: H, the query heads (a multiple of Hk).
        block_size: P, keys per block.
        q_offset: position of the first query.
        offsets: ``[B]`` left padding of each row (blocks row-relative), or None.
        tile: query rows per shared tile.
        extra_tile: query rows per extras tile.
        kernels: build the extras words and the lists with the Triton kernels above (one pass each) instead of torch
            ops (several passes and int64 temporaries over the extras); None: on CUDA tensors.

    Returns:
        ``SplitPlan``. With ``kernels`` the list entries past each count are unspecified.

    Example:
        >>> bitmap = torch.zeros(1, 1, 4, 3, dtype=torch.bool)
        >>> bitmap[0, 0, 2:, 0] = True  # tokens 2 and 3 (own block 1) share block 0
        >>> bitmap[0, 0, 3, 1] = True  # token 3 also selected its own block: the own block's rule covers it
        >>> plan = split_plan(bitmap, heads=1, block_size=2, tile=2, extra_tile=1)
        >>> plan.counts.tolist(), plan.blocks[..., :1].tolist(), plan.extra_counts.tolist()
        ([[[0, 1]]], [[[[0], [0]]]], [[[0, 0, 0, 0]]])
    """
    B, Hk, Tq, N = bitmap.shape
    P, device = block_size, bitmap.device
    tokens = tile_tokens(heads, Hk, tile)
    etokens = extra_tokens(heads, Hk, extra_tile)
    n_qt, n_et = -(-Tq // tokens), -(-Tq // etokens)
    off = torch.zeros(B, dtype=torch.long, device=device) if offsets is None else offsets.to(device).long()
    word = torch.uint8 if etokens <= 8 else torch.int32
    if bitmap.is_cuda if kernels is None else kernels:
        if bitmap.stride(-1) != 1:
            bitmap = bitmap.contiguous()
        sel = bitmap.view(torch.uint8)
        shared = torch.empty(B, Hk, n_qt, N, dtype=torch.uint8, device=device)
        whole, twhole = torch.empty_like(shared), torch.empty(B, Hk, N, n_qt, dtype=torch.uint8, device=device)
        block_t, block = min(SHARED_TILES, next_power_of_2(n_qt)), min(SHARED_BLOCKS, next_power_of_2(N))
        bits = torch.empty(B, Hk, n_et, N, dtype=word, device=device)
        tbits = torch.empty(B, Hk, N, n_et, dtype=word, device=device)
        block_e, block_w = min(EXTRA_WORD_TILES, next_power_of_2(n_et)), min(EXTRA_WORD_BLOCKS, next_power_of_2(N))
        strides = (bitmap.stride(0), bitmap.stride(1), bitmap.stride(2))
        with on_device(bitmap):
            launcher(_shared_blocks_kernel)[(triton.cdiv(n_qt, block_t), triton.cdiv(N, block), B * Hk)](
                sel, off, shared, whole, twhole, Hk, Tq, N, n_qt, q_offset, *strides, P=P, TOKENS=tokens,
                BLOCK_T=block_t, BLOCK=block)
            launcher(_extras_words_kernel)[(triton.cdiv(n_et, block_e), triton.cdiv(N, block_w), B * Hk)](
                sel, shared, off, bits, tbits, Hk, Tq, N, n_qt, n_et, q_offset, *strides, P=P, TOKENS=tokens,
                ETOKENS=etokens, BLOCK_E=block_e, BLOCK=block_w)
        counts, blocks, _ = _compact_kernels(whole, False)
        tile_counts, tiles, _ = _compact_kernels(twhole, False)
        extra_counts, extra_blocks, extra_bits = _compact_kernels(bits, True)
        extra_tile_counts, extra_tiles, extra_tile_bits = _compact_kernels(tbits, True)
        return SplitPlan(tokens, etokens, counts, blocks, tile_counts, tiles, extra_counts, extra_blocks, extra_bits,
                         extra_tile_counts, extra_tiles, extra_tile_bits)
    padded = _tiles_of_tokens(bitmap, n_qt, tokens)
    real = (q_offset + torch.arange(n_qt * tokens, device=device)[None, :] - off[:, None] >= 0)
    real &= torch.arange(n_qt * tokens, device=device)[None, :] < Tq  # [B, n_qt * tokens]
    real = real.view(B, 1, n_qt, tokens, 1)
    # AND over the tile's real tokens: the others count as having selected everything, and a tile with none shares
    # nothing
    if offsets is None and q_offset >= 0 and Tq % tokens == 0:
        shared = padded.all(3)
    else:
        shared = (padded | ~real).all(3) & real.any(3)
    own = _own_blocks(B, Tq, N, tokens, P, q_offset, offsets, device)[:, None]  # [B, 1, n_qt, N]
    whole = shared & ~own
    counts, blocks, _ = _compact_values(whole)
    tile_counts, tiles, _ = _compact_values(whole.transpose(-1, -2))
    # The extras: what a token selected outside its tile's own blocks and, for a real token, its shared blocks.
    taken = own[:, :, :, None] | (shared[:, :, :, None] & real)  # [B, Hk, n_qt, tokens, N]
    extras = (padded & ~taken).view(B, Hk, n_qt * tokens, N)[:, :, :Tq]
    extras = F.pad(extras, (0, 0, 0, n_et * etokens - Tq)).view(B, Hk, n_et, etokens, N)
    bits = torch.zeros(B, Hk, n_et, N, dtype=word, device=device)
    for k in range(etokens):
        bits |= extras[:, :, :, k].to(word) << k
    visit = bits != 0
    extra_counts, extra_blocks, extra_bits = _compact_values(visit, bits)
    tbits = bits.transpose(-1, -2)
    extra_tile_counts, extra_tiles, extra_tile_bits = _compact_values(visit.transpose(-1, -2), tbits)
    return SplitPlan(tokens, etokens, counts, blocks, tile_counts, tiles, extra_counts, extra_blocks, extra_bits,
                     extra_tile_counts, extra_tiles, extra_tile_bits)


def split_work(plan: SplitPlan, *, heads: int, block_size: int, queries: int, q_offset: int = 0,
               offsets: torch.Tensor | None = None) -> dict:
    """The work each part of a split plan visits, as (query rows x key block) tiles against causal attention's.

    ``causal_row_blocks``: rows x blocks dense causal attention computes (each query row against every block up to
    its own). ``shared_row_blocks``: rows x blocks of the shared part (its listed blocks and own blocks, whole tiles);
    ``extra_row_blocks``: rows x blocks of the extras part (each extras tile's rows against its listed blocks);
    ``*_share``: those over the causal count. ``*_tiles``: the (tile, block) pairs visited, per part.
    ``extra_blocks_per_token``: blocks per token that the extras part lists for it (its extras). A tile counts
    whole (``tokens * G`` or ``extra_tokens * G`` rows), as the kernels compute it. One host sync: for reports.
    """
    B, Hk, n_qt = plan.counts.shape
    N = plan.blocks.shape[-1]
    G = heads // Hk
    Tq = queries
    own = _own_blocks(B, Tq, N, plan.tokens, block_size, q_offset, offsets, plan.counts.device).sum(-1)  # [B, n_qt]
    rows_q = plan.tokens * G
    rows_e = plan.extra_tokens * G
    shared_tiles = int(plan.counts.sum()) + int(own.sum()) * Hk
    extra_tiles = int(plan.extra_counts.sum())
    off = torch.zeros(B, dtype=torch.long) if offsets is None else offsets.cpu().long()
    pos = q_offset + torch.arange(Tq)[None, :] - off[:, None]
    causal = int(torch.where(pos >= 0, pos // block_size + 1, 0).sum()) * Hk * G
    listed = torch.arange(N, device=plan.counts.device) < plan.extra_counts[..., None]  # entries past a count: unset
    bits = torch.where(listed, plan.extra_bits.long(), 0)
    per_token = sum(int(((bits >> k) & 1).sum()) for k in range(plan.extra_tokens)) / max(1, B * Hk * Tq)
    return dict(causal_row_blocks=causal, shared_tiles=shared_tiles, extra_tiles=extra_tiles,
                shared_row_blocks=shared_tiles * rows_q, extra_row_blocks=extra_tiles * rows_e,
                shared_share=shared_tiles * rows_q / max(1, causal), extra_share=extra_tiles * rows_e / max(1, causal),
                extra_blocks_per_token=per_token)
