"""transformers' ``PagedAttentionCache`` for a NOSA model: a token ledger on the device, K/V in per-request caches.

transformers builds one allocator per attention type (``ATTN_TYPE_TO_ALLOCATOR``) over one flat device tensor, and
its scheduler, request states and model runner only talk to the cache through a few methods. ``NosaPagedCache``
keeps all of that and changes the cache at its narrowest points:

- the allocators: after transformers' set-up, every layer group's allocator is replaced by a ``NosaLedgerAllocator``
  (``_nosa_ledger``; transformers >= 5.25 builds them so from the start, through ``_create_allocator``), which keeps
  transformers' block bookkeeping (blocks per request, sectors, the pool) over a nominal byte per page and layer, so
  the paged tensor holds no K/V. The K/V of a request live in its own NosaCache (``requests.RequestCaches``): host
  store plus slot pool.
- the ledger's size: transformers fits its sectors to the free device memory and charges every cache token the
  activations of reading it back (``PagedAttentionMemoryHandler``), which NOSA never does; given ``ledger_tokens``,
  the ledger is made to hold that many tokens (what the host budget admits), so it never starves a request the host
  budget took (transformers would then offload or re-prefill it). Without it, the ledger holds what transformers
  sized (``num_blocks``; before 5.25 its set-up allocates that much device K/V for a moment). Under tensor
  parallelism the ranks agree on the smallest ledger and serving budget of the group, so they admit and schedule
  alike.
- ``can_store_request_tokens``: a request is admitted when its host store and device working set fit the serving
  budget (``RequestCaches.admit``), then the ledger is asked as before.
- ``extend_read_and_write_indices``: records the step's plan ``(request_id, past_length, query_length)`` in batch
  order instead of building per-token read / write indices (the attention reads no paged K/V).
- ``free_blocks`` / ``free_all_requests``: also drop the requests' NosaCaches (finished, cancelled, offloaded).
- ``update`` is refused: NOSA layers attend through ``serving.attention``, never through a paged attention function.
"""

from __future__ import annotations

from math import lcm
from typing import Any

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import CachePool, FullAttentionCacheAllocator

from .requests import RequestCaches


class NosaLedgerAllocator(FullAttentionCacheAllocator):
    """transformers' full-attention block bookkeeping over a nominal byte per page and layer: no K/V on the device.

    Blocks still count each request's tokens (so the scheduler's budgets and sector accounting stay stock); nothing
    is read or written through them. No block sharing (prefix caching) and no kernel block table (decode fast path):
    a request's K/V live in its own NosaCache.
    """

    supports_block_sharing = False
    supports_block_table = False

    def __init__(self, index: int, config, num_key_value_heads: int, cache_dtype: torch.dtype, page_size: int,
                 layer_indices: list[int], allow_block_sharing: bool) -> None:
        self.head_dim = 0
        self.num_key_value_heads = num_key_value_heads
        self.cache_dtype = torch.uint8
        self._before_cache_tensor_init(index=index, layer_indices=layer_indices, tokens_per_page=page_size,
                                       bytes_per_page=1, allow_block_sharing=False)

    @classmethod
    def get_bytes_per_page(cls, num_key_value_heads: int, head_dim: int, cache_dtype: torch.dtype,
                           page_size: int) -> int:
        return 1

    def register_cache_tensor(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor,
                              pool) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def update(self, *args, **kwargs):
        raise TypeError("NosaLedgerAllocator holds no K/V: NOSA layers attend through hf_nosa.serving.attention.")

    def get_cache_for_block_table(self, layer_idx: int):
        raise TypeError("NosaLedgerAllocator has no kernel block table: NOSA decodes from its own slot pools.")


class NosaPagedCache(PagedAttentionCache):
    """``PagedAttentionCache`` whose K/V live in one NosaCache per request (see the module docstring).

    Args: those of ``PagedAttentionCache``, and keyword-only ``requests`` (the manager's ``RequestCaches``) and
    ``ledger_tokens`` (tokens the ledger holds for all requests together; None: as transformers sized it).
    """

    def __init__(self, *args, requests: RequestCaches, ledger_tokens: int | None = None, **kwargs) -> None:
        self.nosa_requests = requests
        super().__init__(*args, **kwargs)
        tokens = self.max_tokens_read if ledger_tokens is None else ledger_tokens
        helper = kwargs.get("distributed_helper")
        if helper is not None and helper.tp_size > 1:
            tokens = self._agree_across_ranks(helper, tokens)
        self._nosa_ledger(tokens)

    def _agree_across_ranks(self, helper, tokens: int) -> int:
        """Under tensor parallelism every rank schedules the same batches on its own cache: the group takes the
        smallest host budget, device budget and ledger of its ranks (each read its own host and device)."""
        unset = 1 << 62
        budget = self.nosa_requests.budget
        agreed = torch.tensor([budget.host_bytes or unset, budget.device_bytes or unset, tokens], dtype=torch.int64,
                              device=self.device)
        host, device_bytes, tokens = (int(x) for x in helper.tp_all_reduce_min(agreed).tolist())
        self.nosa_requests.budget = type(budget)(host_bytes=host if host < unset else None,
                                                 device_bytes=device_bytes if device_bytes < unset else None,
                                                 decode_rows=budget.decode_rows)
        return tokens

    def _nosa_ledger(self, tokens: int) -> None:
        """Ledger allocators for every layer group, and a (nominal) paged tensor and pool holding ``tokens`` tokens;
        before any request."""
        allocators = {}
        for attn_type, allocator in self.cache_allocators.items():
            if not isinstance(allocator, NosaLedgerAllocator):
                allocator = NosaLedgerAllocator(index=allocator.index, config=self.config,
                                                num_key_value_heads=allocator.num_key_value_heads,
                                                cache_dtype=self.dtype, page_size=allocator.tokens_per_page,
                                                layer_indices=allocator.layer_indices, allow_block_sharing=False)
            allocators[attn_type] = allocator
        self.cache_allocators = allocators
        self.layer_to_allocator = {i: ca for ca in allocators.values() for i in ca.layer_indices}
        self.bytes_per_sector = lcm(*(ca.bytes_per_block for ca in allocators.values()), 128)
        self.tokens_per_sector = max((self.bytes_per_sector // ca.bytes_per_block) * ca.tokens_per_page
                                     for ca in allocators.values())
        self.use_prefix_sharing = False
        num_sectors = max(1, -(-int(tokens) // self.tokens_per_sector))
        non_trash_bytes = num_sectors * self.bytes_per_sector
        self.num_sectors = num_sectors
        self.cache_tensor = torch.zeros(non_trash_bytes + 2 * self.bytes_per_sector, dtype=torch.uint8,
                                        device=self.device)
        self.pool = CachePool(num_sectors, len(self.cache_allocators))
        for allocator in self.cache_allocators.values():
            allocator.register_cache_tensor(self.bytes_per_sector, non_trash_bytes, self.cache_tensor, self.pool)
        self.num_blocks = non_trash_bytes // sum(ca.bytes_per_block for ca in self.cache_allocators.values())
        self.max_tokens_read = max(ca.tokens_per_page * ca.num_blocks for ca in self.cache_allocators.values())
        self.max_decode_fast_path_length = 0

    def _create_allocator(self, continuous_batching_config, attn_type: str, index: int, layer_indices: list[int],
                          num_key_value_heads: int):
        return NosaLedgerAllocator(index=index, config=self.config, num_key_value_heads=num_key_value_heads,
                                   cache_dtype=self.dtype, page_size=continuous_batching_config.page_size,
                                   layer_indices=layer_indices, allow_block_sharing=False)

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        if state.request_id:  # the warm-up's probe (an empty id) asks about the ledger alone
            # a request transformers re-queued after freeing it (soft reset) is prefilled again from its prompt and
            # the tokens it had generated: those are its prompt now
            prompt = len(state.initial_tokens)
            if not self.nosa_requests.admit(state.request_id, prompt, state.max_new_tokens, dry_run=dry_run):
                return False
        return super().can_store_request_tokens(state, request_len, dry_run)

    def begin_step(self) -> None:
        """A new batch is being scheduled: forget the previous step's plan."""
        self.nosa_requests.plan = []

    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int,
                                      read_index, write_index) -> None:
        self.nosa_requests.plan.append((request_id, past_length, query_length))

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table) -> None:
        raise TypeError("NOSA serving has no decode fast path (kernel block table): set max_blocks_per_request=0.")

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache)
        self.nosa_requests.release(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        self.nosa_requests.release_all()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens the admitted requests hold (what a NOSA forward asks a cache before checking eviction heads)."""
        return self.nosa_requests.held_tokens()

    def update(self, key_states, value_states, layer_idx: int, kwargs: dict[str, Any]):
        raise TypeError(
            "NosaPagedCache holds no paged K/V: a NOSA model's layers attend through hf_nosa.serving.attention. A "
            "stock attention layer reached it; convert the model with hf_nosa.to_nosa first."
        )
