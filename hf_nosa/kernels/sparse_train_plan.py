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
    selected = F.pad(bitmap, (0, 0, 0, n_qt * tokens - Tq)).view(B, Hk, n_qt, tokens, N).any(3)
    starts = torch.arange(n_qt, device=bitmap.device) * tokens
    ends = torch.clamp(starts + tokens, max=Tq) - 1
    off = torch.zeros(B, dtype=torch.long, device=bitmap.device) if offsets is None else offsets.to(bitmap.device)
    first = q_offset + starts[None, :] - off[:, None]  # [B, n_qt] row-relative position of a tile's first token
    last = q_offset + ends[None, :] - off[:, None]
    n = torch.arange(N, device=bitmap.device)
    own = (n >= (first.clamp(min=0) // P)[..., None]) & (n <= (last // P)[..., None]) & (last >= 0)[..., None]
    return selected | own[:, None]


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
