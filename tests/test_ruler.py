"""RULER's protocol: its scoring on hand-made predictions, its templates, and the chat template on and off."""

from __future__ import annotations

import pytest

from hf_nosa.cli.args import EVAL_PROTOCOLS
from hf_nosa.eval import TASKS, generate_samples, score
from hf_nosa.eval.ruler import (
    CWE_PREFIX,
    NIAH_LEAD,
    PASSKEY_PREFIX,
    VT_PREFIX,
    NIAH_PREFIX,
    chat_frame,
    postprocess,
    ruler_score,
    singular,
    string_match_all,
    string_match_part,
)
from hf_nosa.eval.tasks import PROTOCOLS
from hf_nosa.modeling.tokenizer import build_tokenizer

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = CHAT
    return tok


def test_string_match_all_counts_the_share_of_references_found():
    assert string_match_all("The special magic numbers are 1234567.", ["1234567"]) == 1.0
    assert string_match_all("1234567, 7654321 and more", ["7654321", "1234567", "1111111"]) == pytest.approx(2 / 3)
    assert string_match_all("no numbers here", ["1234567"]) == 0.0
    assert string_match_all("ABCDE\nFGHIJ", ["abcde", "fghij"]) == 1.0  # case-insensitive, any line
    assert string_match_all("12345678", ["1234567"]) == 1.0  # a substring counts, as in RULER
    assert string_match_all("", ["1"]) == 0.0


def test_string_match_part_needs_any_one_reference():
    assert string_match_part("It is Paris, I think.", ["paris", "Lyon"]) == 1.0
    assert string_match_part("It is Rome.", ["Paris", "Lyon"]) == 0.0
    assert string_match_part("lyon", ["Paris", "Lyon"]) == 1.0


def test_postprocess_and_metric_dispatch():
    assert postprocess("  a\tb\x00c \n") == "a\nb\nc"
    assert ruler_score("x 42", ["42", "7"], "all") == 0.5
    assert ruler_score("x 42", ["42", "7"], "part") == 1.0
    assert score("x 42", ("42", "7"), metric="all") == 0.5
    assert score("42", ("42",)) == 1.0  # compact exact match stays the default
    with pytest.raises(ValueError, match="metric='fuzzy' is unknown"):
        ruler_score("x", ["x"], "fuzzy")
    with pytest.raises(ValueError, match="metric='fuzzy' is unknown"):
        score("x", ("x",), metric="fuzzy")
    with pytest.raises(ValueError, match="references"):
        string_match_all("x", [])


def test_protocol_names_match_the_command_line():
    assert EVAL_PROTOCOLS == PROTOCOLS


@pytest.mark.parametrize("task", TASKS)
def test_ruler_samples_are_sized_and_scored_by_substring(task, tokenizer):
    samples = generate_samples(task, n=2, length=1200, tokenizer=tokenizer, seed=3, protocol="ruler")
    assert samples == generate_samples(task, n=2, length=1200, tokenizer=tokenizer, seed=3, protocol="ruler")
    for sample in samples:
        assert sample.metric == "all" and sample.add_special_tokens
        assert len(tokenizer(sample.prompt)["input_ids"]) == 1200  # byte-level: exact
        assert sample.score(" " + sample.target + ".\nAnything after.") == 1.0
        assert sample.score("I do not know.") == 0.0
        for answer in sample.answers:
            assert answer in sample.context
    # without a chat template the answer prefix keeps RULER's leading space and ends the prompt
    prefix = {"passkey": PASSKEY_PREFIX, "vt": VT_PREFIX.split(",")[0], "cwe": CWE_PREFIX.format(n=10)}.get(task)
    if prefix is not None:
        assert prefix in samples[0].question


def test_ruler_niah_uses_rulers_words(tokenizer):
    sample = generate_samples("niah_multiquery", n=1, length=1500, tokenizer=tokenizer, seed=0, protocol="ruler")[0]
    assert sample.context.startswith(NIAH_LEAD.format(kinds="numbers"))
    assert "What are all the special magic numbers for" in sample.question
    assert ", and " in sample.question  # RULER joins several keys with ", and "
    assert sample.question.endswith("mentioned in the provided text are")
    assert sample.context.count("One of the special magic numbers for ") == 4
    compact = generate_samples("niah_multiquery", n=1, length=1500, tokenizer=tokenizer, seed=0)[0]
    assert compact.metric == "exact" and "\nQ: " in compact.question  # auto: byte-level tokenizer -> compact


@pytest.mark.parametrize("task", ["niah_single_number", "niah_single_uuid", "niah_multikey_number"])
def test_ruler_asks_for_one_value_in_the_singular(task, tokenizer):
    # RULER's niah.py rewrites its template when one value is asked ("A ... is"); the needles keep the plural
    sample = generate_samples(task, n=1, length=1500, tokenizer=tokenizer, seed=1, protocol="ruler")[0]
    kind = "uuid" if task.endswith("uuid") else "number"
    assert sample.context.startswith(f"A special magic {kind} is hidden within the following text. Make sure to "
                                     f"memorize it. I will quiz you about the {kind} afterwards.\n")
    assert f"\nWhat is the special magic {kind} for " in sample.question
    assert sample.question.endswith("mentioned in the provided text is") and len(sample.answers) == 1
    assert f"One of the special magic {kind}s for " in sample.context
    assert singular(NIAH_PREFIX) == " The special magic {kinds} for {query} mentioned in the provided text is"
    assert singular("Some keys are here") == "A keys is here"  # RULER's plain replacements, in its order


def test_chat_template_on_and_off(chat_tokenizer):
    frame = chat_frame(chat_tokenizer)
    assert frame.head == "<|im_start|>user\n" and frame.tail == "<|im_end|>\n<|im_start|>assistant\n"
    assert not frame.add_special_tokens
    assert frame.prefix(" The pass key is") == "The pass key is"
    on = generate_samples("niah_single_number", n=1, length=900, tokenizer=chat_tokenizer, protocol="ruler")[0]
    assert on.prompt.startswith("<|im_start|>user\nA special magic number is hidden")
    key = on.question.split(" for ")[1].split(" ")[0]
    assert on.question.endswith(f"provided text?<|im_end|>\n<|im_start|>assistant\nThe special magic number for {key} "
                                "mentioned in the provided text is")
    assert not on.add_special_tokens
    assert len(chat_tokenizer(on.prompt, add_special_tokens=False)["input_ids"]) == 900
    off = generate_samples("niah_single_number", n=1, length=900, tokenizer=chat_tokenizer, protocol="ruler",
                           chat_template=False)[0]
    assert "<|im_start|>" not in off.prompt and off.add_special_tokens
    assert off.question.endswith(f"provided text? The special magic number for {key} mentioned in the provided text is")
    assert off.answers == on.answers  # the same needle; only the framing differs
    assert chat_frame(chat_tokenizer, chat_template=False).head == ""


def test_pass_key_is_plain_text_even_with_a_chat_template(chat_tokenizer):
    # Mohtashami's pass-key test is a completion prompt with no chat form (in one, SmolLM2 explains pass keys)
    for chat in (True, False):
        sample = generate_samples("passkey", n=1, length=900, tokenizer=chat_tokenizer, protocol="ruler",
                                  chat_template=chat)[0]
        assert "<|im_start|>" not in sample.prompt and sample.add_special_tokens
        assert sample.prompt.startswith("There is an important info")
        assert sample.question.endswith("What is the pass key? The pass key is")
        # Mohtashami's layout: instruction line, one line of noise, the key's line, one line of noise, the question
        lead, before, key_line, after = sample.context.split("\n")
        assert key_line == f"The pass key is {sample.answers[0]}. Remember it. {sample.answers[0]} is the pass key."
        assert before.endswith(". ") and after[0].isupper()  # the key's line sits between two sentences
        assert "The grass is green. The sky is blue." in before + after


def test_bad_protocol_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="protocol='rulr' is unknown"):
        generate_samples("passkey", n=1, length=500, tokenizer=tokenizer, protocol="rulr")
