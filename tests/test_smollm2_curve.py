"""experiments/smollm2/curve.py: the retrofit-steps curve's plan, results file and table, on hand-made inputs."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "experiments" / "smollm2" / "curve.py"
spec = importlib.util.spec_from_file_location("smollm2_curve", PATH)
curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(curve)

SETTINGS = dict(model="smollm2", recipe={"steps": 500, "lora": {"target_modules": ("q_proj", "v_proj")}}, length=8192,
                budget_tokens=1024, layout=dict(sink_tokens=64, local_tokens=256, query_tokens=256), ppl_docs=8,
                ppl_tokens=128, seed=0, dtype="bfloat16")


def _row(cell, steps, ppl, locality=None, kb=None, **extra):
    row = {"cell": cell, "steps": steps, "perplexity": ppl, "seconds": 20.0, "load_seconds": 10.0, **extra}
    if steps is not None:
        row.update(locality=locality, bytes_to_device_per_token=kb * 1e3)
    return row


def test_steps_parse_sorted_and_within_the_recipe():
    assert curve.parse_steps("80 20, 40 20", 500) == [20, 40, 80]
    for bad in ("", "0 20", "20 501", "twenty"):
        with pytest.raises(ValueError, match="--steps"):
            curve.parse_steps(bad, 500)
    assert curve.point_steps("step-25") == 25
    assert [curve.point_steps(c) for c in ("full", "untrained", "step-0", "step-x", "steps-3")] == [None] * 5


def test_two_writers_keep_each_others_rows_and_other_settings_are_refused(tmp_path):
    path = tmp_path / "curve.json"
    first, second = curve.Results(path, SETTINGS), curve.Results(path, SETTINGS)  # tuples compare as JSON lists
    first.add(_row("full", None, 3.2))
    second.add(_row("step-20", 20, 3.4, 0.9, 2000))  # second read the file before first wrote
    second.add(_row("full", None, 9.9))  # a cell measured twice keeps its first row
    first.update(lambda d: d["skipped"].extend([{"cell": "untrained", "why": "late"}, {"cell": "step-40", "why": "x"}]))
    second.add(_row("untrained", 0, 3.5, 0.94, 1650))  # measured by a later call: no longer listed as skipped
    assert [s["cell"] for s in curve.Results(path, SETTINGS).data["skipped"]] == ["step-40"]
    rows = curve.Results(path, SETTINGS).data["rows"]
    assert [(r["cell"], r["perplexity"]) for r in rows] == [("full", 3.2), ("step-20", 3.4), ("untrained", 3.5)]
    assert first.done("step-20") and first.done("untrained") and not first.done("step-40")
    with pytest.raises(ValueError, match="ppl_docs"):
        curve.Results(path, {**SETTINGS, "ppl_docs": 4})
    with pytest.raises(ValueError, match="recipe"):
        curve.Results(path, {**SETTINGS, "recipe": {"steps": 400}})


def test_rows_come_back_in_order_and_compare_with_full_attention():
    rows = [_row(f"step-{n}", n, 3.0 + 1 / n, 0.9, 2000) for n in (80, 20, 160, 40)]
    rows += [_row("untrained", 0, 3.5, 0.94, 1650), _row("full", None, 3.2)]
    random.Random(0).shuffle(rows)
    data = {"settings": SETTINGS, "rows": rows, "skipped": [{"cell": "step-160", "why": "10s left"},
                                                            {"cell": "step-320", "why": "5s left"}]}
    assert [r["cell"] for r in curve.ordered(rows)] == ["full", "untrained", "step-20", "step-40", "step-80",
                                                        "step-160"]
    lines = curve.table(data).splitlines()
    body = [line.split(" | ") for line in lines[2:8]]
    assert [b[0] for b in body] == ["| full attention", "| NOSA untrained (A = 0)"] + ["| NOSA retrofitted"] * 4
    for cells, row in zip(body, curve.ordered(rows)):
        assert float(cells[4]) == pytest.approx(row["perplexity"], abs=5e-4)
        if row["steps"] is None:
            assert cells[5] == "-"
        else:  # the percentage is recomputed from the perplexities, not stored
            assert float(cells[5].rstrip("%")) == pytest.approx(100 * (row["perplexity"] / 3.2 - 1), abs=0.05)
    assert body[1][5] == "+9.4%" and body[1][6] == "0.940" and body[1][7] == "1,650 |"
    assert lines[-1] == "step-320: not measured (5s left)" and "step-160: not" not in "".join(lines)  # 160 has a row
    no_full = curve.table({**data, "rows": [r for r in rows if r["cell"] != "full"]})
    assert all(line.split(" | ")[5] == "-" for line in no_full.splitlines()[2:7])


def test_a_point_takes_steps_tokens_and_the_mean_loss_of_its_last_steps(tmp_path):
    losses = [2.0 + i for i in range(25)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"losses": losses, "tokens": 25 * 65536, "step": 25}))
    traffic = dict(locality=0.91, bytes_to_device_per_token=2.4e6, device_kv_bytes_per_sequence=1,
                   full_kv_bytes_per_sequence=8)
    row = curve.point_row({"perplexity": 3.4, "perplexity_documents": ["a"], "perplexity_traffic": traffic},
                          "step-25", tmp_path)
    assert (row["steps"], row["tokens"], row["locality"]) == (25, 25 * 65536, 0.91)
    assert row["loss"] == pytest.approx(sum(losses[-curve.LOSS_WINDOW:]) / curve.LOSS_WINDOW)
    full = curve.point_row({"perplexity": 3.2, "perplexity_documents": ["a"], "kv_bytes_read_per_token": 7}, "full",
                           None)
    assert full["steps"] is None and "locality" not in full and full["kv_bytes_read_per_token"] == 7


def test_the_run_and_the_kept_points_are_read_from_their_folders(tmp_path):
    run, keep = tmp_path / "run", tmp_path
    assert curve.current_step(run) == 0
    for step in (20, 40):
        (run / "checkpoints" / f"step-{step:07d}").mkdir(parents=True)
    assert curve.current_step(run) == 40
    (run / "nosa_retrofit.json").write_text(json.dumps({"steps": 500}))  # a finished run keeps no last checkpoint
    assert curve.current_step(run) == 500
    for name in ("step-20", "step-40", "step-80.partial", "step-x"):
        (keep / name).mkdir()
        (keep / name / "adapter_model.safetensors").write_text("")
    (keep / "step-160").mkdir()  # no adapter in it: not kept
    assert curve.kept_steps(keep) == [20, 40]


def test_the_plan_stops_at_the_next_point_that_fits_else_partway_else_not():
    plan = curve.plan_stop
    args = dict(step_s=4.0, overhead_s=60.0, eval_s=90.0)
    assert plan([20, 40, 80], 0, set(), 540, **args)[:2] == (20, "point")
    assert plan([20, 40, 80], 20, {20}, 540, **args)[:2] == (40, "point")  # resumed: measured points are passed
    assert plan([20, 40, 80], 20, {40}, 540, **args)[:2] == (80, "point")  # 40 kept, not measured yet: skipped too
    # 80 - 40 = 40 steps need 60 + 160 s; with 150 s left, (150 - 15 - 60) / 4 = 18 steps fit: a partial stop
    assert plan([20, 40, 80], 40, {20, 40}, 150, **args)[:2] == (58, "partial")
    # the point itself fits once its evaluation is left out (the next call measures the kept adapter)
    assert plan([20, 40, 80], 40, {20, 40}, 60 + 160 + 15, **args)[:2] == (80, "point")
    stop, kind, why = plan([20, 40, 80], 40, {20, 40}, 100, **args)  # 6 steps fit, less than a process's overhead
    assert (stop, kind) == (None, "") and "step 80" in why
    stop, _, why = plan([20, 40, 80], 80, {20, 80}, 540, **args)
    assert stop is None and "[40]" in why  # passed but neither measured nor kept: said, not silently dropped
    assert plan([20, 40], 30, {20}, 540, **args)[:2] == (40, "point")


def test_rates_come_from_the_last_segment_and_the_slowest_cell():
    data = {"segments": [], "rows": []}
    assert curve.rates(data, 4.0, 60.0, 90.0) == (4.0, 60.0, 90.0)
    data["segments"] = [{"from": 0, "to": 20, "seconds": 200.0, "step_tokens": 65536, "tokens_per_second": 16384.0},
                        {"from": 20, "to": 40, "seconds": 130.0, "step_tokens": 65536, "tokens_per_second": 32768.0}]
    data["rows"] = [_row("full", None, 3.2), {**_row("untrained", 0, 3.5, 0.9, 1), "seconds": 40.0}]
    step_s, overhead_s, eval_s = curve.rates(data, 4.0, 60.0, 90.0)
    assert (step_s, overhead_s) == (2.0, 90.0) and eval_s == pytest.approx(1.2 * (40 + 10))
