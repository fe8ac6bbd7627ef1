"""Rows of shared device tensors for the requests of one manager, so their decode tokens can run as one batch.

A request's NosaCache is a batch of one: its slot pool, compressed keys, rings and host block table are
``[1, ...]`` device buffers drawn through its workspace (``host_pool.RequestWorkspace``). ``RowPool`` gives each
request a row ``r`` (the lowest free one, given back when the request is released) and hands out those buffers as
row ``r`` of per-layer ``[max_rows, ...]`` tensors (a bank per buffer name and shape), so a request prefills alone
into shared memory, and the batched decode step (``serving.decode_batch``) sees the rows of the requests decoding
together as one batch of the same memory, with no copy.

A buffer with a capacity dimension (compressed keys, bias and the block table, whose size follows the request's
length: ``cache.nosa_cache._CAPACITY_DIM``) comes from the smallest bank at least as large there, as
``DeviceWorkspace.take`` returns a larger buffer, so requests of different lengths share one bank; a longer request
than any bank holds opens a larger bank, and the batched step moves the shorter requests' rows into it when they
decode beside it (``widest``: a copy of their compressed keys, once). A request without a row (all ``max_rows``
rows taken) draws new buffers and decodes alone.

Banks are allocated whole (``max_rows`` rows) when first asked for and kept for the next requests; their rows are
not cleared between requests (the cache zeroes what it takes).
"""

from __future__ import annotations

import torch

# buffer name -> its capacity dimension in the request's shape (None: none); names of ``NosaLayer`` / CompressedKeys
ROW_BUFFERS = {"slot_k": None, "slot_v": None, "slot_b": None, "slot_block": None, "tail_slot": None,
               "compressed_keys": 2, "compressed_bias": 2, "ring_k": None, "ring_b": None, "host_table": 1}
BATCHED = "host_table"  # the one buffer without the batch dimension: its row is bank[r], not bank[r:r + 1]


class RowPool:
    """Rows ``0 .. max_rows - 1`` and the per-layer banks they index (see the module docstring)."""

    def __init__(self, max_rows: int):
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"RowPool max_rows={max_rows!r} is invalid: it must be a positive int")
        self.max_rows = max_rows
        self.free_rows = list(range(max_rows))
        self.banks: dict[tuple, list[torch.Tensor]] = {}
        self.version = 0  # counts the banks opened: what ``widest`` finds changes only with it
        self.floor: dict[str, int] = {}  # name -> least capacity a new bank opens with (the longest request expected)
        self._summary_of: tuple = (set(), 0)  # the banks' storage addresses and bytes, as of ``_summary_at``
        self._summary_at = 0

    def assign(self) -> int | None:
        """The lowest free row, now taken; None when every row is taken."""
        if not self.free_rows:
            return None
        return self.free_rows.pop(0)

    def limit(self, max_rows: int) -> None:
        """Hold no more than ``max_rows`` rows (0: none); only before any bank is open (banks are ``max_rows`` long)."""
        if self.banks:
            raise RuntimeError("RowPool.limit: the banks are open already; their rows cannot change")
        self.max_rows = max(0, min(self.max_rows, int(max_rows)))
        self.free_rows = [r for r in self.free_rows if r < self.max_rows]

    def holds(self, key: tuple, row_shape: tuple, grow: int | None = None) -> bool:
        """Whether a bank for ``key`` serves rows of ``row_shape`` (at least as large in dimension ``grow``)."""
        return any(len(b.shape) == len(row_shape) + 1
                   and all(h == w or (i == grow and h >= w) for i, (h, w) in enumerate(zip(b.shape[1:], row_shape)))
                   for b in self.banks.get(key, []))

    def give_back(self, row: int | None) -> None:
        if row is not None and row not in self.free_rows:
            self.free_rows.append(row)
            self.free_rows.sort()  # lowest first: the decoding rows stay in few contiguous runs

    def take(self, row: int, key: tuple, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor | None:
        """Row ``row`` of the bank for ``key`` (``(layer, name)``) fitting ``shape``, or None when ``name`` is no
        row buffer or the shape is not one row (a batch other than 1)."""
        name = key[-1]
        if name not in ROW_BUFFERS:
            return None
        leading = name != BATCHED
        if leading and (len(shape) == 0 or shape[0] != 1):
            return None
        row_shape = tuple(shape[1:] if leading else shape)
        grow = ROW_BUFFERS[name]
        grow = None if grow is None else grow - 1 if leading else grow
        device = torch.device(device)

        def fits(bank):
            held = tuple(bank.shape[1:])
            if bank.dtype != dtype or bank.device != device or len(held) != len(row_shape):
                return False
            if grow is None:
                return held == row_shape
            same = all(a == b for i, (a, b) in enumerate(zip(held, row_shape)) if i != grow)
            return same and held[grow] >= row_shape[grow]

        banks = self.banks.setdefault(key, [])
        found = [bank for bank in banks if fits(bank)]
        if found:
            bank = min(found, key=lambda b: b.numel())
        else:
            if grow is not None and self.floor.get(name, 0) > row_shape[grow]:  # wide enough for later requests
                row_shape = row_shape[:grow] + (self.floor[name],) + row_shape[grow + 1:]
            bank = torch.empty((self.max_rows, *row_shape), dtype=dtype, device=device)
            banks.append(bank)
            self.version += 1
        return bank[row : row + 1] if leading else bank[row]

    def widest(self, row: int, key: tuple, like: torch.Tensor) -> torch.Tensor | None:
        """Row ``row`` of the bank for ``key`` widest in its capacity dimension among those that fit ``like`` (a
        row buffer, all its other dimensions equal), or None: where a request moves its capacity buffers so that
        rows of different lengths batch together (``serving.decode_batch``)."""
        name = key[-1]
        leading = name != BATCHED
        grow = ROW_BUFFERS.get(name)
        if grow is None:
            return None
        grow = grow - 1 if leading else grow
        row_shape = tuple(like.shape[1:] if leading else like.shape)
        found = [bank for bank in self.banks.get(key, []) if bank.dtype == like.dtype and bank.device == like.device
                 and bank.dim() == len(row_shape) + 1
                 and all(a == b for i, (a, b) in enumerate(zip(bank.shape[1:], row_shape)) if i != grow)]
        if not found:
            return None
        bank = max(found, key=lambda b: b.shape[grow + 1])
        return bank[row : row + 1] if leading else bank[row]

    def in_banks(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is memory of a bank (banks live as long as the pool, whichever request holds a row)."""
        return tensor.untyped_storage().data_ptr() in self._summary()[0]

    def bank_bytes(self) -> int:
        """Bytes the banks hold (every row, taken or not); admission asks on every scheduling step."""
        return self._summary()[1]

    def _summary(self) -> tuple[set, int]:
        """The banks' storage addresses and bytes, recounted only when a bank opens (the one change)."""
        if self._summary_at != self.version:
            banks = [b for held in self.banks.values() for b in held]
            self._summary_of = ({b.untyped_storage().data_ptr() for b in banks},
                                sum(b.numel() * b.element_size() for b in banks))
            self._summary_at = self.version
        return self._summary_of
