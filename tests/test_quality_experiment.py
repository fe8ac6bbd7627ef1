"""experiments/quality/run.py, the experiment behind docs/results.md: every stage at toy sizes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_nosa.eval import load_model
from hf_nosa.modeling import eviction_heads

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "experiments" / "quality" / "run.py"


SMOKE = ["--smoke", "--selection-loss", "0.05", "--eviction-loss", "0.1", "--minutes", "600", "--max-steps", "10"]
# Steps, not seconds, bound the training, and the time budget is far above what the toy run needs: the work is the
# same however loaded the machine, and no row is skipped for time. 10 steps: the fine-tunes log every 10th step, their
# auxiliary (alignment) loss included.

BAD_SETTINGS = [
    (["--query-tokens", "32"], "the evaluation at 384 tokens has a budget of 48 tokens"),
    (["--windows", "4x2"], "--windows='4x2' is invalid"),
    (["--selection-loss", "-1"], "--selection-loss=-1.0 is invalid"),
    (["--rope-factor", "0.5"], "--rope-factor=0.5 is invalid"),
]

# One fresh interpreter for the whole file (starting one costs seconds of imports): first every bad setting through
# run.py's main() (the exit code and stderr of each call, and whether its --out folder exists afterwards), then the
# smoke run through run.py as a script (its ``__main__`` block, as ``python run.py`` runs it). One thread: the toy
# model's matrices are tiny, and a second thread only slows the run on a busy 2-core machine.
RUN_ALL = """
import contextlib, importlib.util, io, json, runpy, sys, traceback
from pathlib import Path
path, root, bad, smoke = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
spec = importlib.util.spec_from_file_location("quality_run", path)
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
results = {"bad": []}
for i, flags in enumerate(bad):
    out = root / f"run{i}"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = run.main(["--smoke", "--out", str(out), *flags])
        except SystemExit as exit:
            code = exit.code
    results["bad"].append(dict(code=code, stderr=stderr.getvalue(), out_exists=out.exists()))
sys.argv = [path, "--out", str(root / "run"), *smoke]
try:
    runpy.run_path(path, run_name="__main__")
    results["smoke"] = dict(code=None, error="run.py returned without sys.exit")
except SystemExit as exit:
    results["smoke"] = dict(code=exit.code, error="")
except BaseException:
    results["smoke"] = dict(code=None, error=traceback.format_exc())
print(json.dumps(results))
"""


def start_early(tmp_path_factory) -> subprocess.Popen:
    """The one interpreter, started with the session (tests/conftest.py ``started_early``): its toy run is bounded
    by steps, not time, so running beside other tests changes nothing in it. Its output goes to stdout.txt and
    stderr.txt in its root folder (``proc.root``)."""
    root = tmp_path_factory.mktemp("quality")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    bad = json.dumps([flags for flags, _ in BAD_SETTINGS])
    with open(root / "stdout.txt", "w") as stdout, open(root / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", RUN_ALL, str(RUN), str(root), bad, json.dumps(SMOKE)],
                                stdout=stdout, stderr=stderr, text=True, env=env)
    proc.root = root
    return proc


@pytest.fixture(scope="module")
def experiment(started_early):
    proc = started_early[__name__]
    proc.wait(timeout=600)
    root = proc.root
    stdout, stderr = (root / "stdout.txt").read_text(), (root / "stderr.txt").read_text()
    assert proc.returncode == 0, stderr[-3000:]
    results = json.loads(stdout.strip().splitlines()[-1])
    bad_runs = {" ".join(flags): result for (flags, _), result in zip(BAD_SETTINGS, results["bad"])}
    return dict(out=root / "run", smoke=results["smoke"], stderr=stderr, bad=bad_runs)


def test_smoke_run_trains_evaluates_and_exports(experiment):
    out, smoke = experiment["out"], experiment["smoke"]
    assert smoke["code"] == 0, smoke["error"] or experiment["stderr"][-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["finished"]
    assert results["stages"]["retrofit"]["steps"] > 0
    assert results["stages"]["retrofit"]["selection_loss_weight"] == 0.05
    assert results["stages"]["retrofit"]["eviction_loss_weight"] == 0.1
    assert results["stages"]["control"]["steps"] <= results["stages"]["retrofit"]["steps"]
    failed = [note for note in results["notes"] if "failed" in note]
    assert not failed, failed
    # every planned row was evaluated at every length
    ran = {(row["label"], row["length"]) for row in results["evaluation"]}
    for length in results["settings"]["eval"]["lengths"]:
        for label in ("full_attention", "nosa", "query_only", "quest", "shadowkv", "nosa_untrained"):
            assert (label, length) in ran, (label, length, results["notes"])
    for row in results["evaluation"]:
        assert 0.0 <= row["mean_accuracy"] <= 1.0
        if row["label"] in ("nosa", "nosa_untrained", "query_only", "quest", "shadowkv"):
            assert 0.0 <= row["locality"] <= 1.0
    # the export loads as a NOSA checkpoint with its trained eviction heads and layout
    model, _ = load_model(out / "demo_model")
    heads = eviction_heads(model)
    assert heads and any(head.A.abs().max() > 0 for head in heads.values())
    assert model.config.nosa["compress_kernel"] == results["settings"]["nosa"]["compress_kernel"]


@pytest.mark.parametrize(("flags", "message"), BAD_SETTINGS)
def test_bad_settings_fail_before_any_work(experiment, flags, message):
    done = experiment["bad"][" ".join(flags)]
    assert done["code"] == 2
    assert message in done["stderr"]
    assert not done["out_exists"]
