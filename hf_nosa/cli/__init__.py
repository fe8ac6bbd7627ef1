"""The ``hf-nosa`` command: ``main`` (dispatch), ``args`` (every command's arguments, argparse only), ``demo``."""

from .commands import main

__all__ = ["main"]
