"""A model split over two GPUs with accelerate's device_map: each layer's cache lives on that layer's GPU and the
Triton decode path gives the same tokens as the model on one GPU."""

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

LAYERS = 4


def _load(path, device_map, cfg):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, device_map=device_map, dtype=torch.float32).eval()
    model = to_nosa(model, cfg)
    with torch.no_grad():
        randomize_eviction_heads(model, generator=torch.Generator().manual_seed(3))
    return model


def test_device_map_over_two_gpus_matches_one_gpu(tmp_path):
    tiny_model("llama", num_hidden_layers=LAYERS).save_pretrained(tmp_path)
    cfg = small_nosa_config(budget_tokens=128, query_tokens=32)
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    split.update({f"model.layers.{i}": 0 if i < LAYERS // 2 else 1 for i in range(LAYERS)})
    one = _load(tmp_path, {"": 0}, cfg)
    two = _load(tmp_path, split, cfg)

    ids = torch.randint(3, 97, (3, 80), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=200, min_new_tokens=200, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    caches = [NosaCache(m.config, cfg) for m in (one, two)]
    ref = one.generate(input_ids=ids.to("cuda:0"), past_key_values=caches[0], **kwargs)
    out = two.generate(input_ids=ids.to("cuda:0"), past_key_values=caches[1], **kwargs)

    # far past the budget, so selection and fetch ran on both GPUs
    assert caches[1].stats()["host_tokens"] > 2 * cfg.budget_tokens
    for i, layer in enumerate(caches[1].layers):
        expected = 0 if i < LAYERS // 2 else 1
        assert layer.slot_k.device == torch.device("cuda", expected), f"layer {i} slots on {layer.slot_k.device}"
    assert torch.equal(ref.sequences.cpu(), out.sequences.cpu())
    torch.testing.assert_close(ref.logits[-1].cpu(), out.logits[-1].cpu(), atol=1e-4, rtol=0)
