"""A RULER-style synthetic long-context suite, generated locally from a seed and scored by exact match.

Every sample is a context (a haystack with needles, or a word list), a question that ends where the answer starts,
and the expected answer items. Prompts are sized to an exact number of tokens of the tokenizer they are built for.

Tasks (after RULER, Hsieh et al. 2024, and the passkey test of Mohtashami & Jaggi 2023):

- ``niah_single_number`` / ``niah_single_uuid``: one needle "One of the special magic numbers for KEY is: VALUE."
  in standard-library source text; the answer is VALUE (7 digits, or a UUID).
- ``niah_multikey_number`` / ``niah_multikey_uuid``: four needles with different keys; one key is asked.
- ``niah_multivalue``: four needles with the same key; all four values are asked, in order of appearance.
- ``niah_multiquery``: four needles with different keys; all four keys are asked, values in the order asked.
- ``vt`` (variable tracking): a chain ``VAR A = 12345.`` ... ``VAR B = VAR A.`` ... in noise text; the answer is
  every variable that holds the value, in chain order.
- ``cwe`` (common-word extraction): a numbered word list in which five words are frequent; the answer is those
  five words (in order of first appearance; scored as a set).
- ``passkey``: a five-digit pass key hidden in repeated noise sentences.

Scoring: the prediction is read up to its first newline. Single-answer tasks score 1 when it equals the answer
(surrounding spaces and a final period ignored); multi-answer tasks score the share of expected items found among
the comma-separated predicted items.
"""

from __future__ import annotations

import functools
import random
import uuid
from dataclasses import dataclass

from ..tokenizer import VOCAB_SIZE, byte_ids
from .corpus import SPLITS, corpus_text

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_NEEDLES = 4  # needles of the multi-key, multi-value and multi-query tasks (RULER's default)
_CHAIN = 5  # variables in a variable-tracking chain (one value, four hops)
_COMMON_WORDS = 5


@dataclass(frozen=True)
class Sample:
    """One prompt of the suite. ``prompt = context + question``; the model should continue with ``target``."""

    task: str
    length: int
    context: str
    question: str
    answers: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return self.context + self.question

    @property
    def target(self) -> str:
        """The expected continuation (training text ends it with a newline)."""
        return ", ".join(self.answers)

    def score(self, prediction: str) -> float:
        """Exact match in [0, 1]; see the module docstring."""
        return score(prediction, self.answers)


def score(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    """Exact-match score of a generated continuation against the expected items.

    Example:
        >>> score("1234567\\nmore", ("1234567",))
        1.0
        >>> score("ab, cd, xx", ("ab", "cd", "ef"))
        0.6666666666666666
    """
    answers = tuple(answers)
    if not answers:
        raise ValueError("answers must not be empty")
    line = prediction.split("\n", 1)[0].strip()
    if len(answers) == 1:
        return float(line.rstrip(".").strip() == answers[0])
    items = {item.strip().rstrip(".").strip() for item in line.split(",")}
    return sum(answer in items for answer in answers) / len(answers)


# ----- random values -----


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CONSONANTS)


def _key(rng: random.Random) -> str:
    return f"{_word(rng, 2)}-{_word(rng, 2)}"


def _distinct(rng: random.Random, make, n: int) -> list[str]:
    values: dict[str, None] = {}
    while len(values) < n:
        values.setdefault(make(rng))
    return list(values)


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _variable(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


# ----- haystacks -----


class Haystack:
    """Filler text; ``take`` cuts a piece of an exact token count starting at a random line."""

    def __init__(self, text: str, random_start: bool = True):
        if not text:
            raise ValueError("a haystack needs some text")
        self.text = text
        self.random_start = random_start

    def take(self, rng: random.Random, n_tokens: int, counter: "TokenCounter") -> str:
        if n_tokens <= 0:
            return ""
        text = self.text
        start = 0
        if self.random_start:
            start = text.find("\n", rng.randrange(len(text))) + 1  # 0 when no newline follows
        chars = 6 * n_tokens + 64
        piece = text[start : start + chars]
        while len(piece) < chars:  # wrap around short texts
            piece += text[: chars - len(piece)]
        return _fit(piece, n_tokens, counter)


def _fit(text: str, n_tokens: int, counter: "TokenCounter") -> str:
    """A prefix of ``text`` (space-padded if need be) of ``n_tokens`` tokens, or as close as the tokenizer allows."""
    out = counter.prefix(text, n_tokens)
    for _ in range(4):
        missing = n_tokens - counter.count(out)
        if missing <= 0:
            break
        out += " " * missing
    while out and counter.count(out) > n_tokens:
        out = out[:-1]
    return out


class TokenCounter:
    """Token counts of text pieces (without special tokens); a byte-level tokenizer is counted without calling it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        probe = "Aé<s>\n"
        ids = tokenizer(probe, add_special_tokens=False)["input_ids"]
        self.byte_level = len(tokenizer) == VOCAB_SIZE and ids == byte_ids(probe).tolist()

    def count(self, text: str) -> int:
        if self.byte_level:
            return len(text.encode("utf-8"))
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def specials(self) -> int:
        """How many tokens the tokenizer adds around a text (a BOS, say)."""
        return len(self.tokenizer("", add_special_tokens=True)["input_ids"])

    def prefix(self, text: str, n_tokens: int) -> str:
        """The longest prefix of ``text`` that is at most ``n_tokens`` tokens (up to tokenizer merges at the cut)."""
        if self.byte_level:
            return text.encode("utf-8")[:n_tokens].decode("utf-8", errors="ignore")
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) <= n_tokens:
            return text
        return text[: offsets[n_tokens][0]]


@functools.lru_cache(maxsize=4)
def _stdlib_haystack(split: str) -> Haystack:
    return Haystack(corpus_text(split))


def _noise_haystack() -> Haystack:
    return Haystack(NOISE * 8, random_start=False)


# ----- tasks: each returns needles, question, answers and the haystack kind -----


def _niah(rng, *, value, keys: int, values_per_key: int, queries: int, kind: str):
    names = _distinct(rng, _key, keys)
    needles, by_key = [], {}
    for name in names:
        for _ in range(values_per_key):
            v = value(rng)
            by_key.setdefault(name, []).append(v)
            needles.append((name, v))
    rng.shuffle(needles)
    lines = [f"One of the special magic {kind}s for {name} is: {v}.\n" for name, v in needles]
    if values_per_key > 1:
        name = names[0]
        order = [v for n, v in needles if n == name]  # order of appearance in the text
        return lines, f"\nQ: all special magic {kind}s for {name}?\nA: ", tuple(order)
    asked = rng.sample(names, queries)
    if queries == 1:
        return lines, f"\nQ: special magic {kind} for {asked[0]}?\nA: ", (by_key[asked[0]][0],)
    question = f"\nQ: special magic {kind}s for {', '.join(asked)}?\nA: "
    return lines, question, tuple(by_key[name][0] for name in asked)


def _vt(rng):
    names = _distinct(rng, _variable, _CHAIN)
    value = _number(rng, 5)
    lines = [f"VAR {names[0]} = {value}.\n"] + [f"VAR {names[i]} = VAR {names[i - 1]}.\n" for i in range(1, _CHAIN)]
    return lines, f"\nQ: variables equal to {value}?\nA: ", tuple(names)


def _passkey(rng):
    value = _number(rng, 5)
    return [f"The pass key is {value}. Remember it. {value} is the pass key.\n"], "\nWhat is the pass key? The pass key is ", (value,)


_NEEDLE_TASKS = {
    "niah_single_number": ("stdlib", lambda rng: _niah(rng, value=_number, keys=1, values_per_key=1, queries=1, kind="number")),
    "niah_single_uuid": ("stdlib", lambda rng: _niah(rng, value=_uuid, keys=1, values_per_key=1, queries=1, kind="uuid")),
    "niah_multikey_number": ("stdlib", lambda rng: _niah(rng, value=_number, keys=_NEEDLES, values_per_key=1, queries=1, kind="number")),
    "niah_multikey_uuid": ("stdlib", lambda rng: _niah(rng, value=_uuid, keys=_NEEDLES, values_per_key=1, queries=1, kind="uuid")),
    "niah_multivalue": ("stdlib", lambda rng: _niah(rng, value=_number, keys=1, values_per_key=_NEEDLES, queries=1, kind="number")),
    "niah_multiquery": ("stdlib", lambda rng: _niah(rng, value=_number, keys=_NEEDLES, values_per_key=1, queries=_NEEDLES, kind="number")),
    "vt": ("noise", _vt),
    "passkey": ("noise", _passkey),
}

TASKS = (*_NEEDLE_TASKS, "cwe")
# The suite `hf-nosa eval` runs by default: RULER's retrieval, multi-hop tracing and aggregation tasks.
DEFAULT_TASKS = tuple(task for task in TASKS if task != "passkey")


def _insert(haystack: str, lines: list[str], depths: list[float]) -> str:
    """Insert each line at the start of the haystack line found at its depth (a fraction of the length)."""
    spots = []
    for depth in depths:
        p = int(depth * len(haystack))
        after = haystack.find("\n", max(p - 1, 0))
        spots.append(0 if p == 0 else after + 1 if after >= 0 else haystack.rfind("\n") + 1)
    out, prev = [], 0
    for spot, line in sorted(zip(spots, range(len(lines))), key=lambda x: (x[0], x[1])):
        out.append(haystack[prev:spot])
        out.append(lines[line])
        prev = spot
    out.append(haystack[prev:])
    return "".join(out)


def _cwe_context(rng: random.Random, budget: int, counter: TokenCounter) -> tuple[str, tuple[str, ...]]:
    words = _distinct(rng, lambda r: _word(r, r.choice((2, 3))), _COMMON_WORDS)
    line_tokens = max(1, counter.count("123. " + words[0] + "\n"))
    n_lines = max(2 * _COMMON_WORDS, budget // line_tokens + 8)
    per_common = max(3, (3 * n_lines) // (10 * _COMMON_WORDS))  # common words fill ~30% of the list
    n_rare = max(1, n_lines - per_common * _COMMON_WORDS)  # every other word appears once
    rare = [w for w in _distinct(rng, lambda r: _word(r, r.choice((2, 3))), n_rare + _COMMON_WORDS) if w not in words]
    items = [w for w in words for _ in range(per_common)] + rare[:n_rare]
    rng.shuffle(items)
    lines, used = [], 0
    for i, word in enumerate(items):
        line = f"{i + 1}. {word}\n"
        cost = counter.count(line)
        if used + cost > budget:
            break
        lines.append(line)
        used += cost
    kept = [line.split(". ", 1)[1].strip() for line in lines]
    counts: dict[str, int] = {}
    for w in kept:
        counts[w] = counts.get(w, 0) + 1
    top = set(sorted(counts, key=lambda w: -counts[w])[:_COMMON_WORDS])  # stable: ties go to the first seen
    answers = tuple(w for w in counts if w in top)  # order of first appearance
    return "".join(lines), answers


def make_sample(task: str, rng: random.Random, length: int, tokenizer, *, split: str = "eval", counter: TokenCounter | None = None) -> Sample:
    """One sample of ``task`` whose prompt is ``length`` tokens, the tokenizer's special tokens (a BOS) included."""
    counter = counter or TokenCounter(tokenizer)
    specials = counter.specials()
    if task == "cwe":
        question = f"\nQ: {_COMMON_WORDS} most common words?\nA: "
        budget = length - counter.count(question) - specials
        if budget < 4 * _COMMON_WORDS:
            raise ValueError(f"length={length} is too short for task {task!r}")
        context, answers = _cwe_context(rng, budget, counter)
        if counter.count(context) < budget:
            context = _fit(context + " " * budget, budget, counter)
        return Sample(task, length, context, question, answers)

    kind, build = _NEEDLE_TASKS[task]
    lines, question, answers = build(rng)
    depths = sorted(rng.random() for _ in lines)
    haystack = _stdlib_haystack(split) if kind == "stdlib" else _noise_haystack()
    fixed = counter.count("".join(lines)) + counter.count(question) + specials
    budget = length - fixed
    if budget < 1:
        raise ValueError(f"length={length} is too short for task {task!r}: its needles and question need {fixed} tokens")
    hay = haystack.take(rng, budget, counter)
    for _ in range(3):  # merges across the inserted lines can shift the count by a few tokens
        context = _insert(hay, lines, depths)
        excess = counter.count(context + question) + specials - length
        if excess == 0:
            break
        hay = _fit(hay + " " * max(0, -excess), counter.count(hay) - excess, counter)
    return Sample(task, length, context, question, answers)


def generate_samples(task: str, *, n: int, length: int, tokenizer, seed: int = 0, split: str = "eval") -> list[Sample]:
    """``n`` samples of ``task`` at ``length`` tokens; the same ``seed`` gives the same samples.

    Args:
        task: one of ``TASKS``.
        split: which standard-library files fill the haystacks ("eval" for evaluation, "train" for training data).
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; allowed values are {TASKS}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; allowed values are {SPLITS}")
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length={length!r} is invalid: it must be a positive number of tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} is invalid: it must be a non-negative integer")
    counter = TokenCounter(tokenizer)
    return [
        make_sample(task, random.Random(f"{task}|{length}|{seed}|{i}"), length, tokenizer, split=split, counter=counter)
        for i in range(n)
    ]
