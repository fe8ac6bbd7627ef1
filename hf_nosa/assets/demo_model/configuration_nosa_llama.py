"""Configuration of this NOSA Llama checkpoint (model_type "nosa_llama").

The code lives in the hf-nosa package; this file binds it to the checkpoint. Exported with hf-nosa 0.1.0.
Install it with: pip install "hf-nosa>=0.1.0,<1"
"""

import hf_nosa
from packaging.specifiers import SpecifierSet

HF_NOSA_REQUIREMENT = ">=0.1.0,<1"

if not SpecifierSet(HF_NOSA_REQUIREMENT, prereleases=True).contains(hf_nosa.__version__):
    raise ImportError(
        f"This NOSA checkpoint needs hf-nosa{HF_NOSA_REQUIREMENT}; the installed hf-nosa is {hf_nosa.__version__}. "
        f'Run: pip install "hf-nosa{HF_NOSA_REQUIREMENT}"'
    )

from hf_nosa.modeling.remote import NosaLlamaConfig as _NosaLlamaConfig  # noqa: E402


class NosaLlamaConfig(_NosaLlamaConfig):
    """The stock config of the family plus the "nosa" section (NosaConfig fields)."""
