"""One rank of tests/test_tensor_parallel.py:
``python -m torch.distributed.run --nproc-per-node 2 -m tests.tensor_parallel_worker ARGS`` from the repository root.

Loads a model with ``from_pretrained(..., tp_plan="auto")`` (transformers starts the gloo process group on the CPU and
shards the model), then, per case, greedy-generates with a NosaCache and records tokens, the logits of every step,
the cache's stats and KV heads on this rank, and the logits of a plain forward over the prompt. Rank 0 writes what
every rank recorded to OUT (torch.save).

ARGS: a JSON object: ``folder`` (the checkpoint), ``path`` ("to_nosa": a stock checkpoint, converted after loading
with the NosaConfig fields ``nosa`` and its eviction heads randomised with ``seed``; "checkpoint": an exported NOSA
checkpoint, trust_remote_code),
``cases`` (name -> NosaConfig fields), ``cache`` ("explicit": a NosaCache passed to generate; "nosa":
``cache_implementation="nosa"`` with the case's fields as ``cache_config``), ``prompt`` (token ids), ``new`` (tokens
to generate), ``serving`` (optional: ``prompts``, ``new``, ``max_batch_tokens`` for ``generate_batch``), ``out``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_nosa
from hf_nosa.modeling import eviction_heads, randomize_eviction_heads


def main(spec: dict) -> None:
    kwargs = dict(tp_plan="auto", dtype=torch.float32, attn_implementation="sdpa")
    if spec["path"] == "checkpoint":
        kwargs["trust_remote_code"] = True
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], **kwargs).eval()
    if spec["path"] == "to_nosa":
        hf_nosa.to_nosa(model, hf_nosa.NosaConfig.from_dict(spec["nosa"]))
        randomize_eviction_heads(model, scale=2.0, generator=torch.Generator().manual_seed(spec["seed"]))
    ids = torch.tensor([spec["prompt"]])
    heads = eviction_heads(model)
    record = {
        "rank": dist.get_rank(),
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "shards": {i: (h.tensor_parallel.lo, h.tensor_parallel.hi) for i, h in heads.items()},
        "v_proj_rows": model.model.layers[0].self_attn.v_proj.weight.to_local().shape[0],
    }
    with torch.no_grad():
        record["forward_logits"] = model(ids).logits
        for name, fields in spec["cases"].items():
            if spec["cache"] == "nosa":  # what a published checkpoint's user writes
                how = dict(cache_implementation="nosa", cache_config=fields)
            else:
                how = dict(past_key_values=hf_nosa.NosaCache(model.config, hf_nosa.NosaConfig.from_dict(fields)))
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new"],
                                 min_new_tokens=spec["new"], do_sample=False, return_dict_in_generate=True,
                                 output_logits=True, **how)
            cache = out.past_key_values
            assert isinstance(cache, hf_nosa.NosaCache), type(cache)
            layer = cache.layers[0]
            record[name] = {
                "tokens": out.sequences,
                "logits": torch.stack(out.logits, 1),
                "stats": cache.stats(),
                "kv_heads": layer.kv_heads,
                "slot_k": tuple(layer.slot_k.shape),
            }
    if spec.get("serving"):
        record["serving"] = serve(model, **spec["serving"])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if dist.get_rank() == 0:
        torch.save(gathered, spec["out"])
    dist.barrier()
    dist.destroy_process_group()


def serve(model, prompts: list, new: int, max_batch_tokens: int) -> list:
    """transformers' continuous batching on the sharded model (rank 0 schedules, the others follow): each request's
    generated tokens, or its error."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from hf_nosa.serving import ServingBudget, enable

    enable(model, budget=ServingBudget(decode_rows=3))
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(prompts, generation_config=config, persistent_manager=True,
                               continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens))
    budget = model._cached_continuous_batching_manager.nosa_requests.budget  # as the ranks agreed on it
    model.destroy_cached_continuous_batching_manager()
    return dict(tokens=[out[f"req_{i}"].error or out[f"req_{i}"].generated_tokens for i in range(len(prompts))],
                decode_rows=budget.decode_rows)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
