"""The decode tokens of a continuous-batching step as one batched decode update per layer.

A step's decode tokens (one per running request) are independent: each request selects, fetches and attends over
its own slot pool and host store. On the device kernels they run as one update of all their rows (item 1 of
docs/serving.md's "Not done yet"): every request's slot pool, compressed keys, rings and block table are row ``r``
of the manager's shared tensors (``row_pool.RowPool``), so the requests decoding on rows ``r0 .. r1 - 1`` are one
batch of that memory (``host_rows.stack_rows``), and ``DecodePaths.decode_rows`` — the code a NosaCache of that
many rows runs — does the step once for all of them:

- lengths per row: the kernels read row b's token index as ``step - offset[b]`` (left padding); a run's step is the
  longest row's length T and row b's offset ``T - length_b``, set from the host-known lengths each step;
- host stores per row: the fetch kernel reads and writes row b's own store through a block table per row
  (``host_rows.HostRows``);
- what each request's NosaCache does around a device decode step on the host side (room in the store and the
  compressed keys before, its length, ``seen`` and ``warm`` after) is still done per request
  (``prepare_fused_step`` / ``finish_fused_step``).

Rows are batched in runs of consecutive rows with one NosaConfig (a request's budget is sized for its length) and
one ``warm`` state (the first decode step after a prompt is not counted in the locality, as alone); a run's
counters are the manager's per layer (``RequestCaches.step_counters``), so ``RequestCaches.stats`` adds them to the
requests' own. Blocks and bytes are the per-request sums; the locality of a batched update is the share of the
run's selected blocks that were resident, one step per run and layer (alone, one step per request and layer).
A request without a row (more requests than ``ServingBudget.decode_rows``) is a run of its own.

On the torch reference path (the CPU default) ``serving.attention`` keeps its request-by-request loop, which is the
reference these runs are tested against (tests/test_serving_batched.py). Which one runs is logged once.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from ..attention.dispatch import attend_cache_inputs
from ..cache.decode_step import DecodePaths
from ..kernels.backend import kernel_path
from ..kernels.decode.fetch import StepCounters
from .host_rows import HostRows, stack_rows

logger = logging.getLogger(__name__)
_logged: set[str] = set()
POOL = ("slot_k", "slot_v", "slot_b", "slot_block", "tail_slot")
COMPRESSED = ("keys", "bias", "ring_k", "ring_b")


def _log_once(what: str, message: str, *args) -> None:
    if what not in _logged:
        _logged.add(what)
        logger.info(message, *args)


def batched_decode_runs(tensor: torch.Tensor) -> bool:
    """Whether a step's decode tokens run as batched updates: where the decode step runs on the device kernels
    (``kernel_path("decode_step")``: CUDA, or ``TRITON_INTERPRET=1`` with ``HF_NOSA_KERNELS=triton``)."""
    batched = kernel_path("decode_step", tensor) == "triton"
    _log_once(f"path-{batched}", "hf_nosa serving: the decode tokens of a step run %s",
              "as one batched update per layer (device kernels)" if batched
              else "request by request (the torch reference path)")
    return batched


class _Row(SimpleNamespace):
    """A decoding request in one layer: its row, its packed position, its NosaLayer and the token's index."""


def decode_batched(requests, module, query, key, value, bias, out, decoding: list) -> list:
    """Run the decode tokens ``decoding`` (``(request_id, packed position)``) of one layer as batched updates,
    writing their outputs into ``out [1, H, N, D]``. Returns the request ids left to the request-by-request path
    (a layer with another selector than NOSA's)."""
    layer_idx = module.layer_idx
    rows, alone = [], []
    for request_id, position in decoding:
        entry, nosa = requests.cache_of(request_id)
        nosa._check_usable()
        layer = nosa.layers[layer_idx]
        if layer.selector is not None:
            alone.append(request_id)
            continue
        t = layer.seen
        # the run's step tensor is the layer's step here: its own is left as it is (and set again if it decodes alone)
        layer._step_value = t
        layer.prepare_fused_step(t)  # may give the compressed keys more room: then widened at once
        if entry.row is not None:
            _widen(requests.rows, entry.row, layer)
        rows.append(_Row(row=entry.row, position=position, layer=layer, t=t))
    rows.sort(key=lambda r: (r.row is None, r.row if r.row is not None else 0))
    runs: list[list[_Row]] = []
    for row in rows:
        last = runs[-1][-1] if runs else None
        if (last is not None and row.row is not None and last.row is not None and row.row == last.row + 1
                and row.layer.warm == last.layer.warm and row.layer.cfg == last.layer.cfg):
            runs[-1].append(row)
        else:
            runs.append([row])
    for run in runs:
        views = _views(run)
        if views is None:  # not rows of one shared memory (a bank grown for a longer request): one at a time
            _log_once("split", "hf_nosa serving: rows %s are not in one shared bank; they decode one by one",
                      [r.row for r in run])
            for row in run:
                _run(requests, module, [row], _views([row]), query, key, value, bias, out)
        else:
            _run(requests, module, run, views, query, key, value, bias, out)
    return alone


def _widen(rows, row: int, layer) -> None:
    """Move the layer's capacity buffers (compressed keys and bias, block table) to the widest bank of the manager
    (``RowPool.widest``), so a request that began beside shorter ones batches with a longer one; done once, a
    no-op after."""
    compressed, layer_idx = layer.compressed, layer.layer_idx
    keys = rows.widest(row, (layer_idx, "compressed_keys"), compressed.keys)
    bias = rows.widest(row, (layer_idx, "compressed_bias"), compressed.bias)
    if keys is not None and bias is not None:
        held = min(keys.shape[2], bias.shape[2])
        if (keys.data_ptr(), bias.data_ptr(), held) != (compressed.keys.data_ptr(), compressed.bias.data_ptr(),
                                                        compressed.keys.shape[2]):
            for new, old in ((keys, compressed.keys), (bias, compressed.bias)):
                n = old.shape[2]
                if new.data_ptr() != old.data_ptr():
                    new[:, :, :n].copy_(old)
                new[:, :, n:].zero_()
            compressed.keys, compressed.bias = keys, bias
            compressed._match_capacities()
    host = layer.host
    held = host.block_table(layer.device)  # a store that outgrew its bank's table holds a larger one of its own
    table = rows.widest(row, (layer_idx, "host_table"), held)
    if table is not None and table.data_ptr() != held.data_ptr() and table.shape[1] >= held.shape[1]:
        host._table, host._table_version = table.zero_(), -1  # refilled from the store's chunks when next read


def _views(run: list[_Row]) -> dict | None:
    """The run's slot pool, compressed keys and rings as ``[R, ...]`` views of the shared memory, or None."""
    views = {}
    for name in POOL:
        views[name] = stack_rows([getattr(r.layer, name) for r in run])
    for name in COMPRESSED:
        views[name] = stack_rows([getattr(r.layer.compressed, name) for r in run])
    if any(v is None for v in views.values()):
        return None
    try:
        views["host"] = HostRows([r.layer.host for r in run], run[0].layer.device)
    except ValueError:
        return None
    return views


def _run(requests, module, run: list[_Row], views: dict, query, key, value, bias, out) -> None:
    first = run[0].layer
    device, R = first.device, len(run)
    positions = torch.tensor([r.position for r in run], device=query.device)

    def rows_of(x):  # [1, heads, N, ...] -> the run's tokens as [R, heads, 1, ...]
        return x[0][:, positions].transpose(0, 1).unsqueeze(2).contiguous()

    q, k, v = rows_of(query), rows_of(key), rows_of(value)
    b = rows_of(bias.float())
    T = max(r.t for r in run)
    counters = requests.step_counters.get(module.layer_idx)
    if counters is None:
        counters = requests.step_counters[module.layer_idx] = StepCounters.zeros(device)
    compressed = SimpleNamespace(**{name: views[name] for name in COMPRESSED})
    batch = SimpleNamespace(
        compressed=compressed, host=views["host"], counters=counters, warm=first.warm, cfg=first.cfg, batch=R,
        n_slots=first.n_slots, step=torch.full((1,), T, dtype=torch.long, device=device),
        offset=torch.tensor([T - r.t for r in run], dtype=torch.long, device=device),
        **{name: views[name] for name in POOL})
    inputs = DecodePaths.decode_rows(batch, k, v, q, b, module.scaling, 0, R)
    out[0][:, positions] = attend_cache_inputs(q, inputs, module.scaling)[:, :, 0].transpose(0, 1)
    for r in run:
        r.layer.finish_fused_step(r.t)
        r.layer._step_value = -1  # its own step tensor was not advanced: set it again before it decodes alone
    requests.decode_runs[R] = requests.decode_runs.get(R, 0) + 1
