"""The synthetic suite, the decode loop, perplexity and the eval runner/CLI, on tiny models (CPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_nosa import NosaConfig, to_nosa
from hf_nosa.cli.commands import main as cli_main
from hf_nosa.eval import TASKS, decode, evaluate, generate_samples, load_model, perplexity_documents, score
from hf_nosa.eval.tasks import DEFAULT_TASKS
from hf_nosa.modeling import eviction_heads, randomize_eviction_heads
from hf_nosa.modeling.tokenizer import VOCAB_SIZE, build_tokenizer, byte_ids

from .utils import assert_close


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def byte_model(seed: int = 0, layers: int = 2):
    """A random tiny Llama over the byte tokenizer."""
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def small_layout(**overrides) -> NosaConfig:
    base = dict(block_size=16, budget_tokens=64, sink_tokens=16, local_tokens=16, query_tokens=16,
                compress_kernel=8, compress_stride=4)
    return NosaConfig(**{**base, **overrides})


# ----- tokenizer -----


def test_byte_tokenizer_round_trips_and_matches_the_fast_path(tokenizer):
    text = "def f(x):\n\treturn x  # é ✓ <s></s>"
    ids = tokenizer(text)["input_ids"]
    assert ids == byte_ids(text).tolist()  # special-token strings in text stay bytes
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == VOCAB_SIZE
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


# ----- tasks -----


@pytest.mark.parametrize("task", TASKS)
def test_tasks_are_deterministic_exactly_sized_and_contain_their_answers(task, tokenizer):
    a = generate_samples(task, n=2, length=640, tokenizer=tokenizer, seed=7)
    b = generate_samples(task, n=2, length=640, tokenizer=tokenizer, seed=7)
    c = generate_samples(task, n=2, length=640, tokenizer=tokenizer, seed=8)
    assert a == b
    assert a != c
    assert a[0] != a[1]
    for sample in a:
        assert len(tokenizer(sample.prompt)["input_ids"]) == 640
        assert sample.answers and all(sample.answers)
        assert sample.question.startswith("\n")
        assert sample.score(sample.target) == 1.0
        assert sample.score(sample.target + "\nanything after the newline") == 1.0
        for answer in sample.answers:
            assert answer in sample.context


def test_needle_tasks_state_the_answer_next_to_the_asked_key(tokenizer):
    for sample in generate_samples("niah_single_number", n=3, length=800, tokenizer=tokenizer, seed=1):
        key = re.search(r"number for (\S+)\?", sample.question).group(1)
        assert f"One of the special magic numbers for {key} is: {sample.answers[0]}.\n" in sample.context
        assert re.fullmatch(r"[1-9]\d{6}", sample.answers[0])
    for sample in generate_samples("niah_multikey_uuid", n=3, length=800, tokenizer=tokenizer, seed=1):
        key = re.search(r"uuid for (\S+)\?", sample.question).group(1)
        assert f"uuids for {key} is: {sample.answers[0]}.\n" in sample.context
        assert sample.context.count("One of the special magic uuids for") == 4
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", sample.answers[0])
    for sample in generate_samples("niah_multiquery", n=2, length=800, tokenizer=tokenizer, seed=1):
        keys = re.search(r"numbers for (.+)\?", sample.question).group(1).split(", ")
        for key, value in zip(keys, sample.answers, strict=True):
            assert f"numbers for {key} is: {value}.\n" in sample.context
    for sample in generate_samples("niah_multivalue", n=2, length=800, tokenizer=tokenizer, seed=1):
        positions = [sample.context.index(f" is: {v}.") for v in sample.answers]
        assert positions == sorted(positions) and len(set(sample.answers)) == 4


def test_variable_tracking_chain_and_common_words(tokenizer):
    for sample in generate_samples("vt", n=2, length=900, tokenizer=tokenizer, seed=2):
        value = re.search(r"equal to (\d+)\?", sample.question).group(1)
        names = sample.answers
        assert f"VAR {names[0]} = {value}.\n" in sample.context
        for prev, name in zip(names, names[1:]):
            assert f"VAR {name} = VAR {prev}.\n" in sample.context
            assert sample.context.index(f"VAR {name} =") > sample.context.index(f"VAR {prev} =")
    for sample in generate_samples("cwe", n=2, length=1500, tokenizer=tokenizer, seed=2):
        words = re.findall(r"^\d+\. (\w+)$", sample.context, flags=re.M)
        counts = {w: words.count(w) for w in set(words)}
        least_common_answer = min(counts[w] for w in sample.answers)
        others = max(c for w, c in counts.items() if w not in sample.answers)
        assert len(sample.answers) == 5 and least_common_answer > others


def test_exact_match_scoring_by_hand():
    assert score("1234567", ("1234567",)) == 1.0
    assert score(" 1234567.\nnext line", ("1234567",)) == 1.0
    assert score("1234568", ("1234567",)) == 0.0
    assert score("1234567, 1", ("1234567",)) == 0.0  # single answers must match the whole line
    assert score("", ("1234567",)) == 0.0
    assert score("a, b, x", ("a", "b", "c")) == pytest.approx(2 / 3)
    assert score("c, b, a", ("a", "b", "c")) == 1.0  # multi-answer tasks are scored as a set
    assert score("ab, c", ("a", "b", "c")) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="answers"):
        score("x", ())


def test_bad_task_input_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="task='nope' is unknown"):
        generate_samples("nope", n=1, length=500, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="too short"):
        generate_samples("niah_multiquery", n=1, length=100, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="length"):
        generate_samples("passkey", n=1, length=0, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="split"):
        generate_samples("passkey", n=1, length=500, tokenizer=tokenizer, split="test")


def test_perplexity_documents_are_standard_library_files(tokenizer):
    docs = perplexity_documents(tokenizer, length=300, n=3, seed=0)
    assert docs == perplexity_documents(tokenizer, length=300, n=3, seed=0)
    assert len({name for name, _ in docs}) == 3
    assert all(len(ids) == 300 and name.endswith(".py") for name, ids in docs)


# ----- decode loop -----


def test_decode_loop_generates_what_generate_does(tokenizer):
    model = byte_model()
    prompts = [generate_samples("passkey", n=1, length=200, tokenizer=tokenizer, seed=s)[0].prompt for s in (0, 1)]
    ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[:, 200:]
    from transformers import DynamicCache

    result = decode(model, ids, cache=DynamicCache(config=model.config), decode_from=190, max_new_tokens=6, prefill_chunk=70)
    assert torch.equal(result.tokens, reference)
    assert result.decode_steps == 10 + 5


def test_decode_left_padding_matches_unpadded(tokenizer):
    model = byte_model(seed=3)
    from transformers import DynamicCache

    ids = torch.randint(3, VOCAB_SIZE, (1, 120))
    alone = decode(model, ids, cache=DynamicCache(config=model.config), decode_from=110, max_new_tokens=5)
    padded = torch.cat([torch.zeros(1, 9, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 9, dtype=torch.long), torch.ones_like(ids)], 1)
    batch = torch.cat([padded, torch.randint(3, VOCAB_SIZE, (1, 129))])
    mask = torch.cat([mask, torch.ones(1, 129, dtype=torch.long)])
    both = decode(model, batch, attention_mask=mask, cache=DynamicCache(config=model.config), decode_from=119, max_new_tokens=5)
    assert torch.equal(both.tokens[:1], alone.tokens)


def test_decode_scores_equal_one_full_forward():
    model = byte_model(seed=1)
    from transformers import DynamicCache

    ids = torch.randint(3, VOCAB_SIZE, (2, 90))
    result = decode(model, ids, cache=DynamicCache(config=model.config), decode_from=60, score=True)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)
    expected = -logp[:, 59:89].gather(-1, ids[:, 60:90, None])[..., 0]
    assert_close(result.nll, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="decode_from"):
        decode(model, ids, cache=DynamicCache(config=model.config), decode_from=0)


# ----- runner -----


def test_every_method_at_full_budget_predicts_what_full_attention_does(tokenizer):
    model = byte_model(seed=2)
    to_nosa(model, small_layout())
    rows = evaluate(model, tokenizer, tasks=["passkey", "niah_single_number"], lengths=[400], budget_tokens=512,
                    samples=1, batch_size=2, perplexity_docs=1, perplexity_tokens=4, show_progress=False)
    by_method = {row["method"]: row for row in rows}
    assert set(by_method) == {"default", "nosa", "query_only", "quest", "shadowkv"}
    reference = by_method["default"]
    for method, row in by_method.items():
        assert row["examples"] == reference["examples"], method
        assert row["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-4), method
        if method != "default":
            assert row["budget_tokens"] == 512 and row["locality"] == pytest.approx(1.0)


def test_runner_reports_traffic_and_locality_under_a_small_budget(tokenizer):
    model = byte_model(seed=4)
    to_nosa(model, small_layout())
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    seen = []
    rows = evaluate(model, tokenizer, tasks=["passkey", "niah_single_number"], lengths=[512], methods=["nosa", "quest"],
                    budget_ratio=8, samples=1, batch_size=2, perplexity_docs=1, perplexity_tokens=4,
                    show_progress=False, on_result=seen.append)
    assert seen == rows and [r["method"] for r in rows] == ["nosa", "quest"]
    for row in rows:
        assert row["budget_tokens"] == 64
        assert set(row["tasks"]) == {"passkey", "niah_single_number"}
        assert 0.0 <= row["mean_accuracy"] <= 1.0
        assert 0.0 < row["locality"] <= 1.0
        assert 0 < row["bytes_to_device_per_token"] < row["full_kv_bytes_per_sequence"]
        assert row["device_kv_bytes_per_sequence"] < row["full_kv_bytes_per_sequence"]
        assert row["perplexity"] > 1.0


def test_plain_model_is_converted_with_a_zero_eviction_head(tokenizer):
    model = byte_model(seed=5)
    rows = evaluate(model, tokenizer, tasks=["passkey"], lengths=[512], methods=["nosa"], budget_tokens=256,
                    samples=1, perplexity_docs=0, show_progress=False)
    assert eviction_heads(model) and all(float(h.A.detach().abs().sum()) == 0 for h in eviction_heads(model).values())
    # no "nosa" section on a plain model: sink one block, local and query-aware a quarter of the budget each
    assert rows[0]["nosa_config"]["local_tokens"] == 64 and rows[0]["nosa_config"]["query_tokens"] == 64


def test_runner_rejects_bad_input(tokenizer):
    model = byte_model()
    with pytest.raises(ValueError, match="task"):
        evaluate(model, tokenizer, tasks=["nope"], lengths=[256], show_progress=False)
    with pytest.raises(ValueError, match="cache method"):
        evaluate(model, tokenizer, tasks=["passkey"], lengths=[256], methods=["h2o"], show_progress=False)
    with pytest.raises(ValueError, match="at most one"):
        evaluate(model, tokenizer, tasks=["passkey"], lengths=[256], budget_tokens=64, budget_ratio=4, show_progress=False)


def test_nosa_checkpoint_loads_with_its_eviction_heads(tmp_path, tokenizer):
    model = byte_model(seed=6)
    to_nosa(model, small_layout(prefill="nosa"))
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(tmp_path)
    assert loaded.config.nosa["budget_tokens"] == 64
    ids = torch.randint(3, VOCAB_SIZE, (1, 50))
    with torch.no_grad():
        assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5)
    assert loaded_tokenizer("abc")["input_ids"] == tokenizer("abc")["input_ids"]
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


def test_eval_command_writes_json(tmp_path, tokenizer, capsys):
    model = byte_model(seed=7)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "r.json"
    code = cli_main(["eval", "--model", str(tmp_path / "m"), "--tasks", "passkey", "--lengths", "320",
                     "--cache", "default,quest", "--budget", "128", "--samples", "1", "--ppl-docs", "1",
                     "--ppl-tokens", "4", "--device", "cpu", "--out", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["results"]] == ["default", "quest"]
    assert report["environment"]["torch"] == torch.__version__
    assert "[320 quest]" in capsys.readouterr().out
    assert cli_main(["eval", "--model", str(tmp_path / "m"), "--tasks", "nope", "--lengths", "320"]) == 2
    assert "task 'nope' is unknown" in capsys.readouterr().err
    assert cli_main(["eval", "--model", str(tmp_path / "missing"), "--lengths", "320"]) == 2


def test_tasks_all_names_every_task_the_pass_key_included(monkeypatch):
    import hf_nosa.eval.runner as runner

    asked = {}
    monkeypatch.setattr(runner, "evaluate", lambda model, tokenizer, **kw: asked.update(kw) or [])
    args = ["eval", "--model", str(DEMO_MODEL), "--tasks", "all", "--lengths", "320", "--cache", "default",
            "--samples", "1", "--ppl-docs", "0", "--device", "cpu", "--no-progress"]
    assert cli_main(args) == 0
    assert asked["tasks"] == list(TASKS) and "passkey" in asked["tasks"]


def test_default_suite_is_the_ruler_tasks():
    assert set(DEFAULT_TASKS) == set(TASKS) - {"passkey"}
    assert len(DEFAULT_TASKS) == 8


# ----- the command's table and its up-front checks, on the embedded demo model -----

DEMO_MODEL = Path(__file__).resolve().parent.parent / "hf_nosa" / "assets" / "demo_model"


def test_eval_prints_a_table_per_length_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = cli_main(["eval", "--model", str(DEMO_MODEL), "--tasks", "passkey,vt", "--lengths", "320,384",
                     "--cache", "default,nosa", "--budget", "192", "--local-tokens", "64", "--samples", "1",
                     "--ppl-docs", "1", "--ppl-tokens", "2", "--device", "cpu", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    for length in (320, 384):
        title = f"length {length}, budget 192 tokens, compact protocol"
        assert title in printed
        table = printed.split(title, 1)[1].strip().splitlines()
        assert table[0].split() == ["method", "passkey", "vt", "mean", "ppl", "locality", "bytes/token"]
        assert set(table[1]) <= {"-", " "}
        default, nosa = (line.split() for line in table[2:4])
        assert default[0] == "default" and nosa[0] == "nosa"
        assert default[-2:] == ["-", "-"]  # full attention moves nothing and has no selection to keep
        assert 0.0 <= float(nosa[5]) <= 1.0 and float(nosa[6].replace(",", "")) >= 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["length"], r["method"]) for r in rows] == [(320, "default"), (320, "nosa"), (384, "default"), (384, "nosa")]
    assert report["protocol"] == "compact" and all(r["protocol"] == "compact" for r in rows)
    assert f"{rows[1]['mean_accuracy']:.3f}" in printed and f"{rows[1]['perplexity']:.3f}" in printed


def test_eval_checks_every_length_before_loading_or_running(tmp_path, capsys):
    args = ["eval", "--model", str(DEMO_MODEL), "--tasks", "passkey", "--cache", "default,nosa", "--samples", "1",
            "--ppl-docs", "0", "--device", "cpu", "--no-progress"]
    # 8192 / 8 = 1024 fits the model's layout (sink 64 + local 256 + query 64); 1024 / 8 = 128 does not
    assert cli_main([*args, "--lengths", "8192,1024", "--budget-ratio", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran, not even the valid first length
    error = captured.err
    assert "length 1024 with budget_ratio=8 (--budget-ratio 8)" in error
    assert "--budget / --budget-ratio" in error and "--sink-tokens / --local-tokens / --query-tokens" in error
    assert cli_main([*args, "--lengths", "1024", "--budget", "512", "--query-tokens", "512"]) == 2
    assert "query_tokens=512 (--query-tokens 512)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="too short for task 'niah_multiquery'.*--lengths or --tasks"):
        evaluate(byte_model(), build_tokenizer(), tasks=["niah_multiquery"], lengths=[100], methods=["default"],
                 show_progress=False)
