"""CompressedKeys: the window means of keys and eviction scores of a whole sequence, kept on the device.

Selection scores blocks through them (design Sec. 3.2): ``compress_kernel``-token windows every ``compress_stride``
tokens, full windows only. The last ``compress_kernel`` tokens sit in a ring, so a window is finished the moment
its last token arrives (the decode kernels do that themselves, ``kernels.block_scores.append_token``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import NosaConfig
from .kernels.block_scores import window_capacity_for
from .selection import compress_keys, num_windows

Allocator = Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor]


def _plain_allocator(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


class CompressedKeys:
    """``keys [B, Hk, W_cap, D]``, ``bias [B, Hk, W_cap]`` fp32 (the first ``n`` windows are filled), and the ring
    ``ring_k [B, Hk, compress_kernel, D]``, ``ring_b [B, Hk, compress_kernel]``.

    The capacity ``W_cap`` is a power of two (``window_capacity_for``): the decode kernels are specialised on it, so
    sizing it for the whole generation up front (``tokens``) means they never recompile while decoding.
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
        self.ring_k = self._allocate("ring_k", (B, Hk, cfg.compress_kernel, D), like_k.dtype, like_k.device).zero_()
        self.ring_b = self._allocate("ring_b", (B, Hk, cfg.compress_kernel), torch.float32, like_k.device).zero_()
        self.n = 0

    def reserve(self, n_windows: int) -> None:
        """Room for ``n_windows`` windows; grows to the next power of two (a new buffer, so graphs recapture)."""
        if n_windows <= self.keys.shape[2]:
            return
        capacity = window_capacity_for(n_windows)
        keys = self._allocate("compressed_keys", (*self.keys.shape[:2], capacity, self.keys.shape[3]), self.dtype, self.device)
        bias = self._allocate("compressed_bias", (*self.bias.shape[:2], capacity), torch.float32, self.device)
        keys.zero_()[:, :, : self.n] = self.keys[:, :, : self.n]
        bias.zero_()[:, :, : self.n] = self.bias[:, :, : self.n]
        self.keys, self.bias = keys, bias

    def rebuild(self, keys: torch.Tensor, bias: torch.Tensor) -> None:
        """From the full ``keys [B, Hk, T, D]`` and ``bias [B, Hk, T]`` of the sequence."""
        T, kernel = keys.shape[2], self.cfg.compress_kernel
        self.n = num_windows(T, self.cfg)
        self.reserve(self.n)
        self.keys[:, :, : self.n] = compress_keys(keys, self.cfg)
        self.bias[:, :, : self.n] = compress_keys(bias, self.cfg)
        recent = torch.arange(max(0, T - kernel), T, device=keys.device)
        self.ring_k[:, :, recent % kernel] = keys[:, :, recent]
        self.ring_b[:, :, recent % kernel] = bias[:, :, recent]

    def extend(self, keys: torch.Tensor, bias: torch.Tensor, start: int) -> None:
        """Tokens ``start .. start + T - 1`` arrive (``keys [B, Hk, T, D]``, ``bias [B, Hk, T]``): finish every window
        they complete and refill the ring, leaving the state ``rebuild`` over the whole sequence would."""
        cfg = self.cfg
        kernel, stride = cfg.compress_kernel, cfg.compress_stride
        end = start + keys.shape[2]
        n_old, n_new = self.n, num_windows(end, cfg)
        if n_new > n_old:
            first = n_old * stride  # first token of the first new window; the ring holds it if it precedes start
            past = torch.arange(first, start, device=keys.device) % kernel
            span_k = torch.cat([self.ring_k[:, :, past], keys[:, :, max(0, first - start) :]], 2)
            span_b = torch.cat([self.ring_b[:, :, past], bias[:, :, max(0, first - start) :]], 2)
            self.reserve(n_new)
            self.keys[:, :, n_old:n_new] = compress_keys(span_k, cfg)
            self.bias[:, :, n_old:n_new] = compress_keys(span_b, cfg)
            self.n = n_new
        recent = torch.arange(max(start, end - kernel), end, device=keys.device)
        self.ring_k[:, :, recent % kernel] = keys[:, :, recent - start]
        self.ring_b[:, :, recent % kernel] = bias[:, :, recent - start]

    def append(self, k: torch.Tensor, b: torch.Tensor, t: int) -> None:
        """Token ``t`` (``k [B, Hk, 1, D]``, ``b [B, Hk, 1]``) arrives (the torch decode path)."""
        self.extend(k, b, t)

    def index_batch(self, index: torch.Tensor) -> None:
        for name in ("keys", "bias", "ring_k", "ring_b"):
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.keys.device)))
        self.batch = index.numel()
