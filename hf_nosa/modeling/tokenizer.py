"""A byte-level tokenizer built in code: nothing to download, saved beside the tiny models it serves.

Token ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, then one id per byte (``3 + byte``). Text is UTF-8 bytes, so
every string round-trips and a prompt of n ASCII characters is n tokens, which makes synthetic tasks easy to
size exactly. Special-token strings inside text are tokenized as plain bytes (``split_special_tokens``).
"""

from __future__ import annotations

import numpy as np

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
BYTE_OFFSET = len(SPECIAL_TOKENS)
VOCAB_SIZE = BYTE_OFFSET + 256


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2), so that every byte is one vocab entry."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def build_tokenizer():
    """A ``PreTrainedTokenizerFast`` with ``VOCAB_SIZE`` = 259 ids (3 special + 256 bytes); no merges.

    Example:
        >>> tok = build_tokenizer()
        >>> tok("Hi\\n")["input_ids"]
        [75, 108, 13]
        >>> tok.decode([75, 108, 13])
        'Hi\\n'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte, char in sorted(_bytes_to_unicode().items()):
        vocab[char] = BYTE_OFFSET + byte
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        split_special_tokens=True,
        model_max_length=1 << 20,
    )


def byte_ids(text: str) -> np.ndarray:
    """The ids ``build_tokenizer()`` gives ``text``, computed with numpy (fast enough to feed training): ``[T]`` int64."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + BYTE_OFFSET
