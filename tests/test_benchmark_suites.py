"""``python -m benchmarks``: the suites it lists, their help, its error for an unknown suite, and the harness'
JSON writer (the environment every result records). CPU only, nothing measured."""

import json
import pathlib
import subprocess
import sys

import pytest

from benchmarks import harness
from benchmarks.__main__ import SUITES

ROOT = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = ("generate", "decode", "prefill", "train", "serve", "conversation")


def run(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_help_lists_the_suites():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ") and line[2] != " "]
    assert listed == list(SUITES) and set(REQUIRED) <= set(listed)
    for name, suite in SUITES.items():
        assert f"{name}  " in out.stdout and suite.summary in out.stdout


def test_every_suite_and_part_answers_help():
    """One process per suite would import torch 20 times: the suites run in this one, as ``main`` runs them."""
    from benchmarks.__main__ import main

    calls = [[name] for name in SUITES] + [[name, part] for name, suite in SUITES.items() for part in suite.parts]
    for call in calls:
        with pytest.raises(SystemExit) as exit_:
            main([*call, "--help"])
        assert exit_.value.code in (0, None), call


def test_a_suite_runs_as_python_m_benchmarks_with_help():
    out = run("generate", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("python -m benchmarks generate: model.generate")  # the suite, then its parts
    assert "parts: memory" in out.stdout and "usage: python -m benchmarks generate [-h]" in out.stdout


def test_an_unknown_suite_names_the_allowed_ones():
    out = run("bogus")
    assert out.returncode != 0
    assert "unknown suite 'bogus'" in out.stderr and all(name in out.stderr for name in SUITES)


def test_an_unknown_part_names_the_allowed_ones():
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit, match="unknown part 'bogus'; allowed: breakdown"):
        main(["prefill", "bogus"])


def test_write_json_records_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m benchmarks decode", "--steps", "2", "--out", str(tmp_path)])
    written = harness.write_json(tmp_path / "deep" / "result.json", dict(rows=[dict(tok_s=1.0)]))
    on_disk = json.loads((tmp_path / "deep" / "result.json").read_text())
    assert on_disk == written and on_disk["rows"] == [dict(tok_s=1.0)]
    for key in ("gpu", "torch", "transformers", "triton", "command", "date"):
        assert key in on_disk, key
    assert on_disk["command"] == "python -m benchmarks decode --steps 2 --out DIR"


def test_write_json_keeps_an_environment_already_there(tmp_path):
    result = dict(gpu="g", torch="t", transformers="tf", triton="tr", command="c", date="d", rows=[])
    assert harness.write_json(tmp_path / "r.json", result) == result


def test_the_png_is_optional(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert harness.pyplot() is None
    assert "no PNG drawn" in capsys.readouterr().out


def test_results_land_in_docs_results():
    assert harness.RESULTS == ROOT / "docs" / "results" and (harness.RESULTS / "README.md").exists()


def test_the_results_index_describes_a_result_by_its_command(tmp_path):
    from benchmarks import results_index

    result = dict(command="python -m benchmarks prefill breakdown --out DIR", date="2026-12-07T10:00:00+00:00")
    (tmp_path / "2026-12-07_prefill_breakdown.json").write_text(json.dumps(result))
    (tmp_path / "2026-12-07_prefill_breakdown.png").write_bytes(b"")
    results_index.main(["--folder", str(tmp_path)])
    index = (tmp_path / "README.md").read_text()
    summary = SUITES["prefill"].parts["breakdown"][1]
    assert f"| 2026-12-07 | [2026-12-07_prefill_breakdown.json](2026-12-07_prefill_breakdown.json) | {summary} | " \
           f"`python -m benchmarks prefill breakdown --out DIR` |" in index
    assert f"| plot: {summary} |" in index


def test_serve_floor_analysis_and_stream_metrics_on_known_numbers():
    """benchmarks/serve.py's bookkeeping: the floor arithmetic of the 1b shape, and the stream's metrics from
    per-token timestamps (time to first token, per output token, requests decoding at once)."""
    import types

    import torch

    from benchmarks.decode_throughput import build_model
    from benchmarks.serve import floor_analysis, stream_metrics

    model = build_model("1b", "meta", torch.bfloat16)
    floor = floor_analysis(model, [16384, 49152], 1024, 24, 4096, 0.9)
    assert floor["kv_bytes_per_token"] == 2 * 16 * 8 * 64 * 2
    assert floor["mean_context"] == 32768 + 512
    weights = sum(p.numel() * 2 for p in model.parameters())
    assert abs(floor["stock_max_concurrency"] - (24e9 - weights) / (33280 * 32768)) < 1e-9
    assert abs(floor["nosa_fetch_s_per_sequence"] - 0.1 * 4096 * 32768 / 51e9) < 1e-15
    out = [types.SimpleNamespace(created_time=0.0, timestamps=[1.0, 1.5, 2.0], generated_tokens=[1, 2, 3]),
           types.SimpleNamespace(created_time=0.5, timestamps=[1.75, 2.25, 3.25], generated_tokens=[4, 5, 6])]
    metrics = stream_metrics(out, 0.0, 4.0)
    assert metrics["output_tok_s"] == 6 / 4.0 and metrics["max_decoding"] == 2
    assert metrics["ttft_p50_s"] in (1.0, 1.25) and metrics["tpot_p99_s"] == 0.75
