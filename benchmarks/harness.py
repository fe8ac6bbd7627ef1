"""What every benchmark suite shares: the device cap, the environment a result records, and the writers of its JSON
and (optional) PNG.

A result is one JSON object: the environment (``environment.environment()``: GPU, torch, transformers, triton,
peft, hf_nosa, python, command, commit, date) merged with the suite's own fields; ``write_json`` adds the
environment when the object lacks it, so every file under ``docs/results/`` says where and when it was measured.
The PNG needs matplotlib (the ``[bench]`` extra); without it a suite writes its JSON and says it drew nothing.
"""

from __future__ import annotations

import json
import os
import pathlib

from benchmarks.environment import environment

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"  # where committed results live, named YYYY-MM-DD_<name> (docs/results/README.md)
ENVIRONMENT_KEYS = ("gpu", "torch", "transformers", "triton", "command", "date")


def cap_device(cap_gb: float) -> float:
    """Cap this process' CUDA memory at ``cap_gb`` GB (10^9 bytes; the whole device when that is less) so that
    batches are searched against the same budget on any card; returns ``cap_gb``."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 1e9 / total))
    return cap_gb


def cuda_time_ms(run, repeats: int) -> float:
    """Milliseconds per call of ``run()`` on the current CUDA stream (CUDA events), after one untimed call
    (compilation, allocator warm-up)."""
    import torch

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def write_json(path: str | os.PathLike, result: dict, *, indent: int = 1) -> dict:
    """Write ``result`` to ``path`` (its folder created), with the environment in front when ``result`` does not
    already hold it; returns what was written. Suites call it after every row, so a run cut short keeps its rows."""
    if not all(key in result for key in ENVIRONMENT_KEYS):
        result = dict(environment(), **result)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=indent)
    return result


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (with a note) where matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is absent (pip install -e '.[bench]'): no PNG drawn", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 110) -> None:
    """Save ``fig`` as a PNG at ``path`` and release it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)
