"""``hf-nosa demo``: the embedded model ships, loads, and the demo decodes a pass key with NOSA offload."""

from __future__ import annotations

import json
import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_nosa import NosaConfig, to_nosa
from hf_nosa.cli.commands import main as cli_main
from hf_nosa.cli.demo import DEFAULT_MODEL
from hf_nosa.eval import load_model
from hf_nosa.modeling.tokenizer import VOCAB_SIZE, build_tokenizer


def _mib(text: str, label: str) -> float:
    value, unit = re.search(label + r" ([\d.]+) (MiB|KiB)", text).groups()
    return float(value) / (1024 if unit == "KiB" else 1)


def check_output(text: str) -> None:
    for key in ("hf-nosa demo:", "prompt:", "pass key:", "answer:", "KV cache:", "moved:", "locality"):
        assert key in text, key
    assert _mib(text, "full cache") > _mib(text, "device working set")
    assert _mib(text, "moved:      ") > 0
    locality = float(re.search(r"locality ([\d.]+)", text).group(1))
    assert 0.0 < locality <= 1.0


def test_embedded_model_is_small_and_loads():
    files = [f for f in DEFAULT_MODEL.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 16 * 2**20
    settings = json.loads((DEFAULT_MODEL / "demo.json").read_text())
    assert settings["context_tokens"] >= 8 * settings["budget_tokens"]
    model, tokenizer = load_model(DEFAULT_MODEL)
    assert model.config.nosa is not None and tokenizer("A")["input_ids"] == [68]


def test_demo_runs_on_the_embedded_model(capsys):
    settings = json.loads((DEFAULT_MODEL / "demo.json").read_text())
    budget = settings["budget_tokens"]
    assert cli_main(["demo", "--seed", "3", "--context", str(4 * budget)]) == 0  # 4x: quick on any demo model
    captured = capsys.readouterr()
    text = captured.out
    check_output(text)
    assert f"budget {budget} tokens (4x less than the context)" in text
    # progress on stderr while it runs: every prefill chunk up to the whole prompt, then decode steps
    chunks = re.findall(r"prefill: (\d+)/(\d+) prompt tokens", captured.err)
    prefill, total = [int(done) for done, _ in chunks], int(chunks[0][1])
    chunk = NosaConfig.from_dict(json.loads((DEFAULT_MODEL / "config.json").read_text())["nosa"]).prefill_chunk(1)
    assert prefill == sorted(prefill) and prefill[-1] == total and len(prefill) == -(-total // chunk)
    steps = int(re.search(r"decode: (\d+) steps done", captured.err).group(1))
    assert "decode: step 1 of at most" in captured.err and steps == int(re.search(r"over (\d+) decode steps", text).group(1))


def test_demo_runs_on_a_given_checkpoint_and_rejects_bad_input(tmp_path, capsys):
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    to_nosa(model, NosaConfig(block_size=16, budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=16,
                              compress_kernel=8, compress_stride=4))
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "demo.json").write_text(json.dumps({"context_tokens": 512, "budget_tokens": 64, "passkey_accuracy": 0.0}))
    assert cli_main(["demo", "--model", str(tmp_path), "--seed", "1"]) == 0
    text = capsys.readouterr().out
    check_output(text)
    assert "512 tokens" in text and "budget 64 tokens (8x" in text and "accuracy" in text
    assert cli_main(["demo", "--model", str(tmp_path), "--budget", "32"]) == 2
    assert "too small" in capsys.readouterr().err
    assert cli_main(["demo", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no model" in capsys.readouterr().err
