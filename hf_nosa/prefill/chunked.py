"""QUOKA chunked prefill (design Sec. 4): which earlier blocks one prefill chunk attends to
(``quoka.quoka_select``), and how the chunk attends to them.

The prompt reaches a NosaCache one chunk of ``prefill_chunk_size`` tokens at a time: ``modeling.chunked`` sends it
through the whole model chunk by chunk, so every layer finishes chunk i before any layer sees chunk i + 1. For a
chunk and per KV head:

1. ``kernels.prefill.quoka_choice`` (``selection.quoka_query_choice`` in one launch) keeps, per query head, the
   ``quoka_queries`` queries least similar to the chunk's mean query;
2. ``kernels.prefill.quoka_score`` scores every complete block before the chunk by those queries' attention on its
   compressed keys (softmax over windows, summed over the GQA group, mean over the kept queries);
3. ``kernels.prefill.quoka_top`` (``selection.quoka_select_blocks`` in one launch) takes sink + local + the top blocks,
   ``prefill_budget_blocks`` in all;
4. the attention fetches those blocks into the slot pool (``kernels.decode.fetch.fetch_selection``: blocks kept from the
   previous chunk stay, the previous chunk's own blocks are moved in on the device, the others come from the host
   store), a part of the batch at a time so that a part's fetch overlaps the attention of the previous part
   (``attention.pool``), and the chunk attends to them plus itself (causal), with the eviction bias.

So a chunk reads at most ``prefill_budget_tokens + prefill_chunk_size`` KV tokens per (sequence, KV head)
(``stats()["device_tokens"]``), and the prompt's K/V are never on the device at once.

The exception is the prompt's tail (``prefill_dense_tail_tokens``, default one block): a row's last tokens attend
to every earlier token of that row, read from the host store. Those queries produce the first answer token, and
their keys and values are what decoding reads first (its local window); on SmolLM2 at 4K with a budget of 1/8,
QUOKA's budget in that chunk lost pass keys that dense prefill kept, even where the key's block was selected
(docs/results.md). The chunk holding them attends by QUOKA, and then the tail's queries alone attend again to the
whole prompt (``attention.prefix.DenseTail``), read once more over PCIe a prefill budget at a time
(``attention.prefix``), so the device never holds more than a budget of it.
"""

from __future__ import annotations

import torch

from ..attention.pool import PoolBlocks, fetch_parts
from ..attention.prefix import DenseTail, Prefix
from ..kernels.decode.fetch import SlotPool, fetch_selection
from ..kernels.prefill.host_write import host_write
from ..kernels.prefill.move_in import move_in
from ..rules.attend import AttentionInputs, with_prefix_read
from ..rules.devices import host_to_device
from ..rules.masks import additive_mask, padding_bias
from ..rules.padding import from_rows
from ..rules.selection import MASK_VALUE, nosa_token_mask
from .quoka import quoka_select
from .whole_prompt import quoka_chunks

_WRITERS: dict[torch.device, "torch.cuda.Stream"] = {}
# A dense-tail piece holds at most this many rows' prefill budgets: pieces are alive two or three at a time (one read
# ahead) beside the attention's copies, estimated at about 2 GB above a QUOKA chunk's peak at 38 x 4096 tokens of
# the 1b shape with budget-sized pieces (the excess of the measured 64K x 38 peak over the formula).
TAIL_PIECE_ROWS = 8


def tail_piece_tokens(budget_tokens: int, batch: int, block_size: int) -> int:
    """Tokens of the prefix a dense-tail piece reads for every row: the prefill budget up to ``TAIL_PIECE_ROWS``
    rows, proportionally fewer (whole blocks, at least one) above, so the pieces' device memory stops growing with
    the batch; the reads and the attention's work stay the same in total."""
    rows_share = TAIL_PIECE_ROWS * budget_tokens // max(batch, 1) // block_size * block_size
    return max(block_size, min(budget_tokens, rows_share))


def write_to_host(host, start: int, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, offsets=None):
    """Store tokens ``start ..`` in ``host`` (row b's at ``start - offsets[b]`` when given,
    ``kernels.prefill.host_write``); on CUDA from a side stream, so the copy overlaps the attention.

    Returns that stream (None on CPU): the caller makes its stream wait for it before anything reads the store.
    """
    if not k.is_cuda:
        host_write(host, start, k, v, b, offsets=offsets)
        return None
    main = torch.cuda.current_stream(k.device)
    writer = _WRITERS.get(k.device)
    if writer is None:
        writer = _WRITERS[k.device] = torch.cuda.Stream(k.device)
    writer.wait_stream(main)
    with torch.cuda.stream(writer):
        host_write(host, start, k, v, b, offsets=offsets)
    for t in (k, v, b):
        t.record_stream(writer)
    return writer


class PrefillPaths:
    """How a ``NosaLayer`` takes several tokens at once (mixed into it; the attributes are the layer's).

    A prompt arrives one chunk per update (``modeling.chunked``), or whole under "quoka" when it is small enough
    (``whole_prompt``: the layer cuts the same chunks); by the layer's prefill mode a chunk attends to
    every earlier token ("dense", "nosa": a device staging of the prompt) or to QUOKA's blocks fetched into the slot
    pool ("quoka"), then to itself. A prompt that continues a held sequence (a new turn) is prefilled the same way
    from the cache's length: its first chunk may start inside a block, whose earlier tokens every query of that chunk
    sees. A few tokens after a prompt (``decode_rule_tokens``) attend by the decode rule, token by token.
    """

    # ----- prefill: the prompt, one chunk per update -----

    def _prefill(self, k, v, q, b, attention_mask, scale) -> AttentionInputs:
        start, Tq = self.seen, k.shape[2]
        end = start + Tq
        target = max(self.state.prefill_end or 0, end)
        self._grow_layout(target)
        mode = self.cfg.prefill_mode(target)
        pad, attention_mask = self._prompt_padding(attention_mask, start, end)
        if pad is not None:
            b = b + pad.to(b.device)
        self._wait_writer()
        offsets = self.state.prefill_offsets
        if start == 0 and offsets is not None and offsets.numel() == self.batch and self.selector is None:
            self.host.set_limits(target - offsets)  # rows end before their padding: a quantized tail stays exact
        valid = None if pad is None or mode != "quoka" else pad[:, 0] == 0  # [B, Tq]: QUOKA's kept queries skip padding
        if mode == "quoka" and start == 0 and Tq > self.cfg.prefill_chunk(self.batch):
            # a prompt that came whole (modeling.chunked under prefill_whole_prompt_tokens): its chunks cut here
            inputs = quoka_chunks(self, k, v, q, b, valid, target)
            self.previous_chunk = None
        elif mode == "quoka":
            first_tail = self._first_tail_query(start, end, target)
            if first_tail is not None and not bool(first_tail.any()):  # every query of every row: the prefix only
                inputs = AttentionInputs(k, v, b, None, 0, causal=True, prefix=self._dense_tail_prefix(start, Tq))
            else:
                inputs = self._quoka_inputs(k, v, q, b, valid, start)
                if first_tail is not None:
                    inputs = inputs._replace(tail=DenseTail(self._dense_tail_prefix(start, Tq), first_tail))
            self._store(start, k, v, b)
            self.previous_chunk = (k, v, b, start) if end < target else None
        else:
            self._store(start, k, v, b)
            keys, values, key_bias = self._staged(k, v, b, start, target)
            mask = additive_mask(attention_mask, Tq, end, start, self.device) if attention_mask is not None else None
            if mode == "nosa":
                rule = torch.where(nosa_token_mask(q, keys, key_bias, start, self.cfg, scale), 0.0, MASK_VALUE)
                mask = rule if mask is None else mask + rule
            inputs = AttentionInputs(keys, values, key_bias, mask, start, causal=mask is None)
            self.peak_device_tokens = max(self.peak_device_tokens, end)
        if end >= target:
            if inputs.blocks is not None:  # fetched now: settling the rows below empties the slot pool
                inputs = with_prefix_read(inputs)
            self._finish_prefill(k, v, b, start)
        return inputs

    def _prompt_padding(self, attention_mask, start, end):
        """The chunk's padding as a key bias (``[B, 1, Tq]`` fp32, or None when the prompt has none) and the
        model's mask the attention still has to apply (None when the model's masks are causal only:
        ``NosaCache.begin_prefill``)."""
        padding = self.state.prefill_padding
        if padding is True:
            return padding_bias(attention_mask, start, end - start), attention_mask
        if padding is False:
            return None, None
        return torch.where(host_to_device(padding[:, start:end], self.device), 0.0, MASK_VALUE)[:, None, :], None

    def _staged(self, k, v, b, start, target):
        """Every key up to this chunk's end, on the device ("dense"/"nosa" keep the prompt's KV there while it
        is prefilled; a one-update prompt is its own staging)."""
        end = start + k.shape[2]
        if start == 0 and end >= target:
            return k, v, b
        if self.staging is None and start == 0:
            B, Hk, D = self.batch, self.kv_heads, self.head_dim
            self.staging = (k.new_empty(B, Hk, target, D), v.new_empty(B, Hk, target, D),
                            b.new_empty(B, Hk, target))
        if self.staging is None:  # a prefill continued past its planned end: earlier keys come from the host
            hk, hv, hb = self._read_counted(0, start)
            return torch.cat([hk, k], 2), torch.cat([hv, v], 2), torch.cat([hb, b], 2)
        for buffer, new in zip(self.staging, (k, v, b)):
            buffer[:, :, start:end] = new
        return tuple(buffer[:, :, :end] for buffer in self.staging)

    def _quoka_inputs(self, k, v, q, b, valid, start) -> AttentionInputs:
        selected = quoka_select(self, q, valid, start)  # [B, Hk, K]
        n_selected = selected.shape[-1]
        P = self.cfg.block_size
        lo = start // P * P
        # A continued prompt (a new turn) may start inside a block: QUOKA's candidates are the complete blocks before
        # it, so the block's earlier tokens lo .. start - 1 (fewer than a block, read from the host store) are seen
        # by every query of the chunk, as a new prompt's chunk sees its own block from its start.
        partial = self._read_counted(lo, start) if start > lo else None
        self.peak_device_tokens = max(self.peak_device_tokens, n_selected * P + (start - lo) + k.shape[2])
        if n_selected == 0:
            if partial is None:
                return AttentionInputs(k, v, b, None, 0, causal=True)
            joined = (torch.cat([x, y], 2) for x, y in zip(partial, (k, v, b)))
            return AttentionInputs(*joined, None, start - lo, causal=True)
        self._move_in_previous_chunk(start, selected)
        S = self.n_slots

        def fetch(b0: int, b1: int):
            """Rows b0 .. b1 - 1 of the pool made to hold their selection (``attention.pool``: the attention asks for
            a part of the batch at a time, and fetches the next part while it attends over this one)."""
            pool = SlotPool(self.slot_k[b0:b1], self.slot_v[b0:b1], self.slot_b[b0:b1], self.slot_block[b0:b1],
                            self.tail_slot[b0:b1])
            fetch_selection(selected[b0:b1], pool, self.host, self.counters, row0=b0)
            held = (self.slot_k[b0:b1, :, :S].flatten(2, 3), self.slot_v[b0:b1, :, :S].flatten(2, 3),
                    self.slot_b[b0:b1, :, :S].flatten(2))
            if partial is None:
                return held
            return tuple(torch.cat([x, y[b0:b1]], 2) for x, y in zip(held, partial))

        return AttentionInputs(k, v, b, None, 0, causal=True, blocks=PoolBlocks(fetch, fetch_parts(k.device, self.batch)))

    def _move_in_previous_chunk(self, start: int, selected: torch.Tensor) -> None:
        """Put the previous chunk's complete blocks that this chunk's local window holds into the slot pool, copied
        from that chunk's keys and values (still on the device) instead of fetched back over PCIe.

        Each chunk's local window gains the previous chunk's blocks (``prefill_chunk_size / block_size`` of them,
        at most ``local_blocks``), which are never resident: without this they are a third of what a 512-token
        chunk fetches (1b shape, random weights, 16K). They take slots whose block this chunk did not select
        (``selected [B, Hk, K]``: the fetch would free those; a pool of K + 1 slots has one more than the blocks to
        place), and the fetch then finds them resident. The values are the ones the host store was given, so with a
        bf16/fp32 store the chunk attends to the same keys (in other slots); with a quantized store it sees them
        unrounded. One launch on CUDA (``kernels.prefill.move_in``): the torch form took 17 per layer and chunk.
        """
        previous, self.previous_chunk = self.previous_chunk, None
        if previous is None:
            return
        k, v, b, previous_start = previous
        cfg = self.cfg
        P, L, sink = cfg.block_size, cfg.local_blocks, cfg.sink_blocks
        current = start // P  # this chunk's first block: its local window is blocks current - L .. current - 1
        first = max(-(-previous_start // P), current - L, sink)  # complete blocks of the previous chunk only
        last = min((previous_start + k.shape[2]) // P, current)
        n = last - first
        if n <= 0:
            return
        move_in(self.slot_k, self.slot_v, self.slot_b, self.slot_block, selected, k, v, b, first, n,
                first * P - previous_start)

    def _first_tail_query(self, start: int, end: int, target: int) -> torch.Tensor | None:
        """``[B]`` CPU long: per row, the first of the chunk ``start .. end``'s queries among the row's last
        ``prefill_dense_tail_tokens`` tokens (``end - start`` or more: none), or None when no row has one here. A
        row counts from its first real token and ends before its padding (``modeling.chunked`` moves padding last),
        so it gets the tail it would alone."""
        tail = self.cfg.prefill_dense_tail_tokens
        if tail == 0 or start == 0:  # the first chunk has nothing earlier to attend to
            return None
        offsets = self.state.prefill_offsets
        lengths = torch.full((self.batch,), target, dtype=torch.long)
        if offsets is not None and offsets.numel() == self.batch:
            lengths = lengths - offsets
        first = (lengths - tail - start).clamp(min=0)
        return first if bool((first < end - start).any()) else None

    def _dense_tail_prefix(self, start: int, n_queries: int) -> Prefix:
        """Every token before ``start``, read from the host store a piece at a time (at most ``TAIL_PIECE_ROWS``
        rows' prefill budgets a piece, ``tail_piece_tokens``), so the device holds one piece of them, as a QUOKA
        chunk holds its budget, whatever the prompt's length."""
        P = self.cfg.block_size
        piece = tail_piece_tokens(self.cfg.prefill_budget_blocks * P, self.batch, P)
        self.peak_device_tokens = max(self.peak_device_tokens, min(start, piece) + n_queries)
        return Prefix(self._read_counted, start, piece)

    def _finish_prefill(self, k, v, b, start) -> None:
        """The prompt is in: drop the staging, count each row from its first real token (when the prompt came
        with its padding moved to the end, ``modeling.chunked``), and leave the slot pool empty but for each row's
        partly written block."""
        self.staging = None
        self.previous_chunk = None
        offsets = self.state.prefill_offsets
        if offsets is not None and offsets.numel() == self.batch and self.selector is None:
            self._set_offsets(offsets)
        self._settle_rows((k, v, b, start))

    def row_lengths(self) -> torch.Tensor:
        """``[B]`` CPU long: tokens stored in each row (the cache length less the row's left padding)."""
        return self.seen - self.offsets_host

    def _reset_slots(self, tail_k, tail_v, tail_b) -> None:
        """Empty the slot pool but for the partly written last block, from the sequence's last tokens given
        (``[B, Hk, n, D]``, ending at ``seen``); see ``_settle_rows``."""
        self._settle_rows((tail_k, tail_v, tail_b, self.seen - tail_k.shape[2]))

    def _set_offsets(self, offsets: torch.Tensor) -> None:
        """Each row's left padding (``[B]`` CPU long): row b's token at cache index t is stored at t - offsets[b]."""
        self.offsets_host = offsets.to(torch.long).clone()
        self.offset.copy_(self.offsets_host)
        self.padded = bool(self.offsets_host.any())
        self.host.set_offsets(self.offsets_host)

    def _settle_rows(self, source=None) -> None:
        """Empty the slot pool but for each row's partly written last block, which becomes its slot 0, and refill
        each row's ring of recent tokens (rows end at different row-relative lengths in a padded batch).

        ``source``: ``(k, v, b, lo)`` holding row-relative tokens ``lo ..`` when they cover what is needed (the
        last chunk of a prompt); otherwise the tokens are read from the host store.
        """
        P = self.cfg.block_size
        lengths = self.row_lengths()
        lo = max(0, int(lengths.min()) - P)  # covers every row's last block and last compress_kernel tokens
        if source is None or source[3] > lo or source[3] + source[0].shape[2] < int(lengths.max()):
            self._wait_writer()
            source = (*self.host.read(lo, int(lengths.max()), self.device), lo)
        k, v, b, lo = source
        rows = host_to_device(lengths, self.device)
        self.compressed.set_rings(k, b, lo, rows)
        B, Hk, S, D = k.shape
        n_tail = rows % P
        index = (rows - n_tail - lo)[:, None] + torch.arange(P, device=self.device)  # [B, P]
        valid = torch.arange(P, device=self.device) < n_tail[:, None]
        index = index.clamp(0, max(S - 1, 0))[:, None, :].expand(B, Hk, P)
        self.slot_block.fill_(-1)
        self.slot_b.fill_(MASK_VALUE)
        self.tail_slot.zero_()
        self.warm = False
        if S == 0:
            return
        # torch.where, not a product: positions past a row's tokens may hold anything, NaN included
        self.slot_k[:, :, 0] = torch.where(valid[:, None, :, None], k.gather(2, index[..., None].expand(B, Hk, P, D)), 0.0)
        self.slot_v[:, :, 0] = torch.where(valid[:, None, :, None], v.gather(2, index[..., None].expand(B, Hk, P, D)), 0.0)
        self.slot_b[:, :, 0] = torch.where(valid[:, None, :], b.gather(2, index), MASK_VALUE)
        self.slot_block[:, :, 0] = torch.where(n_tail > 0, rows // P, -1)[:, None]
        if self.host.format is not None:  # its tails become these values, after the side stream's last write
            self._wait_writer()
            self.host.set_tails(self.slot_k[:, :, 0], self.slot_v[:, :, 0])

    def _read_counted(self, start: int, end: int):
        self._wait_writer()
        hk, hv, hb = self.host.read(start, end, self.device)
        self.counters.counts[1].add_(self.host.read_bytes(start, end))
        return hk, hv, hb

    def _extend_by_decode_rule(self, k, v, q, b, attention_mask, scale) -> AttentionInputs:
        """Several tokens after a prompt: each attends to what decoding it alone would select.

        The attention gets every earlier key at its cache index (rows stored row-relative are moved back, their
        padding hidden), and the decode rule counts each row from its first real token (``offsets``).
        """
        start, Tq = self.seen, k.shape[2]
        pad = padding_bias(attention_mask, start, Tq)
        if pad is not None:
            b = b + pad.to(b.device)
        lengths = self.row_lengths()
        hk, hv, hb = self._read_counted(0, int(lengths.max()))
        if self.padded:
            hk = from_rows(hk, self.offset, dim=2, fill=0.0, length=start)
            hv = from_rows(hv, self.offset, dim=2, fill=0.0, length=start)
            hb = from_rows(hb, self.offset, dim=2, fill=MASK_VALUE, length=start)
        self._grow_layout(start + Tq)
        if self.padded:
            self._writer = write_to_host(self.host, start, k, v, b, self.offset) or self._writer
            self.host.length = start + Tq
            self.compressed.extend(k, b, lengths)
            self.seen = start + Tq
            if self.selector is not None:
                self.selector.observe(self, k, b, start)
        else:
            self._store(start, k, v, b)
        keys, values, key_bias = torch.cat([hk, k], 2), torch.cat([hv, v], 2), torch.cat([hb, b], 2)
        self.peak_device_tokens = max(self.peak_device_tokens, self.seen)
        offsets = self.offset if self.padded else None
        rule = nosa_token_mask(q, keys, key_bias, start, self.cfg, scale, offsets=offsets)
        mask = torch.where(rule, 0.0, MASK_VALUE)
        if attention_mask is not None:
            mask = mask + additive_mask(attention_mask, Tq, self.seen, start, self.device)
        self._settle_rows()
        return AttentionInputs(keys, values, key_bias, mask, start, causal=False)
