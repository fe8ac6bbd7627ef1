"""Export and Hub publishing of NOSA checkpoints (in the core install: export, verify and push need no extra).

``export`` turns a NOSA model or a retrofit adapter into a self-describing checkpoint folder that loads with
``AutoModelForCausalLM.from_pretrained(folder_or_repo, trust_remote_code=True)`` and decodes with
``generate(..., cache_implementation="nosa")``; ``verify_folder`` checks such a folder without running its code, and
``push`` verifies it and publishes the files export wrote in one commit.

Example:
    >>> from hf_nosa.hub import export, push  # doctest: +SKIP
    >>> export(model, "nosa-llama-1b", repo_id="me/nosa-llama-1b")  # doctest: +SKIP
    >>> push("nosa-llama-1b", "me/nosa-llama-1b", dry_run=True)  # doctest: +SKIP
"""

from ..modeling.remote import register_auto_classes
from .card import load_metrics, render_model_card
from .exporter import export
from .publish import PushError, push
from .verify import verify_folder

__all__ = [
    "PushError",
    "export",
    "load_metrics",
    "push",
    "register_auto_classes",
    "render_model_card",
    "verify_folder",
]
