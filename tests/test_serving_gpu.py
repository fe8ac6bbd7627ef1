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
    # r3 leaves first and its batch's graphs go with it: the next capture needs a pool of its own (CudaGraphs)
    assert graphs["pools"] >= 2, graphs
    assert stats["blocks_loaded"] == eager_stats["blocks_loaded"] > 0
