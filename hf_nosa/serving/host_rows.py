"""The host stores of several requests seen as one store of many rows, for one batched decode fetch.

Under continuous batching every request keeps its K/V in its own ``HostStore`` of one sequence. A batched decode
step (``serving.decode_batch``) fetches the blocks of all decoding requests in one launch of
``kernels.decode.fetch.fetch_step``, whose kernel finds a block through the store's block table. ``HostRows`` hands
the kernel a ``[R, rows, n]`` table, row r being request r's own table (the tables are row views of one shared
tensor, ``serving.row_pool``), so row r reads and writes its own store; the torch reference
(``fetch_step_ref`` / ``fetch_blocks_ref``) reaches the same stores through ``gather_blocks`` and ``write_rows``,
which send each row to its store.

``stack_rows`` builds such a batched view from per-request row views: tensors of one shape and strides, equally
spaced in one storage (rows r0, r0 + 1, ... of a shared tensor) become one tensor with a leading row dimension.
"""

from __future__ import annotations

import torch

from ..cache.host_store import HostStore


def stack_rows(tensors: list[torch.Tensor], *, leading: bool = True) -> torch.Tensor | None:
    """One view ``[R, ...]`` over ``tensors`` (each ``[1, ...]`` when ``leading``, else one row without that
    dimension) when they are rows of one shared tensor at equal spacing; None otherwise (no copy is ever made:
    the batched step must write into each request's own memory)."""
    first = tensors[0]
    shape, strides = tuple(first.shape), first.stride()
    if leading and (first.dim() == 0 or shape[0] != 1):
        return None
    rest_shape, rest_strides = (shape[1:], strides[1:]) if leading else (shape, strides)
    storage = first.untyped_storage().data_ptr()
    size = first.element_size()
    if len(tensors) == 1:
        spacing = max(1, first.numel())
    else:
        gap = tensors[1].data_ptr() - first.data_ptr()
        if gap <= 0 or gap % size:
            return None
        spacing = gap // size
    for i, t in enumerate(tensors):
        if (tuple(t.shape) != shape or t.stride() != strides or t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != first.data_ptr() + i * spacing * size):
            return None
    return first.as_strided((len(tensors), *rest_shape), (spacing, *rest_strides), first.storage_offset())


class HostRows:
    """Stores ``stores`` (one sequence each) as the rows of one store, for ``fetch_step`` and its reference.

    Args:
        stores: one ``HostStore`` of batch 1 per row, all of one layout (KV heads, head dim, dtype, block size,
            host dtype, pinning).
        device: where the kernel reads the block tables; each store's table must be a row view of one shared
            tensor there (``stack_rows``), else a ValueError.
    """

    def __init__(self, stores: list[HostStore], device: torch.device | str):
        first = stores[0]
        layout = ("batch", "kv_heads", "head_dim", "dtype", "block_size", "host_dtype", "pin")
        for store in stores:
            for name in layout:
                mine, theirs = getattr(store, name), getattr(first, name)
                if name == "batch" and mine != 1 or mine != theirs:
                    raise ValueError(f"HostRows: every store must hold one sequence of one layout; a store has "
                                     f"{name}={mine!r} where the first has {theirs!r} (batch must be 1)")
        self.stores = stores
        self.batch, self.kv_heads, self.head_dim, self.dtype = len(stores), first.kv_heads, first.head_dim, first.dtype
        self.block_size, self.host_dtype, self.pin, self.format = (first.block_size, first.host_dtype, first.pin,
                                                                   first.format)
        table = stack_rows([store.block_table(device) for store in stores], leading=False)
        if table is None:
            raise ValueError("HostRows: the stores' block tables are not rows of one shared tensor at equal spacing "
                             "(serving.row_pool hands them out); a batched fetch cannot address them")
        self.table = table

    def block_bytes(self) -> int:
        return self.stores[0].block_bytes()

    def block_table(self, device) -> torch.Tensor:
        """``[R, rows, n]``: row r's store's own table (``HostStore.block_table``), refreshed when built."""
        if self.table.device != torch.device(device):
            raise ValueError(f"HostRows: the block tables are on {self.table.device}, the kernel runs on {device}")
        return self.table

    def gather_blocks(self, b_idx: torch.Tensor, h_idx: torch.Tensor, block_idx: torch.Tensor):
        """``HostStore.gather_blocks`` with ``b_idx`` naming the row, each row read from its own store."""
        n, P, D = b_idx.numel(), self.block_size, self.head_dim
        k = torch.empty(n, P, D, dtype=self.dtype)
        v = torch.empty(n, P, D, dtype=self.dtype)
        b = torch.empty(n, P, dtype=torch.float32)
        for row, store in enumerate(self.stores):
            mine = (b_idx == row).nonzero().squeeze(1)
            if mine.numel():
                k[mine], v[mine], b[mine] = store.gather_blocks(torch.zeros_like(mine), h_idx[mine], block_idx[mine])
        return k, v, b

    def write_rows(self, starts: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> None:
        """``HostStore.write_rows``: row r's tokens go to its own store from ``starts[r]``."""
        for row, store in enumerate(self.stores):
            store.write_rows(starts[row : row + 1], k[row : row + 1], v[row : row + 1], b[row : row + 1])
