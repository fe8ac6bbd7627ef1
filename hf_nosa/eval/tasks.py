"""A RULER-style synthetic long-context suite, generated locally from a seed, in two protocols.

``protocol="ruler"`` (the default for real tokenizers) writes every prompt with RULER's own templates and answer
prefixes inside the tokenizer's chat template, fills the haystacks with RULER's noise sentences or, where RULER uses
Paul Graham's essays (not available offline), with the prose of the Python reference documentation
(``corpus.prose_text``), and scores with RULER's substring match (``ruler.py``). ``protocol="compact"`` (the default
for the byte-level tokenizer) is the terse format below, which the byte-level models of ``experiments/quality`` and the
embedded demo model were trained on, scored by exact match.

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

Compact scoring: the prediction is read up to its first newline. Single-answer tasks score 1 when it equals the answer
(surrounding spaces and a final period ignored); multi-answer tasks score the share of expected items found among
the comma-separated predicted items.
"""

from __future__ import annotations

import functools
import random
import uuid
from dataclasses import dataclass

from ..modeling.tokenizer import VOCAB_SIZE, byte_ids
from . import ruler
from .corpus import SPLITS, corpus_text, prose_text

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_NEEDLES = 4  # needles of the multi-key, multi-value and multi-query tasks (RULER's default)
_CHAIN = 5  # variables in a variable-tracking chain (one value, four hops)
_COMMON_WORDS = 5
PROTOCOLS = ("auto", "ruler", "compact")
_RULER_COMMON_WORDS, _RULER_COMMON_FREQ, _RULER_RARE_FREQ = 10, 30, 3  # RULER's num_cw, freq_cw, freq_ucw


@dataclass(frozen=True)
class Sample:
    """One prompt of the suite. ``prompt = context + question``; the model should continue with ``target``."""

    task: str
    length: int
    context: str
    question: str
    answers: tuple[str, ...]
    metric: str = "exact"  # "exact" (compact protocol), or RULER's "all" / "part"
    add_special_tokens: bool = True  # False when the prompt went through a chat template (it holds its own)

    @property
    def prompt(self) -> str:
        return self.context + self.question

    @property
    def target(self) -> str:
        """The expected continuation (training text ends it with a newline)."""
        return ", ".join(self.answers)

    def score(self, prediction: str) -> float:
        """The sample's metric in [0, 1]: exact match (compact) or RULER's all / part substring match."""
        return score(prediction, self.answers, metric=self.metric)


def score(prediction: str, answers: tuple[str, ...] | list[str], metric: str = "exact") -> float:
    """Score of a generated continuation against the expected items, by ``metric``.

    ``"exact"`` (compact protocol): see the module docstring. ``"all"`` / ``"part"``: RULER's
    ``string_match_all`` / ``string_match_part`` (``ruler.py``).

    Example:
        >>> score("1234567\\nmore", ("1234567",))
        1.0
        >>> score("ab, cd, xx", ("ab", "cd", "ef"))
        0.6666666666666666
    """
    if metric in ruler.METRICS:
        return ruler.ruler_score(prediction, answers, metric)
    if metric != "exact":
        raise ValueError(f"metric={metric!r} is unknown; allowed values are {('exact', *ruler.METRICS)}")
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


@functools.lru_cache(maxsize=4)
def _prose_haystack(split: str) -> Haystack:
    return Haystack(prose_text(split))


def _inline_noise_haystack() -> Haystack:
    # Mohtashami & Jaggi's pass-key filler: the noise sentences joined by spaces into one line
    return Haystack(" ".join([NOISE.strip()] * 64), random_start=False)


def _haystack(kind: str, split: str) -> Haystack:
    if kind == "noise":
        return _noise_haystack()
    if kind == "inline-noise":
        return _inline_noise_haystack()
    return _stdlib_haystack(split) if kind == "stdlib" else _prose_haystack(split)


# ----- tasks: each returns needles, question, answers and the haystack kind -----


def _needles(rng, value, keys: int, values_per_key: int):
    """``keys`` distinct key names, each with ``values_per_key`` values: (names, shuffled (name, value) pairs,
    values by name)."""
    names = _distinct(rng, _key, keys)
    needles, by_key = [], {}
    for name in names:
        for _ in range(values_per_key):
            v = value(rng)
            by_key.setdefault(name, []).append(v)
            needles.append((name, v))
    rng.shuffle(needles)
    return names, needles, by_key


def _niah(rng, *, value, keys: int, values_per_key: int, queries: int, kind: str):
    names, needles, by_key = _needles(rng, value, keys, values_per_key)
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


def _insert(haystack: str, lines: list[str], depths: list[float], inline: bool = False) -> str:
    """Insert each line at the start of the haystack line found at its depth (a fraction of the length), or with
    ``inline`` (one-line filler) at the start of the sentence found there; the line then brings its line breaks."""
    spots = []
    for depth in depths:
        p = int(depth * len(haystack))
        if inline:
            after = haystack.find(". ", max(p - 2, 0))
            spots.append(0 if p == 0 else after + 2 if after >= 0 else len(haystack))
            continue
        after = haystack.find("\n", max(p - 1, 0))
        spots.append(0 if p == 0 else after + 1 if after >= 0 else haystack.rfind("\n") + 1)
    out, prev = [], 0
    for spot, line in sorted(zip(spots, range(len(lines))), key=lambda x: (x[0], x[1])):
        out.append(haystack[prev:spot])
        out.append(lines[line])
        prev = spot
    out.append(haystack[prev:])
    return "".join(out)


def _word_list(rng: random.Random, budget: int, counter: TokenCounter, *, common: int, freq_common: int | None,
               freq_rare: int, line) -> tuple[str, tuple[str, ...]]:
    """A shuffled numbered word list of at most ``budget`` tokens in which ``common`` words are frequent.

    ``freq_common`` None: the common words fill ~30% of the list (compact). Returns the text and the common words in
    order of first appearance.
    """
    words = _distinct(rng, lambda r: _word(r, r.choice((2, 3))), common)
    item_tokens = max(1, counter.count(line(123, words[0])))
    if freq_common is not None:  # RULER: the mean cost of an item, so that the list just fills the budget
        probe = random.Random(rng.random())
        item_tokens = counter.count("".join(line(100 + i, _word(probe, probe.choice((2, 3)))) for i in range(64))) / 64
    n_items = max(2 * common, int(budget // item_tokens) + 8)
    per_common = freq_common or max(3, (3 * n_items) // (10 * common))
    n_rare = max(1, (n_items - per_common * common) // freq_rare)
    rare = [w for w in _distinct(rng, lambda r: _word(r, r.choice((2, 3))), n_rare + common) if w not in words]
    items = [w for w in words for _ in range(per_common)] + [w for w in rare[:n_rare] for _ in range(freq_rare)]
    rng.shuffle(items)
    pieces, kept, used = [], [], 0
    for i, word in enumerate(items):
        piece = line(i + 1, word)
        cost = counter.count(piece)
        if used + cost > budget:
            break
        pieces.append(piece)
        kept.append(word)
        used += cost
    if freq_common is not None:  # fill what the estimate left with more words that appear once
        taken = set(kept) | set(words)
        while True:
            word = _word(rng, 3)
            piece = line(len(pieces) + 1, word)
            cost = counter.count(piece)
            if word in taken:
                continue
            if used + cost > budget:
                break
            taken.add(word)
            pieces.append(piece)
            kept.append(word)
            used += cost
    counts: dict[str, int] = {}
    for w in kept:
        counts[w] = counts.get(w, 0) + 1
    top = set(sorted(counts, key=lambda w: -counts[w])[:common])  # stable: ties go to the first seen
    return "".join(pieces), tuple(w for w in counts if w in top)  # order of first appearance


def _cwe_context(rng: random.Random, budget: int, counter: TokenCounter) -> tuple[str, tuple[str, ...]]:
    return _word_list(rng, budget, counter, common=_COMMON_WORDS, freq_common=None, freq_rare=1,
                      line=lambda i, w: f"{i}. {w}\n")


def resolve_protocol(protocol: str, counter: TokenCounter) -> str:
    """``"compact"`` or ``"ruler"``: ``"auto"`` is compact for the byte-level tokenizer, RULER for any other."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is unknown; allowed values are {PROTOCOLS}")
    if protocol == "auto":
        return "compact" if counter.byte_level else "ruler"
    return protocol


def make_sample(task: str, rng: random.Random, length: int, tokenizer, *, split: str = "eval",
                counter: TokenCounter | None = None, protocol: str = "auto", chat_template: bool = True) -> Sample:
    """One sample of ``task`` whose prompt is ``length`` tokens, the tokenizer's special tokens (a BOS) included.

    Args:
        protocol: "ruler", "compact" or "auto" (see the module docstring).
        chat_template: RULER protocol only: wrap the task in the tokenizer's chat template when it has one.
    """
    counter = counter or TokenCounter(tokenizer)
    if resolve_protocol(protocol, counter) == "ruler":
        return _ruler_sample(task, rng, length, tokenizer, split, counter, chat_template)
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
    return _place(task, rng, length, counter, lines, question, answers, _haystack(kind, split), specials=specials)


def _place(task, rng, length, counter, lines, question, answers, haystack, *, specials, lead="", metric="exact",
           add_special_tokens=True, inline=False) -> Sample:
    """Needles at random depths of a haystack piece sized so that ``lead + context + question`` is ``length`` tokens."""
    depths = sorted(rng.random() for _ in lines)
    fixed = counter.count(lead) + counter.count("".join(lines)) + counter.count(question) + specials
    budget = length - fixed
    if budget < 1:
        raise ValueError(f"length={length} is too short for task {task!r}: its needles and question need {fixed} tokens")
    hay = haystack.take(rng, budget, counter)
    for _ in range(3):  # merges across the inserted lines can shift the count by a few tokens
        context = lead + _insert(hay, lines, depths, inline)
        excess = counter.count(context + question) + specials - length
        if excess == 0:
            break
        hay = _fit(hay + " " * max(0, -excess), counter.count(hay) - excess, counter)
    return Sample(task, length, context, question, answers, metric, add_special_tokens)


# ----- RULER's templates -----


def _ruler_niah(rng, *, value, keys: int, values_per_key: int, queries: int, kinds: str):
    names, needles, by_key = _needles(rng, value, keys, values_per_key)
    lines = [ruler.NIAH_NEEDLE.format(kinds=kinds, key=name, value=v) + "\n" for name, v in needles]
    asked = rng.sample(names, queries)
    query = asked[0] if queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    answers = tuple(v for name in asked for v in by_key[name])
    lead, question, prefix = ruler.NIAH_LEAD, ruler.NIAH_QUESTION, ruler.NIAH_PREFIX
    if len(answers) == 1:  # RULER asks for one value in the singular; the needles keep the plural
        lead, question, prefix = (ruler.singular(text) for text in (lead, question, prefix))
        kinds = kinds[:-1]
    return (lead.format(kinds=kinds), lines, question.format(kinds=kinds, query=query),
            prefix.format(kinds=kinds, query=query), answers)


def _ruler_vt(rng):
    names = _distinct(rng, _variable, _CHAIN)
    value = _number(rng, 5)
    lines = [f"VAR {names[0]} = {value}\n"] + [f"VAR {names[i]} = VAR {names[i - 1]}\n" for i in range(1, _CHAIN)]
    return (ruler.VT_LEAD, lines, ruler.VT_QUESTION.format(query=value),
            ruler.VT_PREFIX.format(num_v=_CHAIN, query=value), tuple(names))


def _ruler_passkey(rng):
    # Mohtashami & Jaggi's layout: instruction, filler cut at the key's depth, the key on its own line, filler, question
    value = _number(rng, 5)
    return (ruler.PASSKEY_LEAD, ["\n" + ruler.PASSKEY_NEEDLE.format(value=value) + "\n"], ruler.PASSKEY_QUESTION,
            ruler.PASSKEY_PREFIX, (value,))


# task -> (haystack, builder), after RULER's synthetic tasks: niah_single_number is its niah_single_1 (noise
# haystack), niah_single_uuid its niah_single_3, niah_multikey_number its niah_multikey_1, and so on. "prose" stands
# in for RULER's essays, "noise" is RULER's repeated noise sentences.
_RULER_TASKS = {
    "niah_single_number": ("noise", lambda r: _ruler_niah(r, value=_number, keys=1, values_per_key=1, queries=1, kinds="numbers")),
    "niah_single_uuid": ("prose", lambda r: _ruler_niah(r, value=_uuid, keys=1, values_per_key=1, queries=1, kinds="uuids")),
    "niah_multikey_number": ("prose", lambda r: _ruler_niah(r, value=_number, keys=_NEEDLES, values_per_key=1, queries=1, kinds="numbers")),
    "niah_multikey_uuid": ("prose", lambda r: _ruler_niah(r, value=_uuid, keys=_NEEDLES, values_per_key=1, queries=1, kinds="uuids")),
    "niah_multivalue": ("prose", lambda r: _ruler_niah(r, value=_number, keys=1, values_per_key=_NEEDLES, queries=1, kinds="numbers")),
    "niah_multiquery": ("prose", lambda r: _ruler_niah(r, value=_number, keys=_NEEDLES, values_per_key=1, queries=_NEEDLES, kinds="numbers")),
    "vt": ("noise", _ruler_vt),
    "passkey": ("inline-noise", _ruler_passkey),
}


def _ruler_sample(task, rng, length, tokenizer, split, counter, chat_template) -> Sample:
    # the pass-key test is a plain completion prompt (ruler.py): no chat form
    frame = ruler.chat_frame(tokenizer, chat_template and task != "passkey")
    specials = counter.specials() if frame.add_special_tokens else 0
    if task == "cwe":
        n = _RULER_COMMON_WORDS
        lead = frame.head + ruler.CWE_LEAD
        question = ruler.CWE_QUESTION.format(n=n) + frame.tail + frame.prefix(ruler.CWE_PREFIX.format(n=n))
        budget = length - counter.count(lead) - counter.count(question) - specials
        if budget < 8 * n:
            raise ValueError(f"length={length} is too short for task {task!r}")
        line_tokens = max(1, counter.count("123. " + _word(rng, 3) + " "))
        # RULER's frequencies (30 and 3) at 4K tokens and more; shorter prompts scale the common words down
        freq = max(3, min(_RULER_COMMON_FREQ, budget // line_tokens // (3 * n)))
        words, answers = _word_list(rng, budget, counter, common=n, freq_common=freq,
                                    freq_rare=min(_RULER_RARE_FREQ, freq - 1), line=lambda i, w: f"{i}. {w} ")
        context = lead + words
        for _ in range(4):  # pad the cut list with spaces (merged spaces may count as fewer tokens)
            missing = length - specials - counter.count(context + question)
            if missing <= 0:
                break
            context += " " * missing
        return Sample(task, length, context, question, answers, "all", frame.add_special_tokens)
    kind, build = _RULER_TASKS[task]
    lead, lines, question, prefix, answers = build(rng)
    question = question + frame.tail + frame.prefix(prefix)
    return _place(task, rng, length, counter, lines, question, answers, _haystack(kind, split), specials=specials,
                  lead=frame.head + lead, metric="all", add_special_tokens=frame.add_special_tokens,
                  inline=kind == "inline-noise")


def generate_samples(task: str, *, n: int, length: int, tokenizer, seed: int = 0, split: str = "eval",
                     protocol: str = "auto", chat_template: bool = True) -> list[Sample]:
    """``n`` samples of ``task`` at ``length`` tokens; the same ``seed`` gives the same samples.

    Args:
        task: one of ``TASKS``.
        split: which standard-library files and documentation topics fill the haystacks ("eval" for evaluation,
            "train" for training data).
        protocol: "ruler" (RULER's templates and scoring), "compact" (the byte-level models' format) or "auto"
            (compact for the byte-level tokenizer, RULER otherwise).
        chat_template: RULER protocol: put the task in the tokenizer's chat template when it has one.
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
    protocol = resolve_protocol(protocol, counter)
    return [
        make_sample(task, random.Random(f"{task}|{length}|{seed}|{i}"), length, tokenizer, split=split, counter=counter,
                    protocol=protocol, chat_template=chat_template)
        for i in range(n)
    ]
