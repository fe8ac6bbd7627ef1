"""The text templates an export fills: remote-code files, custom_generate and the model card (package data)."""

from __future__ import annotations

import re
from importlib import resources

_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def read_template(name: str) -> str:
    """The text of ``hf_nosa/templates/<name>`` (e.g. "modeling_nosa.py.tmpl")."""
    return resources.files("hf_nosa").joinpath("templates", name).read_text(encoding="utf-8")


def render(text: str, values: dict[str, str]) -> str:
    """Replace every ``{{NAME}}`` with ``values[NAME]``; a placeholder without a value is a KeyError."""
    missing = sorted({name for name in _PLACEHOLDER.findall(text) if name not in values})
    if missing:
        raise KeyError(f"template placeholders without a value: {missing}")
    return _PLACEHOLDER.sub(lambda match: str(values[match.group(1)]), text)
