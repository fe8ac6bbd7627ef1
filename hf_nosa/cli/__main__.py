"""``python -m hf_nosa.cli.commands``: the ``hf-nosa`` command."""

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
