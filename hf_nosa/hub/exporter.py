"""``export``: a NOSA model or retrofit adapter -> a self-describing checkpoint folder, and ``hf-nosa export``.

The folder holds safetensors weights (eviction heads included), config.json with model_type ``nosa_<family>``, the
"nosa" section and ``auto_map``, remote-code files importing the installed hf_nosa, ``custom_generate/``, a
generation_config.json stock transformers loads, tokenizer files when there is a tokenizer, and README.md.
Everything is written to a temporary folder next to ``out_dir`` and moved into place only once it verifies, so a
failed export leaves ``out_dir`` untouched; files and folders get the modes the umask gives. Export reads only
inside its inputs: no symbolic link out of a source folder is followed, weight shards must lie inside the folder,
and a folder's recorded ``_name_or_path`` is never read from. It never touches its inputs either: an ``out_dir``
that is, contains or lies inside anything it reads is refused before any work, and ``overwrite`` replaces only the
files a previous export wrote there (its manifest, ``nosa_export.json``), keeping any other file.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from ..config import NosaConfig
from ..modeling import eviction_heads, family_of
from ..modeling.remote import MODEL_TYPE_PREFIX, REMOTE_CLASSES, family_of_model_type
from . import card as card_module
from .adapter import is_adapter_folder, merge_retrofit_adapter, read_retrofit_record
from .files import (
    TOKENIZER_FILES,
    apply_umask,
    check_links_stay_inside,
    check_out_dir,
    discard_stage,
    foreign_entries,
    inside,
    stage_dir,
    swap_into_place,
    write_manifest,
)
from .verify import (
    check_weights,
    default_requirement,
    nosa_section,
    read_config,
    remote_code_files,
    remote_code_texts,
    verify_folder,
    weight_files,
    weight_shapes,
)

logger = logging.getLogger(__name__)


def _load_model_folder(folder: Path):
    """A converted model saved with ``save_pretrained`` (or an exported one) -> NOSA model, eviction heads loaded."""
    config = read_config(folder)
    family = family_of_model_type(str(config.get("model_type", "")))
    nosa_section(config, str(folder))
    config_class, model_class = REMOTE_CLASSES[family]
    shapes = weight_shapes(weight_files(folder))
    nosa_model_config = config_class.from_dict(config)  # a stock model_type here is expected: no mismatch warning
    check_weights(model_class, nosa_model_config, shapes, str(folder))
    return model_class.from_pretrained(str(folder), config=nosa_model_config)


def _resolve_source(source: Any, base_model: Any):
    """(model, retrofit record or None, folder to look for a tokenizer in, base to read the tokenizer and license
    from, base named on the card) of an export source. Folders are checked for links leading out of them first."""
    from torch import nn

    if isinstance(source, nn.Module):
        if type(source).__name__.startswith("Peft"):
            raise TypeError("export takes a merged model or an adapter folder; call merge_and_unload() first")
        family_of(source)
        if not eviction_heads(source):
            raise ValueError("the model has no eviction heads: convert it with hf_nosa.to_nosa(model) first")
        name = getattr(source.config, "_name_or_path", None) or getattr(source, "name_or_path", None) or None
        folder = Path(name) if name and Path(name).is_dir() else None
        base = base_model or name
        for place, what in ((folder, "the model's folder"), (base, "base model folder")):
            if isinstance(place, (str, Path)) and Path(place).is_dir():
                check_links_stay_inside(Path(place), what=what)
        return source, None, folder, base, base
    if not isinstance(source, (str, Path)):
        raise TypeError(f"model_or_adapter_dir must be a model or a folder path, got {type(source).__name__}")
    folder = Path(source)
    if not folder.is_dir():
        raise FileNotFoundError(f"{str(folder)!r} is not a folder (a NOSA model folder or a retrofit adapter folder)")
    check_links_stay_inside(folder, what="source folder")
    if isinstance(base_model, (str, Path)) and Path(base_model).is_dir():
        check_links_stay_inside(Path(base_model), what="base model folder")
    if is_adapter_folder(folder):
        model, record = merge_retrofit_adapter(folder, base_model)
        base = base_model if isinstance(base_model, (str, Path)) else record.get("base_model")
        if isinstance(base, (str, Path)) and Path(base).is_dir():
            check_links_stay_inside(Path(base), what="base model folder")
        return model, record, folder, base, base
    model = _load_model_folder(folder)
    # config.json's _name_or_path is only a label: named on the card when it is a Hub id, never read from
    recorded = read_config(folder).get("_name_or_path")
    label = base_model or (recorded if card_module.is_repo_id(recorded) else None)
    return model, None, folder, base_model, label


def _cached_snapshot(repo_id: Any) -> Path | None:
    """The local Hub-cache folder of ``repo_id`` that holds its tokenizer files, if any were downloaded (no network)."""
    if not card_module.is_repo_id(repo_id):
        return None
    from huggingface_hub import try_to_load_from_cache

    for name in ("tokenizer_config.json", "tokenizer.json"):
        cached = try_to_load_from_cache(repo_id, name)
        if isinstance(cached, str):
            return Path(cached).parent
    return None


def _copy_tokenizer(tokenizer: Any, search: list[Path | None], stage: Path) -> bool:
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        tokenizer.save_pretrained(str(stage))
        return True
    folders = [Path(tokenizer)] if tokenizer is not None else [f for f in search if f is not None]
    for folder in folders:
        found = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
        if found:
            sources = [inside(folder, name) for name in found]  # every link checked before anything is copied
            for name, path in zip(found, sources):
                shutil.copyfile(path, stage / name)
            return True
    if tokenizer is not None:
        raise FileNotFoundError(f"tokenizer folder {str(tokenizer)!r} holds none of {list(TOKENIZER_FILES)}")
    return False


def _built_tokenizer(record: dict | None, base: Any):
    """The tokenizer of a base that keeps none in a folder, or None: the byte-level tokenizer of a run whose recipe
    names ``tokenizer: bytes`` (the ``tiny`` recipe), or the one a GGUF base embeds."""
    recipe = (record or {}).get("recipe") or {}
    if recipe.get("tokenizer") == "bytes":
        from ..modeling.tokenizer import build_tokenizer

        return build_tokenizer()
    from ..modeling.loading import is_gguf, load_tokenizer

    return load_tokenizer(base) if is_gguf(base) else None


def _inputs(source: Any, base_model: Any, tokenizer: Any, metrics: Any) -> dict[str, Path]:
    """What an export reads from the file system, named for error messages (name -> path): the source folder (or
    an in-memory model's folder), the base model given or recorded by an adapter, the tokenizer folder and the
    metrics file. Read before any model loads, so that a bad out_dir is refused first."""
    from torch import nn

    found: dict[str, Any] = {}
    if isinstance(source, nn.Module):
        name = getattr(source.config, "_name_or_path", None) or getattr(source, "name_or_path", None)
        found["model's folder"] = name
    elif isinstance(source, (str, Path)):
        found["source folder"] = source
        if is_adapter_folder(Path(source)):
            found["base model recorded in nosa_retrofit.json"] = read_retrofit_record(Path(source)).get("base_model")
    found.update({"base model": base_model, "tokenizer folder": tokenizer, "metrics file": metrics})
    return {what: Path(path) for what, path in found.items()
            if isinstance(path, (str, Path)) and str(path) and Path(path).exists()}


def _write_config(model, stage: Path, family: str, cfg: NosaConfig, version: str, requirement: str) -> None:
    config = read_config(stage)  # what save_pretrained wrote: the family's config, dtype included
    configuration_file, modeling_file = remote_code_files(family)
    config_class, model_class = REMOTE_CLASSES[family]
    config.update(
        model_type=MODEL_TYPE_PREFIX + family,
        architectures=[model_class.__name__],
        auto_map={
            "AutoConfig": f"{configuration_file[:-3]}.{config_class.__name__}",
            "AutoModelForCausalLM": f"{modeling_file[:-3]}.{model_class.__name__}",
        },
        nosa=cfg.to_dict(),
        hf_nosa_version=version,
        hf_nosa_requirement=requirement,
    )
    (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_generation_config(model, stage: Path) -> None:
    from transformers import GenerationConfig

    generation = model.generation_config.to_dict() if getattr(model, "generation_config", None) else {}
    if generation.get("cache_implementation") == "nosa":
        # stock transformers refuses to load this string; generate(cache_implementation="nosa") is the way in
        logger.warning('dropping cache_implementation="nosa" from generation_config.json (pass it to generate)')
        generation.pop("cache_implementation")
        generation.pop("cache_config", None)
    GenerationConfig.from_dict(generation).save_pretrained(str(stage))


def _write_code(stage: Path, family: str, version: str, requirement: str) -> None:
    (stage / "custom_generate").mkdir()
    for name, text in remote_code_texts(family, version, requirement).items():
        (stage / name).write_text(text, encoding="utf-8")


def export(
    model_or_adapter_dir: Any,
    out_dir: str | Path,
    *,
    base_model: Any = None,
    tokenizer: Any = None,
    nosa_config: NosaConfig | None = None,
    metrics: Any = None,
    repo_id: str | None = None,
    base_model_id: str | None = None,
    license: str | None = None,
    hf_nosa_requirement: str | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write a NOSA model (or a retrofit adapter, merged) as a Hub-ready checkpoint folder; return its path.

    Args:
        model_or_adapter_dir: a converted model (``to_nosa``), a folder it was saved to, or a retrofit adapter
            folder (PEFT files + ``nosa_retrofit.json``), which is merged into its base.
        out_dir: the folder to create; an existing non-empty one must be a previous export and needs
            ``overwrite=True``: the files that export wrote are replaced by a swap that leaves them intact on failure,
            other files stay. The current folder, one containing it, and one that is, contains or lies inside an
            input (source, base, tokenizer folder, metrics file) are refused before any work.
        base_model: for an adapter, the base to merge into (path, Hub id or model) instead of the recorded one; a
            model passed here is converted and merged in place. For a model, the base it came from (path or Hub
            id; default: an in-memory model's ``name_or_path``; for a model folder none, as its config.json's
            ``_name_or_path`` is only named on the card, never read): the card's base_model and license and the
            tokenizer come from it.
        tokenizer: a tokenizer, or a folder holding tokenizer files; by default the source's folder, the base's
            folder or the base's local Hub-cache snapshot is searched and its tokenizer files copied; else the byte
            tokenizer of a ``tokenizer: bytes`` recipe or a GGUF base's tokenizer is saved (none: no tokenizer).
        nosa_config: the NosaConfig to store as the checkpoint's default (default: the model's).
        metrics: a metrics JSON path or object for the card's evaluation table (formats in ``hub/card.py``).
        repo_id: the Hub id the card's usage snippet names (default: the folder's name).
        base_model_id: the Hub id of the base model for the card's metadata (default: the recorded base when it is
            a Hub id).
        license: the card's license (default: read from the base model's card when it is local or cached).
        hf_nosa_requirement: the version specifier the remote code checks (default ``>=<this>,<<next major>``).
        max_shard_size: passed to ``save_pretrained``.
        overwrite: replace a previous export in ``out_dir`` (only the files it wrote).
    """
    import hf_nosa

    out_dir = check_out_dir(Path(out_dir), overwrite, _inputs(model_or_adapter_dir, base_model, tokenizer, metrics))
    if nosa_config is not None and not isinstance(nosa_config, NosaConfig):
        raise TypeError(f"nosa_config must be a NosaConfig, got {type(nosa_config).__name__}")
    version = hf_nosa.__version__
    requirement = hf_nosa_requirement or default_requirement(version)
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        SpecifierSet(requirement)
    except InvalidSpecifier:
        raise ValueError(f"hf_nosa_requirement={requirement!r} is not a version specifier such as '>=0.1,<1'") from None
    metric_rows = card_module.load_metrics(metrics)

    model, record, source_folder, base, label = _resolve_source(model_or_adapter_dir, base_model)
    family = family_of(model)
    cfg = NosaConfig.from_model_config(model.config, nosa_config)
    if base_model_id is None and card_module.is_repo_id(str(label) if label is not None else None):
        base_model_id = str(label)
    license_info = {"license": license} if license else None
    for place in (base, source_folder):  # the source folder of a converted model often carries the base's card
        license_info = license_info or card_module.base_model_license(place)
    base_folder = Path(base) if isinstance(base, (str, Path)) and Path(base).is_dir() else None

    stage, created = stage_dir(out_dir)
    try:
        model.save_pretrained(str(stage), max_shard_size=max_shard_size)
        _write_config(model, stage, family, cfg, version, requirement)
        _write_generation_config(model, stage)
        _write_code(stage, family, version, requirement)
        if not _copy_tokenizer(tokenizer, [source_folder, base_folder, _cached_snapshot(base)], stage):
            built = _built_tokenizer(record, base)
            if built is not None:
                built.save_pretrained(str(stage))
        readme = card_module.render_model_card(
            family=family,
            model_type=MODEL_TYPE_PREFIX + family,
            nosa_config=cfg,
            hf_nosa_version=version,
            hf_nosa_requirement=requirement,
            repo_id=repo_id or out_dir.name,
            base_model_id=base_model_id,
            license_info=license_info,
            retrofit_record=record,
            metrics=metric_rows,
        )
        (stage / "README.md").write_text(readme, encoding="utf-8")
        verify_folder(stage)
        write_manifest(stage, version)
        apply_umask(stage)
        keep = foreign_entries(out_dir) if out_dir.is_dir() and any(out_dir.iterdir()) else ()
        swap_into_place(stage, out_dir, tuple(keep))
    except BaseException:
        discard_stage(stage, created)
        raise
    logger.info("exported a NOSA %s checkpoint to %s", family, out_dir)
    return out_dir


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--nosa expects KEY=VALUE (a NosaConfig field), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run(args) -> int:
    nosa_config = None
    if args.nosa:
        overrides = dict(_parse_override(text) for text in args.nosa)
        source = Path(args.source)
        if is_adapter_folder(source):
            base = read_retrofit_record(source)["nosa_config"]
        else:
            base = read_config(source).get("nosa") or {}
        nosa_config = NosaConfig.from_dict(base, **overrides)
    out = export(
        args.source,
        args.out_dir,
        base_model=args.base_model,
        tokenizer=args.tokenizer,
        nosa_config=nosa_config,
        metrics=args.metrics,
        repo_id=args.repo_id,
        base_model_id=args.base_model_id,
        license=args.license,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    print(f"exported NOSA checkpoint to {out}")
    return 0
