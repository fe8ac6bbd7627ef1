"""The model card (README.md) of an exported NOSA checkpoint, rendered from ``hf_nosa/templates/model_card.md``.

Metadata: base_model, base_model_relation, library_name, pipeline_tag, tags and the base model's license. The body:
NOSA in two sentences, the usage snippet, the NosaConfig table, the retrofit recipe and an evaluation table.

The evaluation table comes from an optional metrics JSON in any of these shapes:
``[{"task": ..., "metric": ..., "nosa": ..., ...}, ...]`` (one row per object, columns in first-seen order),
``{"results": [ ...rows... ]}``, ``{"<task>": {"<column>": value, ...}, ...}`` or ``{"<task>": value, ...}``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from ..config import PREFILL_MODES, NosaConfig
from .files import inside
from .templates import read_template, render

logger = logging.getLogger(__name__)

CARD_TEMPLATE = "model_card.md"
TAGS = ("nosa", "sparse-attention", "kv-cache-offload")
BASE_MODEL_RELATIONS = ("adapter", "merge", "quantized", "finetune")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

FIELD_MEANINGS = {
    "block_size": "tokens per KV block, the unit of selection and transfer",
    "budget_tokens": "tokens of KV blocks each sequence attends to per decode step (the device working set)",
    "query_tokens": "part of the budget chosen by the current query (query-aware selection)",
    "sink_tokens": "first tokens, always attended",
    "local_tokens": "most recent tokens, always attended (local window)",
    "compress_kernel": "window of the mean-pooled keys used to score blocks",
    "compress_stride": "stride of those windows",
    "prefill": f"how the prompt is processed, one of {', '.join(PREFILL_MODES)}",
    "offload": "keep the full KV cache in host memory",
    "prefill_chunk_size": "prompt tokens per chunk in chunked prefill, the same for every row whatever the batch",
    "prefill_batch_tokens": "no longer used (kept so that older configs load)",
    "prefill_max_chunk_size": "no longer used (kept so that older configs load)",
    "decode_rule_tokens": "new tokens on a held sequence up to this many attend by the decode rule; more are prefilled",
    "prefill_whole_prompt_tokens": "prompts up to this many tokens (rows x length) go through each layer whole",
    "quoka_queries": "queries per head kept by QUOKA to score blocks",
    "prefill_budget_tokens": "KV tokens each prompt chunk attends to (default: budget_tokens)",
    "resident_margin": "decode keeps a block it holds unless a new one scores this much higher (0: off)",
}


def is_repo_id(name: Any) -> bool:
    """True for a Hub model id ("org/name") that is not also a local path."""
    return isinstance(name, str) and bool(_REPO_ID.match(name)) and not os.path.exists(name)


def load_metrics(metrics: Any) -> list[dict[str, Any]]:
    """Rows of the evaluation table from a metrics JSON path or an already-parsed object (see the module doc)."""
    if metrics is None:
        return []
    if isinstance(metrics, (str, os.PathLike)):
        path = Path(metrics)
        if not path.is_file():
            raise FileNotFoundError(f"metrics file {str(path)!r} does not exist")
        try:
            metrics = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"metrics file {str(path)!r} is not valid JSON: {error}") from None
    if isinstance(metrics, dict) and isinstance(metrics.get("results"), list):
        metrics = metrics["results"]
    if isinstance(metrics, dict):
        rows = []
        for task, value in metrics.items():
            if isinstance(value, dict):
                rows.append({"task": task, **value})
            elif _is_scalar(value):
                rows.append({"task": task, "value": value})
            else:
                raise ValueError(f"metrics[{task!r}] must be a number, a string or an object of them, got {value!r}")
        return rows
    if isinstance(metrics, list) and all(isinstance(row, dict) for row in metrics):
        for row in metrics:
            bad = [key for key, value in row.items() if not _is_scalar(value)]
            if bad:
                raise ValueError(f"metrics rows must hold numbers or strings; row {row!r} has {bad}")
        return [dict(row) for row in metrics]
    raise ValueError(
        "metrics must be a list of row objects, {'results': [rows]}, {task: {column: value}} or {task: value}; "
        f"got {type(metrics).__name__}"
    )


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _metrics_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "No evaluation results were provided at export (`hf-nosa export --metrics results.json`)."
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    return markdown_table(columns, [[row.get(column) for column in columns] for row in rows])


def _nosa_table(cfg: NosaConfig) -> str:
    return markdown_table(
        ["field", "value", "meaning"],
        [[f"`{name}`", f"`{value!r}`", FIELD_MEANINGS.get(name, "")] for name, value in cfg.to_dict().items()],
    )


def _retrofit_section(record: dict[str, Any] | None) -> str:
    if not record:
        return (
            "No retrofit record: this checkpoint was exported from a converted model, not from a retrofit adapter "
            "(`hf-nosa retrofit` writes one next to the adapter)."
        )
    rows = [[key, record.get(key)] for key in ("base_model", "recipe", "steps", "final_loss", "tokens_per_second")]
    rows += [["hf_nosa_version (retrofit)", record.get("hf_nosa_version")]]
    recipe = record.get("recipe")
    if isinstance(recipe, dict):
        rows[1][1] = recipe.get("name") or recipe.get("description") or "below"
    text = (
        "LoRA on the attention projections plus fully trained eviction heads, with the same sparse attention the "
        "model decodes with; the adapter was merged into the weights at export.\n\n"
        + markdown_table(["", "value"], [[f"`{key}`", value] for key, value in rows])
    )
    if isinstance(recipe, dict):
        text += "\n\nRecipe:\n\n```json\n" + json.dumps(recipe, indent=2, sort_keys=True, default=str) + "\n```"
    return text


def base_model_license(base: Any) -> dict[str, str]:
    """license / license_name / license_link of a base model's card, read from a local folder or the local Hub
    cache only (never the network); empty when unknown."""
    readme = None
    if isinstance(base, (str, os.PathLike)) and Path(base, "README.md").is_file():
        readme = inside(Path(base), "README.md")
    elif is_repo_id(base):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(base, "README.md")
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None:
        return {}
    try:
        data = ModelCard.load(readme).data.to_dict()
    except Exception as error:  # a malformed base card must not block the export; say so
        logger.warning("could not read the license from %s: %s", readme, error)
        return {}
    return {key: data[key] for key in ("license", "license_name", "license_link") if data.get(key)}


def render_model_card(
    *,
    family: str,
    model_type: str,
    nosa_config: NosaConfig,
    hf_nosa_version: str,
    hf_nosa_requirement: str,
    repo_id: str,
    base_model_id: str | None = None,
    base_model_relation: str = "finetune",
    license_info: dict[str, str] | None = None,
    retrofit_record: dict[str, Any] | None = None,
    metrics: list[dict[str, Any]] | None = None,
    title: str | None = None,
) -> str:
    """The README.md text of an exported checkpoint; ``huggingface_hub.ModelCard`` parses it."""
    if base_model_relation not in BASE_MODEL_RELATIONS:
        raise ValueError(f"base_model_relation={base_model_relation!r}; allowed values are {BASE_MODEL_RELATIONS}")
    data = ModelCardData(
        base_model=base_model_id,
        base_model_relation=base_model_relation if base_model_id else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=list(TAGS) + [family],
        **(license_info or {}),
    )
    name = title or repo_id.rstrip("/").split("/")[-1]
    if base_model_id:
        summary = (
            f"[{base_model_id}](https://huggingface.co/{base_model_id}) with NOSA attention: trainable, "
            "offload-native block-sparse attention with eviction heads, for long-context decoding with the KV "
            "cache in host memory."
        )
    else:
        summary = (
            f"A {family} model with NOSA attention: trainable, offload-native block-sparse attention with eviction "
            "heads, for long-context decoding with the KV cache in host memory."
        )
    values = {
        "METADATA": data.to_yaml(),
        "TITLE": name,
        "SUMMARY": summary,
        "REPO_ID": repo_id,
        "MODEL_TYPE": model_type,
        "BUDGET_TOKENS": nosa_config.budget_tokens,
        "HF_NOSA_VERSION": hf_nosa_version,
        "HF_NOSA_REQUIREMENT": hf_nosa_requirement,
        "NOSA_CONFIG_TABLE": _nosa_table(nosa_config),
        "RETROFIT_SECTION": _retrofit_section(retrofit_record),
        "EVALUATION_SECTION": _metrics_table(metrics or []),
    }
    return render(read_template(CARD_TEMPLATE), values)
