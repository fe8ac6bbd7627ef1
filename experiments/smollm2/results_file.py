"""A results file several processes write at once (``query_share.py``, ``curve.py``): settings and lists of rows.

Every change re-reads the file under an exclusive lock and replaces it whole, so processes running different
cells into it keep each other's rows; a file written with other settings is refused by name.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path


class ResultsFile:
    """``{"settings": ..., <list>: [], ...}`` in ``path``; ``lists`` names the lists a new file starts with."""

    def __init__(self, path, settings: dict, lists: tuple[str, ...] = ("rows", "skipped")):
        self.path, self.settings, self.lists = Path(path), settings, lists
        self.data = self.read()

    def read(self) -> dict:
        if not self.path.is_file():
            return {"settings": self.settings, **{name: [] for name in self.lists}}
        saved = json.loads(self.path.read_text())
        if saved["settings"] != self.settings:
            changed = sorted(k for k in self.settings if saved["settings"].get(k) != self.settings[k])
            raise ValueError(f"{self.path} holds cells run with other settings ({changed}); give another --results")
        return saved

    def done(self, cell: str) -> bool:
        return any(row["cell"] == cell for row in self.read()["rows"])

    def update(self, change) -> None:
        """``change(data)`` applied to the file as it is now, under the lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.data = self.read()
            change(self.data)
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps(self.data, indent=1) + "\n")
            os.replace(partial, self.path)
