"""What every benchmark JSON records: the machine, the versions, the command and the date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch
import transformers

import hf_nosa


def command_line() -> str:
    """The command that ran (``python -m benchmarks <suite> ...``, or a script named from the repository root),
    with the output folder written as DIR (it is a path of the machine that ran it) and the ``HF_NOSA_*`` settings
    of the run in front (they change what runs, e.g. ``HF_NOSA_PREFILL_FETCH_PARTS``; ``HF_NOSA_COMMIT`` only names
    the code and is left out), and ``PYTORCH_CUDA_ALLOC_CONF`` where set (it changes what fits)."""
    args = list(sys.argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args and args[0].startswith("python -m "):
        launcher = []  # a suite run by python -m benchmarks names its own program (benchmarks/__main__.py)
    else:
        launcher = ["PYTHONPATH=. python"]
        if args and os.path.abspath(args[0]).startswith(root + os.sep):
            args[0] = os.path.relpath(os.path.abspath(args[0]), root)  # the script, as the repository names it
    for i, arg in enumerate(args[:-1]):
        if arg == "--out":
            out, args[i + 1] = args[i + 1], "DIR"
            # other paths in that folder (a --profile beside the JSON) are the run machine's too
            folder = os.path.dirname(os.path.abspath(out)) + os.sep
            args = [("DIR" + os.sep + a[len(folder):]) if a.startswith(folder) else a for a in args]
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items())
                if k.startswith("HF_NOSA_") and k != "HF_NOSA_COMMIT" or k == "PYTORCH_CUDA_ALLOC_CONF"]
    return " ".join(settings + launcher + args)


def package_version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "absent"


def source_commit() -> str:
    """The git commit of the code that ran: ``HF_NOSA_COMMIT`` when set (a copy of the tree without its .git),
    else ``git rev-parse`` beside this file, else "unknown"."""
    if os.environ.get("HF_NOSA_COMMIT"):
        return os.environ["HF_NOSA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


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
        commit=source_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
