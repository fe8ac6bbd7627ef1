"""hf-nosa: trainable, offload-native sparse attention (NOSA) for Hugging Face transformers.

``import hf_nosa`` registers ``cache_implementation="nosa"`` with transformers' ``generate``.
"""

from .cache import NosaCache
from .config import NosaConfig
from .generation import register as _register
from .modeling import to_nosa

__version__ = "0.1.0"
__all__ = ["NosaCache", "NosaConfig", "to_nosa", "__version__"]

_register()
