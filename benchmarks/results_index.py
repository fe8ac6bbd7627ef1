"""Writes docs/results/README.md, the one index of docs/results/: every file's date, name, what it measured and the
command that wrote it, newest first, read from the files themselves.

A result JSON records its command and date (``environment.environment()``; older quality files under
``environment``); a PNG or log is described by the JSON of its stem, a file without a date by the day git last
committed it. Rerun after adding results:

    python benchmarks/results_index.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.__main__ import SUITES  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")
TOOLS = {  # what a command measured, by the program it ran (the benchmark scripts come from SUITES)
    "experiments/quality/run.py": "quality: a retrofit trained and evaluated on the synthetic suite (docs/results.md)",
    "experiments/quoka_passkey.py": "quality: QUOKA prefill's pass-key retrieval against dense prefill (SmolLM2)",
    "experiments/conversation_passkey.py": "quality: the pass key recalled across turns of a reused cache (SmolLM2)",
    "experiments/sticky_selection.py": "quality: sticky block selection across decode steps",
    "experiments/smollm2/evaluate.py": "quality: SmolLM2-135M evaluated per cache (suite, perplexity, locality)",
    "experiments/smollm2/prefill_chunks.py": "quality: SmolLM2 accuracy per prefill chunk setting",
    "experiments/smollm2/curve.py": "quality: SmolLM2's accuracy against the query share of the budget",
    "hf-nosa eval": "quality: hf-nosa eval, RULER-style tasks and perplexity per cache",
    "hf_nosa.cli demo": "the first NOSA call's kernel compilation time",
    "benchmarks/prefill_host_profile.py": "the QUOKA prefill's host time by function (cProfile)",
}
PREFIXES = {  # what a file without a recorded command measured, by the start of its name
    "host-dtype-quality": "quality: the fp8 and int8 host stores against the model's dtype (host_dtype_quality.py)",
    "smollm2-gpu": "quality: the SmolLM2-135M retrofit on a GPU and its evaluation (experiments/smollm2)",
    "smollm2-query-share": "quality: SmolLM2's accuracy against the query share of the budget, on the CPU",
    "quality-gpu": "quality: a retrofit trained and evaluated on the synthetic suite (docs/results.md)",
}
HEADER = """# Results: the index

Every result the docs cite, one file each: benchmark JSON (with its PNG and console log) and quality runs. A JSON
records the GPU, the versions of torch, transformers and triton, the command, the commit and the date
(`benchmarks/harness.py`). Benchmark results are named `YYYY-MM-DD_<name>` by that date; they lived in
`benchmarks/results/` until 2026-12-07, and commands recorded inside older files still name that folder or a
`gpu_session.sh` phase of their commit; a path of the machine that ran one is written DIR (its output or working
folder). Quality files keep the names their experiments write. The dated record is
[../benchmarks.md](../benchmarks.md) (speed) and [../results.md](../results.md) (quality); the suites are
`python -m benchmarks --help`. Written by `python benchmarks/results_index.py`: rerun it after adding a result.

| date | file | what it measured | command |
| --- | --- | --- | --- |
"""


def scripts() -> dict[str, str]:
    """benchmarks/<script>.py -> what it measures, and ``-m benchmarks <suite> [<part>]`` -> the same."""
    out = {}
    for name, suite in SUITES.items():
        out[f"benchmarks/{suite.script}.py"] = out[f"-m benchmarks {name}"] = suite.summary
        for part, (script, summary) in suite.parts.items():
            out[f"benchmarks/{script}.py"] = out[f"-m benchmarks {name} {part}"] = summary
    return out


def record(data) -> dict:
    """The command and date of a result, at its top level or under ``environment``."""
    if not isinstance(data, dict):
        return {}
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
    return dict(command=data.get("command") or env.get("command"), date=data.get("date") or env.get("date"),
                note=data.get("what") or data.get("about"))


def committed_date(folder: str, name: str) -> str:
    out = subprocess.run(["git", "log", "-1", "--format=%ad", "--date=short", "--", name], cwd=folder,
                         capture_output=True, text=True)
    return out.stdout.strip() or "uncommitted"


def measured(command: str | None, note: str | None, known: dict[str, str], name: str) -> str:
    """What a file measured: by the program its command ran, else its own note, else the start of its name."""
    if command:
        for program in sorted(known, key=len, reverse=True):  # "-m benchmarks train memory" before "... train"
            if re.search(re.escape(program) + r"(\s|$)", command):
                return known[program]
    if note:
        return note
    by_name = dict(PREFIXES, **{program[len("benchmarks/"):-3]: what for program, what in known.items()
                                if program.startswith("benchmarks/")})
    for prefix in sorted(by_name, key=len, reverse=True):
        if name.startswith(prefix):
            return by_name[prefix]
    return "see the docs that cite it"


def rows(folder: str = RESULTS) -> list[tuple[str, str, str, str]]:
    known = dict(scripts(), **TOOLS)
    names = sorted(n for n in os.listdir(folder) if n != "README.md")
    loaded = {}
    for name in names:
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    loaded[name] = record(json.load(f))
            except (OSError, ValueError):
                loaded[name] = {}
    out = []
    for name in names:
        stem, ext = os.path.splitext(name)
        source = stem + ".json" if stem + ".json" in loaded else re.sub(r"-(accuracy|traffic)$", "", stem) + ".json"
        info = loaded.get(name) or loaded.get(source) or {}
        date = (info.get("date") or "")[:10] or (name[:10] if re.match(r"\d{4}-\d{2}-\d{2}_", name) else "")
        date = date or committed_date(folder, name)
        what = measured(info.get("command"), info.get("note"), known, re.sub(r"^\d{4}-\d{2}-\d{2}_", "", stem))
        if "gpu_tests" in stem:
            what = "the GPU-marked tests' log (pytest -m gpu)"
        elif ext in (".png", ".log"):
            what = ("plot: " if ext == ".png" else "console log: ") + what
        command = info.get("command") if ext == ".json" else ""
        out.append((date, name, what, command or ""))
    return sorted(out, key=lambda r: (r[0], r[1]), reverse=True)


def cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text}`" if text and "`" not in text else text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=RESULTS, help="the results folder (default: docs/results)")
    args = parser.parse_args(argv)
    lines = [f"| {date} | [{name}]({name}) | {what} | {cell(command)} |"
             for date, name, what, command in rows(args.folder)]
    with open(os.path.join(args.folder, "README.md"), "w") as f:
        f.write(HEADER + "\n".join(lines) + "\n")
    print(f"indexed {len(lines)} files in {os.path.join(args.folder, 'README.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
