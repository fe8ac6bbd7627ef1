"""HostStore: the full K, V and eviction scores of every token, in host memory.

Tokens live in chunks of whole blocks, appended as the sequence grows, so appending never re-copies what is
stored. The first chunk covers what the caller reserved (``reserve``: generate knows the prompt length and
``max_new_tokens``); later chunks add at least a tenth of what is held, so the store never holds more than
1.1x the tokens it stores plus one block. Pinned when the model runs on CUDA, so blocks can be read straight from
the device (UVA) through a per-block address table, and written back asynchronously.

Quantized store (``host_dtype`` "float8_e4m3fn" or "int8", ``hf_nosa.cache.host_quant``): K and V chunks hold one byte
per value and one fp32 scale per (block, KV head) in chunks of their own, so a block costs about half its bf16
bytes in host memory and across PCIe. Only complete blocks are quantized, each exactly once, with a scale that saw
all its ``P x D`` values: a row's last, incomplete block stays in the model's dtype in a pinned tail
(``tail_k, tail_v [B, Hk, P, D]``, one block per row since rows of a padded batch end at different indices) until
the write that completes it quantizes it. The decode step never fetches that block (it is the slot pool's tail
slot, resident on the device), so only reads on the host (``read``, ``gather_blocks``) put the tail back in place.
Writes are appends: every row's tokens are a prefix ``0 .. length - offsets[b] - 1``; a row that gets shorter
(``length`` lowered by a crop) reloads its tail from the stored block, dequantized. A padded prompt arrives with
each row's padding after its real tokens; ``set_limits`` keeps each row's last real block in its tail, exact, so a
row stores what it stores alone.
"""

from __future__ import annotations

import bisect

import torch

from ..rules.devices import host_to_device
from .host_quant import dequantize_blocks, host_format, quantize_blocks
from .pinned import pinned_empty, pinned_stats

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
    if available is not None and pin:  # the pinned buffers freed caches left in the pool are reused before new ones
        available += pinned_stats()["free_bytes"]
    if available is None or nbytes <= available:
        return
    kind = "pinned host" if pin else "host"
    raise MemoryError(
        f"{what}: batch {batch} x context {tokens} tokens needs {nbytes:,} bytes ({_gib(nbytes)}) of {kind} memory, "
        f"but only {max(available, 0):,} bytes ({_gib(available)}) are available. Lower the batch size or the context "
        "(prompt length + max_new_tokens), or free host memory."
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def _block_bytes(block_size: int, head_dim: int, store_dtype: torch.dtype, quantized: bool) -> int:
    kv = torch.empty(0, dtype=store_dtype).element_size()
    return block_size * (2 * head_dim * kv + 4) + (8 if quantized else 0)


class HostStore:
    """``k_chunks[i]``, ``v_chunks[i]``: ``[B, Hk, C_i, D]``; ``b_chunks[i]``: ``[B, Hk, C_i]`` fp32.

    Chunk i holds tokens ``starts[i] .. starts[i] + C_i - 1``; every ``C_i`` is a multiple of ``block_size``.
    A chunk's K (or V) holds at most ``chunk_bytes`` (or ``chunk_tokens`` tokens, when set): torch's pinned
    allocator rounds each allocation up to a power of two, so chunks of 256 MiB waste at most the last one's slack.

    With ``host_dtype`` a quantized format, K and V chunks are in that format (``store_dtype``), ``ks_chunks[i]``,
    ``vs_chunks[i]`` ``[B, Hk, C_i / P]`` fp32 hold their scales, and ``tail_k, tail_v`` each row's incomplete
    block; reads return the model's ``dtype``.
    """

    chunk_bytes: int = 256 << 20
    chunk_tokens: int | None = None

    def __init__(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, pin: bool,
                 *, table: torch.Tensor | None = None, allocate=None, host_dtype: str = "auto"):
        self.batch, self.kv_heads, self.head_dim, self.dtype = batch, kv_heads, head_dim, dtype
        self.block_size = block_size
        self.pin = pin
        self.host_dtype = host_dtype
        self.format = None if host_dtype == "auto" else host_format(host_dtype)
        self.store_dtype = dtype if self.format is None else self.format.dtype
        self.k_chunks: list[torch.Tensor] = []
        self.v_chunks: list[torch.Tensor] = []
        self.b_chunks: list[torch.Tensor] = []
        self.ks_chunks: list[torch.Tensor] = []  # quantized store: K and V scales per (block, KV head)
        self.vs_chunks: list[torch.Tensor] = []
        self.tail_k = self.tail_v = None  # quantized store: each row's incomplete block, [B, Hk, P, D]
        self.starts: list[int] = []
        self._length = 0
        self.offsets = torch.zeros(batch, dtype=torch.long)  # row b holds tokens 0 .. length - offsets[b] - 1
        self.limits: torch.Tensor | None = None  # [B]: where each row of a padded prompt will end (set_limits)
        self._limits_on: torch.Tensor | None = None  # the same on a kernel's device (int64 max per row if None)
        self._tail_blocks: tuple[tuple, torch.Tensor] | None = None  # (key, tensor) of tail_blocks_on
        self.reserved = 0
        self._pending: torch.cuda.Event | None = None
        self._device_writer: torch.device | None = None  # a device whose kernels write the store directly
        self._version = 0  # bumped whenever a chunk is added or replaced
        self._table = table  # [4 or 8, n] int64 on a device: per block, addresses and row length (block_table)
        self._allocate = allocate  # (name, shape, dtype, pin) -> tensor: chunks drawn from a workspace, or None
        self._table_version = -1
        if self.format is not None:  # zeros: a tail is read before its row has tokens (padding, empty rows)
            shape = (batch, kv_heads, block_size, head_dim)
            self.tail_k = self._chunk("tail_k", shape, dtype).zero_()
            self.tail_v = self._chunk("tail_v", shape, dtype).zero_()

    @staticmethod
    def table_rows(host_dtype: str) -> int:
        """Rows of ``block_table`` for a store of ``host_dtype``: 4, and 4 more for the scales and tails."""
        return 4 if host_dtype == "auto" else 8

    @property
    def capacity(self) -> int:
        return self.starts[-1] + self.k_chunks[-1].shape[2] if self.k_chunks else 0

    @property
    def length(self) -> int:
        """Tokens stored in a row without padding (the cache length)."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        value = int(value)
        if self.format is not None and value < self._length:  # a crop: a row's tail may now be a stored block
            old = self.row_lengths()
            self._length = value
            self._reload_tails(old, self.row_lengths())
        self._length = value

    def row_lengths(self) -> torch.Tensor:
        """``[B]`` CPU long: tokens stored in each row (``length`` less the row's left padding)."""
        lengths = (self._length - self.offsets).clamp(min=0)
        return lengths if self.limits is None else torch.minimum(lengths, self.limits)

    def set_offsets(self, offsets: torch.Tensor) -> None:
        """Row b now holds ``length - offsets[b]`` tokens (``[B]`` long: rows of a left-padded batch are stored from
        their first real token, ``hf_nosa.rules.padding``). Ends ``set_limits``."""
        old = self.row_lengths()
        self.offsets = offsets.to("cpu", torch.long).clone()
        self.limits = self._limits_on = None
        self._reload_tails(old, self.row_lengths())

    def set_limits(self, limits: torch.Tensor) -> None:
        """Row b of the prompt being written ends at ``limits[b]`` (``[B]`` long) and what follows it is padding
        (``modeling.chunked`` moves each row's padding after its real tokens): a quantized store's tail keeps the
        block holding the row's last token, exact, even once the padding completes that block (whose quantized
        copy, scaled with the padding's values, is then never read), so the row stores what it stores alone. The
        padding's blocks are stored as any others (a QUOKA chunk of padding may still fetch them). Until
        ``set_offsets``."""
        self.limits = limits.to("cpu", torch.long).clone()
        self._limits_on = None

    def limits_on(self, device) -> torch.Tensor:
        """``limits`` as ``[B]`` long on ``device`` for a kernel (the int64 maximum where none are set)."""
        if self._limits_on is None or self._limits_on.device != torch.device(device):
            limits = self.limits if self.limits is not None else torch.full((self.batch,), 2**62, dtype=torch.long)
            self._limits_on = host_to_device(limits, device)
        return self._limits_on

    def tail_blocks_on(self, device) -> torch.Tensor:
        """``row_lengths() // block_size`` as ``[B]`` long on ``device``: the block holding each row's tail, for a
        kernel reading a quantized store. Copied from pinned memory once per change of the lengths, so a read makes
        no host sync (a copy from pageable memory may wait for the stream)."""
        device = torch.device(device)
        blocks = self.row_lengths() // self.block_size
        key = (device, tuple(blocks.tolist()))
        if self._tail_blocks is None or self._tail_blocks[0] != key:
            moved = host_to_device(blocks, device)
            self._tail_blocks = (key, moved)
        moved = self._tail_blocks[1]
        if device.type == "cuda":  # read on whichever stream asks (the dense tail reads on a side stream)
            moved.record_stream(torch.cuda.current_stream(device))
        return moved

    def block_bytes(self) -> int:
        """Bytes one block of one (sequence, KV head) takes in the store, and so what fetching it moves: K, V in the
        store's format, the scores and, in a quantized store, the block's two scales."""
        return _block_bytes(self.block_size, self.head_dim, self.store_dtype, self.format is not None)

    def token_bytes(self) -> int:
        """Bytes one token of one sequence takes in the store (K, V of every KV head, their scores, and a block's
        scales shared out over its tokens, rounded up)."""
        return -(-self.kv_heads * self.block_bytes() // self.block_size)

    @staticmethod
    def planned_bytes(batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
                      host_dtype: str, tokens: int) -> int:
        """What a store of ``tokens`` tokens per row will hold (chunks, and a quantized store's tails), known before
        anything is allocated: the host-memory check comes first."""
        fmt = None if host_dtype == "auto" else host_format(host_dtype)
        block = _block_bytes(block_size, head_dim, dtype if fmt is None else fmt.dtype, fmt is not None)
        rows = -(-tokens // block_size) * block_size
        tails = 0 if fmt is None else 2 * kv_heads * block_size * head_dim * torch.empty(0, dtype=dtype).element_size()
        return batch * (rows * -(-kv_heads * block // block_size) + tails)

    def nbytes(self) -> int:
        tails = [t for t in (self.tail_k, self.tail_v) if t is not None]
        held = (*self.k_chunks, *self.v_chunks, *self.b_chunks, *self.ks_chunks, *self.vs_chunks, *tails)
        return sum(t.numel() * t.element_size() for t in held)

    def read_bytes(self, start: int, end: int) -> int:
        """Bytes ``read(start, end, device)`` moves out of the store: K, V in the store's format (quantized: with
        the scales of the blocks touched and, where a row's incomplete block is in range, the tails), and scores."""
        n = max(0, end - start)
        if n == 0:
            return 0
        P, rows = self.block_size, self.batch * self.kv_heads
        kv = torch.empty(0, dtype=self.store_dtype).element_size()
        moved = rows * n * (2 * self.head_dim * kv + 4)
        if self.format is not None:
            moved += rows * 8 * ((end - 1) // P - start // P + 1)
            tail_blocks = self.row_lengths() // P
            if bool(((tail_blocks * P < end) & (tail_blocks * P + P > start)).any()):
                moved += 2 * self.tail_k.numel() * self.tail_k.element_size()
        return moved

    def reserve(self, n_tokens: int) -> None:
        """Say that tokens ``0 .. n_tokens - 1`` will be stored: the next allocation covers them in one go."""
        self.reserved = max(self.reserved, int(n_tokens))

    def _empty(self, *shape, dtype):
        return pinned_empty(shape, dtype) if self.pin else torch.empty(*shape, dtype=dtype)

    def _chunk(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if self._allocate is not None:
            return self._allocate(f"host_{name}_{len(self.k_chunks)}", shape, dtype, self.pin)
        return self._empty(*shape, dtype=dtype)

    def _grow(self, n_tokens: int) -> None:
        P = self.block_size
        capacity = self.capacity
        if capacity >= n_tokens:
            return
        if self.reserved >= n_tokens:  # a call said how far it goes (a new turn: its prompt and answer): just that
            want = self.reserved
        else:  # past any reservation (decoding on): a share more, so a long decode grows a few times, not per token
            want = max(n_tokens, capacity + int(capacity * GROWTH))
        want = -(-want // P) * P
        B, Hk, D = self.batch, self.kv_heads, self.head_dim
        if self._allocate is None:  # a workspace checks what it does not already hold itself
            check_host_memory(B * (want - capacity) * self.token_bytes(), batch=B, tokens=want, pin=self.pin)
        while capacity < want:
            size = want - capacity
            most = self.chunk_tokens or self.chunk_bytes // (B * Hk * D * torch.empty(0, dtype=self.store_dtype).element_size())
            size = min(size, max(P, most // P * P))
            self.v_chunks.append(self._chunk("v", (B, Hk, size, D), self.store_dtype))
            self.b_chunks.append(self._chunk("b", (B, Hk, size), torch.float32))
            if self.format is not None:
                self.ks_chunks.append(self._chunk("ks", (B, Hk, size // P), torch.float32))
                self.vs_chunks.append(self._chunk("vs", (B, Hk, size // P), torch.float32))
            self.k_chunks.append(self._chunk("k", (B, Hk, size, D), self.store_dtype))
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
        fixed until the store outgrows it.

        A quantized store's table has 8 rows: then the addresses of block j's K and V scales for sequence 0, KV head
        0 (a row's scales follow each other: row length / P per (sequence, KV head)), and those of ``tail_k`` and
        ``tail_v`` (the same in every column)."""
        P = self.block_size
        n_blocks = self.capacity // P
        rows = self.table_rows(self.host_dtype)
        if (self._table is None or self._table.device != torch.device(device) or self._table.shape[0] != rows
                or self._table.shape[1] < n_blocks):
            size = 1 << max(6, (max(n_blocks, 1) - 1).bit_length())
            self._table = torch.zeros(rows, size, dtype=torch.int64, device=device)
            self._table_version = -1
        if self._table_version != self._version:
            host = torch.zeros(self._table.shape, dtype=torch.int64)
            kv_size = torch.empty(0, dtype=self.store_dtype).element_size()
            for i, (start, k, v, b) in enumerate(zip(self.starts, self.k_chunks, self.v_chunks, self.b_chunks)):
                n_rows = k.shape[2]
                first, n = start // P, n_rows // P
                offsets = torch.arange(n, dtype=torch.int64) * P
                host[0, first : first + n] = k.data_ptr() + offsets * self.head_dim * kv_size
                host[1, first : first + n] = v.data_ptr() + offsets * self.head_dim * kv_size
                host[2, first : first + n] = b.data_ptr() + offsets * 4
                host[3, first : first + n] = n_rows
                if self.format is not None:
                    host[4, first : first + n] = self.ks_chunks[i].data_ptr() + torch.arange(n, dtype=torch.int64) * 4
                    host[5, first : first + n] = self.vs_chunks[i].data_ptr() + torch.arange(n, dtype=torch.int64) * 4
            if self.format is not None:
                host[6] = self.tail_k.data_ptr()
                host[7] = self.tail_v.data_ptr()
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

    def _record_pending(self, source: torch.Tensor) -> None:
        if source.is_cuda:
            self._pending = torch.cuda.Event()
            self._pending.record()

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> None:
        """Store tokens ``start .. start + T - 1`` from ``k, v [B, Hk, T, D]`` and ``b [B, Hk, T]``."""
        end = start + k.shape[2]
        self._grow(end)
        if self.format is not None:
            self._write_quantized(torch.full((self.batch,), start, dtype=torch.long), k, v)
        for i, off, src, n in self._spans(start, end):
            if self.format is None:
                self.k_chunks[i][:, :, off : off + n].copy_(k[:, :, src : src + n], non_blocking=True)
                self.v_chunks[i][:, :, off : off + n].copy_(v[:, :, src : src + n], non_blocking=True)
            self.b_chunks[i][:, :, off : off + n].copy_(b[:, :, src : src + n], non_blocking=True)
        self.length = max(self.length, end)
        self._record_pending(k)

    def write_rows(self, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> None:
        """Like ``write``, with a start per row (``starts [B]`` CPU long): row i's tokens go to ``starts[i] ..``.

        Rows of a left-padded batch are stored row-relative (``hf_nosa.rules.padding``), so the same new token lands at
        a different index in each row. One indexed copy per chunk touched, whatever the batch.
        """
        T = k.shape[2]
        starts = starts.cpu()
        pos = starts[:, None] + torch.arange(T)  # [B, T]
        end = int(pos.max()) + 1 if pos.numel() else 0
        self._grow(end)
        if self.format is not None:
            self._write_quantized(starts, k, v)
        k, v, b = k.to("cpu"), v.to("cpu"), b.to("cpu")
        for i, first in enumerate(self.starts):
            inside = (pos >= first) & (pos < first + self.k_chunks[i].shape[2])
            if not bool(inside.any()):
                continue
            rows, tokens = inside.nonzero(as_tuple=True)
            local = pos[rows, tokens] - first
            if self.format is None:
                self.k_chunks[i][rows, :, local] = k[rows, :, tokens]
                self.v_chunks[i][rows, :, local] = v[rows, :, tokens]
            self.b_chunks[i][rows, :, local] = b[rows, :, tokens]
        self.length = max(self.length, end)

    def _write_quantized(self, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K, V of tokens ``starts[b] ..`` of each row (``[B]`` CPU long; negative indices are padding, not stored)
        into a quantized store: every block the write completes is quantized from the row's tail (its earlier
        tokens) and the new tokens, and stored with its scales; the new tokens of a block left incomplete go to the
        tail. The torch reference of the host-write kernel (computed on k's device, then copied to the store)."""
        self.wait_writes()  # the tails may be on their way from the device (set_tails)
        P = self.block_size
        B, Hk, T, D = k.shape
        device = k.device
        first_block = starts.clamp(min=0) // P  # the block holding each row's first stored token
        lead = starts.clamp(min=0) - first_block * P  # tokens of that block already in the tail
        end = starts + T
        length = (end - first_block * P).clamp(min=0)  # tokens from that block's start to the write's end
        n_full = length // P  # blocks the write completes
        n_blocks = int(length.max()) // P + 1
        j = torch.arange(n_blocks * P)
        # position j from the first block's start: the tail (j < lead), else new token first_block * P + j - start
        src = torch.where(j < lead[:, None], j, P + first_block[:, None] * P + j - starts[:, None])
        valid = j < length[:, None]
        src = torch.where(valid, src, 0).clamp(0, P + T - 1)
        index = src.to(device)[:, None, :, None].expand(B, Hk, n_blocks * P, D)
        valid_dev = valid.to(device)[:, None, :, None]
        rows, blocks = (torch.arange(n_blocks) < n_full[:, None]).nonzero(as_tuple=True)
        block_index = first_block[rows] + blocks
        # the tail: the block holding the row's last token (before its limit, set_limits), where the write has tokens
        tail_end = end if self.limits is None else torch.minimum(end, self.limits)
        tail_block = (tail_end // P - first_block).clamp(0, n_blocks - 1)  # in blocks from the first one
        n_tail = torch.where(tail_end > starts.clamp(min=0), tail_end % P, 0)
        tail_mask = (torch.arange(P) < n_tail[:, None])[:, None, :, None]  # [B, 1, P, 1]
        for x, tail, q_chunks, s_chunks in ((k, self.tail_k, self.k_chunks, self.ks_chunks),
                                            (v, self.tail_v, self.v_chunks, self.vs_chunks)):
            joined = torch.cat([tail.to(device), x], 2)  # [B, Hk, P + T, D]
            ext = torch.where(valid_dev, joined.gather(2, index), 0).view(B, Hk, n_blocks, P, D)
            q, scale = quantize_blocks(ext, self.host_dtype)
            q, scale = q.view(torch.uint8).cpu(), scale.cpu()
            for i, first in enumerate(self.starts):
                lo, hi = first // P, (first + q_chunks[i].shape[2]) // P
                inside = (block_index >= lo) & (block_index < hi)
                if not bool(inside.any()):
                    continue
                r, jj, local = rows[inside], blocks[inside], block_index[inside] - lo
                q_chunks[i].view(torch.uint8).view(B, Hk, -1, P, D)[r, :, local] = q[r, :, jj]
                s_chunks[i][r, :, local] = scale[r, :, jj]
            new_tail = ext[torch.arange(B, device=device), :, tail_block.to(device)].cpu()  # [B, Hk, P, D]
            tail.copy_(torch.where(tail_mask, new_tail, tail))

    def wait_writes(self) -> None:
        """Block until asynchronous device-to-host writes have landed (before the CPU itself reads the store)."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
        if self._device_writer is not None:
            torch.cuda.synchronize(self._device_writer)
            self._device_writer = None

    def read(self, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``start .. end - 1`` as ``k, v [B, Hk, T, D]`` and ``b [B, Hk, T]`` on ``device`` (in the model's
        dtype: a quantized store moves its bytes and scales and dequantizes them on ``device``). On CUDA one kernel
        reads the pinned store directly, with no host sync (``kernels.prefill.host_read``)."""
        from ..kernels.prefill.host_read import read_span

        return read_span(self, start, end, device)

    def order_after_writes(self, device: torch.device) -> None:
        """Make ``device``'s current stream wait for an asynchronous write into the store (no host sync): what a
        device kernel reading the store needs; the CPU reading it needs ``wait_writes``."""
        if self._pending is not None:
            torch.cuda.current_stream(device).wait_event(self._pending)

    def read_torch(self, start: int, end: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``read`` in torch (the reference of ``kernels.prefill.host_read``): chunk slices moved with ``.to``."""
        self.wait_writes()
        spans = list(self._spans(start, end))
        if not spans:
            B, Hk, D = self.batch, self.kv_heads, self.head_dim
            return (
                torch.empty(B, Hk, 0, D, dtype=self.dtype, device=device),
                torch.empty(B, Hk, 0, D, dtype=self.dtype, device=device),
                torch.empty(B, Hk, 0, dtype=torch.float32, device=device),
            )
        P = self.block_size
        out = []
        for which, chunks in enumerate((self.k_chunks, self.v_chunks, self.b_chunks)):
            pieces = []
            for i, off, _, n in spans:
                piece = chunks[i][:, :, off : off + n].to(device, non_blocking=True)
                if which < 2 and self.format is not None:  # every token times its block's scale
                    scales = (self.ks_chunks, self.vs_chunks)[which][i][:, :, off // P : (off + n - 1) // P + 1]
                    per_token = (torch.arange(off, off + n, device=device) // P) - off // P
                    piece = dequantize_blocks(piece[:, :, :, None], scales.to(device)[:, :, per_token], self.dtype)
                    piece = piece[:, :, :, 0]
                pieces.append(piece)
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
        if self.format is not None:  # each row's incomplete block is in its tail, in the model's dtype
            position = torch.arange(start, end)
            in_tail = (position // P)[None, :] == (self.row_lengths() // P)[:, None]  # [B, T]
            cols = in_tail.any(0).nonzero().squeeze(1)
            if cols.numel():
                pick = in_tail[:, cols].to(device)[:, None, :, None]
                for which, tail in ((0, self.tail_k), (1, self.tail_v)):
                    held = tail.to(device, non_blocking=True)[:, :, (position[cols] % P).to(device)]
                    out[which][:, :, cols.to(device)] = torch.where(pick, held, out[which][:, :, cols.to(device)])
        return out[0], out[1], out[2]

    def _stored_blocks(self, b_idx: torch.Tensor, h_idx: torch.Tensor, block_idx: torch.Tensor):
        """Blocks ``block_idx`` of (sequence, KV head) pairs as the chunks hold them (a quantized store dequantized,
        tails not consulted), all CPU long ``[n]``: ``k, v [n, P, D]``, ``b [n, P]``."""
        P, n = self.block_size, b_idx.numel()
        k = torch.empty(n, P, self.head_dim, dtype=self.dtype, pin_memory=self.pin)
        v = torch.empty_like(k)
        b = torch.empty(n, P, dtype=torch.float32, pin_memory=self.pin)
        first_block = torch.tensor(self.starts, dtype=torch.long) // P
        chunk_of = torch.searchsorted(first_block, block_idx, right=True) - 1
        local = block_idx - first_block[chunk_of]
        for i in torch.unique(chunk_of).tolist():
            rows = (chunk_of == i).nonzero(as_tuple=True)[0]
            where = (b_idx[rows], h_idx[rows], local[rows])
            shape = (self.batch, self.kv_heads, self.k_chunks[i].shape[2] // P, P)
            if self.format is None:
                k[rows] = self.k_chunks[i].view(*shape, -1)[where]
                v[rows] = self.v_chunks[i].view(*shape, -1)[where]
            else:
                for out, chunk, scales in ((k, self.k_chunks[i], self.ks_chunks[i]),
                                           (v, self.v_chunks[i], self.vs_chunks[i])):
                    q = chunk.view(torch.uint8).view(*shape, -1)[where].view(self.store_dtype)
                    out[rows] = dequantize_blocks(q, scales[where], self.dtype)
            b[rows] = self.b_chunks[i].view(*shape)[where]
        return k, v, b

    def gather_blocks(self, b_idx: torch.Tensor, h_idx: torch.Tensor, block_idx: torch.Tensor):
        """Blocks ``block_idx`` of (sequence, KV head) pairs, all CPU long ``[n]``: ``k, v [n, P, D]``, ``b [n, P]``."""
        self.wait_writes()
        k, v, b = self._stored_blocks(b_idx, h_idx, block_idx)
        if self.format is not None:  # a row's incomplete block is its tail
            in_tail = block_idx == (self.row_lengths() // self.block_size)[b_idx]
            if bool(in_tail.any()):
                k[in_tail] = self.tail_k[b_idx[in_tail], h_idx[in_tail]]
                v[in_tail] = self.tail_v[b_idx[in_tail], h_idx[in_tail]]
        return k, v, b

    def _reload_tails(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Rows that now end in an earlier block than their tail held (row lengths ``old`` -> ``new``, ``[B]``):
        that block, complete in the store, comes back into the tail, dequantized; writing to it again quantizes it
        anew (a crop's cost: those tokens are rounded twice)."""
        P = self.block_size
        if self.format is None:
            return
        rows = ((new % P != 0) & (new // P < old // P)).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        self.wait_writes()
        Hk = self.kv_heads
        b_idx = rows.repeat_interleave(Hk)
        h_idx = torch.arange(Hk).repeat(rows.numel())
        k, v, _ = self._stored_blocks(b_idx, h_idx, (new[rows] // P).repeat_interleave(Hk))
        self.tail_k[b_idx, h_idx] = k
        self.tail_v[b_idx, h_idx] = v

    def set_tails(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Each row's incomplete block, ``k, v [B, Hk, P, D]`` in the model's dtype (the slot pool's tail slot when a
        prompt is settled): the exact values, where ``set_offsets`` could only reload them from a quantized block.
        Keeps the store's tails equal to the device's tail slots. Nothing to do in an unquantized store."""
        if self.format is None:
            return
        self.tail_k.copy_(k, non_blocking=True)
        self.tail_v.copy_(v, non_blocking=True)
        self._record_pending(k)

    def index_batch(self, index: torch.Tensor) -> None:
        """Keep/reorder/repeat sequences: sequence i becomes old sequence ``index[i]``."""
        self.wait_writes()
        index = index.cpu()
        self.batch = index.numel()
        for chunks in (self.k_chunks, self.v_chunks, self.b_chunks, self.ks_chunks, self.vs_chunks):
            for j, chunk in enumerate(chunks):
                out = self._empty(index.numel(), *chunk.shape[1:], dtype=chunk.dtype)
                if chunk.element_size() == 1:  # quantized K/V: move the bytes (float8 has no index_select)
                    torch.index_select(chunk.view(torch.uint8), 0, index, out=out.view(torch.uint8))
                else:
                    torch.index_select(chunk, 0, index, out=out)
                chunks[j] = out
        if self.format is not None:
            self.tail_k = self.tail_k.index_select(0, index)
            self.tail_v = self.tail_v.index_select(0, index)
            if self.pin:
                self.tail_k, self.tail_v = self.tail_k.pin_memory(), self.tail_v.pin_memory()
        self.offsets = self.offsets.index_select(0, index)
        if self.limits is not None:
            self.limits = self.limits.index_select(0, index)
        self._limits_on = None
        self._version += 1
