"""The README's usage snippet runs as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_usage_snippet_runs(capsys):
    snippet = re.search(r"## Usage\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(snippet, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "locality" in printed and "bytes_to_device" in printed


def test_ci_runs_the_readme_test_command():
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README.read_text()
