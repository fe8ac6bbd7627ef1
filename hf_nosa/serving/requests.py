"""Per-request NOSA state under continuous batching: one NosaCache of batch 1 per request, and what it may hold.

transformers' continuous batching keeps one ``RequestState`` per request (its prompt, its generated tokens, its
``position_offset``) and asks the cache, request by request, whether the request's next tokens fit
(``PagedAttentionCache.can_store_request_tokens``). For a NOSA model the answer is host memory and the device slot
pool, not device KV pages: ``RequestCaches.admit`` reserves a request's planned host store (prompt + max_new_tokens,
every layer) and its device working set (slot pool and compressed keys) against ``ServingBudget`` the first time the
request is scheduled, and ``release`` gives both back when the request finishes, is cancelled or is dropped
(``PagedAttentionCache.free_blocks``). A request that could never fit, even alone, is refused when it is added
(``check_fits``), so it fails with a clear error while the others run.

Each step, the scheduled requests' new tokens arrive packed in one sequence; ``plan`` lists them in order as
``(request_id, past_length, query_length)``, recorded by the cache as transformers prepares the batch
(``paged_cache.NosaPagedCache.extend_read_and_write_indices``) and read by every layer (``serving.attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.host_store import HostStore, available_host_memory
from ..cache.nosa_cache import NosaCache
from ..config import NosaConfig
from ..kernels.decode.block_scores import window_capacity_for
from ..rules.devices import available_device_memory, step_activation_bytes
from ..rules.selection import num_windows
from .host_pool import HostPool, RequestWorkspace
from .row_pool import RowPool


DEVICE_SHARE = 0.5  # of the free device memory, for the requests' working sets when ServingBudget sets none
# A step's activations, estimated (``rules.devices.step_activation_bytes``), are kept free twice over: the caching
# allocator keeps blocks cut for earlier steps' shapes (an H100 run whose steps carried whole prompts of up to 64K
# tokens held 3.45 GB reserved and unallocated beside 18.7 GB allocated, docs/serving.md).
ACTIVATION_HEADROOM = 2
MAX_LOGIT_ROWS = 1024  # transformers' requests per step when max_requests_per_batch is unset (its fallback)


@dataclass
class ServingBudget:
    """What the requests of one continuous-batching manager may hold at once.

    ``host_bytes``: host memory for the requests' host stores (full K/V and eviction scores of every layer); None:
    what the OS can hand out when the manager starts (``host_store.available_host_memory``), or no limit where that
    cannot be read. ``device_bytes``: device memory for their working sets (slot pools and compressed keys); None: on
    CUDA, ``DEVICE_SHARE`` of the device memory the process may still take when the manager starts (its memory
    fraction counted: ``rules.devices.available_device_memory``; the rest is left to the step's
    activations and the kernels' workspaces), and no more than what is left beside ACTIVATION_HEADROOM x the
    activations of a step of ``max_batch_tokens`` tokens; elsewhere no limit (the CPU's working sets are host
    memory too).
    ``decode_rows``: requests whose decode tokens run as one batched step (rows of the shared slot pools,
    ``row_pool.RowPool``); a request admitted beyond them decodes alone.
    """

    host_bytes: int | None = None
    device_bytes: int | None = None
    decode_rows: int = 32

    def __post_init__(self):
        for name in ("host_bytes", "device_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"ServingBudget.{name}={value!r} is invalid: it must be a positive int or None.")
        rows = self.decode_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
            raise ValueError(f"ServingBudget.decode_rows={rows!r} is invalid: it must be a positive int.")

    def resolved(self, device: torch.device | str = "cpu", step_bytes: int = 0,
                 step_tokens: int | None = None) -> "ServingBudget":
        """This budget with what was left None read from the OS and the device (see the class docstring).

        ``step_bytes``: device bytes kept free for a step's activations (of ``step_tokens`` tokens, named in the
        error). On CUDA, a ``device_bytes`` left None is at most what the device has beside them, and one set is
        refused where it and they do not fit what the device has (a ValueError naming both, before any request)."""
        host, device_bytes = self.host_bytes, self.device_bytes
        if host is None:
            host = available_host_memory()
        device = torch.device(device)
        if device.type == "cuda":
            available = available_device_memory(device)  # within a memory fraction too
            beside = available - step_bytes
            if step_bytes and (beside <= 0 or (device_bytes is not None and device_bytes > beside)):
                asked = "" if device_bytes is None else f"ServingBudget.device_bytes={device_bytes:,} plus "
                raise ValueError(
                    f"NOSA serving: {asked}the activations of a step of ContinuousBatchingConfig.max_batch_tokens="
                    f"{step_tokens} tokens ({step_bytes:,} bytes kept free, ACTIVATION_HEADROOM x the estimate) do "
                    f"not fit the {available:,} bytes this process may still take on {device}. Lower max_batch_tokens"
                    f"{'' if device_bytes is None else ' or device_bytes'}, or free device memory."
                )
            if device_bytes is None:
                device_bytes = min(int(available * DEVICE_SHARE), beside)
        return ServingBudget(host_bytes=host, device_bytes=device_bytes, decode_rows=self.decode_rows)


@dataclass
class RequestEntry:
    """One admitted request: its NosaCache (built at its first layer update) and what it reserved."""

    prompt_length: int
    max_tokens: int  # prompt + max_new_tokens: the host store and slot pool are sized once for it
    host_bytes: int
    device_bytes: int
    cache: NosaCache | None = None
    prefilling: bool = False  # between NosaCache.begin_prefill and end_prefill
    row: int | None = None  # the request's row of the shared slot pools (row_pool.RowPool), None: none free


@dataclass
class RequestCaches:
    """The NOSA state of every admitted request of one manager, keyed by request id (see the module docstring).

    Args:
        model_config: the model's config (its "nosa" section is the default NosaConfig; layers, KV heads, head dim).
        nosa_config: overrides the model's NosaConfig for every request.
        budget: host and device bytes the requests may hold at once.
        rank_kv_heads: under tensor parallelism, the KV heads this rank holds (None: the model's).
        expected_tokens: the longest request (prompt + new tokens) the manager expects, from transformers' workload
            hints (``generate_batch`` gives them; ``transformers serve`` the model's context); the shared rows are
            sized for it (``_assign_row``). None: sized for the first request.
        step_tokens, step_requests: the tokens and requests a step carries at most (``max_batch_tokens``,
            ``max_requests_per_batch``): on CUDA, ACTIVATION_HEADROOM x their activations' estimate
            (``rules.devices.step_activation_bytes``) is left out of the device budget (``ServingBudget.resolved``).
        dtype: the model's dtype (the host store keeps K/V in it unless ``host_dtype`` says otherwise).
        device: the model's device (where the working sets live).
    """

    model_config: object
    nosa_config: NosaConfig | None = None
    budget: ServingBudget = field(default_factory=ServingBudget)
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    entries: dict[str, RequestEntry] = field(default_factory=dict)
    plan: list[tuple[str, int, int]] = field(default_factory=list)
    host_reserved: int = 0
    host_pool: HostPool = field(default_factory=HostPool)  # host stores pinned once, reused request after request
    finished: list = field(default_factory=list)  # [blocks, bytes] and [resident, selected] of released requests
    rank_kv_heads: int | None = None  # under tensor parallelism: the KV heads this rank holds (of every layer)
    expected_tokens: int | None = None  # the longest request expected (workload hints): what the rows are sized for
    step_tokens: int | None = None  # tokens a step carries at most (max_batch_tokens): their activations stay free
    step_requests: int | None = None  # requests a step carries at most (max_requests_per_batch): their logits' rows
    admitted_peak: int = 0  # the most requests admitted at once so far
    # what batched decode steps moved (serving.decode_batch), by layer: they count in the step's counters, not the
    # requests' own
    step_counters: dict = field(default_factory=dict)
    decode_runs: dict = field(default_factory=dict)  # rows of a batched decode update -> how many updates had them
    decode_step_plan: object = None  # the batched decode step's plan, built at a step's first layer (decode_batch)
    run_views: dict = field(default_factory=dict)  # a batched run's views of the shared buffers, by layer and rows
    # what a run's views read (memory, shapes: decode_batch._signature) -> an id for step graph keys, never reused
    view_ids: dict = field(default_factory=dict)
    next_view_id: int = 0

    def __post_init__(self):
        self.nosa_config = NosaConfig.from_model_config(self.model_config, self.nosa_config)
        text = self.model_config.get_text_config(decoder=True)
        self.n_layers = text.num_hidden_layers
        # a rank's caches hold its share of the KV heads: admission counts what this rank's memory holds
        self.kv_heads = self.rank_kv_heads or text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.max_positions = getattr(text, "max_position_embeddings", None)
        self.step_bytes = 0
        if self.step_tokens:  # the logits: one row per request of the step
            itemsize = torch.empty(0, dtype=self.dtype).element_size()
            rows = min(self.step_tokens, self.step_requests or MAX_LOGIT_ROWS)
            self.step_bytes = ACTIVATION_HEADROOM * step_activation_bytes(self.model_config, self.step_tokens,
                                                                          itemsize, rows)
        self.budget = self.budget.resolved(self.device, self.step_bytes, self.step_tokens)
        self.rows = RowPool(self.decode_rows())

    # ----- sizes -----

    def request_tokens(self, prompt_length: int, max_new_tokens: int | None) -> int:
        """Longest sequence a request can reach: its prompt and max_new_tokens (the model's context when None)."""
        if max_new_tokens is None:
            return max(prompt_length + 1, self.max_positions or prompt_length + 1)
        return prompt_length + max_new_tokens

    def host_bytes(self, tokens: int) -> int:
        """Host store bytes of one request of ``tokens`` tokens, every layer (``HostStore.planned_bytes``)."""
        cfg = self.nosa_config.sized_for(tokens)
        return self.n_layers * HostStore.planned_bytes(1, self.kv_heads, self.head_dim, self.dtype, cfg.block_size,
                                                       cfg.host_dtype, tokens)

    def _layout(self, tokens: int):
        """The shapes a request of ``tokens`` tokens allocates, per layer: its NosaConfig (budgets cut to its length),
        the slot pool's slots (``NosaLayer.n_slots`` and a scratch slot), the compressed keys' capacity (a multiple
        of 256 windows, ``window_capacity_for``) and the host block table's columns."""
        cfg = self.nosa_config.sized_for(tokens)
        slots = max(cfg.budget_blocks, cfg.prefill_budget_blocks) + 2
        windows = window_capacity_for(num_windows(tokens, cfg))
        blocks = max(1, -(-tokens // cfg.block_size))
        return cfg, slots, windows, 1 << max(6, (blocks - 1).bit_length())

    def device_bytes(self, tokens: int) -> int:
        """Device bytes of one request's working set, every layer: the slot pool (selected blocks, the block being
        written and a scratch slot; K, V in the model's dtype, scores fp32) and the compressed keys of the whole
        sequence, at the capacity allocated. An estimate used for admission (``row_bytes`` is the exact row of the
        shared banks)."""
        cfg, slots, windows, _ = self._layout(tokens)
        D, Hk = self.head_dim, self.kv_heads
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return self.n_layers * Hk * (slots * cfg.block_size * (2 * D * itemsize + 4) + windows * (D * itemsize + 4))

    def row_bytes(self, tokens: int) -> tuple[int, int]:
        """Device bytes of one row of the banks (``row_pool.RowPool``) a request of ``tokens`` tokens draws on, every
        layer, as ``(slot part, capacity part)``: its slot pool (K, V, scores, block ids, tail slot), and what
        follows its length: the compressed keys and bias, their ring and the host block table. A bank holds every
        row of its shape from the start, taken or not."""
        cfg, slots, windows, columns = self._layout(tokens)
        P, D, Hk = cfg.block_size, self.head_dim, self.kv_heads
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        slot = Hk * (slots * P * (2 * D * itemsize + 4) + (slots - 1) * 8 + 8)
        table = HostStore.table_rows(cfg.host_dtype) * columns * 8
        grows = Hk * (windows + cfg.compress_kernel) * (D * itemsize + 4) + table
        return self.n_layers * slot, self.n_layers * grows

    def _assign_row(self, tokens: int) -> int | None:
        """A row for a request of ``tokens`` tokens, or None (it decodes alone, on buffers of its own) where the
        banks it needs would not fit the device budget beside the banks open and the working sets of the requests
        without a row. The first request sizes the banks: as many rows as half the budget holds at its length (no
        more than ``decode_rows``), since every bank holds all its rows from the start, and a longer request later
        needs room for buffers of its own; with ``expected_tokens``, the first banks are opened at that length's
        capacity instead, so every request up to it shares them, and they may take the whole budget.

        Admission (``admit``) counts the banks whole and the working sets of the requests without a row
        (``device_in_use``), so the two never exceed the budget together: a request that takes a free row adds
        nothing, one that would need its own buffers waits for room (alone, it always runs)."""
        if not self.rows.banks and self.expected_tokens:  # banks open wide enough for the longest request expected
            tokens = max(tokens, self.expected_tokens)
            _, _, windows, columns = self._layout(tokens)
            self.rows.floor = {"compressed_keys": windows, "compressed_bias": windows, "host_table": columns}
        budget = self.budget.device_bytes
        if budget is None:
            return self.rows.assign()
        left = budget - sum(e.device_bytes for e in self.entries.values() if e.cache is not None and e.row is None)
        slot, grows = self.row_bytes(tokens)
        if not self.rows.banks:
            # sized for the longest request expected, the banks serve every request and may take the whole budget;
            # sized for the first request, half: the rest for longer ones, on buffers of their own
            share = budget if self.expected_tokens else budget // 2
            self.rows.limit(min(self.rows.max_rows, min(left, share) // (slot + grows)))
        if not self.rows.free_rows:
            return None
        slot_held, keys_held = self._banks_hold(tokens)
        need = (0 if slot_held else slot) + (0 if keys_held else grows)
        if self.rows.bank_bytes() + self.rows.max_rows * need > left:
            return None
        return self.rows.assign()

    def decode_rows(self) -> int:
        """Rows of the shared slot pools (``row_pool.RowPool``): ``ServingBudget.decode_rows``, and with a device
        budget no more than it holds working sets of requests that use the whole slot budget (a bank holds all its
        rows from the start, taken or not)."""
        rows = self.budget.decode_rows
        if self.budget.device_bytes is not None:
            cfg = self.nosa_config
            full = self.device_bytes(max(cfg.budget_tokens, cfg.prefill_budget_blocks * cfg.block_size))
            rows = max(1, min(rows, self.budget.device_bytes // full))
        return rows

    # ----- admission -----

    def check_fits(self, request_id: str, prompt_length: int, max_new_tokens: int | None) -> None:
        """Raise a MemoryError naming the request when it could not fit the budget even alone."""
        tokens = self.request_tokens(prompt_length, max_new_tokens)
        host, device = self.host_bytes(tokens), self.device_bytes(tokens)
        for what, need, limit in (("host", host, self.budget.host_bytes), ("device", device, self.budget.device_bytes)):
            if limit is not None and need > limit:
                raise MemoryError(
                    f"NOSA serving: request {request_id} (prompt {prompt_length} + max_new_tokens {max_new_tokens} = "
                    f"{tokens} tokens) needs {need:,} bytes of {what} memory, but the whole {what} budget is "
                    f"{limit:,} bytes. Shorten the request, or raise ServingBudget.{what}_bytes."
                )

    def admit(self, request_id: str, prompt_length: int, max_new_tokens: int | None, *, dry_run: bool = False) -> bool:
        """Whether the request fits beside the admitted ones; reserves its bytes unless ``dry_run``."""
        if request_id in self.entries:
            return True
        tokens = self.request_tokens(prompt_length, max_new_tokens)
        host, device = self.host_bytes(tokens), self.device_bytes(tokens)
        # device: the banks are allocated whole, so a request that will take a free row of banks holding its shape
        # adds nothing; one without a row brings its own working set (an admitted request counts as one until its
        # row is given, at its first update). Alone, a request is always admitted (check_fits bounds it).
        on_row = self._row_waiting(tokens)
        fits = all(limit is None or reserved + need <= limit for need, reserved, limit in (
            (host, self.host_reserved, self.budget.host_bytes),
            (0 if on_row else device, self.device_in_use(), self.budget.device_bytes))) or not self.entries
        if fits and not dry_run:
            self.entries[request_id] = RequestEntry(prompt_length, tokens, host, device)
            self.admitted_peak = max(self.admitted_peak, len(self.entries))
            self.host_reserved += host
        return fits

    def device_in_use(self) -> int:
        """Device bytes the requests hold or may still take: the banks (every row, taken or not) and the working
        sets of the requests without a row, or not given one yet (their buffers are their own)."""
        return self.rows.bank_bytes() + sum(e.device_bytes for e in self.entries.values() if e.row is None)

    def _row_waiting(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` tokens will take a row of the open banks: one is free beyond those the
        admitted requests without a cache yet will take, and the banks hold its slot pool and compressed keys."""
        if not self.rows.banks:
            return False
        waiting = sum(1 for e in self.entries.values() if e.cache is None)
        return len(self.rows.free_rows) > waiting and all(self._banks_hold(tokens))

    def _banks_hold(self, tokens: int) -> tuple[bool, bool]:
        """Whether the open banks hold a request of ``tokens`` tokens: its slot pool, and its compressed keys (a
        bank at least as wide)."""
        cfg, slots, windows, _ = self._layout(tokens)
        return (self.rows.holds((0, "slot_k"), (self.kv_heads, slots, cfg.block_size, self.head_dim)),
                self.rows.holds((0, "compressed_keys"), (self.kv_heads, windows, self.head_dim), grow=1))

    def release(self, request_id: str) -> None:
        """Drop a request's NosaCache (its host store and slot pool) and give back what it reserved."""
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return
        self.host_reserved -= entry.host_bytes
        if entry.cache is not None:
            self.finished = self._counters([entry.cache], self.finished)
        entry.cache = None
        self.run_views.clear()  # views that name its buffers (a few runs: rebuilt at the next step)
        self.host_pool.give_back(request_id)
        self.rows.give_back(entry.row)
        entry.row = None

    def release_all(self) -> None:
        for request_id in list(self.entries):
            self.release(request_id)
        self.plan = []

    # ----- the request's cache -----

    def cache_of(self, request_id: str) -> tuple[RequestEntry, NosaCache]:
        """The request's entry and NosaCache (built on first use, sized for the request's whole length)."""
        entry = self.entries.get(request_id)
        if entry is None:
            raise RuntimeError(
                f"NOSA serving: request {request_id} reached the attention without being admitted (no host budget was "
                "reserved for it). Its cache was freed while the step was planned; this is a bug."
            )
        if entry.cache is None:
            entry.row = self._assign_row(entry.max_tokens)  # before its cache: it counts as no row-less request
            entry.cache = NosaCache(self.model_config, self.nosa_config, max_cache_len=entry.max_tokens)
            entry.cache.attach_workspace(RequestWorkspace(self.host_pool, request_id, self.rows, entry.row))
        return entry, entry.cache

    @staticmethod
    def _counters(caches, totals: list) -> list:
        """``totals`` plus the caches' ``[blocks loaded, bytes moved]`` and ``[resident, selected]`` counters
        (device tensors, no host sync)."""
        layers = [layer for cache in caches for layer in cache.layers if layer.is_initialized]
        if not layers:
            return totals
        counts = torch.stack([layer.counters.counts[:2] for layer in layers]).sum(0)
        share = torch.stack([layer.counters.locality.double() for layer in layers]).sum(0)
        return [counts, share] if not totals else [totals[0] + counts.to(totals[0].device),
                                                    totals[1] + share.to(totals[1].device)]

    def stats(self) -> dict:
        """What every request so far (released or running) moved to the device: ``blocks_loaded``,
        ``bytes_to_device`` and ``locality`` (the share of selected blocks already on the device), as
        ``NosaCache.stats`` counts them, plus the batched decode updates' (``step_counters``: blocks and bytes are
        the per-request sums; each batched update is one step of the locality, its share over all its rows); one
        host sync."""
        live = [entry.cache for entry in self.entries.values() if entry.cache is not None]
        totals = self._counters(live, list(self.finished))
        if self.step_counters:  # batched decode steps: blocks and bytes per request summed; locality per run step
            counts = torch.stack([c.counts[:2] for c in self.step_counters.values()]).sum(0)
            share = torch.stack([c.locality.double() for c in self.step_counters.values()]).sum(0)
            totals = [counts, share] if not totals else [totals[0] + counts.to(totals[0].device),
                                                         totals[1] + share.to(totals[1].device)]
        if not totals:
            return dict(blocks_loaded=0, bytes_to_device=0, locality=float("nan"))
        counts, share = (t.cpu() for t in totals)
        return dict(blocks_loaded=int(counts[0]), bytes_to_device=int(counts[1]),
                    locality=float(share[0] / share[1]) if share[1] > 0 else float("nan"))

    def held_tokens(self) -> int:
        """Tokens the admitted requests' caches hold (layer 0)."""
        return sum(entry.cache.get_seq_length() for entry in self.entries.values() if entry.cache is not None)
