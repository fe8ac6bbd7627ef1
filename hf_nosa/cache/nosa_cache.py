"""NosaCache: a transformers ``Cache`` whose KV lives in host memory and whose device holds a fixed block budget.

Per layer and sequence: every token's K, V and eviction score go to the host store; the device keeps the
compressed keys of the whole sequence and a pool of slots of ``block_size`` tokens (the selected blocks and the
block being written). Every update hands the attention what to attend to (``AttentionInputs``):

- a decode token: the slot pool after selection (``rules/selection.py``) and the fetch of missing blocks
  (``kernels/decode/fetch.py``);
- a prefill chunk (the prompt arrives chunk by chunk, ``modeling/chunked.py``): by ``NosaConfig.prefill``, every
  earlier token ("dense", "nosa") or QUOKA's blocks in the slot pool ("quoka", ``prefill/chunked.py``), then the chunk;
- a few tokens after a prompt (at most ``decode_rule_tokens``: the candidates assisted decoding and prompt lookup
  verify): every earlier token, masked by the decode rule token by token, so they see what one-token decoding would;
- more tokens after a prompt (a new turn): the prefill again, from the cache's length, chunk by chunk.

A call on the cache is one turn (``NosaCache.turn``): if it raises part-way, every layer is rebuilt as it was.

Rows of a left-padded batch are stored from their first real token (``rules/padding.py``): ``offset [B]`` on the device
says by how much each row's row-relative index trails the cache index.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..config import NosaConfig
from ..kernels.decode.fetch import StepCounters
from ..prefill.chunked import PrefillPaths, write_to_host
from ..rules.attend import AttentionInputs
from ..rules.padding import from_rows
from ..rules.selection import MASK_VALUE
from .compressed_keys import CompressedKeys
from .decode_step import DecodePaths
from .host_store import HostStore, check_host_memory
from .selectors import BlockSelector

logger = logging.getLogger(__name__)
# Buffers with a capacity dimension: from a workspace they may come larger (``DeviceWorkspace.take``'s ``grow``),
# so requests up to the longest so far share one buffer and the decode graph captured on it.
_CAPACITY_DIM = {"compressed_keys": 2, "compressed_bias": 2, "host_table": 1}


class CacheState:
    """What every layer of one NosaCache shares: the planned length, the prefill under way, the workspace."""

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens  # longest sequence this cache will hold, when known (generate knows it)
        self.prefill_end: int | None = None  # sequence length at the end of the prefill being chunked
        # [B] CPU long: the left padding of each row of the prompt being prefilled, whose real tokens arrive moved
        # to the front (``modeling.chunked``); the layers count every row from its first real token after it
        self.prefill_offsets: torch.Tensor | None = None
        # where the layers of the prefill under way find the prompt's padding (``NosaCache.begin_prefill``)
        self.prefill_padding: torch.Tensor | bool = True
        self.workspace = None  # a DeviceWorkspace shared across generate calls, or None
        self.n_layers = 0


class NosaLayer(PrefillPaths, DecodePaths, CacheLayerMixin):
    """One layer's NOSA cache: host store, compressed keys and the device slot pool."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, nosa_config: NosaConfig, selector: BlockSelector | None = None, *, layer_idx: int = 0,
                 state: CacheState | None = None):
        super().__init__()
        self.base_cfg = self.cfg = nosa_config
        self.selector = selector
        self.layer_idx = layer_idx
        self.state = state if state is not None else CacheState()
        self.selector_state: dict[str, torch.Tensor] = {}
        self.seen = 0
        self.staging: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.previous_chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None  # QUOKA's last chunk
        self.peak_device_tokens = 0
        self.decode_steps = 0
        self.updates = 0  # updates, fused steps and rewinds so far (``checkpoint``)
        self.warm = False
        self._writer = None

    # ----- the cache-layer protocol's K/V: the whole sequence, read from the host store -----

    @property
    def keys(self) -> torch.Tensor | None:
        """All keys ``[B, Hk, T, D]`` on the layer's device: a copy read from the host store on every access."""
        return self._read_all(0)

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("NosaLayer.keys is read from the host store and cannot be assigned")

    @property
    def values(self) -> torch.Tensor | None:
        """All values ``[B, Hk, T, D]`` on the layer's device: a copy read from the host store on every access."""
        return self._read_all(1)

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("NosaLayer.values is read from the host store and cannot be assigned")

    def _read_all(self, which: int) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        self._wait_writer()
        if not self.padded:
            return self.host.read(0, self.seen, self.device)[which]
        # rows are stored row-relative: back to cache indices, zeros in the padding (which is not stored)
        stored = self.host.read(0, int(self.row_lengths().max()), self.device)[which]
        return from_rows(stored, self.offset, dim=2, fill=0.0, length=self.seen)

    def offload(self) -> None:
        """Nothing to move: the layer's K/V live in the host store already (transformers' layer offloading)."""

    def prefetch(self) -> None:
        """Nothing to fetch ahead: each step brings the blocks its selection needs."""

    # ----- set-up -----

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        workspace = self.state.workspace
        if workspace is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return workspace.take((self.layer_idx, name), shape, dtype, self.device, grow=_CAPACITY_DIM.get(name))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, Hk, T, D = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch, self.kv_heads, self.head_dim = B, Hk, D
        planned = max(self.state.max_tokens or 0, self.state.prefill_end or 0, T)
        self.cfg = self.base_cfg.sized_for(planned)
        pin = self.device.type == "cuda" and self.cfg.offload
        workspace = self.state.workspace
        if workspace is not None:  # pinned chunks and the block table (part of a captured graph) outlive this cache
            def host_allocate(name, shape, dtype, pin_memory):
                return workspace.take((self.layer_idx, name), shape, dtype, "cpu", pin=pin_memory)

            blocks = max(1, -(-planned // self.cfg.block_size))
            rows = HostStore.table_rows(self.cfg.host_dtype)
            table = self._buffer("host_table", (rows, 1 << max(6, (blocks - 1).bit_length())), torch.int64).zero_()
        else:
            host_allocate = table = None
        sized = self.state.max_tokens is not None or self.state.prefill_end is not None
        if sized and self.layer_idx == 0:  # the whole cache's host memory, before any layer allocates
            total = self.state.n_layers * HostStore.planned_bytes(B, Hk, D, key_states.dtype, self.cfg.block_size,
                                                                  self.cfg.host_dtype, planned)
            held = workspace.host_bytes() if workspace is not None else 0
            check_host_memory(total - held, batch=B, tokens=planned, pin=pin)
        self.host = HostStore(B, Hk, D, key_states.dtype, self.cfg.block_size, pin=pin, table=table,
                              allocate=host_allocate, host_dtype=self.cfg.host_dtype)
        if sized:
            self.host.reserve(planned)
        self.compressed = CompressedKeys(self.cfg, key_states, tokens=planned, allocate=self._allocate)
        self._allocate_slots()
        self.step = self._buffer("step", (1,), torch.long).zero_()
        # Row b's token at cache index t is stored at row-relative index t - offset[b] (``hf_nosa.rules.padding``).
        self.offset = self._buffer("offset", (B,), torch.long).zero_()
        self.offsets_host = torch.zeros(B, dtype=torch.long)  # the same on the CPU, for host-side indexing
        self.padded = False  # whether any offset is nonzero
        self._step_value = 0  # what `step` holds once the queued work has run
        self.counters = StepCounters(self._buffer("counts", (5,), torch.int64).zero_(),
                                     self._buffer("locality", (2,), torch.float32).zero_())
        self.is_initialized = True

    def _allocate(self, name, shape, dtype, device) -> torch.Tensor:
        return self._buffer(name, shape, dtype)

    def _allocate_slots(self) -> None:
        """The slot pool: ``n_slots`` slots (selected blocks + the block being written) and a scratch slot."""
        B, Hk, D, P = self.batch, self.kv_heads, self.head_dim, self.cfg.block_size
        S = self.n_slots
        self.slot_k = self._buffer("slot_k", (B, Hk, S + 1, P, D), self.dtype).zero_()
        self.slot_v = self._buffer("slot_v", (B, Hk, S + 1, P, D), self.dtype).zero_()
        self.slot_b = self._buffer("slot_b", (B, Hk, S + 1, P), torch.float32).fill_(MASK_VALUE)
        self.slot_block = self._buffer("slot_block", (B, Hk, S), torch.long).fill_(-1)
        self.tail_slot = self._buffer("tail_slot", (B, Hk), torch.long).zero_()

    @property
    def n_slots(self) -> int:
        return max(self.cfg.budget_blocks, self.cfg.prefill_budget_blocks) + 1

    def _grow_layout(self, n_tokens: int) -> None:
        """A cache of unknown length outgrew its cut budget: widen the slot pool (its blocks stay in place)."""
        if self.cfg is self.base_cfg or n_tokens // self.cfg.block_size < self.cfg.budget_blocks:
            return
        old = (self.slot_k, self.slot_v, self.slot_b, self.slot_block)
        tail = self.tail_slot
        S_old = self.n_slots
        self.cfg = self.base_cfg.sized_for(max(2 * n_tokens, n_tokens + self.cfg.block_size))
        self.compressed.cfg = self.cfg
        self._allocate_slots()
        for new, previous in zip((self.slot_k, self.slot_v, self.slot_b, self.slot_block), old):
            new[:, :, :S_old] = previous[:, :, :S_old]
        self.tail_slot.copy_(tail)  # the block being written stays where it is

    def _check_input(self, key_states: torch.Tensor, query, bias) -> None:
        if query is None or bias is None:
            raise TypeError(
                "NosaCache.update needs the query states and eviction scores: use it with a model converted by "
                "hf_nosa.to_nosa (or a NOSA checkpoint), not with stock attention."
            )
        if not self.is_initialized:
            return
        B, Hk, _, D = key_states.shape
        for what, mine, theirs in (("batch size", self.batch, B), ("KV heads", self.kv_heads, Hk),
                                   ("head dim", self.head_dim, D), ("dtype", self.dtype, key_states.dtype)):
            if mine != theirs:
                raise ValueError(
                    f"NosaCache layer {self.layer_idx} holds a sequence with {what} {mine}, but this update has "
                    f"{what} {theirs}: a cache belongs to one model and batch. Use a new NosaCache (or reset() it)."
                )

    # ----- update -----

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args,
        query: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        scaling: float | None = None,
        **kwargs,
    ) -> AttentionInputs:
        """Store new tokens and return what the attention reads.

        Args:
            key_states, value_states: ``[B, Hk, Tq, D]`` post-RoPE keys and values.
            query: ``[B, H, Tq, D]`` post-RoPE queries (for query-aware selection).
            bias: ``[B, Hk, Tq]`` eviction-head scores of the new tokens.
            attention_mask: the model's mask for this forward (padding), or None.
        """
        self._check_input(key_states, query, bias)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.updates += 1  # what ``restore`` asks: whether anything may have changed since a checkpoint
        scale = scaling if scaling is not None else key_states.shape[-1] ** -0.5
        bias = bias.float()
        Tq = key_states.shape[2]
        prefilling = self.state.prefill_end is not None or self.seen == 0
        if Tq == 1 and not prefilling:
            return self._decode(key_states, value_states, query, bias, scale)
        if not prefilling and Tq <= self.base_cfg.decode_rule_tokens:  # candidates of assisted decoding: exact
            return self._extend_by_decode_rule(key_states, value_states, query, bias, attention_mask, scale)
        if self.seen > 0 and self.padded:
            raise ValueError(
                f"NosaCache layer {self.layer_idx}: {Tq} new tokens continue a left-padded batch (rows of different "
                f"lengths). Continuing prompts longer than NosaConfig.decode_rule_tokens="
                f"{self.base_cfg.decode_rule_tokens} are supported on caches without left padding: keep one "
                "conversation per cache, or batch conversations of equal length."
            )
        return self._prefill(key_states, value_states, query, bias, attention_mask, scale)

    def _wait_writer(self) -> None:
        """Later work reads the host store: make the current stream wait for the side-stream writes."""
        if self._writer is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._writer)
            self._writer = None

    def _store(self, start, k, v, b) -> None:
        # The compressed keys first: beside a host write in flight the extension's kernel took 0.13 ms a launch at
        # 64K, batch 4, against under 9 us at batch 1 (docs/results/2026-12-03_prefill_breakdown_64k_b*_eceb868.json)
        self.compressed.extend(k, b, start)
        self._writer = write_to_host(self.host, start, k, v, b) or self._writer
        self.seen = start + k.shape[2]
        if self.selector is not None:
            if start > 0 and k.shape[2] > 1:  # selectors index a whole sequence or one more token
                self._wait_writer()
                k, _, b = self.host.read(0, self.seen, self.device)
                start = 0
            self.selector.observe(self, k, b, start)

    def device_tokens(self) -> int:
        """Largest number of KV tokens on the device for one (sequence, KV head) in the slot pool right now."""
        if not self.is_initialized or self.seen == 0:
            return 0
        P = self.cfg.block_size
        t = (self.seen - 1 - self.offset)[:, None, None, None]
        pos = self.slot_block[..., None] * P + torch.arange(P, device=self.device)
        valid = (self.slot_block[..., None] >= 0) & (pos <= t)
        return int(valid.flatten(2).sum(-1).max())

    # ----- the cache protocol -----

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget every token; the next update starts a new sequence."""
        self.is_initialized = False
        self.seen = 0
        self.peak_device_tokens = 0
        self.decode_steps = 0
        self.warm = False
        self.staging = None
        self.previous_chunk = None
        self._writer = None
        self.selector_state = {}
        self.cfg = self.base_cfg
        self.padded = False
        for name in ("host", "compressed", "slot_k", "slot_v", "slot_b", "slot_block", "tail_slot", "counters",
                     "offset", "offsets_host"):
            self.__dict__.pop(name, None)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a positive value is the length to keep, the legacy form)."""
        if not self.is_initialized:
            return
        tokens_to_remove = int(tokens_to_remove)  # some transformers versions pass a 0-d tensor
        new_length = tokens_to_remove if tokens_to_remove > 0 else self.seen + tokens_to_remove
        new_length = max(0, min(new_length, self.seen))
        if new_length == self.seen:
            return
        self.rewind(new_length)

    def rewind(self, length: int) -> None:
        """Hold the first ``length`` tokens (at most ``seen``) and rebuild from the host store what depends on the
        last ones: the compressed keys and their rings, and the slot pool (emptied but for each row's partly written
        block). Unlike ``crop`` it always rebuilds, so it also repairs a layer that an update left half done."""
        self._wait_writer()
        self.staging = None
        self.previous_chunk = None
        self.seen = self.host.length = length
        if self.padded:  # a row cut inside its padding keeps no token
            self._set_offsets(torch.minimum(self.offsets_host, torch.tensor(length)))
        lengths = self.row_lengths()
        end = int(lengths.max())
        if self.selector is not None:  # selectors observe a whole sequence at once
            keys, values, bias = self._read_counted(0, end)
            self.compressed.rebuild(keys, bias, lengths)
            self._settle_rows((keys, values, bias, 0))
            self.selector.observe(self, keys, bias, 0)
        else:
            # A prefill budget of tokens at a time, as a QUOKA chunk reads them: the device never holds the layer's
            # whole K/V (rows stored row-relative extend alike; windows past a row's end are never read).
            P = self.cfg.block_size
            piece = max(P, self.cfg.prefill_budget_blocks * P)
            self.compressed.n = 0
            for lo in range(0, end, piece):
                k, _, b = self._read_counted(lo, min(end, lo + piece))
                self.compressed.extend(k, b, lo)
            self._settle_rows()
        self._step_value = -1  # the device step counter is set again before the next fused step
        self.updates += 1

    def checkpoint(self) -> tuple | None:
        """What ``restore`` needs to bring this layer back to now (None: not initialized)."""
        if not self.is_initialized:
            return None
        return (self.seen, self.updates, self.counters.counts.clone(), self.counters.locality.clone(),
                self.decode_steps, self.peak_device_tokens)

    def restore(self, saved: tuple | None) -> None:
        """Back to ``checkpoint()``'s state: the tokens after it dropped, counters as they were. A layer that no
        update touched since (the call failed before reaching it) keeps what it holds."""
        if saved is None:
            self.reset()
            return
        seen, updates, counts, locality, decode_steps, peak = saved
        if self.seen < seen:
            raise RuntimeError(f"layer {self.layer_idx} holds {self.seen} tokens, fewer than the {seen} to restore")
        if self.updates != updates or self.seen != seen:
            self.rewind(seen)
        self.counters.counts.copy_(counts)
        self.counters.locality.copy_(locality)
        self.decode_steps, self.peak_device_tokens = decode_steps, peak

    def _index_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self._wait_writer()
        index = index.to(self.device)
        same_size = index.numel() == self.batch
        self.host.index_batch(index)
        self.compressed.index_batch(index)
        self.offsets_host = self.offsets_host.index_select(0, index.cpu())
        for name in ("slot_k", "slot_v", "slot_b", "slot_block", "tail_slot", "offset"):
            current = getattr(self, name)
            if same_size:  # in place: a captured decode graph stays valid through beam reorders
                current.copy_(current.index_select(0, index))
            else:
                setattr(self, name, current.index_select(0, index))
        for name, value in self.selector_state.items():
            self.selector_state[name] = value.index_select(0, index.to(value.device))
        self.batch = index.numel()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_batch(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_batch(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            index = torch.arange(self.batch, device=self.device)[indices]
            self._index_batch(index)


class NosaCache(Cache):
    """A transformers ``Cache`` for NOSA models: full KV in host memory, a fixed block budget on the device.

    Args:
        config: the model's config (``PretrainedConfig``); its "nosa" section is the default NosaConfig.
        nosa_config: overrides the model's NosaConfig for this cache (budget, prefill mode, ...).
        selector: another block-selection rule on the same engine (see ``cache/selectors.py``); default NOSA.
        max_cache_len: the longest sequence (prompt + new tokens) the cache will hold, if known. The host store,
            compressed keys and slot pool are then sized once for it (``generate`` passes it by itself).

    Example:
        >>> cache = NosaCache(model.config, NosaConfig(budget_tokens=2048))  # doctest: +SKIP
        >>> out = model.generate(**inputs, cache=cache)  # doctest: +SKIP
        >>> cache.stats()["locality"]  # doctest: +SKIP
    """

    def __init__(
        self, config: Any = None, nosa_config: NosaConfig | None = None, *, selector: BlockSelector | None = None,
        max_cache_len: int | None = None, **kwargs
    ):
        if kwargs:
            raise TypeError(
                f"NosaCache got unexpected arguments {sorted(kwargs)}; expected config, nosa_config, selector and "
                "max_cache_len"
            )
        if config is None and nosa_config is None:
            raise TypeError("NosaCache needs the model config (or at least a NosaConfig)")
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"NosaCache max_cache_len={max_cache_len!r} is invalid: it must be a positive int or None")
        self.nosa_config = NosaConfig.from_model_config(config, nosa_config)
        self.selector = selector
        self.state = CacheState(max_cache_len)
        self.workspace_lost = False
        self.broken: str | None = None  # why the cache cannot be used (a failed call it could not be restored from)
        self.restore_on_error = True  # False for a cache generate built for one call (no one holds it after)
        self._turns = 0  # nesting depth of ``turn()``: only the outermost checkpoints and restores
        text_config = config.get_text_config(decoder=True) if config is not None else None
        n_layers = getattr(text_config, "num_hidden_layers", None)
        if n_layers is not None:
            self.state.n_layers = n_layers
            super().__init__(layers=[self._new_layer(selector, i) for i in range(n_layers)])
        else:
            super().__init__(layer_class_to_replicate=lambda: self._new_layer(selector, len(self.layers)))

    def _new_layer(self, selector, layer_idx: int) -> NosaLayer:
        return NosaLayer(self.nosa_config, selector, layer_idx=layer_idx, state=self.state)

    def reserve(self, max_tokens: int) -> None:
        """Sequences will grow to ``max_tokens`` tokens: before the first update every buffer is sized once; on a
        cache that holds tokens (a new turn) the host stores grow that far in one growth, not by a share."""
        if self.get_seq_length() == 0:
            self.state.max_tokens = int(max_tokens)
        for layer in (layer for layer in self.layers if layer.is_initialized):
            layer.host.reserve(max_tokens)

    def begin_prefill(
        self, end: int, offsets: torch.Tensor | None = None, *, padding: torch.Tensor | bool = True
    ) -> None:
        """A prompt is about to arrive in several updates and will end at ``end`` tokens (``modeling.chunked``).

        ``offsets``: ``[B]`` long, each row's left padding, when the prompt's rows arrive with their real tokens
        moved to the front (padding last); the layers then count each row from its first real token.
        ``padding``: where the layers find padding. True: in the mask of each update. A ``[B, end]`` bool tensor
        (True for a real token, rows as they arrive): here, so the forward runs without a padding mask (transformers
        would expand a 2D one to ``[B, 1, chunk, context]`` per chunk: 1.2 GB at 64K x 38). False: none (an
        all-ones mask). With a tensor or False the model's masks are causal only and the layers ignore them.
        """
        if isinstance(padding, torch.Tensor) and (padding.dim() != 2 or padding.shape[1] != end):
            raise ValueError(f"begin_prefill: padding must be [batch, end={end}] bool, got {tuple(padding.shape)}")
        self.state.prefill_end = int(end)
        self.state.prefill_offsets = None if offsets is None else offsets.detach().to("cpu", torch.long)
        self.state.prefill_padding = padding.bool() if isinstance(padding, torch.Tensor) else bool(padding)

    @property
    def has_selector(self) -> bool:
        """Whether the layers run another block-selection rule than NOSA's (``cache/selectors.py``)."""
        return self.selector is not None

    def end_prefill(self) -> None:
        self.state.prefill_end = None
        self.state.prefill_offsets = None
        self.state.prefill_padding = True

    def attach_workspace(self, workspace) -> None:
        """Draw device buffers from ``workspace`` (shared by a model's generate calls, so graphs are reused)."""
        if self.get_seq_length() == 0:
            self.state.workspace = workspace

    @contextlib.contextmanager
    def turn(self):
        """One call on this cache (a ``generate``, a forward) as a unit: if it raises part-way (an error in a layer,
        KeyboardInterrupt), every layer is put back as it was when the call began (tokens after it dropped, compressed
        keys and slot pool rebuilt from the host store, counters restored) and the error goes on. Should that repair
        fail too, the cache is marked and every later use raises, saying why, until ``reset()``. Nested turns (the
        forwards of a generate) leave it to the outermost."""
        if self._turns or not self.restore_on_error:
            self._turns += 1
            try:
                yield self
            finally:
                self._turns -= 1
            return
        self._check_usable()
        saved = [layer.checkpoint() for layer in self.layers]
        length = self.get_seq_length()
        self._turns = 1
        try:
            yield self
        except BaseException as error:
            self._restore(saved, length, error)
            raise
        finally:
            self._turns = 0

    def _restore(self, saved: list, length: int, error: BaseException) -> None:
        self.end_prefill()
        try:
            for layer, checkpoint in zip(self.layers, saved + [None] * (len(self.layers) - len(saved))):
                layer.restore(checkpoint)
        except Exception as repair:
            self.broken = (
                f"a call on this NosaCache raised {type(error).__name__} ({error}) part-way, and restoring the "
                f"{length} tokens it held before failed too ({type(repair).__name__}: {repair})"
            )
            logger.error("NosaCache: %s", self.broken)
            return
        logger.warning("NosaCache: a call raised %s part-way; the cache was restored to the %d tokens it held before.",
                       type(error).__name__, length)

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"This NosaCache cannot be used: {self.broken}. Call cache.reset() (or build a new "
                               "NosaCache) and send the whole conversation again.")

    def reset(self) -> None:
        """Forget every token of every layer (and a failure the cache was marked with)."""
        super().reset()
        self.broken = None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs) -> AttentionInputs:
        self._check_usable()
        if self.workspace_lost:
            raise RuntimeError(
                "This NosaCache's device buffers were taken over by a later generate(cache_implementation='nosa') "
                "call on the same model. To keep a cache across calls, pass your own hf_nosa.NosaCache(model.config)."
            )
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        elif layer_idx >= len(self.layers):
            raise ValueError(
                f"NosaCache was built for {len(self.layers)} layers, but layer {layer_idx} updated it: a cache belongs "
                "to one model. Build it from this model's config: NosaCache(model.config)."
            )
        layer = self.layers[layer_idx]
        if not layer.is_initialized and layer_idx == 0 and self.state.workspace is not None:
            self.state.workspace.claim(self)
        return layer.update(key_states, value_states, *args, **kwargs)

    def stats(self) -> dict[str, float | int]:
        """Counters of what the cache holds and moved (one host sync); the README lists every key."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            return dict(seen_tokens=0, host_tokens=0, device_tokens=0, blocks_loaded=0, bytes_to_device=0,
                        locality=float("nan"), decode_steps=0, host_bytes=0, full_kv_bytes=0, device_kv_bytes=0)
        for layer in layers:
            layer.peak_device_tokens = max(layer.peak_device_tokens, layer.device_tokens())
        counts = torch.stack([layer.counters.counts[:2].cpu() for layer in layers]).sum(0)
        locality = torch.stack([layer.counters.locality.double().cpu() for layer in layers]).sum(0)
        first = layers[0]
        token_bytes = 2 * first.head_dim * first.slot_k.element_size() * first.kv_heads * first.batch
        return dict(
            seen_tokens=first.seen,
            host_tokens=first.host.length,
            device_tokens=max(layer.peak_device_tokens for layer in layers),
            blocks_loaded=int(counts[0]),
            bytes_to_device=int(counts[1]),
            locality=float(locality[0] / locality[1]) if locality[1] > 0 else float("nan"),
            decode_steps=first.decode_steps,
            host_bytes=sum(layer.host.nbytes() for layer in layers),
            full_kv_bytes=token_bytes * first.seen * len(layers),
            device_kv_bytes=sum(
                sum(t.numel() * t.element_size() for t in (layer.slot_k, layer.slot_v, layer.slot_b))
                + layer.compressed.keys.numel() * layer.compressed.keys.element_size()
                for layer in layers
            ),
        )
