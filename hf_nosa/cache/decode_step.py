"""The decode step of a NosaLayer: one new token per row, selection, fetch, and what the attention reads.

Two paths compute the same step. ``_decode`` is the torch reference (the CPU default): the host store's write, the
selection rules of ``rules/selection.py`` and ``plan_fetch`` + ``fetch_blocks``, as separate steps. ``_decode_fused``
runs the device kernels (``kernels/decode/block_scores.py``, ``kernels/decode/fetch.py``) with no host sync, so a CUDA
graph can capture it; ``decode_rows`` is its body for a range of rows (``cache/decode_parts.py`` runs a step a part at a
time), and ``prepare_fused_step`` / ``finish_fused_step`` are the host-side bookkeeping a captured step leaves out.
"""

from __future__ import annotations

import torch

from ..kernels.backend import kernel_path
from ..kernels.decode.block_scores import NewToken, append_token, block_select
from ..kernels.decode.fetch import SlotPool, count_share, fetch_blocks, fetch_step, plan_fetch
from ..rules.attend import AttentionInputs
from ..rules.selection import (MASK_VALUE, eviction_block_scores, favour_resident, num_windows, query_block_scores,
                               select_blocks)


class DecodePaths:
    """The decode step, mixed into ``cache.NosaLayer`` (whose state it reads: slot pool, host store, compressed
    keys, counters, ``step``, ``offset``)."""

    def _decode(self, k, v, q, b, scale) -> AttentionInputs:
        self._wait_writer()
        if kernel_path("decode_step", k) == "triton":
            return self._decode_fused(k, v, q, b, scale)
        P = self.cfg.block_size
        t = self.seen
        self._grow_layout(t + 1)
        rows_t = t - self.offset  # [B] row-relative index of the token in each row
        if self.padded:
            self.host.write_rows(t - self.offsets_host, k, v, b)
            self.host.length = t + 1
        else:
            self.host.write(t, k, v, b)
        self._store_token(k, b, t, rows_t)
        selected = self.select(q, t, scale)  # [B, Hk, K]
        plan = plan_fetch(selected, self.slot_block, self.tail_slot, new_block=rows_t % P == 0,
                          current_block=rows_t // P)
        fetch_blocks(plan, selected, self.host, self.slot_k, self.slot_v, self.slot_b)
        self.slot_block.copy_(plan.slot_block)
        self.tail_slot.copy_(plan.tail_slot)

        B, Hk = self.batch, self.kv_heads
        bi = torch.arange(B, device=self.device)[:, None]
        hi = torch.arange(Hk, device=self.device)[None, :]
        at = (rows_t % P)[:, None]
        self.slot_k[bi, hi, self.tail_slot, at] = k[:, :, 0]
        self.slot_v[bi, hi, self.tail_slot, at] = v[:, :, 0]
        self.slot_b[bi, hi, self.tail_slot, at] = b[:, :, 0]

        counts, locality = self.counters
        loaded = plan.missing.sum()
        counts[0].add_(loaded)
        counts[1].add_(loaded * self.host.block_bytes())
        if self.warm:
            count_share(locality, plan.n_resident.sum(), plan.n_selected.sum())
        self.warm = True
        self.decode_steps += 1
        S = self.n_slots
        pos = self.slot_block[..., None] * P + torch.arange(P, device=self.device)  # [B, Hk, S, P]
        valid = (self.slot_block[..., None] >= 0) & (pos <= rows_t[:, None, None, None])
        key_bias = torch.where(valid, self.slot_b[:, :, :S], MASK_VALUE).flatten(2)
        return AttentionInputs(self.slot_k[:, :, :S].flatten(2, 3), self.slot_v[:, :, :S].flatten(2, 3), key_bias,
                               None, 0, causal=False)

    def _store_token(self, k, b, t, rows_t) -> None:
        self.seen = t + 1
        n = num_windows(t + 1, self.cfg)  # at least every row's windows (rows are at t - offset)
        self.compressed.reserve(n)
        self.compressed.n = max(self.compressed.n, n)
        self.compressed.append(k, b, rows_t)
        if self.selector is not None:
            self.selector.observe(self, k, b, t)

    def _decode_fused(self, k, v, q, b, scale) -> AttentionInputs:
        """The decode step on device kernels; the attention then reads the whole slot pool.

        Three launches per layer (selection: two; fetch + tail write + host write + counters: one). No host sync:
        the token index is ``self.step`` on the device. Python-side bookkeeping sits in ``prepare_fused_step`` /
        ``finish_fused_step``, which are skipped while a CUDA graph is being captured (``modeling.cuda_graph`` runs
        them around each replay).
        """
        t = self.seen
        capturing = k.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            self.prepare_fused_step(t)
        if self.selector is None:
            inputs = self.decode_rows(k, v, q, b, scale, 0, self.batch)
        else:
            ck, cb = self.compressed.keys, self.compressed.bias
            token = NewToken(k, b, self.compressed.ring_k, self.compressed.ring_b)
            append_token(ck, cb, token, self.step, self.cfg, offsets=self.offset)
            self.selector.observe(self, k, b, t)
            selected = self.selector.select(self, q, t, scale)
            pool = SlotPool(self.slot_k, self.slot_v, self.slot_b, self.slot_block, self.tail_slot)
            fetch_step(selected, pool, self.host, k, v, b, self.step, self.counters, count_locality=self.warm,
                       offsets=self.offset)
            S = self.n_slots
            inputs = AttentionInputs(self.slot_k[:, :, :S].flatten(2, 3), self.slot_v[:, :, :S].flatten(2, 3),
                                     self.slot_b[:, :, :S].flatten(2), None, 0, causal=False)
        if not capturing:
            self.finish_fused_step(t)
        return inputs

    def decode_rows(self, k, v, q, b, scale: float, b0: int, b1: int, fetch_after=None, fetch_done=None
                    ) -> AttentionInputs:
        """The device-kernel decode step (NOSA selection) of rows ``b0 .. b1 - 1``; ``k, v, q, b`` are those rows'.

        A step may run a part of the batch at a time (``hf_nosa.cache.decode_parts``): every part reads the same step
        index, and the fetch of the last part to finish advances it. The caller runs ``prepare_fused_step`` before
        the first part and ``finish_fused_step`` after the last. ``fetch_after`` / ``fetch_done`` (CUDA events of a
        staggered step): the fetch waits for the first and records the second.
        """
        ck, cb = self.compressed.keys[b0:b1], self.compressed.bias[b0:b1]
        token = NewToken(k, b, self.compressed.ring_k[b0:b1], self.compressed.ring_b[b0:b1])
        offsets = self.offset[b0:b1]
        pool = SlotPool(self.slot_k[b0:b1], self.slot_v[b0:b1], self.slot_b[b0:b1], self.slot_block[b0:b1],
                        self.tail_slot[b0:b1])
        # read before fetch_step rewrites it: the blocks last step selected
        resident = pool.slot_block if self.cfg.resident_margin else None
        selected = block_select(q, ck, cb, self.step, self.cfg, scale, token=token, offsets=offsets,
                                resident=resident)
        if fetch_after is not None:
            torch.cuda.current_stream(k.device).wait_event(fetch_after)
        fetch_step(selected, pool, self.host, k, v, b, self.step, self.counters, count_locality=self.warm,
                   offsets=offsets, row0=b0, step_rows=self.batch)
        if fetch_done is not None:
            fetch_done.record(torch.cuda.current_stream(k.device))
        S = self.n_slots
        return AttentionInputs(pool.slot_k[:, :, :S].flatten(2, 3), pool.slot_v[:, :, :S].flatten(2, 3),
                               pool.slot_b[:, :, :S].flatten(2), None, 0, causal=False)

    def prepare_fused_step(self, t: int) -> None:
        """Host-side work before decoding token ``t`` on the device path: room in the host store, the compressed
        keys and the slot pool (all sized up front when the cache knows its length), and ``step`` set if the
        cache changed under it."""
        self._wait_writer()
        self.updates += 1  # a captured step writes the layer's buffers without calling update
        self.host.ensure_capacity(t + 1)
        self._grow_layout(t + 1)
        n = num_windows(t + 1, self.cfg)
        self.compressed.reserve(n)
        self.compressed.n = n
        if self._step_value != t:
            self.step.fill_(t)
            self._step_value = t

    def finish_fused_step(self, t: int) -> None:
        """Host-side bookkeeping after token ``t`` was decoded on the device path (no host sync)."""
        self.seen = t + 1
        self._step_value = t + 1
        self.host.mark_device_written(t + 1, self.device)
        self.decode_steps += 1
        self.warm = True

    FUSED_GRAPH_KEY_NAMES = ("slot_k", "slot_v", "slot_b", "slot_block", "tail_slot", "step", "offset",
                             "compressed.keys", "compressed.bias", "compressed.ring_k", "compressed.ring_b",
                             "host block table", "counters.counts", "counters.locality", "warm")

    def fused_graph_key(self) -> tuple:
        """Addresses and sizes a captured decode step depends on; a CUDA graph must be recaptured when they change."""
        tensors = (self.slot_k, self.slot_v, self.slot_b, self.slot_block, self.tail_slot, self.step, self.offset,
                   self.compressed.keys, self.compressed.bias, self.compressed.ring_k, self.compressed.ring_b,
                   self.host.block_table(self.device), *self.counters)
        return tuple((x.data_ptr(), tuple(x.shape)) for x in tensors) + (self.warm,)

    def select(self, query: torch.Tensor, t: int, scale: float) -> torch.Tensor:
        """NOSA selection for the decode token at cache index ``t``: ``[B, Hk, K]`` block indices (-1 = none),
        row-relative (row b's token is ``t - offset[b]``)."""
        if self.selector is not None:
            return self.selector.select(self, query, t, scale)
        positions = (t - self.offset)[:, None]  # [B, 1]
        n = self.compressed.n
        keys, bias = self.compressed.keys[:, :, :n], self.compressed.bias[:, :, :n]
        c = t // self.cfg.block_size  # blocks of the longest row; a shorter row's later blocks are no candidates
        qs = query_block_scores(query, keys, positions, c, self.cfg, scale, compressed_bias=bias)
        if self.cfg.resident_margin:  # the slot pool still holds last step's selection
            qs = favour_resident(qs, self.slot_block, self.cfg.resident_margin)
        es = eviction_block_scores(bias, positions, c, self.cfg)
        return select_blocks(qs, es, positions // self.cfg.block_size, self.cfg)[:, :, 0]
