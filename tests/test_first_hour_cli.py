"""The command line as a new user meets it: numbers are checked as typed and reported as given, every option shows
its default, and a missing optional package is one line naming the extra to install, before any download."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from hf_nosa.cli import commands as cli


@pytest.mark.parametrize("argv,flag,value", [
    (["demo", "--budget", "-64"], "--budget", "'-64'"),
    (["demo", "--context", "0"], "--context", "'0'"),
    (["demo", "--seed", "x"], "--seed", "'x'"),
    (["eval", "--model", "m", "--samples", "0"], "--samples", "'0'"),
    (["eval", "--model", "m", "--ppl-docs", "-1"], "--ppl-docs", "'-1'"),
    (["retrofit", "--recipe", "tiny", "--output", "o", "--time-limit", "nan"], "--time-limit", "'nan'"),
    (["retrofit", "--recipe", "tiny", "--output", "o", "--max-steps", "1.5"], "--max-steps", "'1.5'"),
])
def test_numbers_are_reported_as_typed(argv, flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {value} is invalid" in err, err


def test_demo_budget_too_small_names_the_value_given(capsys):
    assert cli.main(["demo", "--budget", "100"]) == 2
    err = capsys.readouterr().err
    assert "--budget=100 is too small" in err and "pass --budget" in err and len(err.strip().splitlines()) == 1


def test_every_option_shows_its_default():
    parsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in parsers.items():
        for action in parser._actions:
            if action.option_strings and not action.required and not isinstance(action, argparse._HelpAction):
                shown = parser._get_formatter()._get_help_string(action)
                assert "(default" in shown, (name, action.option_strings)
    assert "(default: every one)" in " ".join(parsers["eval"].format_help().split())


@pytest.fixture
def no_gguf(monkeypatch):
    """gguf not installed, and any attempt to fetch the SmolLM2 file fails the test."""
    import hf_nosa.modeling.loading as loading

    real = importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))

    def no_download(*args, **kwargs):
        raise AssertionError("fetched a model before saying which extra is missing")

    monkeypatch.setattr(loading, "packaged_gguf", no_download)


@pytest.mark.parametrize("argv", [
    ["demo", "--model", "smollm2"],
    ["eval", "--model", "smollm2"],
    ["eval", "--model", "some/model.gguf"],
    ["retrofit", "--recipe", "smollm2-135m", "--output", "out"],
    ["retrofit", "--recipe", "tiny", "--model", "smollm2", "--output", "out"],
])
def test_missing_gguf_is_one_line_naming_the_extra(no_gguf, argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'pip install "hf-nosa[gguf]"' in err[0], err


def test_missing_datasets_names_the_train_extra(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "hello"}\n')
    assert cli.main(["retrofit", "--recipe", "tiny", "--data", str(data), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert 'pip install "hf-nosa[train]"' in err and not (tmp_path / "o").exists()
    assert cli.needed_packages(cli.build_parser().parse_args(
        ["retrofit", "--recipe", "tiny", "--data", "python-prose-and-code", "--output", "o"])) == {}


def test_a_module_missing_at_run_time_names_its_extra(monkeypatch, capsys):
    import hf_nosa.cli.demo as demo

    def run(args):
        raise ModuleNotFoundError("No module named 'datasets'", name="datasets")

    monkeypatch.setattr(demo, "run", run)
    assert cli.main(["demo"]) == 2
    assert 'this command needs the datasets package, which is not installed: pip install "hf-nosa[train]"' in \
        capsys.readouterr().err


def test_missing_peft_is_one_line(monkeypatch, tmp_path):
    import sys

    from hf_nosa.modeling.loading import MissingExtraError
    from hf_nosa.training.retrofit import load_adapter

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ModuleNotFoundError
    with pytest.raises(MissingExtraError, match=r'needs peft.*pip install "peft>=0.17"'):
        load_adapter("base", tmp_path)
