"""experiments/smollm2: the evaluation driver's bookkeeping and the report's tables and target checks (no model)."""

from __future__ import annotations

import importlib.util
import io
import json
import random
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "experiments" / "smollm2"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


evaluate = _module("evaluate")
report = _module("report")
TASKS = ["passkey", "vt", "cwe"]
SETTINGS = dict(model="smollm2", length=8192, tasks=TASKS, samples=16, budget_ratio=8, seed=0, ppl_docs=8,
                ppl_tokens=128, chat_template=True)


def _row(cell: str, rng: random.Random, **extra) -> dict:
    tasks = {task: round(rng.random(), 2) for task in TASKS}
    row = {"cell": cell, "model": cell.split(":")[0], "method": cell.split(":")[1], "tasks": tasks,
           "mean_accuracy": sum(tasks.values()) / len(tasks), "perplexity": 5 + rng.random()}
    if not cell.endswith(":default"):
        row.update(locality=0.8 + 0.2 * rng.random(), bytes_to_device_per_token=1e5 * (1 + rng.random()))
    return {**row, **extra}


def _results(rows: list[dict]) -> dict:
    return {"settings": SETTINGS, "cells": rows, "skipped": [], "budget_tokens": 1024, "dtype": "bfloat16",
            "layout": {"sink_tokens": 64, "local_tokens": 256, "query_tokens": 256},
            "environment": {"device": "NVIDIA H200", "torch": "2.11.0", "transformers": "5.17.0", "date": "2026-12-02"}}


def test_cells_are_checked_and_results_resume_only_with_the_same_settings(tmp_path):
    assert evaluate.parse_cells("base:default,retrofit:nosa", ("default", "nosa")) == [("base", "default"),
                                                                                      ("retrofit", "nosa")]
    for bad in ("base:dense", "trained:nosa", "nosa", ""):
        with pytest.raises(ValueError, match="cells"):
            evaluate.parse_cells(bad, ("default", "nosa"))
    with pytest.raises(ValueError, match="tasks"):
        evaluate.parse_tasks("passkey,needle", ("passkey", "vt"))
    path = tmp_path / "r.json"
    first = evaluate.Results(path, SETTINGS)
    first.add(_row("base:nosa", random.Random(0)))
    first.skip("base:quest", "no time")
    again = evaluate.Results(path, SETTINGS)
    assert again.done("base:nosa") and not again.done("base:quest") and again.data["skipped"] == []
    with pytest.raises(ValueError, match="samples"):
        evaluate.Results(path, {**SETTINGS, "samples": 8})
    # the slowest cell of the same kind bounds the next one
    seconds = {"default": 30.0, "nosa": 60.0, "quest": 80.0}
    assert evaluate.estimate(seconds, "shadowkv") == pytest.approx(1.15 * 80)
    assert evaluate.estimate(seconds, "default") == pytest.approx(1.15 * 30)
    assert evaluate.estimate({}, "nosa") == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_targets_follow_the_numbers(seed):
    rng = random.Random(seed)
    rows = [_row(cell, rng) for cell in report.LABELS]
    data = _results(rows)
    by = {row["cell"]: row for row in rows}
    lines = "\n".join(report.targets(data))
    full, ours = by["base:default"], by["retrofit:nosa"]
    ppl_met = ours["perplexity"] / full["perplexity"] - 1 <= 0.03
    assert f"{ours['perplexity']:.3f} against {full['perplexity']:.3f}" in lines
    assert ("perplexity within 3% of full attention" in lines) and (
        lines.split("\n")[0].endswith(": met") == ppl_met)
    best = max(by[c]["mean_accuracy"] for c in report.TRAINING_FREE)
    line = next(x for x in lines.split("\n") if "best training-free" in x)
    assert line.endswith(": met") == (ours["mean_accuracy"] >= best)
    moved = next(x for x in lines.split("\n") if "bytes moved" in x)
    assert moved.endswith(": met") == (ours["bytes_to_device_per_token"] < by["base:query_only"]["bytes_to_device_per_token"])
    table = report.table(data)
    order = [table.index(f"| {label} |") for label in report.LABELS.values()]
    assert order == sorted(order)  # rows in the documented order
    assert f"**{ours['mean_accuracy']:.3f}**" in table


def test_missing_rows_are_said_and_the_adapter_is_read_from_its_tar(tmp_path):
    rng = random.Random(3)
    data = _results([_row("base:default", rng), _row("base:nosa", rng)])
    lacking = "NOSA retrofitted, query-only, Quest, ShadowKV, retrofit weights under full attention"
    assert f"Not run at this length: {lacking} (not in the results file)." in report.table(data)
    assert f"{lacking} (the process crashed)." in report.table(data, "the process crashed")
    assert report.table(data).count("| not run |") == 5 and "| **" in report.table(data)
    # the driver's own reason wins for the cells it skipped; the JSON gets the same reasons
    data["skipped"] = [{"cell": "base:quest", "why": "71s left, about 274s needed"}]
    assert "crashed); Quest (skipped for time: 71s left, about 274s needed)." in report.table(data, "the process crashed")
    reasons = {x["cell"]: x["why"] for x in report.not_run(data, "crashed")}
    assert reasons["base:shadowkv"] == "crashed" and reasons["base:quest"].startswith("skipped for time")
    assert report.targets(data) == ["targets: full attention and the retrofitted NOSA are both needed"]
    # a baseline that did not run leaves "at or above the best training-free" open unless one that ran is above
    for ours, verdict in ((0.5, "not measured"), (0.1, "not met")):
        rows = [_row("base:default", rng), _row("retrofit:nosa", rng, mean_accuracy=ours),
                _row("base:nosa", rng, mean_accuracy=0.2), _row("base:query_only", rng, mean_accuracy=0.3)]
        line = next(x for x in report.targets(_results(rows)) if "best training-free" in x)
        assert "(query-only, 0.300 of those run; Quest, ShadowKV not run)" in line and line.endswith(f": {verdict}")
    assert report.parse_not_run(["8192=the process crashed"]) == {8192: "the process crashed"}
    for bad in ("8192", "eight=x", "8192="):
        with pytest.raises(ValueError, match="not-run"):
            report.parse_not_run([bad])
    run = {"steps": 90, "schedule_steps": 90, "time_limit_s": 470.0, "final_loss": 2.1, "tokens_per_second": 2e4,
           "recipe": {"grad_accum": 8, "batch_size": 1, "seq_len": 8192, "steps": 500}}
    tar_path = tmp_path / "adapter.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name, content in (("nosa_retrofit.json", run), ("trainer_state.json", {"losses": [3.0, 2.5, 2.1]})):
            blob = json.dumps(content).encode()
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    adapter = report.read_adapter(tar_path)
    assert adapter["losses"] == [3.0, 2.5, 2.1] and adapter["run"]["steps"] == 90
    text = report.describe([_results([_row(c, rng) for c in report.LABELS])], adapter)
    assert "Retrofit: 90 steps (the recipe: 500) of 8 x 8192 tokens" in text and "planned for 90 steps" in text
    with pytest.raises(ValueError, match="not a retrofit adapter"):
        report.read_adapter(tmp_path)
