"""Retrofit adapter folders (PEFT LoRA + eviction heads + ``nosa_retrofit.json``) merged into their base for export.

``nosa_retrofit.json`` = {"base_model", "family", "nosa_config", "recipe", "steps", "final_loss",
"tokens_per_second", "hf_nosa_version", "allocator"}, written by ``hf_nosa.training.retrofit`` next to the PEFT files
(``allocator``: the CUDA allocator setting the run trained with, None on the CPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import NosaConfig
from ..modeling import eviction_heads
from ..training.retrofit import RUN_FILE, merge_adapter
from .files import inside

RECORD_FILE = RUN_FILE
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RECORD_KEYS = ("base_model", "family", "nosa_config")


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def read_retrofit_record(folder: Path) -> dict[str, Any]:
    """The adapter's ``nosa_retrofit.json``, its base_model, family and nosa_config checked."""
    path = inside(Path(folder), RECORD_FILE)
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has PEFT adapter files but no {RECORD_FILE}: it is not a NOSA retrofit adapter "
            "(hf-nosa retrofit writes both)"
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None
    missing = [key for key in RECORD_KEYS if not isinstance(record, dict) or key not in record]
    if missing:
        raise ValueError(f"{str(path)!r} lacks {missing}")
    try:
        NosaConfig.from_dict(record["nosa_config"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{str(path)!r}: nosa_config is invalid: {error}") from None
    return record


def merge_retrofit_adapter(folder: Path, base_model: Any = None):
    """(merged NOSA model, record): ``hf_nosa.training.retrofit.merge_adapter`` with its failures stated as the adapter
    not fitting the base (another family, other shapes or layer count, a different NosaConfig)."""
    folder = Path(folder)
    record = read_retrofit_record(folder)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no {ADAPTER_WEIGHTS}")
    base_name = base_model if isinstance(base_model, (str, Path)) else record["base_model"]
    try:
        merged = merge_adapter(folder, base_model=base_model)
    except OSError as error:
        raise FileNotFoundError(f"cannot load the base model {str(base_name)!r}: {error}") from None
    except (RuntimeError, KeyError, ValueError) as error:  # PEFT reports shape and key mismatches as these
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else repr(error)
        raise ValueError(
            f"adapter {str(folder)!r} does not fit the base model {str(base_name)!r} "
            f"(trained on {record['base_model']}): {first_line}"
        ) from None
    if not eviction_heads(merged):
        raise ValueError(f"merging {str(folder)!r} lost the eviction heads")
    return merged, record
