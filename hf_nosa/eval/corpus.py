"""Real text that ships with Python: the standard library's own source files, split into train and eval files, and
the prose of the Python reference documentation that ``pydoc`` carries (``pydoc_data.topics``), split into halves.

The file split is by a hash of each file's path relative to the library root (one file in ten goes to "eval"), the
prose split by a hash of each topic's name (one in two), so both are the same on every machine; the texts themselves
differ between Python versions, which results record.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sys
import sysconfig
from pathlib import Path

SPLITS = ("train", "eval")
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; allowed values are {SPLITS}")


def split_of(relative_path: str) -> str:
    """"eval" for one path in ten (by MD5 of the relative path), else "train"."""
    return "eval" if hashlib.md5(relative_path.encode()).digest()[0] % 10 == 0 else "train"


@functools.lru_cache(maxsize=4)
def stdlib_files(split: str) -> tuple[Path, ...]:
    """The ``.py`` files of the standard library in ``split``, sorted by relative path."""
    _check_split(split)
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if any(part in _SKIP_DIRS for part in path.relative_to(root).parts):
            continue
        if split_of(relative) == split:
            files.append((relative, path))
    if not files:
        raise FileNotFoundError(f"no standard-library .py files found under {root}")
    return tuple(path for _, path in sorted(files))


def read_text(path: Path) -> str:
    """A source file as text (undecodable bytes replaced, so every file reads)."""
    return path.read_bytes().decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=4)
def corpus_text(split: str, max_chars: int = 1 << 62) -> str:
    """The files of ``split`` concatenated (each followed by a blank line), up to ``max_chars`` characters."""
    parts, total = [], 0
    for path in stdlib_files(split):
        text = read_text(path)
        parts.append(text + "\n\n")
        total += len(text) + 2
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def long_documents(split: str, min_chars: int, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` files of ``split`` with at least ``min_chars`` characters, chosen by ``seed``: ``(name, text)`` pairs.

    Raises ValueError when the split has fewer than ``n`` such files.
    """
    root = stdlib_root()
    candidates = [path for path in stdlib_files(split) if path.stat().st_size >= min_chars]
    candidates = [path for path in candidates if len(read_text(path)) >= min_chars]
    if len(candidates) < n:
        raise ValueError(
            f"only {len(candidates)} {split} files of the standard library have >= {min_chars} characters "
            f"(Python {sys.version.split()[0]}); ask for fewer documents or shorter ones"
        )
    chosen = random.Random(f"documents:{split}:{min_chars}:{seed}").sample(candidates, n)
    return [(path.relative_to(root).as_posix(), read_text(path)) for path in chosen]


def _prose_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise FileNotFoundError(f"this Python ({sys.version.split()[0]}) ships without pydoc_data.topics, the prose "
                                "the evaluation's haystacks and the retrofit's training text use") from None
    return topics


def prose_split_of(topic: str) -> str:
    """"eval" for one documentation topic in two (by MD5 of its name), else "train"."""
    return "eval" if hashlib.md5(f"pydoc:{topic}".encode()).digest()[0] % 2 == 0 else "train"


@functools.lru_cache(maxsize=4)
def prose_documents(split: str) -> tuple[tuple[str, str], ...]:
    """The Python reference documentation's topics of ``split`` (``pydoc_data.topics``): ``(topic, text)`` pairs."""
    _check_split(split)
    topics = _prose_topics()
    chosen = [(name, topics[name]) for name in sorted(topics) if prose_split_of(name) == split and topics[name].strip()]
    if split == "train":  # some topics share one text ("if" and "else"): the evaluation's copy wins
        held_out = {topics[name] for name in topics if prose_split_of(name) == "eval"}
        chosen = [(name, text) for name, text in chosen if text not in held_out]
    return tuple(chosen)


@functools.lru_cache(maxsize=4)
def prose_text(split: str) -> str:
    """The documentation topics of ``split`` concatenated, each followed by a blank line: English prose about Python."""
    return "".join(text.strip() + "\n\n" for _, text in prose_documents(split))
