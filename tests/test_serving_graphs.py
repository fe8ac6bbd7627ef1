"""A NOSA manager's decode steps replayed as graphs (``serving.step_graph``), on the CPU.

A CUDA graph records a step's launches once and replays them on the memory they name. ``RerunGraphs`` stands in
for it here: its capture records the step's function and runs nothing, and each replay runs that function again as
it was captured, on the plan and views the capture recorded and the same transformers buffers. What it checks is
the host side the real graph depends on: the per-request work run around the replay for every layer, the step's
integers written into the graph's static tensor, the keys (a changed batch is not replayed on an old graph), and
that the tokens are those of the eager steps and of ``generate`` alone. The real graphs run in
tests/test_serving_gpu.py."""

import weakref
from types import SimpleNamespace

import pytest
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig

from hf_nosa.serving import MIN_TRANSFORMERS

if Version(Version(transformers.__version__).base_version) < MIN_TRANSFORMERS:
    pytest.skip(f"serving needs transformers >= {MIN_TRANSFORMERS}", allow_module_level=True)

from hf_nosa.serving import init_continuous_batching  # noqa: E402
from hf_nosa.serving.step_graph import CudaGraphs, StepGraphs, step_graphs_wanted  # noqa: E402

from .test_serving import _generation_config, _prompts, _sparse_model, _wait_for  # noqa: E402
from .test_serving_batched import _alone  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class RerunGraphs:
    """A graph backend for the CPU: capturing records ``fn`` (runs nothing); ``replay()`` runs it."""

    def __init__(self):
        self.captured = 0

    def capture(self, fn, device):
        self.captured += 1
        return SimpleNamespace(replay=fn)


class _Graph:
    def __init__(self, replay):
        self.replay = replay


class LatchedPools:
    """torch's rule for CUDA graph memory pools, on the CPU: capturing into a pool id adds a use, freeing the graph
    removes it, and capturing into an id whose uses went back to 0 fails as CUDACachingAllocator's
    ``TORCH_INTERNAL_ASSERT(it->second->use_count > 0)`` does. The graphs replay as ``RerunGraphs``'."""

    def __init__(self):
        self.uses: dict = {}
        self.made = 0

    def new_pool(self):
        self.made += 1
        return (0, self.made)

    def capture_into(self, fn, device, pool):
        if self.uses.get(pool, 1) == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (a released pool id)")
        self.uses[pool] = self.uses.get(pool, 0) + 1
        graph = _Graph(fn)
        weakref.finalize(graph, self._release, pool)
        return graph

    def _release(self, pool):
        self.uses[pool] -= 1

    def backend(self) -> CudaGraphs:
        return CudaGraphs(new_pool=self.new_pool, capture_into=self.capture_into)


def test_a_pool_is_made_anew_once_its_graphs_are_gone():
    """The live graphs share one pool; when the last is freed the next capture gets a new pool, not the released
    id (torch asserts on it)."""
    pools = LatchedPools()
    graphs = pools.backend()
    first, second = graphs.capture(lambda: None, "cpu"), graphs.capture(lambda: None, "cpu")
    assert pools.made == 1 and pools.uses[(0, 1)] == 2
    del first
    third = graphs.capture(lambda: None, "cpu")  # `second` still lives in the pool: shared
    assert pools.made == 1 and pools.uses[(0, 1)] == 2
    del second, third
    assert pools.uses[(0, 1)] == 0
    with pytest.raises(RuntimeError, match="use_count"):  # the rule the stand-in follows
        pools.capture_into(lambda: None, "cpu", (0, 1))
    fourth = graphs.capture(lambda: None, "cpu")
    assert pools.made == 2 and graphs.pools == 2 and pools.uses[(0, 2)] == 1
    fourth.replay()


def _serve(model, prompts, new_tokens, *, backend=None, use_cuda_graph=None, after=None):
    """Each prompt with its own ``max_new_tokens`` through one manager (with ``StepGraphs(backend)`` when a backend
    is given, else the manager's own: CUDA graphs on CUDA unless ``use_cuda_graph`` is False, none on the CPU); the
    tokens, the graphs' stats (None without graphs) and the manager's counters. ``after`` maps a request's index to
    the one whose end it is added after (the others are added at once)."""
    manager = init_continuous_batching(model, _generation_config(max(new_tokens)), ContinuousBatchingConfig(
        max_batch_tokens=256, use_cuda_graph=use_cuda_graph))
    requests = manager.nosa_requests
    if backend is not None:
        manager.nosa_step_graphs = StepGraphs(requests, backend=backend)
    graphs = manager.nosa_step_graphs
    manager.start()
    results, after = {}, after or {}
    added = set()

    def step():
        results.update({r.request_id: r for r in [manager.get_result(timeout=0.05)] if r and r.is_finished()})
        for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):
            if i not in added and (i not in after or f"r{after[i]}" in results):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
                added.add(i)
        return len(results) == len(prompts)

    try:
        _wait_for(step, timeout=600)
    finally:
        manager.stop(block=True, timeout=10)
    tokens = [results[f"r{i}"].generated_tokens for i in range(len(prompts))]
    return tokens, (graphs.stats() if graphs is not None else None), requests.stats(), dict(requests.decode_runs)


@pytest.mark.slow
def test_replayed_decode_steps_equal_eager_and_generate_alone_interpreted(interpret, prompt_rotary_on_torch):
    """Three requests prefill in one step and decode together; one stops early, so the batch changes. The steps
    replayed from the captured ones give each request the tokens of the eager steps and of generate alone, the
    counters sum the same, and a changed batch ran eagerly before its own capture."""
    model = _sparse_model("llama", seed=31)
    prompts = _prompts((60, 70, 66), seed=31)
    new_tokens = (7, 12, 12)
    alone = [_alone(model, p, n)[0] for p, n in zip(prompts, new_tokens)]
    pools = LatchedPools()  # the second capture comes after the first graph is gone: it needs a new pool
    backend = pools.backend()
    tokens, graphs, stats, runs = _serve(model, prompts, new_tokens, backend=backend)
    eager_tokens, none, eager_stats, eager_runs = _serve(model, prompts, new_tokens)
    assert none is None
    assert tokens == alone == eager_tokens
    # steps: the prefill, the first decode step (warm False), the first warm one (eager, compiles), then captured and
    # replayed; when r0 stops the batch of two runs once eagerly, then its own capture and replays
    assert graphs["failed"] is None
    assert graphs["captures"] == 2 and graphs["replays"] >= 6, graphs
    assert graphs["eager_decode_steps"] >= 2, graphs
    # the three requests' graph stays when r0 leaves (its rows are the banks'), so one pool holds both
    assert graphs["graphs"] == 2 and backend.pools == pools.made == 1, graphs
    assert graphs["reused"] == 0, graphs  # no request took r0's row
    assert runs == eager_runs  # the replayed updates counted as the eager ones
    assert stats == eager_stats and stats["blocks_loaded"] > 0


@pytest.mark.slow
def test_a_request_on_a_freed_row_replays_the_graph_of_the_batch_it_joins_interpreted(interpret,
                                                                                       prompt_rotary_on_torch):
    """r0 and r1 decode together, and their step is captured; r0 ends, and r2 (added then) takes its row. Once r2
    decodes beside r1, their steps replay the graph captured for r0 and r1, on the same memory, which now holds
    r2's slot pool, compressed keys and block table: each request's tokens are those of the eager steps and of
    generate alone."""
    model = _sparse_model("llama", seed=37)
    prompts = _prompts((60, 66, 60), seed=37)
    new_tokens, after = (6, 30, 8), {2: 0}
    alone = [_alone(model, p, n)[0] for p, n in zip(prompts, new_tokens)]
    tokens, graphs, stats, runs = _serve(model, prompts, new_tokens, backend=RerunGraphs(), after=after)
    eager_tokens, _, eager_stats, eager_runs = _serve(model, prompts, new_tokens, after=after)
    assert tokens == alone == eager_tokens
    assert graphs["failed"] is None and graphs["reused"] >= 1, graphs
    assert stats["blocks_loaded"] == eager_stats["blocks_loaded"] > 0


def test_the_torch_reference_path_is_never_captured():
    """On the torch reference path a step's decode tokens go request by request: the graphs run nothing (no
    whole-step plan, no prepare) and the tokens equal generate alone."""
    model = _sparse_model("llama", seed=33)
    prompts = _prompts((40, 50), seed=33)
    alone = [_alone(model, p, 5)[0] for p in prompts]
    backend = RerunGraphs()
    tokens, graphs, _, runs = _serve(model, prompts, (5, 5), backend=backend)
    assert tokens == alone
    assert backend.captured == 0 and graphs["replays"] == 0 and graphs["eager_decode_steps"] == 0
    assert runs == {}


def test_graphs_are_wanted_on_cuda_unless_turned_off(monkeypatch):
    monkeypatch.delenv("HF_NOSA_CUDA_GRAPH", raising=False)
    assert step_graphs_wanted("cuda:0", None) and step_graphs_wanted("cuda", True)
    assert not step_graphs_wanted("cuda", False) and not step_graphs_wanted("cpu", None)
    monkeypatch.setenv("HF_NOSA_CUDA_GRAPH", "0")
    assert not step_graphs_wanted("cuda", None)


@pytest.mark.slow
def test_a_failed_capture_turns_the_graphs_off_and_the_steps_go_on(interpret, prompt_rotary_on_torch, caplog):
    """A capture that raises is logged, and the manager's steps go on eagerly with the same tokens."""

    class Failing(RerunGraphs):
        def capture(self, fn, device):
            raise RuntimeError("operation not permitted when stream is capturing")

    model = _sparse_model("llama", seed=35)
    prompts = _prompts((40, 44), seed=35)
    alone = [_alone(model, p, 6)[0] for p in prompts]
    with caplog.at_level("WARNING", logger="hf_nosa.serving.step_graph"):
        tokens, graphs, _, _ = _serve(model, prompts, (6, 6), backend=Failing())
    assert tokens == alone
    assert graphs["captures"] == 0 and "not permitted" in graphs["failed"]
    assert any("run eagerly from now on" in r.getMessage() for r in caplog.records)
