"""GPU: NOSA under transformers' continuous batching on CUDA (pinned host stores, the device kernels, transformers'
compute stream) gives each request the tokens of NOSA generate on it alone (which decodes with its captured graph),
with the decode tokens of a step in batched updates (``serving.decode_batch``) and decode-only steps replayed as CUDA
graphs (``serving.step_graph``).

Serving needs transformers >= 5.18; where the GPU machine has 5.17, carry the wheels (``bash benchmarks/gpu_session.sh
serve`` installs those of ``build/serving_wheels``); on 5.17 this module skips.
"""

import pytest
import torch
import transformers
from packaging.version import Version

from hf_nosa.serving import MIN_TRANSFORMERS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(Version(Version(transformers.__version__).base_version) < MIN_TRANSFORMERS,
                       reason=f"serving needs transformers >= {MIN_TRANSFORMERS}"),
]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_the_gpu_generate_batch_equals_generate_alone(family):
    from transformers import ContinuousBatchingConfig

    from hf_nosa.serving import enable

    from .test_serving import _alone, _generation_config, _prompts, _sparse_model

    model = _sparse_model(family, seed=11).cuda()
    prompts = _prompts((40, 150, 300, 700), seed=11)
    expected = [_alone(model, p) for p in prompts]
    enable(model)
    try:
        out = model.generate_batch(prompts, generation_config=_generation_config(),
                                   continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128),
                                   persistent_manager=True)
        runs = dict(model._cached_continuous_batching_manager.nosa_requests.decode_runs)
    finally:
        model.destroy_cached_continuous_batching_manager()
    assert [out[f"req_{i}"].generated_tokens for i in range(len(prompts))] == expected
    assert max(runs) > 1, runs  # the decode tokens of several requests went through one batched update


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_the_gpu_replayed_decode_steps_equal_eager_steps_and_generate_alone(family):
    """The manager's decode steps replayed as CUDA graphs (``serving.step_graph``, on by default on CUDA) give each
    request the tokens of the eager steps (``use_cuda_graph=False``) and of generate alone; a request that stops
    early changes the batch, which is captured anew."""
    from .test_serving import _alone, _prompts, _sparse_model
    from .test_serving_graphs import _serve

    model = _sparse_model(family, seed=13).cuda()
    prompts = _prompts((60, 90, 200, 70), seed=13)
    new_tokens = (24, 40, 40, 12)
    expected = [_alone(model, p, n) for p, n in zip(prompts, new_tokens)]
    tokens, graphs, stats, _ = _serve(model, prompts, new_tokens)
    eager_tokens, no_graphs, eager_stats, _ = _serve(model, prompts, new_tokens, use_cuda_graph=False)
    assert no_graphs is None
    assert tokens == expected == eager_tokens
    assert graphs["failed"] is None and graphs["captures"] >= 2 and graphs["replays"] >= 20, graphs
    assert stats["blocks_loaded"] == eager_stats["blocks_loaded"] > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_on_the_gpu_a_request_on_a_freed_row_replays_the_graph_of_its_batch(family):
    """r2 is added when r0 ends and takes its row: the CUDA graph captured for r0 and r1 replays for r2 and r1 (on
    the same bank memory, now holding r2's buffers), and every request gets the tokens of the eager steps and of
    generate alone."""
    from .test_serving import _alone, _prompts, _sparse_model
    from .test_serving_graphs import _serve

    model = _sparse_model(family, seed=17).cuda()
    prompts = _prompts((60, 66, 60), seed=17)
    new_tokens, after = (12, 60, 16), {2: 0}
    expected = [_alone(model, p, n) for p, n in zip(prompts, new_tokens)]
    tokens, graphs, stats, _ = _serve(model, prompts, new_tokens, after=after)
    eager_tokens, _, eager_stats, _ = _serve(model, prompts, new_tokens, use_cuda_graph=False, after=after)
    assert tokens == expected == eager_tokens
    assert graphs["failed"] is None and graphs["reused"] >= 1, graphs
    assert stats["blocks_loaded"] == eager_stats["blocks_loaded"] > 0


def test_on_the_gpu_a_pool_is_made_anew_once_its_graphs_are_gone():
    """torch's graph pool id latches once its last graph is freed; ``CudaGraphs`` then takes a new one, and the
    graphs replay what they captured."""
    from hf_nosa.serving.step_graph import CudaGraphs

    x = torch.randn(64, device="cuda")
    out = torch.empty_like(x)
    graphs = CudaGraphs()
    first = graphs.capture(lambda: out.copy_(x * 2), x.device)
    del first  # the pool's only graph: its id may no longer be captured into
    second = graphs.capture(lambda: out.copy_(x + 1), x.device)
    x.copy_(torch.randn(64, device="cuda"))
    second.replay()
    torch.cuda.synchronize()
    assert graphs.pools == 2 and torch.equal(out, x + 1)
