"""The core on a CUDA device: pinned host store, asynchronous write-back, identity with the default cache."""

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_identity_on_cuda(family):
    model = to_nosa(tiny_model(family), small_nosa_config(budget_tokens=256)).cuda()
    ids = torch.randint(3, 97, (3, 60), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)
    reference = model.generate(**kwargs)
    nosa = model.generate(**kwargs, cache_implementation="nosa")
    assert torch.equal(reference.sequences, nosa.sequences)
    torch.testing.assert_close(reference.logits[-1], nosa.logits[-1], atol=1e-4, rtol=0)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_budget_and_pinned_store_on_cuda():
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32)
    model = randomize_eviction_heads(to_nosa(tiny_model("llama"), cfg)).cuda()
    cache = NosaCache(model.config, cfg)
    ids = torch.randint(3, 97, (2, 24), device="cuda")
    out = model.generate(input_ids=ids, max_new_tokens=200, min_new_tokens=200, do_sample=False, past_key_values=cache)
    stats = cache.stats()
    assert stats["host_tokens"] == out.shape[1] - 1
    assert stats["device_tokens"] <= cfg.budget_tokens + cfg.block_size
    assert cache.layers[0].host.k_chunks[0].is_pinned()
    assert stats["locality"] >= 1 - (cfg.query_tokens + cfg.block_size) / cfg.budget_tokens
