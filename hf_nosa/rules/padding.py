"""Left padding, counted out: each row of a batch is stored and selected as if it were alone.

A left-padded row's first real token sits at cache index ``offset`` (its padding length), which need not be a
multiple of ``block_size``. Every NOSA rule counts from a token index: blocks are ``index // block_size``, the sink
blocks are the first ones, the compressed windows start every ``compress_stride`` tokens from index 0. Counted from
cache indices, the padding would shift all of them (and the sink blocks would be padding), so a padded row would
select other tokens than the same row alone.

So a NosaCache stores each row *row-relative*: row b's real token at cache index ``j`` sits at storage index
``j - offsets[b]`` in the host store, the compressed keys and the slot pool's block numbers, and the padding is
not stored at all (``modeling.chunked`` moves a left-padded prompt's real tokens to the front before the layers see
it, so every prefill chunk, QUOKA's included, starts at the same row-relative index as the row alone). After the
prompt, decoding token ``t`` of row b is storage index ``t - offsets[b]``; the kernels read ``offsets`` (a ``[B]``
device tensor) next to the step counter, so a decode step stays free of host syncs and capturable. The cache's
length (``get_seq_length``) stays the padded one transformers expects.

A prompt that reaches the cache by another route (the decoder called directly, a 4D mask, a cache running another
selector from ``cache/selectors.py``) is stored as it comes, padding included: the padding is hidden from attention by
its eviction score (``masks.padding_bias``), but blocks are then counted from cache index 0.

Rules that see a whole padded sequence at once (``selection.nosa_token_mask``, the training mask) move each row's
tokens to the front with ``to_rows``, select, and bring the result back with ``from_rows``.
"""

from __future__ import annotations

import torch


def leading_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: how many masked tokens precede each row's first real token.

    Args:
        attention_mask: ``[B, T]`` 2D (1/True = real), or the 4D mask a model builds (bool, or additive float with
            large negatives for hidden keys); its last query row is read, which sees every earlier real token.
    """
    if attention_mask.dim() == 4:
        row = attention_mask[:, 0, -1]
        real = row if row.dtype == torch.bool else row.float() > -1.0
    else:
        real = attention_mask.bool()
    return (real.long().cumsum(-1) == 0).sum(-1)


def _shift(x: torch.Tensor, index: torch.Tensor, dim: int, fill) -> torch.Tensor:
    """``out[b, .., i, ..] = x[b, .., index[b, i], ..]`` along ``dim``, ``fill`` where the index is out of range."""
    dim = dim % x.dim()
    T = x.shape[dim]
    valid = (index >= 0) & (index < T)  # [B, n]
    shape = [x.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = index.shape[1]
    idx = index.clamp(0, max(T - 1, 0)).view(shape)
    size = list(x.shape)
    size[dim] = index.shape[1]
    out = x.gather(dim, idx.expand(size))
    return out.masked_fill(~valid.view(shape).expand(size), fill)


def to_rows(x: torch.Tensor, offsets: torch.Tensor, *, dim: int = 2, fill=0.0) -> torch.Tensor:
    """Move each row's tokens to the front: ``out[b, .., s] = x[b, .., s + offsets[b]]``, ``fill`` past the end.

    Args:
        x: ``[B, ...]`` with tokens along ``dim`` (``[B, Hk, T, D]`` keys, ``[B, Hk, T]`` scores).
        offsets: ``[B]`` long, each row's left padding.
    """
    T = x.shape[dim]
    index = torch.arange(T, device=x.device)[None, :] + offsets.to(x.device)[:, None]
    return _shift(x, index, dim, fill)


def from_rows(x: torch.Tensor, offsets: torch.Tensor, *, dim: int = -1, fill=False, length: int | None = None
              ) -> torch.Tensor:
    """The inverse of ``to_rows``: ``out[b, .., j] = x[b, .., j - offsets[b]]``, ``fill`` inside the padding.

    ``length``: tokens of the result along ``dim`` (default: those of ``x``).
    """
    T = x.shape[dim] if length is None else length
    index = torch.arange(T, device=x.device)[None, :] - offsets.to(x.device)[:, None]
    return _shift(x, index, dim, fill)



def roll_rows(x: torch.Tensor, offsets: torch.Tensor, *, dim: int = 1) -> torch.Tensor:
    """``out[b, .., s] = x[b, .., (s + offsets[b]) mod T]``: each row's first ``offsets[b]`` tokens move to its end
    (a left-padded prompt becomes real tokens first, padding last); ``-offsets`` undoes it."""
    T = x.shape[dim]
    index = (torch.arange(T, device=x.device)[None, :] + offsets.to(x.device)[:, None]) % max(T, 1)
    return _shift(x, index, dim, 0)
