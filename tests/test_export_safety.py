"""Export and verify never leak or lose files: reads stay inside the inputs (symbolic links, ``_name_or_path``, shard
paths), verification runs none of the folder's code, an overwrite either completes or leaves the old folder intact
(failures injected at each step of the swap), and created files follow the umask. Export never touches its inputs
(tests/test_first_hour_export.py: an out_dir that is, contains or lies inside one; overwrite keeps what it did not
write)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

import hf_nosa
from hf_nosa.hub import export, files, verify_folder
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model


def nosa_model(family="llama", seed=0):
    return randomize_eviction_heads(hf_nosa.to_nosa(tiny_model(family, seed=seed), small_nosa_config()), scale=2.0)


def listing(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_nothing_written(out_dir: Path):
    assert not out_dir.exists()
    assert not [p.name for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One export to copy from: (folder, its files)."""
    folder = export(nosa_model(), tmp_path_factory.mktemp("exported") / "llama")
    return folder, listing(folder)


@pytest.fixture()
def source(tmp_path):
    """A converted model saved with save_pretrained, as export reads it from a folder."""
    folder = tmp_path / "source"
    nosa_model().save_pretrained(folder)
    return folder


def _tokenizer_files(folder: Path, marker: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77, "marker": marker}))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# other model\n")


# --------------------------------------------------------------------------- reads stay inside the inputs


def test_symlinked_tokenizer_file_out_of_the_source_is_refused(source, tmp_path):
    _tokenizer_files(tmp_path / "elsewhere", "outside")
    (source / "tokenizer_config.json").symlink_to(tmp_path / "elsewhere" / "tokenizer_config.json")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*symbolic link.*outside the folder"):
        export(source, out)
    assert_nothing_written(out)


def test_tokenizer_folder_with_a_link_out_is_refused(tmp_path):
    _tokenizer_files(tmp_path / "elsewhere", "outside")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").symlink_to(tmp_path / "elsewhere" / "tokenizer_config.json")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"tok/tokenizer_config\.json' leads outside"):
        export(nosa_model(), out, tokenizer=tmp_path / "tok")
    assert_nothing_written(out)


def test_symlinked_weights_out_of_the_source_are_refused(source, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    shutil.move(source / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors")
    (source / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"model\.safetensors.*symbolic link"):
        export(source, out)
    assert_nothing_written(out)


def test_links_inside_the_source_are_followed(source, tmp_path):
    (source / "weights").mkdir()
    shutil.move(source / "model.safetensors", source / "weights" / "model.safetensors")
    (source / "model.safetensors").symlink_to(Path("weights") / "model.safetensors")
    out = export(source, tmp_path / "out")
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors").is_symlink()


def test_name_or_path_of_a_source_folder_is_never_read(source, tmp_path, monkeypatch):
    from huggingface_hub import constants

    _tokenizer_files(tmp_path / "other_model", "other")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "_name_or_path": str(tmp_path / "other_model")}))
    out = export(source, tmp_path / "out")
    assert not (out / "tokenizer_config.json").exists()
    card = ModelCard.load(out / "README.md").data
    assert card.license is None and card.base_model is None

    # a Hub id there names the base on the card, and its cached snapshot is not read either
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--other"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    _tokenizer_files(repo / "snapshots" / commit, "cached")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    (source / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/other"}))
    out = export(source, tmp_path / "out2")
    card = ModelCard.load(out / "README.md").data
    assert card.base_model == "org/other" and card.license is None
    assert not (out / "tokenizer_config.json").exists()


def test_hub_cache_links_into_its_blobs_are_followed(tmp_path, monkeypatch):
    """A real Hub cache stores snapshot files as links into the repository's blobs/: those stay inside."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    _tokenizer_files(repo / "blobs", "cached")
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("tokenizer_config.json", "README.md"):
        (snapshot / name).symlink_to(Path("..", "..", "blobs", name))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    model = nosa_model()
    model.config._name_or_path = "org/tiny"  # as from_pretrained("org/tiny") leaves it
    out = export(model, tmp_path / "out")
    assert json.loads((out / "tokenizer_config.json").read_text())["marker"] == "cached"
    assert ModelCard.load(out / "README.md").data.license == "mit"


@pytest.mark.parametrize("entry", ["../outside_dir/{shard}", "{outside}/{shard}", "sub/../../outside_dir/{shard}"])
def test_shard_index_naming_a_path_outside_the_folder_is_refused(tmp_path, entry):
    source = tmp_path / "source"
    nosa_model().save_pretrained(source, max_shard_size="100KB")
    index_path = source / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "outside_dir").mkdir()
    shutil.move(source / shard, tmp_path / "outside_dir" / shard)
    named = entry.format(shard=shard, outside=tmp_path / "outside_dir")
    index["weight_map"] = {k: named if v == shard else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*not a file inside the folder"):
        export(source, out)
    assert_nothing_written(out)


# --------------------------------------------------------------------------- verify runs none of the folder's code


def test_verify_checks_remote_code_hashes_without_running_it(exported, tmp_path):
    folder, _ = exported
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    marker = tmp_path / "code_ran"
    for name in ("modeling_nosa_llama.py", "configuration_nosa_llama.py", "custom_generate/generate.py"):
        shutil.copyfile(folder / name, copy / name)
        with open(copy / name, "a") as handle:
            handle.write(f"\nopen({str(marker)!r}, 'w').close()\n")
        for load_check in (False, True):
            with pytest.raises(ValueError, match=rf"{name}.*sha256.*not the file hf_nosa writes"):
                verify_folder(copy, load_check=load_check)
        shutil.copyfile(folder / name, copy / name)
    assert not marker.exists()
    assert verify_folder(copy)["family"] == "llama"


def test_verify_lists_what_push_uploads_and_refuses_links(exported, tmp_path):
    folder, original = exported
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / ".env").write_text("HF_TOKEN=hf_secret\n")
    (copy / "custom_generate" / "notes.md").write_text("mine")
    (copy / "nosa_retrofit.json").write_text("{}")
    summary = verify_folder(copy)
    assert summary["files"] == sorted([*original, "nosa_retrofit.json"])
    assert summary["skipped"] == [".env", "custom_generate/notes.md"]
    (copy / "tokenizer.json").symlink_to(copy / "config.json")  # even a link that stays inside
    with pytest.raises(ValueError, match=r"\['tokenizer\.json'\] is a symbolic link"):
        verify_folder(copy)


def test_verify_command(exported, capsys):
    from hf_nosa.cli.commands import main

    folder, original = exported
    assert main(["verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "its code was not run" in out and all(f"  {name}\n" in out for name in original)


# --------------------------------------------------------------------------- atomic overwrite


def _old_out(tmp_path: Path, exported) -> tuple[Path, dict[str, bytes]]:
    """A previous export, with two files of the user's beside what it wrote: (folder, its files)."""
    out = tmp_path / "out"
    shutil.copytree(exported[0], out)
    (out / "sub").mkdir()
    (out / "keep.txt").write_text("old")
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return out, listing(out)


def _failing_rename(monkeypatch, folder: Path, fail_calls: set[int]):
    """os.rename raising OSError on the given calls (1-based) among those that move a folder in ``folder``."""
    real, calls = os.rename, []

    def rename(src, dst, *args, **kwargs):
        if Path(src).parent != folder:
            return real(src, dst, *args, **kwargs)
        calls.append((src, dst))
        if len(calls) in fail_calls:
            raise OSError(f"injected failure of rename #{len(calls)}")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    return calls


@pytest.mark.parametrize("step", [1, 2], ids=["rename-old-aside", "rename-new-in"])
def test_failed_swap_leaves_the_old_out_dir_intact(tmp_path, monkeypatch, step, exported):
    out, before = _old_out(tmp_path, exported)
    calls = _failing_rename(monkeypatch, tmp_path, {step})
    with pytest.raises(OSError, match=f"injected failure of rename #{step}"):
        export(nosa_model(), out, overwrite=True)
    assert len(calls) == (step if step == 1 else 3)  # step 2 is followed by the rename back
    assert listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no stage, no hidden old folder


def test_failed_swap_and_failed_restore_say_where_the_old_content_is(tmp_path, monkeypatch, exported):
    out, before = _old_out(tmp_path, exported)
    _failing_rename(monkeypatch, tmp_path, {2, 3})
    with pytest.raises(OSError, match="the old content is in") as caught:
        export(nosa_model(), out, overwrite=True)
    aside = Path(str(caught.value).rsplit("the old content is in ", 1)[1].strip("'"))
    assert aside.parent == tmp_path and listing(aside) == before


def test_failed_removal_of_the_old_folder_keeps_the_new_export(tmp_path, monkeypatch, caplog, exported):
    out, _ = _old_out(tmp_path, exported)

    def rmtree(path, *args, **kwargs):
        raise OSError("injected failure of rmtree")

    monkeypatch.setattr(files.shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger="hf_nosa.hub.files"):
        export(nosa_model(), out, overwrite=True)
    assert (out / "model.safetensors").is_file() and (out / "keep.txt").read_text() == "old"
    assert "removing the replaced folder" in caplog.text


def test_failure_before_the_swap_removes_created_parents(tmp_path, monkeypatch):
    from hf_nosa.hub import card

    def broken(**kwargs):
        raise RuntimeError("card failed")

    monkeypatch.setattr(card, "render_model_card", broken)
    with pytest.raises(RuntimeError, match="card failed"):
        export(nosa_model(), tmp_path / "a" / "b" / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", [".", "..", "./"])
def test_export_to_the_current_folder_is_refused_up_front(tmp_path, monkeypatch, target, exported):
    out, before = _old_out(tmp_path, exported)
    monkeypatch.chdir(out)
    with pytest.raises(ValueError, match="current folder"):
        export(nosa_model(), target, overwrite=True)
    assert listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_export_command_to_the_current_folder_fails_cleanly(tmp_path, monkeypatch, capsys, source, exported):
    from hf_nosa.cli.commands import main

    out, before = _old_out(tmp_path, exported)
    monkeypatch.chdir(out)
    assert main(["export", str(source), ".", "--overwrite"]) == 2
    assert "current folder" in capsys.readouterr().err
    assert listing(out) == before


def test_out_dir_that_is_a_link_is_refused(tmp_path, exported):
    out, before = _old_out(tmp_path, exported)
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(ValueError, match="symbolic link"):
        export(nosa_model(), tmp_path / "link", overwrite=True)
    assert listing(out) == before


# --------------------------------------------------------------------------- modes follow the umask


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("overwrite", [False, True])
def test_created_files_and_folders_follow_the_umask(tmp_path, umask, overwrite, exported):
    out = tmp_path / "new" / "out"
    if overwrite:
        shutil.copytree(exported[0], out)
        out.chmod(0o700)
    previous = os.umask(umask)
    try:
        export(nosa_model(), out, overwrite=overwrite)
    finally:
        os.umask(previous)
    folders = [out, out / "custom_generate"] + ([] if overwrite else [out.parent])
    assert {stat.S_IMODE(p.stat().st_mode) for p in folders} == {0o777 & ~umask}
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()} == {0o666 & ~umask}
