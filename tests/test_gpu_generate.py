"""GPU: generate's decode steps replay one captured graph, across steps and across calls, and match eager decode."""

import pytest
import torch

from hf_nosa import to_nosa
from hf_nosa.modeling import randomize_eviction_heads
from hf_nosa.cache.workspace import workspace_of

from .conftest import small_nosa_config, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, cache_implementation="nosa", **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_replays_one_graph_across_calls_and_equals_eager(family, monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    model = to_nosa(tiny_model(family, seed=3), small_nosa_config(prefill_chunk_size=64, prefill_budget_tokens=64))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(2))
    model = model.cuda()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (3, 300), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    mask[2, :40] = 0
    first = _run(model, ids, mask)
    graph = workspace_of(model).decode_graph
    # two eager steps, then replays; the first step's graph (no locality counted yet), whose key ran eagerly, is
    # captured beside the second step's
    assert graph.captures == 2 and graph.replays >= 36
    second = _run(model, ids, mask)
    # both are kept by key: the next calls capture nothing and replay every step
    assert graph.captures == 2 and graph.replays >= 36 + 39
    third = _run(model, ids, mask)
    assert graph.captures == 2 and graph.replays >= 36 + 39 + 39
    assert torch.equal(first.sequences, third.sequences)
    monkeypatch.setenv("HF_NOSA_CUDA_GRAPH", "0")
    eager = _run(model, ids, mask)
    assert torch.equal(first.sequences, second.sequences)
    assert torch.equal(first.sequences, eager.sequences)
    for a, b in zip(first.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
