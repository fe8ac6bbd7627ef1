"""What every benchmark JSON records: the machine, the versions, the command and the date."""

from __future__ import annotations

import datetime
import platform
import sys

import torch
import transformers

import hf_nosa


def command_line() -> str:
    """The command that ran, with the output folder written as DIR (it is a path of the machine that ran it)."""
    args = list(sys.argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "--out":
            args[i + 1] = "DIR"
    return "PYTHONPATH=. python " + " ".join(args)


def package_version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "absent"


def environment() -> dict:
    return dict(
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        torch=torch.__version__,
        transformers=transformers.__version__,
        triton=package_version("triton"),
        peft=package_version("peft"),
        hf_nosa=hf_nosa.__version__,
        python=platform.python_version(),
        command=command_line(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
