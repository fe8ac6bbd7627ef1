"""CompressedKeys: the window means of keys and eviction scores of a whole sequence, kept on the device.

Selection scores blocks through them (design Sec. 3.2): ``compress_kernel``-token windows every ``compress_stride``
tokens, full windows only. The last ``compress_kernel`` tokens sit in a ring, so a window is finished the moment
its last token arrives (the decode kernels do that themselves, ``kernels.decode.block_scores.append_token``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import NosaConfig
from ..kernels.backend import kernel_path
from ..kernels.decode.block_scores import window_capacity_for, window_capacity_grown
from ..kernels.prefill.compress_extend import extend_windows
from ..rules.selection import compress_keys, num_windows

Allocator = Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor]


def _plain_allocator(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _ring_spans(lo: int, hi: int, kernel: int) -> list[tuple[int, int, int]]:
    """Tokens ``lo .. hi - 1`` as ring slots ``token % kernel``: runs ``(slot_lo, slot_hi, first_token)`` in token
    order (at most two for the at most ``kernel`` tokens a ring holds). Slices instead of index tensors: each index
    tensor cost a kernel launch or two per layer and chunk of a prefill."""
    spans = []
    while lo < hi:
        slot = lo % kernel
        n = min(hi - lo, kernel - slot)
        spans.append((slot, slot + n, lo))
        lo += n
    return spans


class CompressedKeys:
    """``keys [B, Hk, W_cap, D]``, ``bias [B, Hk, W_cap]`` fp32 (the first ``n`` windows are filled), and the ring
    ``ring_k [B, Hk, compress_kernel, D]``, ``ring_b [B, Hk, compress_kernel]``.

    The capacity ``W_cap`` is sized for the whole generation up front (``tokens``; a multiple of 256 windows,
    ``window_capacity_for``), so decoding never reallocates it; a cache that outgrows it (its length unknown) grows
    to a power of two (``window_capacity_grown``).
    """

    def __init__(self, cfg: NosaConfig, like_k: torch.Tensor, *, tokens: int = 0, allocate: Allocator | None = None):
        B, Hk, _, D = like_k.shape
        self.cfg = cfg
        self._allocate = allocate or _plain_allocator
        self.batch, self.kv_heads, self.head_dim = B, Hk, D
        self.dtype, self.device = like_k.dtype, like_k.device
        capacity = window_capacity_for(num_windows(tokens, cfg))
        self.keys = self._allocate("compressed_keys", (B, Hk, capacity, D), like_k.dtype, like_k.device).zero_()
        self.bias = self._allocate("compressed_bias", (B, Hk, capacity), torch.float32, like_k.device).zero_()
        self._match_capacities()
        self.ring_k = self._allocate("ring_k", (B, Hk, cfg.compress_kernel, D), like_k.dtype, like_k.device).zero_()
        self.ring_b = self._allocate("ring_b", (B, Hk, cfg.compress_kernel), torch.float32, like_k.device).zero_()
        self.n = 0

    def reserve(self, n_windows: int) -> None:
        """Room for ``n_windows`` windows; grows to the next power of two (a new buffer, so graphs recapture)."""
        if n_windows <= self.keys.shape[2]:
            return
        capacity = window_capacity_grown(n_windows)
        keys = self._allocate("compressed_keys", (*self.keys.shape[:2], capacity, self.keys.shape[3]), self.dtype, self.device)
        bias = self._allocate("compressed_bias", (*self.bias.shape[:2], capacity), torch.float32, self.device)
        keys.zero_()[:, :, : self.n] = self.keys[:, :, : self.n]
        bias.zero_()[:, :, : self.n] = self.bias[:, :, : self.n]
        self.keys, self.bias = keys, bias
        self._match_capacities()

    def _match_capacities(self) -> None:
        """A workspace may hand out larger buffers than asked (``DeviceWorkspace.take``'s ``grow``); keys and bias
        keep one capacity, the smaller of the two (a view)."""
        capacity = min(self.keys.shape[2], self.bias.shape[2])
        self.keys, self.bias = self.keys[:, :, :capacity], self.bias[:, :, :capacity]

    def rebuild(self, keys: torch.Tensor, bias: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """From the full ``keys [B, Hk, T, D]`` and ``bias [B, Hk, T]`` of the sequence.

        ``lengths``: ``[B]`` long, each row's own length when rows differ (row-relative storage of a left-padded
        batch, ``hf_nosa.rules.padding``); windows past a row's length are then left as garbage that no rule reads (each
        counts the windows complete at its row's token) and a decode step overwrites when it completes them.
        """
        T = keys.shape[2]
        self.n = num_windows(T, self.cfg)
        self.reserve(self.n)
        self.keys[:, :, : self.n] = compress_keys(keys, self.cfg)
        self.bias[:, :, : self.n] = compress_keys(bias, self.cfg)
        if lengths is None:
            lengths = torch.full((keys.shape[0],), T, dtype=torch.long)
        self.set_rings(keys, bias, 0, lengths)

    def set_rings(self, keys: torch.Tensor, bias: torch.Tensor, lo: int, lengths: torch.Tensor) -> None:
        """Refill each row's ring with its last ``compress_kernel`` tokens before ``lengths[b]``, read from
        ``keys [B, Hk, S, D]`` / ``bias [B, Hk, S]`` that hold tokens ``lo .. lo + S - 1`` (positions before 0
        keep the ring's old content, as ``extend`` leaves it)."""
        kernel = self.cfg.compress_kernel
        if keys.shape[2] == 0:
            return
        lengths = lengths.to(keys.device)
        p = torch.arange(kernel, device=keys.device)
        first = lengths[:, None] - kernel  # [B, 1]
        token = first + (p - first) % kernel  # [B, kernel]: the token whose ring slot is p
        valid = token >= 0
        index = (token - lo).clamp(0, max(keys.shape[2] - 1, 0))
        B, Hk, _, D = keys.shape
        new_k = keys.gather(2, index[:, None, :, None].expand(B, Hk, kernel, D))
        new_b = bias.gather(2, index[:, None, :].expand(B, Hk, kernel))
        self.ring_k.copy_(torch.where(valid[:, None, :, None], new_k, self.ring_k))
        self.ring_b.copy_(torch.where(valid[:, None, :], new_b, self.ring_b))

    def extend(self, keys: torch.Tensor, bias: torch.Tensor, start) -> None:
        """Tokens ``start .. start + T - 1`` arrive (``keys [B, Hk, T, D]``, ``bias [B, Hk, T]``): finish every window
        they complete and refill the ring, leaving the state ``rebuild`` over the whole sequence would.

        ``start``: an int, or a ``[B]`` CPU long tensor of row-relative starts (rows of a left-padded batch).
        """
        if isinstance(start, int):
            self._extend_rows(slice(None), keys, bias, start)
            return
        for b, row_start in enumerate(start.tolist()):
            self._extend_rows(slice(b, b + 1), keys[b : b + 1], bias[b : b + 1], row_start)

    def _extend_rows(self, rows: slice, keys: torch.Tensor, bias: torch.Tensor, start: int) -> None:
        cfg = self.cfg
        kernel, stride = cfg.compress_kernel, cfg.compress_stride
        end = start + keys.shape[2]
        n_old, n_new = num_windows(start, cfg), num_windows(end, cfg)
        ring_k, ring_b = self.ring_k[rows], self.ring_b[rows]
        if kernel_path("compress_extend", keys) == "triton":  # one launch where the torch form below takes ten
            self.reserve(n_new)
            extend_windows(self.keys[rows], self.bias[rows], ring_k, ring_b, keys, bias, start, n_old, n_new, cfg)
            self.n = max(self.n, n_new)
            return
        if n_new > n_old:
            first = n_old * stride  # first token of the first new window; the ring holds it if it precedes start
            past = _ring_spans(first, start, kernel)
            span_k = torch.cat([ring_k[:, :, a:b] for a, b, _ in past] + [keys[:, :, max(0, first - start) :]], 2)
            span_b = torch.cat([ring_b[:, :, a:b] for a, b, _ in past] + [bias[:, :, max(0, first - start) :]], 2)
            self.reserve(n_new)
            self.keys[rows, :, n_old:n_new] = compress_keys(span_k, cfg)
            self.bias[rows, :, n_old:n_new] = compress_keys(span_b, cfg)
        self.n = max(self.n, n_new)
        for a, b, token in _ring_spans(max(start, end - kernel), end, kernel):
            ring_k[:, :, a:b] = keys[:, :, token - start : token - start + b - a]
            ring_b[:, :, a:b] = bias[:, :, token - start : token - start + b - a]

    def append(self, k: torch.Tensor, b: torch.Tensor, t) -> None:
        """Token ``t`` (``k [B, Hk, 1, D]``, ``b [B, Hk, 1]``) arrives (the torch decode path); ``t`` an int, or a
        ``[B]`` long tensor on the device of row-relative indices (one token per row, vectorised: no host sync)."""
        if isinstance(t, int):
            self.extend(k, b, t)
            return
        cfg = self.cfg
        kernel, stride = cfg.compress_kernel, cfg.compress_stride
        B, Hk, _, D = k.shape
        rows = torch.arange(B, device=k.device)
        self.ring_k[rows, :, t % kernel] = k[:, :, 0]
        self.ring_b[rows, :, t % kernel] = b[:, :, 0]
        completes = (t + 1 >= kernel) & ((t + 1 - kernel) % stride == 0)  # [B]
        order = (t[:, None] + 1 - kernel + torch.arange(kernel, device=k.device)) % kernel  # oldest first
        window_k = self.ring_k.gather(2, order[:, None, :, None].expand(B, Hk, kernel, D))
        window_b = self.ring_b.gather(2, order[:, None, :].expand(B, Hk, kernel))
        w = ((t + 1 - kernel).div(stride, rounding_mode="floor")).clamp(min=0)  # the window ending at t
        mean_k = window_k.float().mean(2).to(self.keys.dtype)
        mean_b = window_b.float().mean(2)
        self.keys[rows, :, w] = torch.where(completes[:, None, None], mean_k, self.keys[rows, :, w])
        self.bias[rows, :, w] = torch.where(completes[:, None], mean_b, self.bias[rows, :, w])

    def index_batch(self, index: torch.Tensor) -> None:
        for name in ("keys", "bias", "ring_k", "ring_b"):
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.keys.device)))
        self.batch = index.numel()
