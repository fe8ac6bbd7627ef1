"""HostStore: the full K, V and eviction scores of every token, in host memory.

Tokens live in chunks of whole blocks, appended as the sequence grows, so appending never re-copies what is
stored. The first chunk covers what the caller reserved (``reserve``: generate knows the prompt length and
``max_new_tokens``); later chunks add at least a tenth of what is held, so the store never holds more than
1.1x the tokens it stores plus one block. Pinned when the model runs on CUDA, so blocks can be read straight from
the device (UVA) through a per-block address table, and written back asynchronously.
"""

from __future__ import annotations

import bisect

import torch

GROWTH = 0.1  # a chunk added past the reservation holds at least this share of the tokens already held


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_host_memory() -> int | None:
    """Bytes of host memory the OS can still hand out (``MemAvailable``, and the cgroup's limit where one is set),
    or None where it cannot be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        available = limit - used if available is None else min(available, limit - used)
    return available


def check_host_memory(nbytes: int, *, batch: int, tokens: int, pin: bool, what: str = "NosaCache host store") -> None:
    """Raise a MemoryError naming batch, context and bytes when ``nbytes`` exceed the available host memory."""
    available = available_host_memory()
    if available is None or nbytes <= available:
        return
    kind = "pinned host" if pin else "host"
    raise MemoryError(
        f"{what}: batch {batch} x context {tokens} tokens needs {nbytes / 2**30:.2f} GiB of {kind} memory, but only "
        f"{available / 2**30:.2f} GiB is available. Lower the batch size or the context (prompt length + "
        "max_new_tokens), or free host memory."
    )


class HostStore:
    """``k_chunks[i]``, ``v_chunks[i]``: ``[B, Hk, C_i, D]``; ``b_chunks[i]``: ``[B, Hk, C_i]`` fp32.

    Chunk i holds tokens ``starts[i] .. starts[i] + C_i - 1``; every ``C_i`` is a multiple of ``block_size``.
    A chunk's K (or V) holds at most ``chunk_bytes`` (or ``chunk_tokens`` tokens, when set): torch's pinned
    allocator rounds each allocation up to a power of two, so chunks of 256 MiB waste at most the last one's slack.
    """

    chunk_bytes: int = 256 << 20
    chunk_tokens: int | None = None

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, pin: bool,
                 *, table: torch.Tensor | None = None, allocate=None):
        self.batch, self.kv_heads, self.head_dim, self.dtype = batch, kv_heads, head_dim, dtype
        self.block_size = block_size
        self.pin = pin
        self.k_chunks: list[torch.Tensor] = []
        self.v_chunks: list[torch.Tensor] = []
        self.b_chunks: list[torch.Tensor] = []
        self.starts: list[int] = []
        self.length = 0
        self.reserved = 0
        self._pending: torch.cuda.Event | None = None
        self._device_writer: torch.device | None = None  # a device whose kernels write the store directly
        self._version = 0  # bumped whenever a chunk is added or replaced
        self._table = table  # [4, n] int64 on a device: per block, K/V/b addresses and the chunk's row length
        self._allocate = allocate  # (name, shape, dtype, pin) -> tensor: chunks drawn from a workspace, or None
        self._table_version = -1

    @property
    def capacity(self) -> int:
        return self.starts[-1] + self.k_chunks[-1].shape[2] if self.k_chunks else 0

    def token_bytes(self) -> int:
        """Bytes one token of one sequence takes in the store (K, V of every KV head and their scores)."""
        return self.kv_heads * (2 * self.head_dim * torch.empty(0, dtype=self.dtype).element_size() + 4)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_chunks, *self.v_chunks, *self.b_chunks))

    def reserve(self, n_tokens: int) -> None:
        """Say that tokens ``0 .. n_tokens - 1`` will be stored: the next allocation covers them in one go."""
        self.reserved = max(self.reserved, int(n_tokens))

    def _empty(self, *shape, dtype):
        return torch.empty(*shape, dtype=dtype, pin_memory=self.pin)

    def _chunk(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self._allocate is not None:
            return self._allocate(f"host_{name}_{len(self.k_chunks)}", shape, dtype, self.pin)
        return self._empty(*shape, dtype=dtype)

    def _grow(self, n_tokens: int) -> None:
        P = self.block_size
        capacity = self.capacity
        if capacity >= n_tokens:
            return
        want = max(n_tokens, self.reserved if self.reserved > capacity else 0, capacity + int(capacity * GROWTH))
        want = -(-want // P) * P
        B, Hk, D = self.batch, self.kv_heads, self.head_dim
        if self._allocate is None:  # a workspace checks what it does not already hold itself
            check_host_memory(B * (want - capacity) * self.token_bytes(), batch=B, tokens=want, pin=self.pin)
        while capacity < want:
            size = want - capacity
            most = self.chunk_tokens or self.chunk_bytes // (B * Hk * D * torch.empty(0, dtype=self.dtype).element_size())
            size = min(size, max(P, most // P * P))
            self.v_chunks.append(self._chunk("v", (B, Hk, size, D), self.dtype))
            self.b_chunks.append(self._chunk("b", (B, Hk, size), torch.float32))
            self.k_chunks.append(self._chunk("k", (B, Hk, size, D), self.dtype))
            self.starts.append(capacity)
            capacity += size
            self._version += 1

    def ensure_capacity(self, n_tokens: int) -> None:
        """Allocate chunks so that tokens ``0 .. n_tokens - 1`` have a place (before a kernel writes them)."""
        self._grow(n_tokens)

    def block_table(self, device: torch.device) -> torch.Tensor:
        """``[4, n]`` int64 on ``device``, per block j: the addresses of token ``j * P`` of sequence 0, KV head 0 in
        the K, V and b chunks, and the row length (tokens per (sequence, KV head)) of its chunk. Kernels read and
        write the pinned store through it (UVA). Updated in place when chunks are added, so its address stays
        fixed until the store outgrows it."""
        P = self.block_size
        n_blocks = self.capacity // P
        if self._table is None or self._table.device != torch.device(device) or self._table.shape[1] < n_blocks:
            size = 1 << max(6, (max(n_blocks, 1) - 1).bit_length())
            self._table = torch.zeros(4, size, dtype=torch.int64, device=device)
            self._table_version = -1
        if self._table_version != self._version:
            host = torch.zeros(self._table.shape, dtype=torch.int64)
            kv_size = torch.empty(0, dtype=self.dtype).element_size()
            for start, k, v, b in zip(self.starts, self.k_chunks, self.v_chunks, self.b_chunks):
                rows = k.shape[2]
                first, n = start // P, rows // P
                offsets = torch.arange(n, dtype=torch.int64) * P
                host[0, first : first + n] = k.data_ptr() + offsets * self.head_dim * kv_size
                host[1, first : first + n] = v.data_ptr() + offsets * self.head_dim * kv_size
                host[2, first : first + n] = b.data_ptr() + offsets * 4
                host[3, first : first + n] = rows
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
            i = bisect.bisect_right(self.starts, pos) - 1
            off = pos - self.starts[i]
            n = min(self.k_chunks[i].shape[2] - off, end - pos)
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

    def write_rows(self, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> None:
        """Like ``write``, with a start per row (``starts [B]`` CPU long): row i's tokens go to ``starts[i] ..``.

        Rows of a left-padded batch are stored row-relative (``hf_nosa.padding``), so the same new token lands at
        a different index in each row. One indexed copy per chunk touched, whatever the batch.
        """
        T = k.shape[2]
        pos = starts.cpu()[:, None] + torch.arange(T)  # [B, T]
        end = int(pos.max()) + 1 if pos.numel() else 0
        self._grow(end)
        k, v, b = k.to("cpu"), v.to("cpu"), b.to("cpu")
        for i, first in enumerate(self.starts):
            inside = (pos >= first) & (pos < first + self.k_chunks[i].shape[2])
            if not bool(inside.any()):
                continue
            rows, tokens = inside.nonzero(as_tuple=True)
            local = pos[rows, tokens] - first
            self.k_chunks[i][rows, :, local] = k[rows, :, tokens]
            self.v_chunks[i][rows, :, local] = v[rows, :, tokens]
            self.b_chunks[i][rows, :, local] = b[rows, :, tokens]
        self.length = max(self.length, end)

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
        first_block = torch.tensor(self.starts, dtype=torch.long) // P
        chunk_of = torch.searchsorted(first_block, block_idx, right=True) - 1
        local = block_idx - first_block[chunk_of]
        for i in torch.unique(chunk_of).tolist():
            rows = (chunk_of == i).nonzero(as_tuple=True)[0]
            shape = (self.batch, self.kv_heads, self.k_chunks[i].shape[2] // P, P)
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
