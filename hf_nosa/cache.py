"""NosaCache: a transformers ``Cache`` whose KV lives in host memory and whose device holds a fixed block budget.

Per layer and sequence: every token's K, V and eviction score go to the host store; the device keeps the
compressed keys of the whole sequence and a pool of ``K + 1`` slots of ``block_size`` tokens (the selected
blocks and the block being written). A decode step selects blocks (``selection.py``), fetches the missing ones
(``kernels/fetch.py``) and hands the attention the slot pool.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attend import AttentionInputs
from .config import NosaConfig
from .host_store import HostStore
from .kernels.backend import kernel_path
from .kernels.block_scores import NewToken, append_token, block_select, window_capacity_for
from .kernels.decode_attention import decode_attention
from .kernels.fetch import SlotPool, StepCounters, fetch_blocks, fetch_step, plan_fetch
from .masks import additive_mask, padding_bias
from .prefill import quoka_prefill
from .selectors import BlockSelector
from .selection import (
    MASK_VALUE,
    compress_keys,
    eviction_block_scores,
    nosa_token_mask,
    num_windows,
    query_block_scores,
    select_blocks,
)

logger = logging.getLogger(__name__)


class CompressedKeys:
    """Window means of keys and eviction scores for the whole sequence, kept on the device.

    ``keys [B, Hk, W, D]``, ``bias [B, Hk, W]``; the last ``compress_kernel`` tokens sit in a ring so that a
    window is finished the moment its last token arrives.
    """

    grow_windows = 256

    def __init__(self, cfg: NosaConfig, like_k: torch.Tensor):
        B, Hk, _, D = like_k.shape
        self.cfg = cfg
        self.keys = like_k.new_zeros(B, Hk, self.grow_windows, D)
        self.bias = torch.zeros(B, Hk, self.grow_windows, dtype=torch.float32, device=like_k.device)
        self.ring_k = like_k.new_zeros(B, Hk, cfg.compress_kernel, D)
        self.ring_b = torch.zeros(B, Hk, cfg.compress_kernel, dtype=torch.float32, device=like_k.device)
        self.n = 0

    def _reserve(self, n: int) -> None:
        if n <= self.keys.shape[2]:
            return
        extra = max(self.grow_windows, n - self.keys.shape[2])
        self.keys = torch.cat([self.keys, self.keys.new_zeros(*self.keys.shape[:2], extra, self.keys.shape[3])], 2)
        self.bias = torch.cat([self.bias, self.bias.new_zeros(*self.bias.shape[:2], extra)], 2)

    def rebuild(self, keys: torch.Tensor, bias: torch.Tensor) -> None:
        """From the full ``keys [B, Hk, T, D]`` and ``bias [B, Hk, T]`` of the sequence."""
        T, kernel = keys.shape[2], self.cfg.compress_kernel
        self.n = num_windows(T, self.cfg)
        self._reserve(self.n)
        self.keys[:, :, : self.n] = compress_keys(keys, self.cfg)
        self.bias[:, :, : self.n] = compress_keys(bias, self.cfg)
        recent = torch.arange(max(0, T - kernel), T, device=keys.device)
        self.ring_k[:, :, recent % kernel] = keys[:, :, recent]
        self.ring_b[:, :, recent % kernel] = bias[:, :, recent]

    def append(self, k: torch.Tensor, b: torch.Tensor, t: int) -> None:
        """Token ``t`` (``k [B, Hk, 1, D]``, ``b [B, Hk, 1]``) arrives; finish a window if it ends here."""
        kernel = self.cfg.compress_kernel
        self.ring_k[:, :, t % kernel] = k[:, :, 0]
        self.ring_b[:, :, t % kernel] = b[:, :, 0]
        if num_windows(t + 1, self.cfg) == self.n:
            return
        order = torch.arange(t + 1 - kernel, t + 1, device=k.device) % kernel
        self._reserve(self.n + 1)
        self.keys[:, :, self.n] = compress_keys(self.ring_k[:, :, order], self.cfg)[:, :, 0]
        self.bias[:, :, self.n] = compress_keys(self.ring_b[:, :, order], self.cfg)[:, :, 0]
        self.n += 1

    def index_batch(self, index: torch.Tensor) -> None:
        for name in ("keys", "bias", "ring_k", "ring_b"):
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.keys.device)))


class NosaLayer(CacheLayerMixin):
    """One layer's NOSA cache: host store, compressed keys and the device slot pool."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, nosa_config: NosaConfig, selector: BlockSelector | None = None):
        super().__init__()
        self.cfg = nosa_config
        self.selector = selector
        self.selector_state: dict[str, torch.Tensor] = {}
        self.seen = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.blocks_loaded = 0  # int or device tensor: accumulated without host syncs
        self.bytes_to_device = 0
        self.locality_sum = 0
        self.locality_steps = 0
        self.decode_steps = 0
        self.peak_device_tokens = 0
        self.warm = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, Hk, _, D = key_states.shape
        cfg = self.cfg
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch, self.kv_heads, self.head_dim = B, Hk, D
        pin = self.device.type == "cuda" and cfg.offload
        self.host = HostStore(B, Hk, D, key_states.dtype, cfg.block_size, pin=pin)
        self.compressed = CompressedKeys(cfg, key_states)
        S, P = cfg.budget_blocks + 1, cfg.block_size
        self.slot_k = key_states.new_zeros(B, Hk, S + 1, P, D)
        self.slot_v = value_states.new_zeros(B, Hk, S + 1, P, D)
        self.slot_b = torch.zeros(B, Hk, S + 1, P, dtype=torch.float32, device=self.device)
        self.slot_block = torch.full((B, Hk, S), -1, dtype=torch.long, device=self.device)
        self.tail_slot = torch.zeros(B, Hk, dtype=torch.long, device=self.device)
        # Device-kernel decode path: the index of the token being decoded lives on the device (advanced by the
        # fetch kernel), so a step needs no host value and can be replayed from a CUDA graph.
        self.step = torch.zeros(1, dtype=torch.long, device=self.device)
        self._step_value = 0  # what `step` holds once the queued work has run
        self.counters = StepCounters.zeros(self.device)
        self.is_initialized = True

    @property
    def n_slots(self) -> int:
        return self.cfg.budget_blocks + 1

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
    ) -> AttentionInputs | torch.Tensor:
        """Store new tokens and return what the attention reads, or, for a QUOKA prefill, the attention output.

        Args:
            key_states, value_states: ``[B, Hk, Tq, D]`` post-RoPE keys and values.
            query: ``[B, H, Tq, D]`` post-RoPE queries (for query-aware selection).
            bias: ``[B, Hk, Tq]`` eviction-head scores of the new tokens.

        Returns:
            AttentionInputs, or ``[B, H, Tq, D]`` when the update runs the chunked QUOKA prefill (the cache attends
            chunk by chunk itself, so the prompt's KV never has to be on the device at once).
        """
        if query is None or bias is None:
            raise TypeError(
                "NosaCache.update needs the query states and eviction scores: use it with a model converted by "
                "hf_nosa.to_nosa (or a NOSA checkpoint), not with stock attention."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        scale = scaling if scaling is not None else key_states.shape[-1] ** -0.5
        bias = bias.float()
        if key_states.shape[2] == 1 and self.seen > 0:
            return self._decode(key_states, value_states, query, bias, scale)
        if self.cfg.prefill_mode(self.seen + key_states.shape[2]) == "quoka":
            return quoka_prefill(self, key_states, value_states, query, bias, attention_mask, scale)
        return self._prefill(key_states, value_states, query, bias, attention_mask, scale)

    # ----- prefill: any update of several tokens (prompt, chunk, assisted-decoding candidates) -----

    def _prefill(self, k, v, q, b, attention_mask, scale) -> AttentionInputs:
        start, Tq = self.seen, k.shape[2]
        pad = padding_bias(attention_mask, start, Tq)
        if pad is not None:
            b = b + pad.to(b.device)
        self.host.write(start, k, v, b)
        if start == 0:
            keys, values, key_bias = k, v, b
        else:
            hk, hv, hb = self.host.read(0, start, self.device)
            self.bytes_to_device += sum(t.numel() * t.element_size() for t in (hk, hv, hb))
            keys, values, key_bias = torch.cat([hk, k], 2), torch.cat([hv, v], 2), torch.cat([hb, b], 2)
        self.seen = T = start + Tq
        self.peak_device_tokens = max(self.peak_device_tokens, T)
        self.compressed.rebuild(keys, key_bias)
        self._reset_slots(keys, values, key_bias)
        if self.selector is not None:
            self.selector.observe(self, keys, key_bias, 0)

        mask = additive_mask(attention_mask, Tq, T, start, self.device) if attention_mask is not None else None
        if self.cfg.prefill == "nosa":
            allowed = nosa_token_mask(q, keys, key_bias, start, self.cfg, scale)  # [B, Hk, Tq, T]
            rule = torch.where(allowed, 0.0, MASK_VALUE)
            mask = rule if mask is None else mask + rule
        return AttentionInputs(keys, values, key_bias, mask, start, causal=mask is None)

    def _reset_slots(self, keys, values, key_bias) -> None:
        """Empty the slot pool but for the partly written last block, which becomes the tail (slot 0)."""
        P, T = self.cfg.block_size, self.seen
        self.slot_block.fill_(-1)
        self.tail_slot.zero_()
        self.warm = False
        n_tail = T % P
        if n_tail:
            c = T // P
            start = T - n_tail
            offset = T - keys.shape[2]  # keys may hold only the end of the sequence
            self.slot_k[:, :, 0, :n_tail] = keys[:, :, start - offset : T - offset]
            self.slot_v[:, :, 0, :n_tail] = values[:, :, start - offset : T - offset]
            self.slot_b[:, :, 0, :n_tail] = key_bias[:, :, start - offset : T - offset]
            self.slot_block[:, :, 0] = c

    # ----- decode: one new token -----

    def _decode(self, k, v, q, b, scale) -> AttentionInputs | torch.Tensor:
        if kernel_path("decode_step", k) == "triton":
            return self._decode_fused(k, v, q, b, scale)
        P = self.cfg.block_size
        t = self.seen
        c = t // P
        self.host.write(t, k, v, b)
        self.seen = t + 1
        self.compressed.append(k, b, t)
        if self.selector is not None:
            self.selector.observe(self, k, b, t)

        selected = self.select(q, t, scale)  # [B, Hk, K]
        plan = plan_fetch(selected, self.slot_block, self.tail_slot, new_block=t % P == 0, current_block=c)
        fetch_blocks(plan, selected, self.host, self.slot_k, self.slot_v, self.slot_b)
        self.slot_block, self.tail_slot = plan.slot_block, plan.tail_slot

        # Write the new token into the tail slot.
        B, Hk = self.batch, self.kv_heads
        bi = torch.arange(B, device=self.device)[:, None]
        hi = torch.arange(Hk, device=self.device)[None, :]
        self.slot_k[bi, hi, self.tail_slot, t % P] = k[:, :, 0]
        self.slot_v[bi, hi, self.tail_slot, t % P] = v[:, :, 0]
        self.slot_b[bi, hi, self.tail_slot, t % P] = b[:, :, 0]

        self._count_step(plan)
        S = self.n_slots
        pos = self.slot_block[..., None] * P + torch.arange(P, device=self.device)  # [B, Hk, S, P]
        valid = (self.slot_block[..., None] >= 0) & (pos <= t)
        key_bias = torch.where(valid, self.slot_b[:, :, :S], MASK_VALUE).flatten(2)
        keys = self.slot_k[:, :, :S].flatten(2, 3)
        values = self.slot_v[:, :, :S].flatten(2, 3)
        return AttentionInputs(keys, values, key_bias, None, 0, causal=False)

    def _decode_fused(self, k, v, q, b, scale) -> torch.Tensor:
        """The decode step on device kernels; returns the attention output ``[B, H, 1, D]``.

        Three launches per layer (selection: two; fetch + tail write + host write + counters: one) and the
        attention (one, plus a merge when it splits the slots). No host sync: the token index is ``self.step`` on
        the device. Python-side bookkeeping sits in ``prepare_fused_step`` / ``finish_fused_step``, which are
        skipped while a CUDA graph is being captured (``kernels.cuda_graph`` runs them around each replay).
        """
        t = self.seen
        capturing = k.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            self.prepare_fused_step(t)
        ck, cb = self.compressed.keys, self.compressed.bias
        token = NewToken(k, b, self.compressed.ring_k, self.compressed.ring_b)
        if self.selector is None:
            selected = block_select(q, ck, cb, self.step, self.cfg, scale, token=token)
        else:
            append_token(ck, cb, token, self.step, self.cfg)
            self.selector.observe(self, k, b, t)
            selected = self.selector.select(self, q, t, scale)
        pool = SlotPool(self.slot_k, self.slot_v, self.slot_b, self.slot_block, self.tail_slot)
        fetch_step(selected, pool, self.host, k, v, b, self.step, self.counters, count_locality=self.warm)
        if not capturing:
            self.finish_fused_step(t)
        S = self.n_slots
        keys, values = self.slot_k[:, :, :S].flatten(2, 3), self.slot_v[:, :, :S].flatten(2, 3)
        return decode_attention(q, keys, values, self.slot_b[:, :, :S].flatten(2), scale)

    def prepare_fused_step(self, t: int) -> None:
        """Host-side work before decoding token ``t`` on the device path: room in the host store and the
        compressed keys (grown to a power of two of windows), and ``step`` set if the cache changed under it."""
        self.host.ensure_capacity(t + 1)
        n = num_windows(t + 1, self.cfg)
        if self.compressed.keys.shape[2] < n:
            self.compressed._reserve(window_capacity_for(n))
        self.compressed.n = n
        if self._step_value != t:
            self.step.fill_(t)
            self._step_value = t
        # The counters live on the device; point the attributes stats() reads at them, carrying over what the
        # prefill (or a torch-path step) counted so far.
        counts, locality = self.counters
        for name, view in (("blocks_loaded", counts[0]), ("bytes_to_device", counts[1]), ("locality_sum", locality[0])):
            current = getattr(self, name)
            if isinstance(current, torch.Tensor) and current.data_ptr() == view.data_ptr():
                continue
            if isinstance(current, torch.Tensor):
                view.copy_(current)
            else:
                view.fill_(current)
            setattr(self, name, view)

    def finish_fused_step(self, t: int) -> None:
        """Host-side bookkeeping after token ``t`` was decoded on the device path (no host sync)."""
        self.seen = t + 1
        self._step_value = t + 1
        self.host.mark_device_written(t + 1, self.device)
        self.decode_steps += 1
        if self.warm:
            self.locality_steps += 1
        self.warm = True

    def fused_graph_key(self) -> tuple:
        """Addresses and sizes a captured decode step depends on; a CUDA graph must be recaptured when they change."""
        tensors = (self.slot_k, self.slot_v, self.slot_b, self.slot_block, self.tail_slot, self.step,
                   self.compressed.keys, self.compressed.bias, self.compressed.ring_k, self.compressed.ring_b,
                   self.host.pointer_table(self.device), *self.counters)
        return tuple((x.data_ptr(), tuple(x.shape)) for x in tensors) + (self.warm,)

    def select(self, query: torch.Tensor, t: int, scale: float) -> torch.Tensor:
        """NOSA selection for the decode token at cache index ``t``: ``[B, Hk, K]`` block indices (-1 = none)."""
        c = t // self.cfg.block_size
        B, Hk, K = self.batch, self.kv_heads, self.cfg.budget_blocks
        if self.selector is not None:
            return self.selector.select(self, query, t, scale)
        if c == 0:
            return torch.full((B, Hk, K), -1, dtype=torch.long, device=self.device)
        n = self.compressed.n
        positions = torch.tensor([t], device=self.device)
        keys, bias = self.compressed.keys[:, :, :n], self.compressed.bias[:, :, :n]
        qs = query_block_scores(query, keys, positions, c, self.cfg, scale, compressed_bias=bias)
        es = eviction_block_scores(bias, positions, c, self.cfg)
        return select_blocks(qs, es, positions // self.cfg.block_size, self.cfg)[:, :, 0]

    def _count_step(self, plan) -> None:
        P, D = self.cfg.block_size, self.head_dim
        loaded = plan.missing.sum()
        block_bytes = P * (2 * D * self.slot_k.element_size() + 4)
        self.blocks_loaded = self.blocks_loaded + loaded
        self.bytes_to_device = self.bytes_to_device + loaded * block_bytes
        self.decode_steps += 1
        if self.warm:
            share = plan.n_resident.sum().float() / plan.n_selected.sum().clamp(min=1).float()
            self.locality_sum = self.locality_sum + share
            self.locality_steps += 1
        self.warm = True

    def device_tokens(self) -> int:
        """Largest number of KV tokens on the device for one (sequence, KV head) in the slot pool right now."""
        if not self.is_initialized or self.seen == 0:
            return 0
        P, t = self.cfg.block_size, self.seen - 1
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
        self._reset_counters()
        self.selector_state = {}
        for name in ("host", "compressed", "slot_k", "slot_v", "slot_b", "slot_block", "tail_slot"):
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
        self.seen = self.host.length = new_length
        keys, values, bias = self.host.read(0, new_length, self.device)
        self.bytes_to_device += sum(x.numel() * x.element_size() for x in (keys, values, bias))
        self.compressed.rebuild(keys, bias)
        self._reset_slots(keys, values, bias)
        if self.selector is not None:
            self.selector.observe(self, keys, bias, 0)

    def _index_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = index.to(self.device)
        self.host.index_batch(index)
        self.compressed.index_batch(index)
        for name in ("slot_k", "slot_v", "slot_b", "slot_block", "tail_slot"):
            setattr(self, name, getattr(self, name).index_select(0, index))
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
        selector: another block-selection rule on the same engine (see ``selectors.py``); default NOSA.

    Example:
        >>> cache = NosaCache(model.config, NosaConfig(budget_tokens=2048))  # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache)  # doctest: +SKIP
        >>> cache.stats()["locality"]  # doctest: +SKIP
    """

    def __init__(
        self, config: Any = None, nosa_config: NosaConfig | None = None, *, selector: BlockSelector | None = None, **kwargs
    ):
        if kwargs:
            raise TypeError(
                f"NosaCache got unexpected arguments {sorted(kwargs)}; expected config, nosa_config and selector"
            )
        if config is None and nosa_config is None:
            raise TypeError("NosaCache needs the model config (or at least a NosaConfig)")
        self.nosa_config = NosaConfig.from_model_config(config, nosa_config)
        text_config = config.get_text_config(decoder=True) if config is not None else None
        n_layers = getattr(text_config, "num_hidden_layers", None)
        if n_layers is not None:
            super().__init__(layers=[NosaLayer(self.nosa_config, selector) for _ in range(n_layers)])
        else:
            super().__init__(layer_class_to_replicate=lambda: NosaLayer(self.nosa_config, selector))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs) -> AttentionInputs:
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def stats(self) -> dict[str, float | int]:
        """Counters of what the cache holds and moved (one host sync).

        seen_tokens: tokens seen per sequence; host_tokens: tokens in the host store per sequence;
        device_tokens: most KV tokens ever resident on the device for one (sequence, layer, KV head), the block
        being written included; blocks_loaded / bytes_to_device: host-to-device traffic; locality: mean over
        decode steps (after the first one following a prefill) of the share of selected blocks already resident.
        """
        layers = [layer for layer in self.layers if layer.is_initialized]
        if not layers:
            return dict(seen_tokens=0, host_tokens=0, device_tokens=0, blocks_loaded=0, bytes_to_device=0,
                        locality=float("nan"), decode_steps=0, host_bytes=0, full_kv_bytes=0, device_kv_bytes=0)
        for layer in layers:
            layer.peak_device_tokens = max(layer.peak_device_tokens, layer.device_tokens())
        steps = sum(layer.locality_steps for layer in layers)
        locality = float(sum(torch.as_tensor(layer.locality_sum).item() for layer in layers) / steps) if steps else float("nan")
        first = layers[0]
        token_bytes = 2 * first.head_dim * first.slot_k.element_size() * first.kv_heads * first.batch
        return dict(
            seen_tokens=first.seen,
            host_tokens=first.host.length,
            device_tokens=max(layer.peak_device_tokens for layer in layers),
            blocks_loaded=int(sum(torch.as_tensor(layer.blocks_loaded).item() for layer in layers)),
            bytes_to_device=int(sum(torch.as_tensor(layer.bytes_to_device).item() for layer in layers)),
            locality=locality,
            decode_steps=first.decode_steps,
            host_bytes=sum(layer.host.nbytes() for layer in layers),
            full_kv_bytes=token_bytes * first.seen * len(layers),
            device_kv_bytes=sum(
                sum(t.numel() * t.element_size() for t in (layer.slot_k, layer.slot_v, layer.slot_b))
                + layer.compressed.keys.numel() * layer.compressed.keys.element_size()
                for layer in layers
            ),
        )
