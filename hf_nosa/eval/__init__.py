"""Quality evidence for NOSA: a RULER-style synthetic suite, long-generation perplexity, and the runner.

Everything is generated locally (from a seed, and from the standard library's own source files), so anyone can
regenerate the numbers. ``hf-nosa eval`` is ``runner.run``.
"""

from .corpus import long_documents, stdlib_files
from .decode import DecodeResult, decode
from .perplexity import long_generation_perplexity, perplexity_documents
from .runner import METHODS, evaluate, evaluate_tasks, load_model, nosa_layout
from .tasks import DEFAULT_TASKS, TASKS, Sample, generate_samples, score

__all__ = [
    "DEFAULT_TASKS",
    "DecodeResult",
    "METHODS",
    "Sample",
    "TASKS",
    "decode",
    "evaluate",
    "evaluate_tasks",
    "generate_samples",
    "load_model",
    "long_documents",
    "long_generation_perplexity",
    "nosa_layout",
    "perplexity_documents",
    "score",
    "stdlib_files",
]
