"""Export never touches its inputs, and every export carries the tokenizer its base has.

An out_dir that is, contains or lies inside anything export reads (the source, the base model, the tokenizer folder,
the metrics file) is refused before any work, with or without ``--overwrite``; ``--overwrite`` replaces only what a
previous export wrote (its manifest) and refuses any other non-empty folder. The ``tiny`` recipe's byte tokenizer
travels into the export, so ``hf-nosa eval`` and the model card's snippet work there.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import hf_nosa
from hf_nosa.cli.commands import main
from hf_nosa.hub import export, files
from hf_nosa.modeling import randomize_eviction_heads
from hf_nosa.modeling.tokenizer import build_tokenizer

from .conftest import small_nosa_config, tiny_model


def nosa_model(seed: int = 0):
    return randomize_eviction_heads(hf_nosa.to_nosa(tiny_model(seed=seed), small_nosa_config()), scale=2.0)


def listing(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def source(tmp_path):
    """run/model: a converted model saved with save_pretrained, and its tokenizer."""
    folder = tmp_path / "run" / "model"
    nosa_model().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("out", ["run", "run/model", "run/model/out"], ids=["contains", "is", "inside"])
def test_out_dir_overlapping_the_source_is_refused_before_any_work(tmp_path, monkeypatch, capsys, source, out):
    """``hf-nosa export run/model run --overwrite`` once removed run/model and exited 0."""
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    assert main(["export", "run/model", out, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"out_dir .* (is|contains|lies inside) the source folder", err), err
    assert listing(tmp_path) == before and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model"]


def test_out_dir_overlapping_any_input_is_refused(tmp_path, source, monkeypatch):
    from hf_nosa.hub import exporter

    def no_work(*args, **kwargs):
        raise AssertionError("export loaded a model before checking out_dir")

    monkeypatch.setattr(exporter, "_resolve_source", no_work)
    tok = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "m.json").write_text("{}")
    before = listing(tmp_path)
    cases = [
        (dict(out_dir=tok, tokenizer=tok, overwrite=True), "is the tokenizer folder"),
        (dict(out_dir=tmp_path / "metrics", metrics=tmp_path / "metrics" / "m.json", overwrite=True),
         "contains the metrics file"),
        (dict(out_dir=source / "sub", base_model=source), "lies inside the base model"),
        (dict(out_dir=tmp_path / "run", base_model=source, overwrite=True), "contains the base model"),
    ]
    for kwargs, message in cases:
        model = nosa_model()
        with pytest.raises(ValueError, match=message):
            export(model if "base_model" in kwargs else source, **kwargs)
    model = nosa_model()
    model.config._name_or_path = str(source)  # as from_pretrained(folder) leaves it: export reads its tokenizer
    with pytest.raises(ValueError, match="contains the model's folder"):
        export(model, tmp_path / "run", overwrite=True)
    assert listing(tmp_path) == before


def test_out_dir_overlapping_an_adapters_recorded_base_is_refused(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    base = tmp_path / "base"
    nosa_model().save_pretrained(base)
    record = {"base_model": str(base), "family": "llama", "nosa_config": small_nosa_config().to_dict()}
    (adapter / "nosa_retrofit.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="is the base model recorded in nosa_retrofit.json"):
        export(adapter, base, overwrite=True)
    assert (base / "model.safetensors").is_file()


def test_overwrite_refuses_a_folder_that_is_not_a_previous_export(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="previous export" if overwrite else "not empty"):
            export(nosa_model(), out, overwrite=overwrite)
    assert listing(out) == {"notes.txt": b"keep me"}
    (out / files.MANIFEST).write_text("not json")
    with pytest.raises(ValueError, match="not a valid export manifest"):
        export(nosa_model(), out, overwrite=True)


def test_overwrite_replaces_only_what_the_export_wrote(tmp_path):
    out = tmp_path / "out"
    export(nosa_model(), out, tokenizer=build_tokenizer())
    written = json.loads((out / files.MANIFEST).read_text())["files"]
    assert "tokenizer.json" in written and "model.safetensors" in written and files.MANIFEST not in written
    (out / "eval.json").write_text("{}")
    (out / "notes").mkdir()
    (out / "notes" / "a.md").write_text("mine")
    (out / "custom_generate" / "local.py").write_text("# mine")
    (out / "empty").mkdir()
    (out / "README.md").write_text("edited card")  # written by export: replaced
    old_weights = (out / "model.safetensors").read_bytes()

    export(nosa_model(seed=1), out, overwrite=True)  # no tokenizer this time
    now = listing(out)
    assert now["eval.json"] == b"{}" and now["notes/a.md"] == b"mine" and now["custom_generate/local.py"] == b"# mine"
    assert (out / "empty").is_dir()
    assert now["model.safetensors"] != old_weights and now["README.md"] != b"edited card"
    assert "tokenizer.json" not in now  # the old export wrote it, this one did not
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no stage or old folder left behind
    assert "eval.json" not in json.loads((out / files.MANIFEST).read_text())["files"]


def test_overwrite_refuses_to_replace_a_file_it_did_not_write(tmp_path):
    out = tmp_path / "out"
    export(nosa_model(), out)
    (out / "tokenizer.json").write_text("the user's")
    before = listing(out)
    with pytest.raises(ValueError, match=r"\['tokenizer.json'\], which the previous export did not write"):
        export(nosa_model(), out, tokenizer=build_tokenizer(), overwrite=True)
    assert listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --------------------------------------------------------------------------- the tokenizer travels


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """The README's path on the ``tiny`` recipe, shortened: retrofit 2 steps -> export."""
    from hf_nosa.training.retrofit import retrofit

    root = tmp_path_factory.mktemp("tiny")
    retrofit("tiny", "python-prose-and-code", root / "runs" / "tiny", max_steps=2)
    assert main(["export", str(root / "runs" / "tiny"), str(root / "out" / "tiny")]) == 0
    return root / "out" / "tiny"


@pytest.mark.slow
def test_tiny_recipe_export_carries_the_byte_tokenizer(tiny_export):
    from hf_nosa.modeling.loading import load_tokenizer

    assert (tiny_export / "tokenizer.json").is_file()
    assert load_tokenizer(tiny_export)("Hi\n")["input_ids"] == build_tokenizer()("Hi\n")["input_ids"]
    assert "tokenizer.json" in json.loads((tiny_export / files.MANIFEST).read_text())["files"]


@pytest.mark.slow
def test_eval_runs_on_the_tiny_export(tiny_export, capsys):
    argv = ["eval", "--model", str(tiny_export), "--lengths", "256", "--tasks", "passkey", "--cache", "default", "nosa",
            "--samples", "1", "--ppl-docs", "0", "--budget", "64", "--no-progress"]
    assert main(argv) == 0
    assert "nosa" in capsys.readouterr().out


@pytest.mark.slow
def test_model_card_snippet_runs_on_the_export_without_a_prompt(tiny_export, tmp_path):
    """The card's usage snippet, with the local folder as the repo, in a fresh process whose stdin is closed:
    nothing may ask whether to trust remote code."""
    import subprocess
    import sys

    card = (tiny_export / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    snippet = re.sub(r'^repo = ".*"$', f"repo = {str(tiny_export)!r}", snippet, flags=re.M)
    snippet = snippet.replace("dtype=torch.bfloat16", "dtype=torch.float32").replace("max_new_tokens=256",
                                                                                     "max_new_tokens=4")
    script = tmp_path / "card.py"
    script.write_text(snippet)
    done = subprocess.run([sys.executable, str(script)], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trust_remote_code=True" in card.split("AutoTokenizer.from_pretrained", 1)[1].splitlines()[0]


@pytest.mark.slow
def test_readme_load_snippet_runs_on_the_tiny_export(tiny_export, monkeypatch):
    """The README's "Retrofit, export, load" Python block, with its out/tiny as the fixture's export."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Retrofit, export, load", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tiny_export.parent.parent)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["out"].shape[1] > namespace["inputs"]["input_ids"].shape[1]
