"""Checks that an exported NOSA folder loads: config, weights (eviction heads included), remote code, card.

Weights are checked from the safetensors headers against the model built on the meta device, so a multi-GB
checkpoint is verified without reading its tensors. The remote-code files are compared (sha256) with the files this
version of hf_nosa writes, so a folder is verified without running its code; loading it with remote code is a
separate, explicit check (``load_check=True``, ``--load-check``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from packaging.version import InvalidVersion, Version
from safetensors import safe_open

from ..config import NosaConfig
from ..modeling.remote import MODEL_TYPE_PREFIX, REMOTE_CLASSES, family_of_model_type
from .files import (
    CUSTOM_GENERATE,
    CUSTOM_GENERATE_REQUIREMENTS,
    EXPORT_FILES,
    SINGLE_WEIGHTS,
    WEIGHTS_INDEX,
    all_files,
    inside,
    symbolic_links,
)
from .templates import read_template, render

FAMILY_TITLES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
EVICTION_HEAD_PARAMS = ("eviction_head.A", "eviction_head.delta.weight", "eviction_head.delta.bias")


def remote_code_files(family: str) -> tuple[str, str]:
    """The configuration and modeling file names of a family's exported checkpoint."""
    model_type = MODEL_TYPE_PREFIX + family
    return f"configuration_{model_type}.py", f"modeling_{model_type}.py"


def default_requirement(version: str) -> str:
    """The hf-nosa versions an export accepts: this one or newer, before the next major version."""
    parsed = Version(version)
    return f">={parsed.base_version},<{parsed.major + 1}"


def remote_code_texts(family: str, version: str, requirement: str) -> dict[str, str]:
    """File name -> text of the remote-code files an export of ``family`` writes (configuration, modeling,
    custom_generate/generate.py and its requirements.txt), for hf_nosa ``version`` and the ``requirement`` the code
    checks."""
    configuration_file, modeling_file = remote_code_files(family)
    config_class, model_class = REMOTE_CLASSES[family]
    values = {
        "FAMILY_TITLE": FAMILY_TITLES[family],
        "MODEL_TYPE": MODEL_TYPE_PREFIX + family,
        "CONFIG_CLASS": config_class.__name__,
        "MODEL_CLASS": model_class.__name__,
        "CONFIGURATION_MODULE": configuration_file[:-3],
        "HF_NOSA_VERSION": version,
        "HF_NOSA_REQUIREMENT": requirement,
        "HF_NOSA_MIN_VERSION": Version(version).base_version,
    }
    templates = {
        configuration_file: "configuration_nosa.py.tmpl",
        modeling_file: "modeling_nosa.py.tmpl",
        CUSTOM_GENERATE: "custom_generate/generate.py.tmpl",
        CUSTOM_GENERATE_REQUIREMENTS: "custom_generate/requirements.txt.tmpl",
    }
    return {name: render(read_template(template), values) for name, template in templates.items()}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_remote_code(folder: Path, config: dict[str, Any], family: str) -> None:
    """The remote-code files of ``folder`` are byte for byte those this version of hf_nosa writes for the version and
    requirement config.json records (compared by sha256; nothing is imported or run); ValueError naming the file."""
    where = str(folder)
    version = config.get("hf_nosa_version")
    try:
        Version(str(version))
    except InvalidVersion:
        raise ValueError(
            f"{where}: config.json hf_nosa_version={version!r} is not a version; hf-nosa export records the version "
            "that wrote the folder"
        ) from None
    requirement = config.get("hf_nosa_requirement") or default_requirement(str(version))
    if not isinstance(requirement, str):
        raise ValueError(f"{where}: config.json hf_nosa_requirement={requirement!r} must be a version specifier")
    for name, text in remote_code_texts(family, str(version), requirement).items():
        stored = _sha256((folder / name).read_bytes())
        expected = _sha256(text.encode("utf-8"))
        if stored != expected:
            raise ValueError(
                f"{where}: {name} (sha256 {stored[:12]}...) is not the file hf_nosa writes for this checkpoint (sha256 "
                f"{expected[:12]}...): it was edited, or exported by another hf_nosa version. It would run as remote "
                "code: re-export the folder with this version (hf-nosa export)"
            )


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of ``folder`` as a dict; FileNotFoundError / ValueError with the reason otherwise."""
    path = inside(Path(folder), "config.json")
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object")
    return config


def nosa_section(config: dict[str, Any], where: str) -> NosaConfig:
    """The validated "nosa" section of a config.json dict; ValueError naming the field otherwise."""
    if "nosa" not in config:
        raise ValueError(f'{where}: config.json has no "nosa" section; it is not a NOSA checkpoint')
    section = config["nosa"]
    if not isinstance(section, dict):
        raise ValueError(f'{where}: the "nosa" section of config.json must be an object, got {section!r}')
    try:
        return NosaConfig.from_dict(section)
    except (TypeError, ValueError) as error:
        raise ValueError(f'{where}: the "nosa" section of config.json is invalid: {error}') from None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder`` (one file, or every shard its index names), all present."""
    folder = Path(folder)
    if (folder / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads(inside(folder, WEIGHTS_INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{str(folder / WEIGHTS_INDEX)!r} is not a valid safetensors index: {error!r}") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{str(folder / WEIGHTS_INDEX)!r}: weight_map must be an object of tensor -> file name")
        shards = sorted({inside(folder, name, where=str(folder / WEIGHTS_INDEX)).relative_to(folder).as_posix()
                         for name in weight_map.values()})
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{str(folder)!r} is missing weight file(s) {missing} named by {WEIGHTS_INDEX}")
        return [folder / name for name in shards]
    if (folder / SINGLE_WEIGHTS).is_file():
        return [inside(folder, SINGLE_WEIGHTS)]
    raise FileNotFoundError(f"{str(folder)!r} has no weights: expected {SINGLE_WEIGHTS} or {WEIGHTS_INDEX}")


def weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers only."""
    shapes = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:  # safetensors raises its own error types for truncated or foreign files
            raise ValueError(f"{str(path)!r} is not a readable safetensors file: {error}") from None
    return shapes


def check_weights(model_class: type, config: Any, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Every parameter and persistent buffer of ``model_class(config)`` is in ``shapes`` with its shape (tied
    weights may be stored once), nothing else is, and every layer has its eviction head."""
    with torch.device("meta"):
        model = model_class(config)
    by_tensor: dict[int, list[str]] = {}
    expected = model.state_dict(keep_vars=True)
    for name, tensor in expected.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    missing, wrong = [], []
    for names in by_tensor.values():
        present = [name for name in names if name in shapes]
        if not present:
            missing.append(names[0])
        for name in present:
            if tuple(expected[name].shape) != shapes[name]:
                wrong.append(f"{name}: stored {list(shapes[name])}, model needs {list(expected[name].shape)}")
    unexpected = sorted(set(shapes) - set(expected))
    heads = [name for name in missing if ".eviction_head." in name]
    if heads:
        raise ValueError(f"{where}: the weights lack the eviction heads ({len(heads)} tensors, e.g. {heads[0]})")
    problems = []
    if missing:
        problems.append(f"missing tensors {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}")
    if wrong:
        problems.append(f"shape mismatches {wrong[:5]}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if problems:
        raise ValueError(f"{where}: the weights do not match config.json: " + "; ".join(problems))


def load_with_remote_code(folder: Path, config_dict: dict[str, Any], family: str) -> None:
    """Load the folder's remote-code classes and custom generate through transformers, as a user would. This imports
    and runs the folder's Python files (what ``trust_remote_code=True`` does)."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.dynamic_module_utils import (
        check_python_requirements,
        get_cached_module_file,
        get_class_from_dynamic_module,
        get_class_in_module,
    )

    config_base, model_base = REMOTE_CLASSES[family]
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
    if not isinstance(config, config_base):
        raise ValueError(f"{folder}: auto_map's AutoConfig gives {type(config).__name__}, not a {config_base.__name__}")
    model_class = get_class_from_dynamic_module(config_dict["auto_map"]["AutoModelForCausalLM"], str(folder))
    if not issubclass(model_class, model_base):
        raise ValueError(f"{folder}: auto_map's AutoModelForCausalLM is not a {model_base.__name__}")
    module = get_cached_module_file(str(folder), CUSTOM_GENERATE)
    check_python_requirements(str(folder), requirements_file=CUSTOM_GENERATE_REQUIREMENTS)
    if not callable(get_class_in_module("generate", module)):
        raise ValueError(f"{folder}: {CUSTOM_GENERATE} defines no generate function")
    GenerationConfig.from_pretrained(str(folder))


def upload_files(folder: Path, family: str) -> tuple[list[str], list[str]]:
    """(the files of ``folder`` an export writes, the other files). Only the first are ever uploaded: the export
    files, the remote-code files of ``family`` and the weight shards the index names."""
    allowed = set(EXPORT_FILES) | set(remote_code_files(family))
    allowed |= {path.relative_to(folder).as_posix() for path in weight_files(folder)}
    present = all_files(folder)
    return [name for name in present if name in allowed], [name for name in present if name not in allowed]


def verify_folder(folder: str | Path, *, load_check: bool = False) -> dict[str, Any]:
    """Check that an exported folder is a loadable NOSA checkpoint without running its code; return a summary.

    Checks that the folder holds no symbolic links, config.json (model_type, "nosa" section, auto_map and its files),
    that the remote-code files are the ones this version of hf_nosa writes (sha256 of the rendered templates), the
    weights against the model class (names and shapes, eviction heads included, shards inside the folder),
    generation_config.json (loads on stock transformers: never cache_implementation "nosa"), and that README.md parses
    as a model card. With ``load_check=True`` it also loads the remote-code files and the custom generate through
    transformers: that imports and runs the folder's Python code, as ``trust_remote_code=True`` would.

    Returns ``{"family", "model_type", "files", "skipped", "tensors"}``: ``files`` are the files an export writes
    (what ``push`` uploads), ``skipped`` every other file in the folder.
    """
    from huggingface_hub import ModelCard

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder")
    where = str(folder)
    links = symbolic_links(folder)
    if links:
        raise ValueError(
            f"{where}: {links} {'is a symbolic link' if len(links) == 1 else 'are symbolic links'}; an exported folder "
            "holds plain files only (a link could publish a file from outside the folder). Replace each link with "
            "the file itself or remove it"
        )
    config_dict = read_config(folder)
    model_type = config_dict.get("model_type", "")
    if not str(model_type).startswith(MODEL_TYPE_PREFIX):
        raise ValueError(f"{where}: config.json model_type={model_type!r}; an export has model_type nosa_<family>")
    family = family_of_model_type(model_type)
    nosa_section(config_dict, where)
    configuration_file, modeling_file = remote_code_files(family)
    config_base, model_base = REMOTE_CLASSES[family]
    expected_map = {
        "AutoConfig": f"{configuration_file[:-3]}.{config_base.__name__}",
        "AutoModelForCausalLM": f"{modeling_file[:-3]}.{model_base.__name__}",
    }
    auto_map = config_dict.get("auto_map") or {}
    if not isinstance(auto_map, dict) or set(auto_map) != set(expected_map):
        raise ValueError(f"{where}: config.json auto_map is {auto_map!r}, expected {expected_map!r}")
    for key, value in expected_map.items():
        if auto_map.get(key) != value:
            raise ValueError(f"{where}: config.json auto_map[{key!r}] is {auto_map.get(key)!r}, expected {value!r}")
    required = [configuration_file, modeling_file, CUSTOM_GENERATE, CUSTOM_GENERATE_REQUIREMENTS, "README.md"]
    required.append("generation_config.json")
    absent = [name for name in required if not (folder / name).is_file()]
    if absent:
        raise FileNotFoundError(f"{where} is missing {absent}")
    check_remote_code(folder, config_dict, family)

    try:
        config = config_base.from_dict(config_dict)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: config.json does not build a {config_base.__name__}: {error}") from None
    files = weight_files(folder)
    shapes = weight_shapes(files)
    check_weights(model_base, config, shapes, where)

    generation = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    if generation.get("cache_implementation") == "nosa":
        raise ValueError(
            f'{where}: generation_config.json sets cache_implementation "nosa", which stock transformers refuses '
            "to load; pass it to generate() instead."
        )
    card = ModelCard.load(folder / "README.md")
    if card.data.to_dict().get("library_name") != "transformers":
        raise ValueError(f"{where}: README.md metadata lacks library_name: transformers")
    if load_check:
        load_with_remote_code(folder, config_dict, family)
    upload, skipped = upload_files(folder, family)
    return {"family": family, "model_type": model_type, "files": upload, "skipped": skipped, "tensors": len(shapes)}


def run(args) -> int:
    """``hf-nosa verify``."""
    summary = verify_folder(args.folder, load_check=args.load_check)
    checked = "and loads with its remote code" if args.load_check else "(its code was not run; --load-check loads it)"
    print(f"{args.folder}: a NOSA {summary['family']} checkpoint with {summary['tensors']} tensors; it verifies {checked}")
    print(f"files push uploads ({len(summary['files'])}):")
    for name in summary["files"]:
        print(f"  {name}")
    if summary["skipped"]:
        print(f"files push leaves out ({len(summary['skipped'])}): export does not write them")
        for name in summary["skipped"]:
            print(f"  {name}")
    return 0
