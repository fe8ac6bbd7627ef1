"""The ``hf-nosa`` command answers --help without loading torch or transformers, and every flag has help text that
states its default."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_nosa.cli import commands as cli
from hf_nosa.cli import args as cli_args

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "safetensors", "huggingface_hub", "numpy", "triton", "peft", "accelerate")

# Runs the command as ``python -m hf_nosa.cli.commands ARGS`` would, once per argument list, and reports the heavy top-level
# modules loaded after each.
HELP = r"""
import json, runpy, sys
heavy = set(json.loads(sys.argv[1]))
report = []
for argv in json.loads(sys.argv[2]):
    sys.argv = ["hf-nosa", *argv]
    try:
        runpy.run_module("hf_nosa.cli.commands", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    report.append({"argv": argv, "code": code, "loaded": sorted({m.split(".")[0] for m in sys.modules} & heavy)})
print(json.dumps(report))
"""


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def test_help_imports_no_heavy_module():
    invocations = [["--help"]] + [[name, "--help"] for name in cli.COMMANDS]
    result = subprocess.run([sys.executable, "-c", HELP, json.dumps(HEAVY), json.dumps(invocations)], env=_env(),
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [entry["argv"] for entry in report] == invocations
    assert all(entry["code"] == 0 for entry in report), report
    assert [entry for entry in report if entry["loaded"]] == []


def test_python_m_help_lists_every_command():
    result = subprocess.run([sys.executable, "-m", "hf_nosa.cli.commands", "--help"], env=_env(), capture_output=True,
                            text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in cli.COMMANDS)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_flag_has_help_and_states_its_default(command):
    parser = _subparsers(cli.build_parser())[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action)
        assert action.help and len(action.help) > 10, f"{command} {action.dest} has no help"
        if action.option_strings:
            assert action.required == ("(required)" in text), f"{command} {action.option_strings}: {text}"
            assert action.required or "(default" in text, f"{command} {action.option_strings}: {text}"
    help_text = parser.format_help()
    assert "%(default)" not in help_text and "(default: None)" not in help_text


def test_defaults_are_shown_as_given():
    parser = _subparsers(cli.build_parser())
    eval_help = parser["eval"].format_help().replace("\n", " ")
    assert "(default: 4096 8192 16384)" in " ".join(eval_help.split())
    assert "(default: 4)" in eval_help  # --samples
    push_help = " ".join(parser["push"].format_help().split())
    assert "--load-check" in push_help and "RUNS the folder's Python files" in push_help
    assert "(default: off)" in push_help


def test_eval_names_match_the_eval_package():
    from hf_nosa.eval import DEFAULT_TASKS, METHODS, TASKS

    assert cli_args.EVAL_TASKS == tuple(TASKS)
    assert cli_args.EVAL_DEFAULT_TASKS == tuple(DEFAULT_TASKS)
    assert cli_args.EVAL_METHODS == tuple(METHODS)


def test_demo_prefill_choices_match_the_config():
    from hf_nosa.config import PREFILL_MODES

    assert set(cli_args.DEMO_PREFILLS) <= set(PREFILL_MODES)


def test_unknown_recipe_lists_each_recipe_once(monkeypatch):
    from hf_nosa.training.retrofit import load_recipe

    monkeypatch.chdir(REPO_ROOT)  # recipes/ of the working folder and of the package are the same folder here
    with pytest.raises(FileNotFoundError, match="not found") as caught:
        load_recipe("no-such-recipe")
    names = caught.value.args[0].rsplit("name of ", 1)[1]
    listed = [name.strip(" '[]") for name in names.split(",")]
    shipped = sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml"))
    assert listed == shipped


@pytest.mark.parametrize("command,args", [("retrofit", ["--recipe", "r", "--output", "o"]), ("export", ["src", "out"])])
def test_model_flag_names_the_base_model(command, args):
    """Issue 16 names ``--model`` for every command that loads a model: retrofit and export take it as the base
    model, the same as ``--base-model``."""
    parser = cli.build_parser()
    for flag in ("--model", "--base-model"):
        assert parser.parse_args([command, *args, flag, "smollm2"]).base_model == "smollm2"
    assert parser.parse_args([command, *args]).base_model is None
