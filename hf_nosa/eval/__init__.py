"""Quality evidence for NOSA: a RULER-style synthetic suite, long-generation perplexity, and the runner.

Everything is generated locally (from a seed, the standard library's own source files and the prose of the Python
reference documentation), so anyone can regenerate the numbers. Real tokenizers get RULER's templates, chat template
and scoring (``ruler``); the byte-level models keep their compact format. ``hf-nosa eval`` is ``runner.run``.
"""

from .corpus import long_documents, stdlib_files
from .decode import DecodeResult, decode
from .perplexity import long_generation_perplexity, perplexity_documents
from .ruler import string_match_all, string_match_part
from .runner import METHODS, check_layouts, evaluate, evaluate_tasks, format_table, load_model, nosa_layout
from .tasks import DEFAULT_TASKS, PROTOCOLS, TASKS, Sample, generate_samples, score

__all__ = [
    "DEFAULT_TASKS",
    "DecodeResult",
    "METHODS",
    "PROTOCOLS",
    "Sample",
    "TASKS",
    "check_layouts",
    "decode",
    "evaluate",
    "evaluate_tasks",
    "format_table",
    "generate_samples",
    "load_model",
    "long_documents",
    "long_generation_perplexity",
    "nosa_layout",
    "perplexity_documents",
    "score",
    "stdlib_files",
    "string_match_all",
    "string_match_part",
]
