"""Retrofit recipes: the YAML files of ``recipes/`` (or a dict), validated, with their defaults filled in.

``load_recipe`` is what ``hf-nosa retrofit --recipe`` reads; every key and its meaning is in ``recipes/README.md``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..config import NosaConfig
from ..modeling import FAMILIES
from .data import BUILTIN_DATA

REQUIRED = ("model", "nosa", "lora", "seq_len", "lr_eviction", "lr_lora", "steps", "batch_size", "grad_accum",
            "device_memory_gb")
DEFAULTS = dict(description="", tokenizer=None, text_field="text", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, seed=0, save_every=0, keep_checkpoints=2, gradient_checkpointing=True,
                selection_loss=0.0, eviction_loss=0.0, distill_loss=0.0, data=None)
LORA_KEYS = ("r", "alpha", "dropout", "target_modules")
MODEL_CONFIG_KEYS = ("config", "family", "seed")


def _recipe_dirs() -> list[Path]:
    return [Path.cwd() / "recipes", Path(__file__).resolve().parents[2] / "recipes"]


def _number(recipe: dict, name: str, kind: type, low: float, *, inclusive: bool = False):
    value = recipe[name]
    if kind is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    ok_type = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not (value >= low if inclusive else value > low):
        bound = f">= {low}" if inclusive else f"> {low}"
        raise ValueError(f"recipe {name}={value!r} is invalid: it must be {'an integer' if kind is int else 'a number'} {bound}")
    recipe[name] = kind(value)


def load_recipe(recipe: str | Path | dict) -> dict:
    """A validated recipe with defaults filled: from a dict, a YAML path, or a bare name in ``recipes/``.

    Required keys: ``model`` (Hub id, local folder, ``.gguf`` file, ``smollm2``, or ``{"config": {...}, "family": ...,
    "seed": 0}`` for a random model built from a config; a relative ``.gguf`` path is looked up beside the recipe
    file too), ``nosa`` (NosaConfig fields), ``lora`` (``r``, ``alpha``, ``dropout``,
    ``target_modules``), ``seq_len`` (a multiple of the block size), ``lr_eviction``, ``lr_lora``, ``steps``,
    ``batch_size`` (per process), ``grad_accum``, ``device_memory_gb``. Optional: see ``DEFAULTS`` (``data``: the
    training data when none is given, a path or a built-in corpus of ``BUILTIN_DATA``).
    Unknown keys are an error.
    """
    if isinstance(recipe, (str, Path)):
        path = Path(recipe)
        if not path.is_file() and path.suffix not in (".yaml", ".yml") and len(path.parts) == 1:  # a bare name
            candidates = [folder / f"{path}.yaml" for folder in _recipe_dirs()]
            path = next((c for c in candidates if c.is_file()), candidates[0])
        if not path.is_file():
            raise FileNotFoundError(f"recipe {str(recipe)!r} not found (looked for {path}); pass a YAML path or a "
                                    f"name of {sorted({p.stem for d in _recipe_dirs() if d.is_dir() for p in d.glob('*.yaml')})}")
        import yaml

        recipe = yaml.safe_load(path.read_text())
        model = recipe.get("model") if isinstance(recipe, dict) else None
        if isinstance(model, str) and model.lower().endswith(".gguf") and not Path(model).is_absolute():
            beside = path.resolve().parent / model
            if not Path(model).is_file() and beside.is_file():
                recipe["model"] = str(beside)
    if not isinstance(recipe, dict):
        raise TypeError(f"recipe must be a mapping of keys to values, got {type(recipe).__name__}")
    unknown = sorted(set(recipe) - set(REQUIRED) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"recipe: unknown key(s) {unknown}; allowed keys are {sorted([*REQUIRED, *DEFAULTS])}")
    missing = [key for key in REQUIRED if key not in recipe]
    if missing:
        raise ValueError(f"recipe: missing required key(s) {missing}")
    out = {**DEFAULTS, **json.loads(json.dumps(recipe))}
    model = out["model"]
    if isinstance(model, dict):
        unknown = sorted(set(model) - set(MODEL_CONFIG_KEYS))
        if unknown or not isinstance(model.get("config"), dict) or model.get("family") not in FAMILIES:
            raise ValueError(f"recipe model: a mapping needs 'config' (a dict of config fields) and 'family' (one of "
                             f"{sorted(FAMILIES)}), optionally 'seed'; got keys {sorted(model)}")
        model.setdefault("seed", 0)
    elif not isinstance(model, str) or not model:
        raise ValueError(f"recipe model={model!r} is invalid: a Hub id, a local folder, or a mapping with 'config'")
    if not isinstance(out["nosa"], dict):
        raise ValueError("recipe nosa must be a mapping of NosaConfig fields")
    cfg = NosaConfig.from_dict(out["nosa"])
    lora = out["lora"]
    if not isinstance(lora, dict) or sorted(lora) != sorted(LORA_KEYS):
        raise ValueError(f"recipe lora must have exactly the keys {list(LORA_KEYS)}; got {lora!r}")
    _number(lora, "r", int, 0)
    _number(lora, "alpha", float, 0)
    _number(lora, "dropout", float, 0, inclusive=True)
    targets = lora["target_modules"]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"recipe lora.target_modules={targets!r} is invalid: a non-empty list of module names")
    for name in ("seq_len", "steps", "batch_size", "grad_accum"):
        _number(out, name, int, 0)
    for name in ("lr_eviction", "lr_lora", "device_memory_gb"):
        _number(out, name, float, 0)
    for name in ("warmup_steps", "save_every", "seed"):
        _number(out, name, int, 0, inclusive=True)
    _number(out, "keep_checkpoints", int, 0)
    _number(out, "weight_decay", float, 0, inclusive=True)
    for name in ("selection_loss", "eviction_loss"):  # weights of hf_nosa.attention.selection_loss's auxiliary losses
        _number(out, name, float, 0, inclusive=True)
    _number(out, "distill_loss", float, 0, inclusive=True)  # weight of the KL to the base model (training.distill)
    if (out["selection_loss"] or out["eviction_loss"]) and out["gradient_checkpointing"]:
        raise ValueError("recipe selection_loss / eviction_loss need gradient_checkpointing: false (a recomputed layer "
                         "does not hand its loss back)")
    if out["max_grad_norm"] is not None:
        _number(out, "max_grad_norm", float, 0)
    if out["seq_len"] % cfg.block_size:
        raise ValueError(f"recipe seq_len={out['seq_len']} is invalid: it must be a multiple of "
                         f"nosa.block_size={cfg.block_size}")
    if not isinstance(out["gradient_checkpointing"], bool):
        raise ValueError("recipe gradient_checkpointing must be true or false")
    for name in ("tokenizer",):
        if out[name] is not None and not isinstance(out[name], str):
            raise ValueError(f"recipe {name} must be a string (a Hub id, a folder, or 'bytes') or null")
    if out["data"] is not None and (not isinstance(out["data"], str) or not out["data"]):
        raise ValueError(f"recipe data={out['data']!r} is invalid: a path (file or folder) or one of {BUILTIN_DATA}")
    return out
