"""RULER's protocol (Hsieh et al. 2024, github.com/NVIDIA/RULER): its task templates, answer prefixes and scoring,
and the tokenizer's chat template around them.

A prompt is RULER's task template (instruction, context, question) as the user's turn of the model's chat template,
followed by RULER's answer prefix as the start of the assistant's turn; a model without a chat template (or with
``chat_template=False``) gets the template and the prefix as plain text, as RULER's "base" model template does. The
answer prefix drops its leading space after a chat template's assistant header, which ends a line.

Scoring is RULER's: a reference counts when it appears, case-insensitively, anywhere in the prediction (after control
characters are turned into newlines and the ends stripped). ``string_match_all`` gives the share of references found
(RULER's metric for its needle, variable-tracking and word-extraction tasks); ``string_match_part`` gives 1 when any
is found (its metric for question answering). RULER reports percentages; these return fractions in [0, 1].
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NIAH_LEAD = ("Some special magic {kinds} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {kinds} afterwards.\n")
NIAH_QUESTION = "\nWhat are all the special magic {kinds} for {query} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {kinds} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {kinds} for {key} is: {value}."

VT_LEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {query} in the text above."
# "assgined" is RULER's spelling: the prefix is kept exactly as RULER writes it.
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are: ")

CWE_LEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
CWE_QUESTION = "\nQuestion: What are the {n} most common words in the above list?"
CWE_PREFIX = " Answer: The top {n} words that appear most often in the list are:"



def singular(template: str) -> str:
    """RULER's rewrite of a needle template when one value is asked (niah.py, ``num_needle_q * num_needle_v == 1``):
    "Some ... are" becomes "A ... is", so the answer prefix ends in "is" and the model gives one value rather than
    starting a list. Apply it to the unformatted template (a key may hold "are"); the kind loses its "s" apart.

    Example:
        >>> singular(NIAH_PREFIX)
        ' The special magic {kinds} for {query} mentioned in the provided text is'
    """
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


# The pass-key test of Mohtashami & Jaggi (2023), which RULER's niah_single_1 generalises. It is a completion prompt
# written for base models and has no chat form: its samples are plain text even when the chat template is on.
PASSKEY_LEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                "I will quiz you about the important information there.\n")
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key."
PASSKEY_QUESTION = "\nWhat is the pass key?"
PASSKEY_PREFIX = " The pass key is"

METRICS = ("all", "part")
_CONTROL = re.compile(r"[\x00-\x1f]")
_MARK = "\u2063HF_NOSA_USER_CONTENT\u2063"


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a prediction: control characters become newlines, the ends are stripped."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references) -> float:
    """Share of ``references`` found (case-insensitive substring) in ``prediction``: RULER's ``string_match_all``.

    Example:
        >>> string_match_all("The numbers are 123, 456.", ["123", "789"])
        0.5
    """
    references = _references(references)
    text = postprocess(prediction).lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(prediction: str, references) -> float:
    """1.0 when any of ``references`` is found (case-insensitive substring) in ``prediction``, else 0.0: RULER's
    ``string_match_part``.

    Example:
        >>> string_match_part("It is 789.", ["123", "789"])
        1.0
    """
    references = _references(references)
    text = postprocess(prediction).lower()
    return float(any(ref.lower() in text for ref in references))


def _references(references) -> tuple[str, ...]:
    references = (references,) if isinstance(references, str) else tuple(references)
    if not references or not all(isinstance(r, str) and r for r in references):
        raise ValueError(f"references={references!r} is invalid: a non-empty list of non-empty strings")
    return references


def ruler_score(prediction: str, references, metric: str = "all") -> float:
    """RULER's score of one prediction with ``metric`` "all" or "part"."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is unknown; allowed values are {METRICS}")
    return (string_match_all if metric == "all" else string_match_part)(prediction, references)


@dataclass(frozen=True)
class ChatFrame:
    """What the chat template puts around the user's turn, and where the assistant's turn starts."""

    head: str  # before the user's content (system prompt, user header)
    tail: str  # after it, up to the start of the assistant's answer
    add_special_tokens: bool  # tokenise the whole prompt with the tokenizer's own special tokens (no template)

    def prefix(self, answer_prefix: str) -> str:
        """RULER's answer prefix; its leading space goes when the assistant header ends a line."""
        return answer_prefix.lstrip(" ") if self.tail.endswith("\n") else answer_prefix


PLAIN = ChatFrame("", "", True)


def chat_frame(tokenizer, chat_template: bool = True) -> ChatFrame:
    """The tokenizer's chat template split around one user message; ``PLAIN`` without one (or when turned off)."""
    if not chat_template or not getattr(tokenizer, "chat_template", None):
        return PLAIN
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=True)
    if text.count(_MARK) != 1:
        raise ValueError("the tokenizer's chat template does not place the user's message once; pass "
                         "chat_template=False (--no-chat-template)")
    head, tail = text.split(_MARK)
    return ChatFrame(head, tail, False)
