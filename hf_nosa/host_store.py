"""HostStore: the full K, V and eviction scores of every token, in host memory.

Grown in fixed chunks of tokens, so appending never re-copies what is stored; pinned when the model runs on
CUDA, so blocks can be read straight from the device (UVA) and written back asynchronously.
"""

from __future__ import annotations

import torch


class HostStore:
    """``k_chunks[i]``, ``v_chunks[i]``: ``[B, Hk, C, D]``; ``b_chunks[i]``: ``[B, Hk, C]`` fp32; C = chunk_tokens."""

    chunk_tokens = 8192

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, pin: bool):
        self.batch, self.kv_heads, self.head_dim, self.dtype = batch, kv_heads, head_dim, dtype
        self.block_size = block_size
        self.chunk = max(block_size, (self.chunk_tokens // block_size) * block_size)
        self.pin = pin
        self.k_chunks: list[torch.Tensor] = []
        self.v_chunks: list[torch.Tensor] = []
        self.b_chunks: list[torch.Tensor] = []
        self.length = 0
        self._pending: torch.cuda.Event | None = None
        self._device_writer: torch.device | None = None  # a device whose kernels write the store directly
        self._version = 0  # bumped whenever a chunk is added or replaced
        self._table: torch.Tensor | None = None
        self._table_version = -1

    @property
    def capacity(self) -> int:
        return len(self.k_chunks) * self.chunk

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk // self.block_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_chunks, *self.v_chunks, *self.b_chunks))

    def _empty(self, *shape, dtype):
        return torch.empty(*shape, dtype=dtype, pin_memory=self.pin)

    def _grow(self, n_tokens: int) -> None:
        B, Hk, D = self.batch, self.kv_heads, self.head_dim
        while self.capacity < n_tokens:
            self.k_chunks.append(self._empty(B, Hk, self.chunk, D, dtype=self.dtype))
            self.v_chunks.append(self._empty(B, Hk, self.chunk, D, dtype=self.dtype))
            self.b_chunks.append(self._empty(B, Hk, self.chunk, dtype=torch.float32))
            self._version += 1

    def ensure_capacity(self, n_tokens: int) -> None:
        """Allocate chunks so that tokens ``0 .. n_tokens - 1`` have a place (before a kernel writes them)."""
        self._grow(n_tokens)

    def pointer_table(self, device: torch.device) -> torch.Tensor:
        """``[3, n]`` int64 on ``device``: the addresses of the K, V and b chunks, for kernels that read and write
        the pinned store directly (UVA). Updated in place when chunks are added, so its own address stays fixed."""
        n = max(64, len(self.k_chunks))
        if self._table is None or self._table.device != device or self._table.shape[1] < n:
            self._table = torch.zeros(3, 1 << (n - 1).bit_length(), dtype=torch.int64, device=device)
            self._table_version = -1
        if self._table_version != self._version:
            rows = [[t.data_ptr() for t in chunks] for chunks in (self.k_chunks, self.v_chunks, self.b_chunks)]
            host = torch.zeros(self._table.shape, dtype=torch.int64)
            if rows[0]:
                host[:, : len(rows[0])] = torch.tensor(rows, dtype=torch.int64)
            self._table.copy_(host, non_blocking=True)
            self._table_version = self._version
        return self._table

    def mark_device_written(self, end: int, device: torch.device) -> None:
        """A kernel on ``device`` wrote tokens up to ``end - 1`` straight into the store (no host sync)."""
        self.length = max(self.length, end)
        if device.type == "cuda":
            self._device_writer = device

    def _spans(self, start: int, end: int):
        """(chunk index, offset in chunk, offset in the source, length) for tokens start .. end - 1."""
        pos = start
        while pos < end:
            i, off = divmod(pos, self.chunk)
            n = min(self.chunk - off, end - pos)
            yield i, off, pos - start, n
            pos += n

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> None:
        """Store tokens ``start .. start + T - 1`` from ``k, v [B, Hk, T, D]`` and ``b [B, Hk, T]``."""
        end = start + k.shape[2]
        self._grow(end)
        for i, off, src, n in self._spans(start, end):
            self.k_chunks[i][:, :, off : off + n].copy_(k[:, :, src : src + n], non_blocking=True)
            self.v_chunks[i][:, :, off : off + n].copy_(v[:, :, src : src + n], non_blocking=True)
            self.b_chunks[i][:, :, off : off + n].copy_(b[:, :, src : src + n], non_blocking=True)
        self.length = max(self.length, end)
        if k.is_cuda:
            self._pending = torch.cuda.Event()
            self._pending.record()

    def wait_writes(self) -> None:
        """Block until asynchronous device-to-host writes have landed (before the CPU itself reads the store)."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
        if self._device_writer is not None:
            torch.cuda.synchronize(self._device_writer)
            self._device_writer = None

    def read(self, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``start .. end - 1`` as ``k, v [B, Hk, T, D]`` and ``b [B, Hk, T]`` on ``device``."""
        self.wait_writes()
        parts = [(self.k_chunks[i], self.v_chunks[i], self.b_chunks[i], off, n) for i, off, _, n in self._spans(start, end)]
        if not parts:
            B, Hk, D = self.batch, self.kv_heads, self.head_dim
            return (
                torch.empty(B, Hk, 0, D, dtype=self.dtype, device=device),
                torch.empty(B, Hk, 0, D, dtype=self.dtype, device=device),
                torch.empty(B, Hk, 0, dtype=torch.float32, device=device),
            )
        out = []
        for which in range(3):
            pieces = [p[which][:, :, off : off + n].to(device, non_blocking=True) for *p, off, n in parts]
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
        return out[0], out[1], out[2]

    def gather_blocks(self, b_idx: torch.Tensor, h_idx: torch.Tensor, block_idx: torch.Tensor):
        """Blocks ``block_idx`` of (sequence, KV head) pairs, all CPU long ``[n]``: ``k, v [n, P, D]``, ``b [n, P]``."""
        self.wait_writes()
        P, n = self.block_size, b_idx.numel()
        k = torch.empty(n, P, self.head_dim, dtype=self.dtype, pin_memory=self.pin)
        v = torch.empty_like(k)
        b = torch.empty(n, P, dtype=torch.float32, pin_memory=self.pin)
        chunk_of = block_idx // self.blocks_per_chunk
        local = block_idx % self.blocks_per_chunk
        for i in torch.unique(chunk_of).tolist():
            rows = (chunk_of == i).nonzero(as_tuple=True)[0]
            shape = (self.batch, self.kv_heads, self.blocks_per_chunk, P)
            k[rows] = self.k_chunks[i].view(*shape, -1)[b_idx[rows], h_idx[rows], local[rows]]
            v[rows] = self.v_chunks[i].view(*shape, -1)[b_idx[rows], h_idx[rows], local[rows]]
            b[rows] = self.b_chunks[i].view(*shape)[b_idx[rows], h_idx[rows], local[rows]]
        return k, v, b

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep/reorder/repeat sequences: sequence i becomes old sequence ``index[i]``."""
        self.wait_writes()
        index = index.cpu()
        self.batch = index.numel()
        for chunks in (self.k_chunks, self.v_chunks, self.b_chunks):
            for j, chunk in enumerate(chunks):
                out = self._empty(index.numel(), *chunk.shape[1:], dtype=chunk.dtype)
                torch.index_select(chunk, 0, index, out=out)
                chunks[j] = out
        self._version += 1
