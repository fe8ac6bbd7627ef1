"""custom_generate for NOSA checkpoints: ``generate(..., cache_implementation="nosa", cache_config={...})``.

"nosa" builds an hf_nosa NosaCache (``cache_config`` holds NosaConfig overrides such as ``budget_tokens``); every
other argument goes to the stock ``generate`` unchanged. Exported with hf-nosa 0.1.0.
Install it with: pip install "hf-nosa>=0.1.0,<1"
"""

import hf_nosa
from packaging.specifiers import SpecifierSet

HF_NOSA_REQUIREMENT = ">=0.1.0,<1"

if not SpecifierSet(HF_NOSA_REQUIREMENT, prereleases=True).contains(hf_nosa.__version__):
    raise ImportError(
        f"This NOSA generate function needs hf-nosa{HF_NOSA_REQUIREMENT}; the installed hf-nosa is "
        f'{hf_nosa.__version__}. Run: pip install "hf-nosa{HF_NOSA_REQUIREMENT}"'
    )

from hf_nosa.modeling.remote import remote_generate  # noqa: E402


def generate(*args, model, **kwargs):
    """The stock ``generate`` of ``model``, with ``cache_implementation="nosa"`` available."""
    return remote_generate(model, *args, **kwargs)
