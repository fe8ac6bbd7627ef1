"""The retrofit's training data: local jsonl / json / parquet / txt files read through ``datasets``, tokenized
when they hold text, and packed into sequences of the recipe's length; or ``python-prose-and-code``, text every
Python installation carries.

``python-prose-and-code`` is the standard library's ``.py`` files of the "train" split (code, with English docstrings
and comments) and the "train" half of the Python reference documentation's prose (``pydoc_data.topics``), in a seeded
order. The evaluation draws its haystacks from the other split and half, and from its noise sentences, so nothing the
suite measures on is trained on; it never trains on the suite's templates either.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..modeling.tokenizer import SPECIAL_TOKENS, byte_ids

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
BUILTIN_DATA = ("python-prose-and-code",)
EOS_ID = SPECIAL_TOKENS.index("</s>")  # of the byte-level tokenizer (recipe tokenizer: bytes)


def _byte_ids(texts: list[str]) -> list[list[int]]:
    return [byte_ids(text).tolist() for text in texts]


def _tokenizer(recipe: dict, base):
    name = recipe["tokenizer"]
    if name == "bytes":
        return _byte_ids, EOS_ID
    if name is None:
        name = base if isinstance(base, str) else getattr(getattr(base, "config", None), "_name_or_path", "") or None
    if name is None:
        raise ValueError("the data holds text but the recipe names no tokenizer and the base model has none: set "
                         "recipe tokenizer (a Hub id, a folder, or 'bytes'), or give the data as input_ids")
    from ..modeling.loading import load_tokenizer

    tok = load_tokenizer(name)
    return (lambda texts: tok(texts, add_special_tokens=True)["input_ids"]), tok.eos_token_id


def builtin_documents(name: str, seed: int = 0) -> list[str]:
    """The documents of a built-in corpus (``BUILTIN_DATA``), in an order fixed by ``seed``."""
    import random

    from ..eval.corpus import prose_documents, read_text, stdlib_files

    if name not in BUILTIN_DATA:
        raise ValueError(f"data={name!r} is not a built-in corpus; built-in corpora are {BUILTIN_DATA}")
    docs = [text for _, text in prose_documents("train")] + [path for path in stdlib_files("train")]
    random.Random(f"{name}:{seed}").shuffle(docs)
    return [doc if isinstance(doc, str) else read_text(doc) for doc in docs]


def _pack_builtin(name: str, recipe: dict, base, eos_id: int | None, sequences: int | None) -> torch.Tensor:
    """Tokenize the built-in corpus document by document until ``sequences`` sequences are filled (all: None)."""
    encode, tok_eos = _tokenizer(recipe, base)
    eos_id = eos_id if eos_id is not None else tok_eos
    tail = [] if eos_id is None else [eos_id]
    need = None if sequences is None else sequences * recipe["seq_len"]
    ids: list[int] = []
    docs = builtin_documents(name, recipe["seed"])
    for lo in range(0, len(docs), 64):
        for doc in encode(docs[lo : lo + 64]):
            ids += list(doc) + tail
        if need is not None and len(ids) >= need:
            break
    n = len(ids) // recipe["seq_len"] if need is None else min(len(ids), need) // recipe["seq_len"]
    if n == 0:
        raise ValueError(f"data {name!r} holds {len(ids)} tokens; one training sequence needs seq_len={recipe['seq_len']}")
    return torch.tensor(ids[: n * recipe["seq_len"]], dtype=torch.long).view(n, recipe["seq_len"])


def data_files(data: str | Path) -> dict[str, list[str]]:
    """The data files of ``data`` (a file or a folder of .jsonl/.json/.parquet/.txt) grouped by ``datasets`` builder;
    ``{}`` for a built-in corpus (``BUILTIN_DATA``)."""
    if str(data) in BUILTIN_DATA and not Path(data).exists():
        return {}
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"data path {str(data)!r} does not exist (nor is it a built-in corpus: {BUILTIN_DATA})")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    groups: dict[str, list[str]] = {}
    for file in files:
        builder = DATA_SUFFIXES.get(file.suffix.lower())
        if builder is None and not path.is_dir():
            raise ValueError(f"data file {file} has suffix {file.suffix!r}; allowed are {sorted(DATA_SUFFIXES)}")
        if builder is not None and file.stat().st_size > 0:
            groups.setdefault(builder, []).append(str(file))
    if not groups:
        raise ValueError(f"data path {str(data)!r} holds no non-empty {sorted(DATA_SUFFIXES)} file")
    return groups


def pack_data(data: str | Path, recipe: dict, base, eos_id: int | None, *, sequences: int | None = None) -> torch.Tensor:
    """Read the data through ``datasets`` and pack it into ``[n, seq_len]`` token sequences.

    Records with ``input_ids`` are used as they are; records with the recipe's ``text_field`` (``.txt`` files: one
    record per file) go through the tokenizer. Documents are joined with the end-of-sequence token. A built-in
    corpus is tokenized only until ``sequences`` sequences are filled (None: all of it).
    """
    if not data_files(data):
        return _pack_builtin(str(data), recipe, base, eos_id, sequences)
    import datasets
    import numpy as np

    parts = []
    for builder, files in data_files(data).items():
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=files, split="train", keep_in_memory=True, **kwargs)
        if "input_ids" in ds.column_names:
            encode, column = (lambda docs: docs), "input_ids"
        elif recipe["text_field"] in ds.column_names:
            encode, tok_eos = _tokenizer(recipe, base)
            eos_id, column = (eos_id if eos_id is not None else tok_eos), recipe["text_field"]
        else:
            raise ValueError(f"data files {files} have columns {ds.column_names}; expected 'input_ids' or "
                             f"{recipe['text_field']!r} (recipe text_field)")
        tail = [] if eos_id is None else [eos_id]

        def to_ids(batch, encode=encode, column=column, tail=tail):
            return {"ids": [list(doc) + tail for doc in encode([x for x in batch[column] if x])]}

        ds = ds.map(to_ids, batched=True, remove_columns=ds.column_names, keep_in_memory=True)
        parts += [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in ds.data.column("ids").chunks]
    ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    n = len(ids) // recipe["seq_len"]
    if n == 0:
        raise ValueError(f"data {str(data)!r} holds {len(ids)} tokens; one training sequence needs "
                         f"seq_len={recipe['seq_len']}")
    return torch.from_numpy(ids[: n * recipe["seq_len"]].copy()).view(n, recipe["seq_len"])
