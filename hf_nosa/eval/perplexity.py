"""Long-generation perplexity: the last tokens of long standard-library source files, fed one at a time.

For each document of ``length`` tokens, the first ``length - generate_tokens`` are prefilled and the last
``generate_tokens`` go through the cache's decode path, as a long generation would; the perplexity is
``exp(mean NLL)`` of those tokens. With a sparse cache, every scored token attends only to what the method keeps.
"""

from __future__ import annotations

import math
import random

import torch

from .corpus import read_text, stdlib_files
from .decode import decode


def perplexity_documents(tokenizer, *, length: int, n: int, seed: int = 0, split: str = "eval") -> list[tuple[str, list[int]]]:
    """``n`` standard-library files of ``split`` with at least ``length`` tokens, cut to ``length``: ``(name, ids)``.

    The files are taken in a seeded order, so the same seed gives the same documents on the same Python.
    """
    if length < 2:
        raise ValueError(f"length={length} is invalid: it must be at least 2 tokens")
    files = [path for path in stdlib_files(split) if path.stat().st_size >= length // 8]
    random.Random(f"perplexity|{length}|{seed}").shuffle(files)
    docs = []
    for path in files:
        text = read_text(path)
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) >= length:
            docs.append((path.name, ids[:length]))
            if len(docs) == n:
                return docs
    raise ValueError(f"only {len(docs)} {split} files of the standard library have >= {length} tokens; ask for fewer")


def long_generation_perplexity(
    model,
    docs: list[list[int]],
    *,
    make_cache,
    generate_tokens: int,
    batch_size: int = 8,
    prefill_chunk: int = 4096,
    on_batch=None,
) -> dict:
    """Perplexity of the last ``generate_tokens`` tokens of each document (all of one length), fed through decode.

    Args:
        docs: token id lists of equal length.
        make_cache: a function returning a fresh cache for one batch.
        on_batch: called as ``on_batch(cache, result)`` after each batch (to read the cache's traffic).

    Returns:
        ``{"perplexity", "nll", "tokens", "decode_steps"}``.
    """
    if not docs:
        raise ValueError("docs must not be empty")
    length = len(docs[0])
    if any(len(d) != length for d in docs):
        raise ValueError("every document must have the same number of tokens")
    if not 1 <= generate_tokens < length:
        raise ValueError(f"generate_tokens={generate_tokens} is invalid: it must be in [1, {length - 1}]")
    total, count, steps = 0.0, 0, 0
    for lo in range(0, len(docs), batch_size):
        ids = torch.tensor(docs[lo : lo + batch_size], dtype=torch.long)
        cache = make_cache()
        result = decode(
            model, ids, cache=cache, decode_from=length - generate_tokens, score=True, prefill_chunk=prefill_chunk
        )
        if on_batch is not None:
            on_batch(cache, result)
        total += float(result.nll.double().sum())
        count += result.nll.numel()
        steps += result.decode_steps
    nll = total / count
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": count, "decode_steps": steps}
