"""experiments/smollm2/query_share.py: its Q values, cell names and a results file shared by two writers (no model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "experiments" / "smollm2" / "query_share.py"
spec = importlib.util.spec_from_file_location("smollm2_query_share", PATH)
query_share = importlib.util.module_from_spec(spec)
spec.loader.exec_module(query_share)

SETTINGS = dict(model="smollm2", length=8192, budget_ratio=8, sink_tokens=64, local_tokens=256, ppl_docs=8,
                ppl_tokens=128, seed=0, dtype="float32")


def test_queries_run_from_zero_to_half_the_budget_in_eighths():
    assert query_share.default_queries(1024, 64) == [0, 128, 256, 384, 512]
    assert query_share.default_queries(512, 64) == [0, 64, 128, 192, 256]
    assert query_share.default_queries(128, 64) == [0, 64]  # an eighth under a block still steps by a block


def test_cells_name_a_model_and_a_listed_q_or_full():
    assert query_share.parse_cells("base:full,retrofit:256", [0, 256]) == [("base", None), ("retrofit", 256)]
    for bad in ("base:128", "trained:0", "base:-64", "base", ""):
        with pytest.raises(ValueError, match="cells"):
            query_share.parse_cells(bad, [0, 256])
    assert query_share.cell_name("base", None) == "base:full" and query_share.cell_name("retrofit", 0) == "retrofit:0"


def test_two_writers_keep_each_others_rows_and_other_settings_are_refused(tmp_path):
    path = tmp_path / "r.json"
    first, second = query_share.ResultsFile(path, SETTINGS), query_share.ResultsFile(path, SETTINGS)
    first.update(lambda d: d["rows"].append({"cell": "base:0"}))
    second.update(lambda d: d["rows"].append({"cell": "retrofit:0"}))  # second read the file before first wrote
    assert first.done("retrofit:0") and second.done("base:0") and not first.done("base:full")
    assert [row["cell"] for row in query_share.ResultsFile(path, SETTINGS).data["rows"]] == ["base:0", "retrofit:0"]
    with pytest.raises(ValueError, match="ppl_docs"):
        query_share.ResultsFile(path, {**SETTINGS, "ppl_docs": 4})


def test_the_table_compares_each_nosa_cell_with_its_own_models_full_attention():
    def row(model, q, ppl):
        extra = {} if q is None else dict(layout={"eviction_tokens": 768 - q}, locality=0.9, bytes_to_device_per_token=2e6)
        return {"cell": query_share.cell_name(model, q), "model": model, "query_tokens": q, "perplexity": ppl, **extra}

    text = query_share.table({"rows": [row("retrofit", 256, 3.3), row("base", 0, 4.4), row("retrofit", None, 3.0),
                                       row("base", None, 4.0)]})
    lines = text.splitlines()[2:]
    assert [line.split(" | ")[1] for line in lines] == ["-", "0", "-", "256"]  # base first, full attention first
    assert lines[1].split(" | ")[4:6] == ["+10.0%", "+10.0%"]  # base Q=0: 4.4 against 4.0 twice
    assert lines[3].split(" | ")[4:6] == ["+10.0%", "-17.5%"]  # retrofit Q=256: 3.3 against 3.0 and 4.0
    assert lines[2].split(" | ")[5] == "-25.0%" and "2,000" in lines[3]
