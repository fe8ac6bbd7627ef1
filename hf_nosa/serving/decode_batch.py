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

Which requests decode, their rows and packed positions, the runs and their offsets are the same in every layer of
a step's forward, so they are planned once per step (``plan_step``, FlashInfer's plan/run split): at the first
layer, from that layer's state, with every run's device tensors (positions, offsets, a step per layer, since a
layer's fetch advances its step) in one host-to-device copy; kept on ``RequestCaches.decode_step_plan`` for the
step's plan list (``RequestCaches.plan``, a new list each step). Each layer then does only its own work: each
request's ``prepare_fused_step`` / ``finish_fused_step``, its rows' views of that layer's banks, the update. A
layer whose rows would group otherwise (not seen: every layer of a request decodes in step) is regrouped alone.

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
    """A decoding request in one layer: its id, row, packed position, NosaLayer and the token's index ``t``."""


class _PlannedRun(SimpleNamespace):
    """A run of the step's plan: its requests in row order (``ids``, packed ``at`` positions, token indices
    ``ts``), the ``warm`` and ``cfg`` its rows share, and its device tensors: ``positions`` (packed positions),
    ``offset`` (``T - t`` per row, T the run's longest) and ``steps`` (``[n_layers]``, each T: a layer's fetch
    advances its own)."""


class StepPlan(SimpleNamespace):
    """The decode tokens of one continuous-batching step as runs of rows, the same in every layer of the step's
    forward: built at its first layer from that layer's state (``plan_step``), read by every layer after; or for
    every layer before the forward (``plan_whole_step``, ``whole``), when the step may replay a CUDA graph.
    ``source`` is the ``RequestCaches.plan`` it was built for (a new list each step); ``prepared`` the rows of the
    layers it was built at (layer -> rows), already through ``prepare_fused_step`` (each dropped once that layer
    has run it); ``captured`` (a graph's plan only): per layer and run, the views and first row the captured step
    reads, so the layers run no host work (``serving.step_graph`` runs it around the replay)."""


def decode_tokens(requests, layer_idx: int) -> list[tuple[str, int]]:
    """``(request_id, packed position)`` of the plan's decode tokens: one token after a finished prompt, continuing
    what the request's cache holds (anything else stays on the request-by-request path, which checks it)."""
    decoding, offset = [], 0
    for request_id, past, length in requests.plan:
        entry = requests.entries.get(request_id)
        if (length == 1 and entry is not None and entry.cache is not None and not entry.prefilling
                and 0 < entry.prompt_length <= past and entry.cache.state.prefill_end is None
                and entry.cache.get_seq_length(layer_idx) == past):
            decoding.append((request_id, offset))
        offset += length
    return decoding


def step_plan(requests, layer_idx: int, device) -> StepPlan:
    """The step's plan: built at the forward's first layer (layer 0, or any layer that finds the plan of an earlier
    step), kept on ``requests.decode_step_plan`` for the other layers."""
    plan = getattr(requests, "decode_step_plan", None)
    if plan is None or plan.source is not requests.plan or (layer_idx == 0 and not plan.whole):
        plan = requests.decode_step_plan = plan_step(requests, layer_idx, device)
    return plan


def plan_step(requests, layer_idx: int, device) -> StepPlan:
    """Which requests decode this step, on which rows, in which runs, and the runs' device tensors: once per step.

    Rows are grouped as layer ``layer_idx`` holds them after its ``prepare_fused_step`` (run here, so that layer's
    capacities are the ones grouped; ``decode_batched`` does not run it again). Every run's positions, offsets and
    per-layer steps are one host-to-device copy for the whole step (from pinned memory, non-blocking, on CUDA)."""
    rows = _layer_rows(requests, layer_idx, [(rid, at, None) for rid, at in decode_tokens(requests, layer_idx)])
    runs = _group(rows)
    host = plan_ints(runs, requests.n_layers)
    planned = _planned_runs(runs, _device_ints(host, device) if host else None, requests.n_layers)
    return StepPlan(source=requests.plan, runs=planned, prepared={layer_idx: rows}, whole=False, captured=None)


def plan_ints(runs: list[list[_Row]], n_layers: int) -> list[int]:
    """The runs' device integers, run after run: packed positions, offsets (``T - t``, T the run's longest) and
    ``n_layers`` steps (each T)."""
    host = []
    for run in runs:
        T = max(r.t for r in run)
        host += [r.position for r in run] + [T - r.t for r in run] + [T] * n_layers
    return host


def _planned_runs(runs: list[list[_Row]], ints: torch.Tensor | None, n_layers: int) -> list[_PlannedRun]:
    """The runs of a plan, their tensors slices of ``ints`` (laid out by ``plan_ints``)."""
    planned, i = [], 0
    for run in runs:
        R = len(run)
        planned.append(_PlannedRun(
            ids=[r.request_id for r in run], at=[r.position for r in run], ts=[r.t for r in run],
            warm=run[0].layer.warm, cfg=run[0].layer.cfg, positions=ints[i:i + R], offset=ints[i + R:i + 2 * R],
            steps=ints[i + 2 * R:i + 2 * R + n_layers]))
        i += 2 * R + n_layers
    return planned


class WholeStep(SimpleNamespace):
    """A decode-only step planned for every layer before its forward (``plan_whole_step``): ``layer_rows`` (per
    layer, through ``prepare_fused_step``), ``runs`` (layer 0's, as ``_Row`` lists), ``host`` (``plan_ints``) and,
    when every layer groups its rows as layer 0 and every run has views of shared banks, ``views`` (per layer and
    run, the ``_cached_views`` dicts) and ``key`` (what a captured step of it depends on); else ``key`` is None."""

    def plan(self, ints: torch.Tensor, *, captured: bool) -> StepPlan:
        """The step's ``StepPlan`` over ``ints`` (its device integers); ``captured``: the layers read the recorded
        views and run no host work (a graph's capture, and its replays); else each layer runs its prepared rows."""
        record = None
        if captured:  # what the captured launches read: the views, and the first row's settings (not its layer)
            record = [[(views, _settings(run[0].layer)) for views, run in zip(layer_views, self.runs)]
                      for layer_views in self.views]
        return StepPlan(source=None, runs=_planned_runs(self.runs, ints, len(self.layer_rows)),
                        prepared=None if captured else dict(enumerate(self.layer_rows)), whole=True, captured=record)


def plan_whole_step(requests) -> WholeStep | None:
    """The step planned before its forward, for every layer, when every token of it is a batched decode token
    (one token after a finished prompt on a request with a row); None otherwise (the step runs eagerly and plans
    at its first layer). Runs every layer's ``prepare_fused_step`` of the step's rows: the plan must then be the
    one the step's forward uses (``WholeStep.plan``), and ``finish_whole_step`` ends it after the forward."""
    tokens = decode_tokens(requests, 0)
    if not tokens or len(tokens) != len(requests.plan):
        return None
    if any(requests.entries[rid].row is None for rid, _ in tokens):
        return None
    first = _layer_rows(requests, 0, [(rid, at, None) for rid, at in tokens])
    wanted = [(r.request_id, r.position, r.t) for r in first]
    layer_rows = [first] + [_layer_rows(requests, i, wanted) for i in range(1, requests.n_layers)]
    runs = _group(first)
    step = WholeStep(layer_rows=layer_rows, runs=runs, host=plan_ints(runs, requests.n_layers), views=None,
                     key=None)
    # every layer groups its rows as layer 0 when each row has layer 0's request, row, warm state and config (a
    # request's layers decode in step): checked row by row, the runs taken by layer 0's positions, not regrouped
    where = {id(r): j for j, r in enumerate(first)}
    order = [[where[id(r)] for r in run] for run in runs]
    views = []
    for i, rows in enumerate(layer_rows):
        if i and not _grouped_alike(rows, first):
            return step
        layer_runs = [[rows[j] for j in run] for run in order]
        layer_views = [_cached_views(requests, i, run) for run in layer_runs]
        if any(v is None for v in layer_views):
            return step
        views.append(layer_views)
    step.views = views
    configs = tuple(repr(run[0].layer.cfg) for run in runs)
    signatures = [_signature(requests, v) for layer_views in views for v in layer_views]
    # in the banks only: any requests on these rows read the same memory, so the step's graph serves them; else the
    # graph is these requests' own
    owners = () if all(shared for _, shared in signatures) else tuple(r.request_id for r in first)
    rows = tuple((tuple(r.row for r in run), run[0].layer.warm) for run in runs)
    step.key = (len(tokens), rows, configs, owners, tuple(view_id for view_id, _ in signatures))
    return step


def _settings(layer) -> SimpleNamespace:
    """What ``_run_device`` reads of a run's first layer besides its views (a captured step's record keeps these, not
    the layer of a request that may leave while the graph serves the next ones on its rows)."""
    return SimpleNamespace(device=layer.device, warm=layer.warm, cfg=layer.cfg, n_slots=layer.n_slots)


SIGNATURE = "signature"  # a views dict's key for its ``_signature``


def _signature(requests, views: dict) -> tuple[int, bool]:
    """What a captured update reads through a run's views: every tensor's memory (storage address and offset),
    shape, strides and dtype, and the host rows' layout. Returns an id for it (equal ids: the same memory, read the
    same way) and whether all of it lies in the manager's banks (``RowPool.in_banks``), which outlive any request.
    Kept on the views dict, which is rebuilt when a row's buffers change."""
    found = views.get(SIGNATURE)
    if found is None:
        host = views["host"]
        tensors = [views[name] for name in POOL + COMPRESSED] + [host.table]
        read = tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                     for t in tensors)
        read += ((host.block_size, host.host_dtype, repr(host.format), host.kv_heads, host.head_dim, host.dtype,
                  host.pin),)
        view_id = requests.view_ids.get(read)
        if view_id is None:
            if len(requests.view_ids) >= 4096:  # a long stream's old signatures (ids are never reused)
                requests.view_ids.clear()
            view_id = requests.view_ids[read] = requests.next_view_id
            requests.next_view_id += 1
        found = views[SIGNATURE] = (view_id, all(requests.rows.in_banks(t) for t in tensors))
    return found


def _grouped_alike(rows: list[_Row], first: list[_Row]) -> bool:
    """Whether ``rows`` (one layer's) are ``first``'s requests on the same rows, in the same order, each with the
    same ``warm`` state and config as there: then ``_group`` would make the same runs of them."""
    if len(rows) != len(first):
        return False
    for a, b in zip(rows, first):
        la, lb = a.layer, b.layer
        if (a.request_id != b.request_id or a.row != b.row or la.warm != lb.warm
                or (la.cfg is not lb.cfg and la.cfg != lb.cfg)):
            return False
    return True


def finish_whole_step(requests, step: WholeStep) -> None:
    """After a captured step's replay: each row's ``finish_fused_step`` in every layer, and the counts of its
    batched updates (what ``_run`` does after an eager update)."""
    for rows in step.layer_rows:
        for r in rows:
            r.layer.finish_fused_step(r.t)
            r.layer._step_value = -1
        for run in step.runs:
            requests.decode_runs[len(run)] = requests.decode_runs.get(len(run), 0) + 1


def _device_ints(values: list[int], device) -> torch.Tensor:
    """``values`` as one long tensor on ``device``: one copy, from pinned memory without a host wait on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=torch.long, device=device)


def _layer_rows(requests, layer_idx: int, wanted: list) -> list[_Row]:
    """The layer's rows of the requests ``wanted`` (``(request_id, packed position, t or None)``), each through its
    ``prepare_fused_step``; a request whose layer has another selector than NOSA's, or holds another length than
    ``t``, is left out (the request-by-request path runs and checks it)."""
    rows = []
    for request_id, position, expected in wanted:
        entry, nosa = requests.cache_of(request_id)
        nosa._check_usable()
        layer = nosa.layers[layer_idx]
        t = layer.seen
        if layer.selector is not None or (expected is not None and t != expected):
            continue
        # the run's step tensor is the layer's step here: its own is left as it is (and set again if it decodes alone)
        layer._step_value = t
        layer.prepare_fused_step(t)  # may give the compressed keys more room: then widened at once
        if entry.row is not None:
            _widen(requests.rows, entry.row, layer)
        rows.append(_Row(request_id=request_id, row=entry.row, position=position, layer=layer, t=t))
    return rows


def _group(rows: list[_Row]) -> list[list[_Row]]:
    """Runs of consecutive rows with one ``warm`` state and one NosaConfig; a request without a row is its own."""
    rows = sorted(rows, key=lambda r: (r.row is None, r.row if r.row is not None else 0))
    runs: list[list[_Row]] = []
    for row in rows:
        last = runs[-1][-1] if runs else None
        if (last is not None and row.row is not None and last.row is not None and row.row == last.row + 1
                and row.layer.warm == last.layer.warm
                and (row.layer.cfg is last.layer.cfg or row.layer.cfg == last.layer.cfg)):
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def decode_batched(requests, module, query, key, value, bias, out) -> set:
    """Run the step's decode tokens through layer ``module.layer_idx`` as batched updates, writing their outputs
    into ``out [1, H, N, D]``. Returns the ids of the requests it decoded; any other decode token of the step (a
    layer with another selector than NOSA's, a request out of step) is left to the request-by-request path."""
    layer_idx = module.layer_idx
    plan = step_plan(requests, layer_idx, key.device)
    if plan.captured is not None:  # a CUDA graph's step: device work only, on the views the plan recorded
        for run, (views, first) in zip(plan.runs, plan.captured[layer_idx]):
            _run_device(requests, module, views, first, run.positions, run.offset,
                        run.steps[layer_idx:layer_idx + 1], query, key, value, bias, out)
        # a whole decode step: every request of this step's plan decoded, whichever requests the plan was recorded
        # with (a graph of the banks' rows replays for the next requests on them)
        return {rid for rid, _, length in requests.plan if length}
    rows = plan.prepared.pop(layer_idx, None) if plan.prepared else None  # already through prepare_fused_step
    if rows is None:
        rows = _layer_rows(requests, layer_idx, [(rid, at, t) for run in plan.runs
                                                 for rid, at, t in zip(run.ids, run.at, run.ts)])
    by_id = {r.request_id: r for r in rows}
    done, left = set(), []
    for run in plan.runs:
        layer_rows = [by_id.get(rid) for rid in run.ids]
        if all(r is not None and r.layer.warm == run.warm and (r.layer.cfg is run.cfg or r.layer.cfg == run.cfg)
               for r in layer_rows):
            step = run.steps[layer_idx:layer_idx + 1]
            _run(requests, module, layer_rows, run.positions, run.offset, step, query, key, value, bias, out)
            done.update(run.ids)
        else:
            left += [r for r in layer_rows if r is not None]
    if left:  # this layer's rows group otherwise than the plan's: grouped for this layer alone (not seen so far)
        _log_once("regroup", "hf_nosa serving: layer %d's decode rows differ from the step's plan; regrouped there",
                  layer_idx)
        for run in _group(left):
            _run_alone(requests, module, run, query, key, value, bias, out)
            done.update(r.request_id for r in run)
    return done


def _widen(rows, row: int, layer) -> None:
    """Move the layer's capacity buffers (compressed keys and bias, block table) to the widest bank of the manager
    (``RowPool.widest``), so a request that began beside shorter ones batches with a longer one; done once, a
    no-op after."""
    compressed, layer_idx, host = layer.compressed, layer.layer_idx, layer.host
    done = layer.__dict__.get("_widened")  # what it was done for: nothing changed since, nothing to do
    if (done is not None and done[0] is rows and done[1] == rows.version and done[2] is compressed.keys
            and done[3] is compressed.bias and done[4] is host._table and done[5] == host._version):
        return
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
    held = host.block_table(layer.device)  # a store that outgrew its bank's table holds a larger one of its own
    table = rows.widest(row, (layer_idx, "host_table"), held)
    if table is not None and table.data_ptr() != held.data_ptr() and table.shape[1] >= held.shape[1]:
        host._table, host._table_version = table.zero_(), -1  # refilled from the store's chunks when next read
        host.block_table(layer.device)
    layer._widened = (rows, rows.version, compressed.keys, compressed.bias, host._table, host._version)


def _held(layer) -> tuple:
    """The buffers of ``layer`` a run's views are made of (``_unchanged`` reads them in this order)."""
    compressed, host = layer.compressed, layer.host
    return (layer, layer.slot_k, layer.slot_v, layer.slot_b, layer.slot_block, layer.tail_slot, compressed.keys,
            compressed.bias, compressed.ring_k, compressed.ring_b, host, host._table)


def _unchanged(held: list[tuple], run: list[_Row]) -> bool:
    """Whether every row of ``run`` still holds the buffers ``held`` (by identity: a buffer that grows or moves to a
    wider bank is a new tensor) and its host block table is up to date (it is refilled in place). Written out: this
    runs for every row of every layer of every step."""
    for r, h in zip(run, held):
        layer = r.layer
        c, host = layer.compressed, layer.host
        if (h[0] is not layer or h[1] is not layer.slot_k or h[2] is not layer.slot_v or h[3] is not layer.slot_b
                or h[4] is not layer.slot_block or h[5] is not layer.tail_slot or h[6] is not c.keys
                or h[7] is not c.bias or h[8] is not c.ring_k or h[9] is not c.ring_b or h[10] is not host
                or h[11] is not host._table or host._table_version != host._version):
            return False
    return True


def _cached_views(requests, layer_idx: int, run: list[_Row]) -> dict | None:
    """``_views(run)``, kept per layer and rows on ``requests.run_views`` while the rows hold the same buffers
    (``_unchanged``), so a step builds the views of a run only when its requests or their buffers changed: at 16
    rows, building them (stack_rows on every buffer of every row, HostRows' checks) took as long as the rest of the
    layer's host work (CPU, tiny Llama, kernels stubbed)."""
    cache = requests.run_views
    key = (layer_idx, tuple(r.row for r in run))
    found = cache.get(key)
    if found is not None and len(found[0]) == len(run) and _unchanged(found[0], run):
        return found[1]
    views = _views(run)
    if views is not None:
        if len(cache) >= 4 * max(requests.n_layers, 1):  # runs come and go with requests: keep the recent ones
            cache.pop(next(iter(cache)))
        cache[key] = ([_held(r.layer) for r in run], views)
    return views


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


def _run_alone(requests, module, run: list[_Row], query, key, value, bias, out) -> None:
    """A run that is not the plan's: its tensors built here."""
    T, R = max(r.t for r in run), len(run)
    ints = _device_ints([r.position for r in run] + [T - r.t for r in run] + [T], key.device)
    _run(requests, module, run, ints[:R], ints[R:2 * R], ints[2 * R:], query, key, value, bias, out)


def _run(requests, module, run: list[_Row], positions, offset, step, query, key, value, bias, out) -> None:
    """One batched update of the run's rows: ``positions`` (packed), ``offset`` (per row) and ``step`` (``[1]``,
    advanced by the fetch) on the device."""
    views = _cached_views(requests, module.layer_idx, run)
    if views is None:  # not rows of one shared memory (a bank grown for a longer request): one at a time
        _log_once("split", "hf_nosa serving: rows %s are not in one shared bank; they decode one by one",
                  [r.row for r in run])
        for row in run:
            if _views([row]) is None:
                raise RuntimeError(f"NOSA serving: request {row.request_id}'s buffers in layer {module.layer_idx} "
                                   "are no row of a batch; this is a bug.")
            _run_alone(requests, module, [row], query, key, value, bias, out)
        return
    _run_device(requests, module, views, run[0].layer, positions, offset, step, query, key, value, bias, out)
    for r in run:
        r.layer.finish_fused_step(r.t)
        r.layer._step_value = -1  # its own step tensor was not advanced: set it again before it decodes alone
    requests.decode_runs[len(run)] = requests.decode_runs.get(len(run), 0) + 1


def _run_device(requests, module, views: dict, first, positions, offset, step, query, key, value, bias, out) -> None:
    """The device work of one batched update (no host sync, nothing per request: what a CUDA graph captures):
    the run's tokens gathered from the packed step, ``DecodePaths.decode_rows`` on the run's views (``first`` is
    its first row's layer: config, warm, slot count), the outputs scattered back."""
    R = positions.shape[0]

    def rows_of(x):  # [1, heads, N, ...] -> the run's tokens as [R, heads, 1, ...]
        return x[0][:, positions].transpose(0, 1).unsqueeze(2).contiguous()

    q, k, v = rows_of(query), rows_of(key), rows_of(value)
    b = rows_of(bias).float()
    counters = requests.step_counters.get(module.layer_idx)
    if counters is None:
        counters = requests.step_counters[module.layer_idx] = StepCounters.zeros(first.device)
    compressed = SimpleNamespace(**{name: views[name] for name in COMPRESSED})
    batch = SimpleNamespace(
        compressed=compressed, host=views["host"], counters=counters, warm=first.warm, cfg=first.cfg, batch=R,
        n_slots=first.n_slots, step=step, offset=offset, **{name: views[name] for name in POOL})
    inputs = DecodePaths.decode_rows(batch, k, v, q, b, module.scaling, 0, R)
    out[0][:, positions] = attend_cache_inputs(q, inputs, module.scaling)[:, :, 0].transpose(0, 1)
