"""The README's usage snippet runs as written, and CI runs the README's test commands."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
CI = README.parent / ".ci" / "run"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_usage_snippet_runs(capsys):
    snippet = re.search(r"## Usage\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(snippet, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "locality" in printed and "bytes_to_device" in printed


def test_ci_runs_the_readme_test_commands():
    """.ci/run's commands after ``cd`` are the README's two test commands, each a line of a README code block: the
    fast tier first (no downloads, no training runs), then the full suite."""
    ci = CI.read_text().strip().splitlines()
    commands = ci[ci.index('cd "$(dirname "$0")/.."') + 1:]
    readme_lines = set(README.read_text().splitlines())
    assert len(commands) == 2 and all(command in readme_lines for command in commands), commands
    fast, full = commands
    assert fast.endswith('python -m pytest -q -m "not slow and not download"') and full == "python -m pytest -q"
    assert "set -euo pipefail" in ci


def test_readme_is_user_documentation():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text.replace("e4m3fn", "")), "commit hashes belong in docs/"
    assert not re.search(r"\bissue \d+|#\d+\b", text, re.I), "issue numbers belong in docs/"
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert (README.parent / link).exists(), link
