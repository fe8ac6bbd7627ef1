"""The retrofit's training data: local jsonl / json / parquet / txt files read through ``datasets``, tokenized
when they hold text, and packed into sequences of the recipe's length."""

from __future__ import annotations

from pathlib import Path

import torch

from .tokenizer import SPECIAL_TOKENS, byte_ids

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    return (lambda texts: tok(texts)["input_ids"]), tok.eos_token_id


def data_files(data: str | Path) -> dict[str, list[str]]:
    """The data files of ``data`` (a file or a folder of .jsonl/.json/.parquet/.txt) grouped by ``datasets`` builder."""
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"data path {str(data)!r} does not exist")
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


def pack_data(data: str | Path, recipe: dict, base, eos_id: int | None) -> torch.Tensor:
    """Read the data through ``datasets`` and pack it into ``[n, seq_len]`` token sequences.

    Records with ``input_ids`` are used as they are; records with the recipe's ``text_field`` (``.txt`` files: one
    record per file) go through the tokenizer. Documents are joined with the end-of-sequence token.
    """
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
