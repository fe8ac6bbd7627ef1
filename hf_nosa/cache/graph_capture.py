"""Capturing a CUDA graph, and leaving the process usable when a capture fails.

``capture`` records a function into a CUDA graph on its own stream; when the capture raises (an operation not
permitted while capturing, e.g. a host sync), ``abandon_capture`` ends it, restores the caller's stream, hands the
memory pool back and repairs the default CUDA generator, so the caller can go on eagerly. Used by ``generate``'s
decode graph (``modeling.cuda_graph``) and the serving manager's step graphs (``serving.step_graph``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# "0" replays no CUDA graph: generate's decode steps (modeling.chunked) and a serving manager's (serving.step_graph)
# run eagerly, the reference the graphs are tested against
GRAPH_ENV_VAR = "HF_NOSA_CUDA_GRAPH"


def capture(fn, device: torch.device, *, pool=None, capture_error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """``fn()`` captured into a new CUDA graph on its own stream, in memory ``pool`` (a new one by default); when
    capturing raises, the process is repaired (``abandon_capture``) before the error propagates.
    ``capture_error_mode``: torch's (``"thread_local"`` where other threads use CUDA meanwhile, as a serving
    manager's caller does)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        graph = torch.cuda.CUDAGraph()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream, caller = torch.cuda.Stream(index), torch.cuda.current_stream(index)
        torch.cuda.synchronize(index)
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
                fn()
        except BaseException:
            abandon_capture(graph, stream=stream, caller=caller, pool=pool)
            raise
    return graph


def abandon_capture(graph: torch.cuda.CUDAGraph, *, stream: torch.cuda.Stream, caller: torch.cuda.Stream, pool,
                    repair_rng: bool = True) -> None:
    """Leave the process usable after capturing ``graph`` (begun on ``stream`` with memory ``pool``) raised.

    Why: when a capture is invalidated (an operation not permitted while capturing, e.g. a host sync), torch's
    ``CUDAGraph.capture_end`` throws at ``cudaStreamEndCapture`` and skips the rest of its work, and
    ``torch.cuda.graph.__exit__`` then skips restoring the stream. Left as is: (1) the caller keeps running on the
    capture stream; (2) the caching allocator still counts the capture as underway, so it never again recycles
    memory that was used on two streams (the prefill's host-to-device writer stream does that); (3) in torch
    versions that flag the generator state while capturing (2.11 does), ``capture_epilogue`` never runs on the
    default CUDA generator of the device, and every later CUDA random op (``torch.rand``, ``nn.Linear``'s
    initialisation) fails with "Offset increment outside graph capture encountered unexpectedly". This ends any
    capture still open, restores ``caller``, ends and hands back the pool if ``capture_end`` did not, resets the
    graph, and repairs the generator (``_repair_default_generator``). The pinned-host allocator's pool (newer torch)
    has no Python hook to end it; it only routes pinned allocations of the dead capture, which no stream matches.

    Raises:
        RuntimeError: the stream is still capturing after ``cudaStreamEndCapture`` (CUDA is unusable then), or the
            generator cannot be repaired.
    """
    index = stream.device.index
    with torch.cuda.stream(stream):
        if torch.cuda.is_current_stream_capturing():
            try:  # cudaStreamEndCapture ends the capture even when it reports it invalidated
                graph.capture_end()
            except RuntimeError:
                pass
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("NOSA decode: a failed CUDA graph capture could not be ended; its stream still "
                                   "captures, so this process cannot use CUDA any more.")
    torch.cuda.set_stream(caller)
    try:
        graph.pool()  # only answers after a completed capture_end, whose pool graph.reset() hands back
    except RuntimeError:
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        release = getattr(torch._C, "_cuda_releasePool", None)
        if end is not None and release is not None:
            try:
                end(index, pool)
            except RuntimeError:  # not routed to the pool: capture_begin failed before, or capture_end ended it
                pass
            else:
                release(index, pool)
    graph.reset()
    if repair_rng:
        _repair_default_generator(index)


def _rng_usable(index: int) -> bool:
    """Whether a random op on the default generator of ``cuda:index`` runs; its seed and offset are put back."""
    gen = torch.cuda.default_generators[index]
    saved = gen.get_state()
    try:
        torch.empty(1, device=f"cuda:{index}").uniform_()
        return True
    except RuntimeError:
        return False
    finally:
        gen.set_state(saved)


def _repair_default_generator(index: int) -> None:
    """Clear the "capturing" flag a failed capture left on the default CUDA generator of ``cuda:index``, keeping its
    seed and offset (see ``abandon_capture``). First a small capture that completes: its ``capture_begin`` /
    ``capture_end`` run the prologue and epilogue on the same generator state object, which also heals graphs
    captured earlier that share it. If that fails, the generator is pointed at a fresh state with the same seed and
    offset (``graphsafe_set_state``)."""
    if _rng_usable(index):
        return
    device = torch.device("cuda", index)
    x = torch.zeros(1, device=device)
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    stream, caller = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            x.add_(1)
    except RuntimeError as error:
        logger.warning("NOSA decode: repairing the CUDA generator with a small capture failed (%s); "
                       "swapping in a fresh generator state instead.", error)
        abandon_capture(graph, stream=stream, caller=caller, pool=pool, repair_rng=False)
    del graph
    if _rng_usable(index):
        return
    gen = torch.cuda.default_generators[index]
    fresh = torch.Generator(device=device)
    fresh.set_state(gen.get_state())
    gen.graphsafe_set_state(fresh.graphsafe_get_state())
    if not _rng_usable(index):
        raise RuntimeError(f"NOSA decode: the default CUDA generator of {device} still fails after a failed CUDA "
                           "graph capture; random ops on that device will fail in this process.")
