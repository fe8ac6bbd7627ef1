"""Retrofit adapter folders (PEFT LoRA + eviction heads + ``nosa_retrofit.json``) merged into their base for export.

``nosa_retrofit.json`` = {"base_model", "family", "nosa_config", "recipe", "steps", "final_loss",
"tokens_per_second", "hf_nosa_version"}, written by ``hf_nosa.retrofit`` next to the PEFT files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import NosaConfig
from ..modeling import eviction_heads, family_of, to_nosa

logger = logging.getLogger(__name__)

RECORD_FILE = "nosa_retrofit.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
RECORD_KEYS = ("base_model", "family", "nosa_config")


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def read_retrofit_record(folder: Path) -> dict[str, Any]:
    """The adapter's ``nosa_retrofit.json``, its base_model, family and nosa_config checked."""
    path = Path(folder) / RECORD_FILE
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


def _load_base(base: Any):
    from torch import nn
    from transformers import AutoModelForCausalLM

    if isinstance(base, nn.Module):
        return base
    try:
        return AutoModelForCausalLM.from_pretrained(str(base))
    except OSError as error:
        raise FileNotFoundError(f"cannot load the base model {str(base)!r}: {error}") from None


def merge_retrofit_adapter(folder: Path, base_model: Any = None):
    """(merged NOSA model, record): the adapter's LoRA merged into its base, eviction heads restored.

    ``base_model`` (path, Hub id or model; default: the recorded one) must be the model the adapter was trained
    on: another family, other shapes, or an adapter whose tensors do not all land in the model are errors.
    """
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(folder)
    record = read_retrofit_record(folder)
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no {ADAPTER_WEIGHTS}")
    base_name = base_model if isinstance(base_model, (str, Path)) else record["base_model"]
    model = _load_base(base_model if base_model is not None else record["base_model"])
    family = family_of(model)
    if family != record["family"]:
        raise ValueError(
            f"adapter {str(folder)!r} was trained on a {record['family']} model ({record['base_model']}); "
            f"the base model given is a {family} model"
        )
    to_nosa(model, NosaConfig.from_dict(record["nosa_config"]))
    try:
        peft_model = PeftModel.from_pretrained(model, str(folder))
    except (RuntimeError, KeyError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise ValueError(
            f"adapter {str(folder)!r} does not fit the base model {str(base_name)!r} "
            f"(trained on {record['base_model']}): {first_line}"
        ) from None
    stored = load_file(str(folder / ADAPTER_WEIGHTS))
    loaded = get_peft_model_state_dict(peft_model)
    lost = sorted(set(stored) - set(loaded))
    differ = [name for name in set(stored) & set(loaded) if not torch.equal(stored[name].to(loaded[name]), loaded[name])]
    if lost or differ:
        raise ValueError(
            f"adapter {str(folder)!r} does not fit the base model {str(base_name)!r}: "
            f"{len(lost) + len(differ)} adapter tensors did not load (e.g. {(lost + differ)[0]})"
        )
    merged = peft_model.merge_and_unload()
    if not eviction_heads(merged):
        raise ValueError(f"merging {str(folder)!r} lost the eviction heads")
    return merged, record
