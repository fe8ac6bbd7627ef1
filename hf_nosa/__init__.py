"""hf-nosa: trainable, offload-native sparse attention (NOSA) for Hugging Face transformers.

``import hf_nosa`` registers ``cache_implementation="nosa"`` with transformers' ``generate``: at once when
transformers' generation code is loaded, else as soon as it loads. The package's names load on first use, so
``import hf_nosa`` (and the ``hf-nosa`` command's help) stays light until torch and transformers are needed.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"
__all__ = ["NosaCache", "NosaConfig", "to_nosa", "__version__"]

_LAZY = {"NosaCache": ".cache", "NosaConfig": ".config", "to_nosa": ".modeling"}
_WATCHED = ("transformers.generation.utils", "hf_nosa.generation")  # GenerationMixin; register() itself


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _loaded(name: str) -> bool:
    """The module is in sys.modules and done executing."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _register() -> None:
    """Teach generate "nosa" (``hf_nosa.generation.register``) once transformers' generation code has loaded
    and hf_nosa.generation is not halfway through its own import (it imports transformers: it then registers at
    its end)."""
    if not _loaded(_WATCHED[0]) or (_WATCHED[1] in sys.modules and not _loaded(_WATCHED[1])):
        return
    for finder in [f for f in sys.meta_path if isinstance(f, _RegisterOnLoad)]:
        sys.meta_path.remove(finder)
    from .generation import register

    register()


class _RegisterOnLoad(importlib.abc.MetaPathFinder):
    """Calls ``_register`` right after either watched module finishes executing; leaves sys.meta_path once done."""

    def __init__(self):
        self._finding = set()

    def find_spec(self, name, path=None, target=None):
        if name not in _WATCHED or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            module.__spec__._initializing = False  # done executing: what _loaded() asks
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


if _loaded(_WATCHED[0]):
    _register()
elif not any(isinstance(finder, _RegisterOnLoad) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnLoad())
