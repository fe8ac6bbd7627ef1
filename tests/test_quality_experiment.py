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


def run_experiment(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, env=env, timeout=600)


def test_smoke_run_trains_evaluates_and_exports(tmp_path):
    out = tmp_path / "run"
    # Steps, not seconds, bound the training, and the time budget is far above what the toy run needs: the work
    # is the same however loaded the machine, and no row is skipped for time.
    done = run_experiment("--smoke", "--out", str(out), "--selection-loss", "0.05", "--eviction-loss", "0.1",
                          "--minutes", "600", "--max-steps", "10")
    assert done.returncode == 0, done.stderr[-3000:]
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


BAD_SETTINGS = [
    (["--query-tokens", "32"], "the evaluation at 384 tokens has a budget of 48 tokens"),
    (["--windows", "4x2"], "--windows='4x2' is invalid"),
    (["--selection-loss", "-1"], "--selection-loss=-1.0 is invalid"),
    (["--rope-factor", "0.5"], "--rope-factor=0.5 is invalid"),
]

# Every bad setting through run.py's main() in one fresh interpreter (starting one costs seconds of imports): the
# exit code and stderr of each call, and whether its --out folder exists afterwards.
CHECK_ALL = """
import contextlib, importlib.util, io, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("quality_run", sys.argv[1])
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
results = []
for i, flags in enumerate(json.loads(sys.argv[3])):
    out = Path(sys.argv[2]) / f"run{i}"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = run.main(["--smoke", "--out", str(out), *flags])
        except SystemExit as exit:
            code = exit.code
    results.append(dict(code=code, stderr=stderr.getvalue(), out_exists=out.exists()))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_settings_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_settings")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    flags = json.dumps([flags for flags, _ in BAD_SETTINGS])
    done = subprocess.run([sys.executable, "-c", CHECK_ALL, str(RUN), str(root), flags], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {" ".join(flags): result for (flags, _), result in zip(BAD_SETTINGS, results)}


@pytest.mark.parametrize(("flags", "message"), BAD_SETTINGS)
def test_bad_settings_fail_before_any_work(bad_settings_runs, flags, message):
    done = bad_settings_runs[" ".join(flags)]
    assert done["code"] == 2
    assert message in done["stderr"]
    assert not done["out_exists"]
