"""GPU: NOSA under transformers' continuous batching on CUDA (pinned host stores, the device kernels, transformers'
compute stream) gives each request the tokens of NOSA generate on it alone (which decodes with its captured graph),
with the decode tokens of a step in batched updates (``serving.decode_batch``).

Not run yet (no GPU machine could be started when it was written). Serving needs transformers >= 5.18; the GPU machine
has 5.17, so carry a wheel (docs/serving.md), e.g. ``pip install --no-deps --target /tmp/tf transformers-5.18.0 +
tokenizers 0.23 + huggingface_hub 1.33 wheels`` and ``PYTHONPATH=/tmp/tf:.``; on 5.17 this module skips.
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
