"""A continuous-batching decode step of a NOSA model replayed as a CUDA graph, keyed by its batch of rows.

Once every running request decodes, a step is the same launches over and over: per layer the projections, one
batched decode update of the requests' rows (``serving.decode_batch``), the MLP; then transformers' sampling. On
an H100 at 16 requests such a step took 69 ms, 13.8 ms of it on the device: the rest was launches and Python
(docs/serving.md). ``StepGraphs`` captures that step once per batch of rows and replays it.

Where it plugs in: transformers' ``ModelRunner.compute_batch(model, batch_data)`` runs one step's forward and
sampling on the IOs' persistent buffers (the same ones its own CUDA graphs capture). ``StepGraphs.install`` puts
its ``compute_batch`` on the manager's runner instance; a step it cannot replay goes to transformers' own.

A step is replayed when every token of it is a batched decode token (no prompt piece, every request on a row)
and every layer groups the rows alike, as runs of rows with views of shared banks. Its key: the number of
tokens, the runs (rows, ``warm``, config) and what every run's views read (``decode_batch._signature``: each
tensor's memory, shape and strides; new views are made when a request's buffers change, e.g. its compressed keys
grow). The key names no request: when all of that memory is the banks' (``row_pool.RowPool``, which outlive any
request), a graph serves whichever requests hold its rows, so a request that takes a freed row replays the graph
of the batch it joins (``stats()["reused"]`` counts such replays). Rows are handed out lowest first, so a steady
stream of n requests mostly decodes on rows 0 .. n - 1, and its graphs are in effect one per batch size. A key whose
memory is partly some request's own (a buffer outgrew its bank) names those requests, and its graph goes when one
of them leaves. What changes from step to step
lives in device memory the graph reads: transformers' inputs in its IO buffers, the runs' positions, offsets and
steps in one static tensor per graph written before each replay (one host-to-device copy), the host stores'
block tables refilled in place. The host work of each request (``prepare_fused_step`` before, room in its store
and compressed keys; ``finish_fused_step`` after, its length and ``warm``) runs around the replay, for every
layer (``decode_batch.plan_whole_step`` / ``finish_whole_step``), as ``modeling.cuda_graph.DecodeGraph`` does for
``generate``.

A key is captured the second time it is seen (its first step runs eagerly and compiles every kernel variant the
capture launches); the graphs share one memory pool (they replay one at a time; what they leave for later is in
transformers' output buffer) and the ``MAX_GRAPHS`` most recently replayed are kept, less those that are some
requests' own once one of them has left. A request's first decode
step (no locality counted) or a batch that changed since the last step runs eagerly. A failed capture is logged
with its error, and the manager's later steps run eagerly (``stats()["failed"]``).

``HF_NOSA_CUDA_GRAPH=0`` or ``ContinuousBatchingConfig(use_cuda_graph=False)`` turns it off (the manager then
runs every step eagerly, the reference the graphs are tested against).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import OrderedDict
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from ..cache.graph_capture import GRAPH_ENV_VAR, capture
from .decode_batch import _device_ints, batched_decode_runs, finish_whole_step, plan_whole_step

logger = logging.getLogger(__name__)

MAX_GRAPHS = 8


class CudaGraphs:
    """Capture on CUDA: the manager's live graphs share one memory pool; thread-local capture mode (the caller's
    thread may use CUDA while the manager's thread captures).

    A pool is made anew once every graph captured into it is gone. torch's pool id is a one-way latch: when the
    last graph captured into it is freed, its use count drops to 0 but the allocator keeps the id, and the next
    capture into it fails ``TORCH_INTERNAL_ASSERT(it->second->use_count > 0)`` (CUDACachingAllocator). Graphs go
    when they are evicted (``MAX_GRAPHS``) or were some requests' own and one of those left
    (``StepGraphs._drop_released``); before graphs served the next requests on their rows, every stream where a
    request finished while others decoded hit this.

    ``new_pool`` and ``capture_into(fn, device, pool)`` default to torch's (``graph_pool_handle`` and
    ``cache.graph_capture.capture``); the tests pass ones that follow the same rule on the CPU.
    """

    def __init__(self, *, new_pool=None, capture_into=None):
        self.pool = None
        self._live = weakref.WeakSet()  # the graphs captured into ``pool`` that still exist
        self._new_pool = new_pool or torch.cuda.graph_pool_handle
        self._capture_into = capture_into or (
            lambda fn, device, pool: capture(fn, device, pool=pool, capture_error_mode="thread_local"))
        self.pools = 0  # pools made so far

    def capture(self, fn, device):
        if self.pool is None or not self._live:
            self.pool, self._live = self._new_pool(), weakref.WeakSet()
            self.pools += 1
        try:
            graph = self._capture_into(fn, device, self.pool)
        except BaseException:
            self.pool = None  # a failed capture hands its pool back (abandon_capture)
            raise
        self._live.add(graph)
        return graph


def step_graphs_wanted(device, use_cuda_graph) -> bool:
    """Whether a manager on ``device`` replays its decode steps as CUDA graphs: on CUDA, unless the caller's
    ``ContinuousBatchingConfig.use_cuda_graph`` is False or ``HF_NOSA_CUDA_GRAPH=0``."""
    return (torch.device(device).type == "cuda" and use_cuda_graph is not False
            and os.environ.get(GRAPH_ENV_VAR, "1") != "0")


class StepGraphs:
    """CUDA graphs of a NOSA manager's decode steps (module docstring).

    Args:
        requests: the manager's ``RequestCaches``.
        backend: what captures (``CudaGraphs`` by default); anything with ``capture(fn, device)`` returning an
            object with ``replay()``.
    """

    def __init__(self, requests, backend=None):
        self.requests = requests
        self.backend = backend if backend is not None else CudaGraphs()
        self.graphs: OrderedDict = OrderedDict()  # key -> SimpleNamespace(graph, ints, plan), last replayed last
        self._seen: dict = {}  # the keys whose first step ran eagerly (ids in a key are never reused)
        self.captures = self.replays = self.eager_steps = 0
        self.reused = 0  # replays for requests other than those a graph was captured with (on the same rows)
        self.failed: str | None = None
        self.runner = None
        self._requests_seen: set = set()  # the requests admitted when the graphs were last pruned

    def install(self, runner) -> None:
        """Put ``compute_batch`` on ``runner`` (transformers' ``ModelRunner``, this manager's own instance)."""
        if getattr(runner, "nosa_step_graphs", None) is self:
            return
        self.runner, self._stock = runner, runner.compute_batch
        runner.compute_batch = self.compute_batch
        runner.nosa_step_graphs = self

    def stats(self) -> dict:
        return dict(captures=self.captures, replays=self.replays, reused=self.reused,
                    eager_decode_steps=self.eager_steps, graphs=len(self.graphs),
                    pools=getattr(self.backend, "pools", None), failed=self.failed)

    def compute_batch(self, model, batch_data: dict) -> None:
        """transformers' ``ModelRunner.compute_batch``: a decode step replays its graph where it can."""
        requests = self.requests
        if self.failed is not None or not batched_decode_runs(batch_data["input_ids"]):
            return self._stock(model, batch_data)  # the torch reference path decodes request by request
        if (self.graphs or self._seen) and requests.entries.keys() != self._requests_seen:
            self._drop_released()
        step = plan_whole_step(requests)
        if step is None:
            return self._stock(model, batch_data)
        device = batch_data["input_ids"].device
        if step.key is None or step.key not in self.graphs and step.key not in self._seen:
            if step.key is not None:
                if len(self._seen) >= 4 * MAX_GRAPHS:
                    self._seen.clear()
                self._seen[step.key] = None
            return self._eager(model, batch_data, step, device)
        entry = self.graphs.get(step.key)
        if entry is None:
            entry = self._capture(model, batch_data, step, device)
            if entry is None:
                return self._eager(model, batch_data, step, device)
        self.graphs.move_to_end(step.key)
        runner = self.runner
        stream = runner.inputs_and_outputs.compute_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            entry.ints.copy_(_pinned(step.host, entry.ints.device), non_blocking=True)
            entry.plan.source = requests.plan  # what the layers look up (a graph reads the captured views)
            requests.decode_step_plan = entry.plan
            entry.graph.replay()
        finish_whole_step(requests, step)
        self.replays += 1
        self.reused += _request_ids(step) != entry.requests

    def _drop_released(self) -> None:
        """Drop the graphs that are some requests' own (they read memory outside the banks) once one of those has
        left (finished, cancelled): they would never replay again, and their records hold its buffers alive. A
        graph of the banks' rows stays for the next requests on those rows."""
        live = self.requests.entries.keys()
        for keys in (self.graphs, self._seen):
            for key in [key for key in keys if any(rid not in live for rid in key[3])]:
                del keys[key]
        self._requests_seen = set(live)

    def _eager(self, model, batch_data, step, device) -> None:
        """The step on transformers' path, its layers on ``step``'s plan (prepared already)."""
        requests = self.requests
        plan = step.plan(_device_ints(step.host, device), captured=False)
        plan.source = requests.plan
        requests.decode_step_plan = plan
        self.eager_steps += step.key is not None
        return self._stock(model, batch_data)

    def _capture(self, model, batch_data, step, device):
        """Capture ``step``'s forward and sampling (transformers' ``_forward_process_and_sample`` on its buffers);
        None after a failed capture, which turns the graphs off for the manager (logged)."""
        runner, requests = self.runner, self.requests
        if runner.supports_logits_to_keep(model):  # as transformers' compute_batch does before its forward
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        cb_kwargs = runner.inputs_and_outputs.get_cb_kwargs()
        ints = torch.empty(len(step.host), dtype=torch.long, device=device)
        plan = step.plan(ints, captured=True)
        plan.source = requests.plan
        requests.decode_step_plan = plan
        try:
            graph = self.backend.capture(lambda: runner._forward_process_and_sample(model, batch_data, *cb_kwargs),
                                         device)
        except Exception as error:  # the process is usable again (cache.graph_capture.capture); go on eagerly
            self.failed = f"{type(error).__name__}: {error}"
            self.graphs.clear()
            logger.warning("NOSA serving: capturing a decode step as a CUDA graph failed (%s); this manager's steps "
                           "run eagerly from now on.", self.failed)
            return None
        self.captures += 1
        entry = self.graphs[step.key] = SimpleNamespace(graph=graph, ints=ints, plan=plan, requests=_request_ids(step))
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return entry


def _request_ids(step) -> tuple:
    return tuple(r.request_id for run in step.runs for r in run)


def _pinned(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a host long tensor, pinned when it goes to CUDA (the copy then waits for nothing)."""
    return torch.tensor(values, dtype=torch.long, pin_memory=torch.device(device).type == "cuda")
