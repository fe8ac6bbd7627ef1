"""File rules of export and push: which files an export writes, reads that stay inside their folder, an out_dir
apart from every input, permissions that follow the umask, the manifest of what an export wrote, and the swap that
moves a finished export into place (keeping what the export did not write).

Nothing here imports torch: push, verify and the command line use it before any model code loads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

logger = logging.getLogger(__name__)

SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CUSTOM_GENERATE = "custom_generate/generate.py"
CUSTOM_GENERATE_REQUIREMENTS = "custom_generate/requirements.txt"
RETROFIT_RECORD = "nosa_retrofit.json"
# The names of the files an export wrote, written last into the folder: what a later --overwrite may replace.
MANIFEST = "nosa_export.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# Every file an export writes except the weight shards and the remote-code files, whose names depend on the folder.
EXPORT_FILES = (
    "README.md",
    "config.json",
    "generation_config.json",
    SINGLE_WEIGHTS,
    WEIGHTS_INDEX,
    CUSTOM_GENERATE,
    CUSTOM_GENERATE_REQUIREMENTS,
    RETROFIT_RECORD,
    MANIFEST,
    *TOKENIZER_FILES,
)


def containment_root(folder: Path) -> Path:
    """The folder whose inside ``folder``'s files may point to: the folder itself, or for a Hub-cache snapshot
    (``models--ORG--NAME/snapshots/REV``) the cached repository, whose files link into its ``blobs/``."""
    folder = Path(folder).resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent
    return folder


def relative_name(name: object, where: str) -> PurePosixPath:
    """``name`` as a plain relative path (no absolute path, no ``..``); ValueError naming ``where`` otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: {name!r} is not a file name")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name or name.startswith("~"):
        raise ValueError(f"{where}: {name!r} is not a file inside the folder (absolute paths and '..' are refused)")
    return path


def inside(folder: Path, name: str, *, root: Path | None = None, where: str | None = None) -> Path:
    """``folder / name`` after checking that the name stays in the folder and that no symbolic link on the way
    leads out of ``root`` (default: :func:`containment_root` of ``folder``); ValueError naming the file otherwise."""
    folder = Path(folder)
    path = folder / relative_name(name, where or str(folder))
    limit = (root or containment_root(folder)).resolve()
    target = path.resolve()
    if target != limit and limit not in target.parents:
        raise ValueError(
            f"{str(path)!r} leads outside {str(limit)!r} (to {str(target)!r}): files are read only inside the folder "
            "they belong to; copy the file into the folder instead of linking it"
        )
    return path


def check_links_stay_inside(folder: Path, *, what: str = "folder") -> None:
    """Every symbolic link in ``folder`` (at any depth) points inside its :func:`containment_root`; ValueError
    naming the first that does not. Nothing is followed."""
    folder = Path(folder)
    limit = containment_root(folder)
    for current, dirs, files in os.walk(folder, followlinks=False):
        for entry in sorted(dirs) + sorted(files):
            path = Path(current) / entry
            if path.is_symlink():
                target = path.resolve()
                if target != limit and limit not in target.parents:
                    raise ValueError(
                        f"{what} {str(folder)!r}: {str(path.relative_to(folder))!r} is a symbolic link to "
                        f"{str(target)!r}, outside the folder; export reads only inside its inputs"
                    )


def symbolic_links(folder: Path) -> list[str]:
    """Names (relative, POSIX) of the symbolic links in ``folder``, at any depth; links are not followed."""
    folder = Path(folder)
    found = []
    for current, dirs, files in os.walk(folder, followlinks=False):
        for entry in dirs + files:
            path = Path(current) / entry
            if path.is_symlink():
                found.append(path.relative_to(folder).as_posix())
    return sorted(found)


def all_files(folder: Path) -> list[str]:
    """Names (relative, POSIX) of the regular files in ``folder``, at any depth, without following links."""
    folder = Path(folder)
    found = []
    for current, _dirs, files in os.walk(folder, followlinks=False):
        for entry in files:
            path = Path(current) / entry
            if not path.is_symlink() and path.is_file():
                found.append(path.relative_to(folder).as_posix())
    return sorted(found)


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(tree: Path) -> None:
    """Give ``tree`` and everything in it the modes a plain mkdir / open would: 0o777 and 0o666 less the umask
    (``tempfile.mkdtemp`` makes 0o700 folders, and some writers make 0o600 files)."""
    mask = current_umask()
    tree = Path(tree)
    os.chmod(tree, 0o777 & ~mask)
    for current, dirs, files in os.walk(tree):
        for entry in dirs:
            os.chmod(Path(current) / entry, 0o777 & ~mask)
        for entry in files:
            os.chmod(Path(current) / entry, 0o666 & ~mask)


def _overlap(out_dir: Path, path: Path) -> str | None:
    """How ``out_dir`` and an input ``path`` overlap ("is", "contains", "lies inside"), or None; both resolved."""
    out_dir, path = Path(os.path.realpath(out_dir)), Path(os.path.realpath(path))
    if out_dir == path:
        return "is"
    if out_dir in path.parents:
        return "contains"
    if path in out_dir.parents:
        return "lies inside"
    return None


def check_out_dir(out_dir: Path, overwrite: bool, inputs: dict[str, Path] | None = None) -> Path:
    """``out_dir`` made absolute, after refusing what export cannot replace safely: a file, a link, the current folder
    or one that contains it (it cannot be renamed away), a folder that is, contains or lies inside one of ``inputs``
    (what export reads, name -> path: replacing it would delete the input, writing into it would change it), a
    non-empty folder without ``overwrite``, and with ``overwrite`` a non-empty folder that is not a previous export
    (no :data:`MANIFEST`): ``overwrite`` replaces only what an export wrote. Nothing is written."""
    out_dir = Path(out_dir)
    absolute = Path(os.path.abspath(out_dir))
    if not absolute.name or absolute.parent == absolute:
        raise ValueError(f"out_dir {str(out_dir)!r} names no folder; pass the folder to write, e.g. 'nosa-model'")
    if absolute.is_symlink():
        raise ValueError(f"out_dir {str(out_dir)!r} is a symbolic link; pass the folder it points to")
    if absolute.exists() and not absolute.is_dir():
        raise ValueError(f"out_dir {str(out_dir)!r} exists and is not a folder")
    cwd = Path.cwd().resolve()
    if absolute.exists() and (absolute.resolve() == cwd or absolute.resolve() in cwd.parents):
        raise ValueError(
            f"out_dir {str(out_dir)!r} is the current folder or contains it: export writes a new folder and swaps it "
            "in, which cannot be done to the folder you are in; pass a subfolder such as 'nosa-model'"
        )
    for what, path in (inputs or {}).items():
        how = _overlap(absolute, Path(path))
        if how is not None:
            raise ValueError(
                f"out_dir {str(out_dir)!r} {how} the {what} {str(path)!r}: export never writes where it reads; pass "
                "an out_dir outside every input, e.g. a sibling folder"
            )
    if absolute.is_dir() and any(absolute.iterdir()):
        if not overwrite:
            raise ValueError(f"out_dir {str(out_dir)!r} is not empty; pass overwrite=True (--overwrite) to replace a "
                             "previous export there")
        read_manifest(absolute)
    return absolute


def write_manifest(stage: Path, version: str) -> None:
    """Record every file now in ``stage`` as written by this export (:data:`MANIFEST`, written last)."""
    names = [name for name in all_files(stage) if name != MANIFEST]
    text = json.dumps({"hf_nosa_version": version, "files": names}, indent=1) + "\n"
    (Path(stage) / MANIFEST).write_text(text, encoding="utf-8")


def read_manifest(folder: Path) -> list[str]:
    """The files a previous export wrote into ``folder`` (its :data:`MANIFEST`, the manifest itself included);
    ValueError when the folder has no valid manifest, i.e. it is not a previous export."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file() or path.is_symlink():
        raise ValueError(
            f"out_dir {str(folder)!r} is not empty and is not a previous export (it has no {MANIFEST}): --overwrite "
            "replaces only what an export wrote. Pass a new folder, or empty this one yourself"
        )
    try:
        names = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{str(path)!r} is not a valid export manifest ({error!r}); remove the folder yourself") from None
    if not isinstance(names, list):
        raise ValueError(f"{str(path)!r}: 'files' must be a list of file names")
    return [relative_name(name, str(path)).as_posix() for name in names] + [MANIFEST]


def foreign_entries(folder: Path) -> list[str]:
    """Names (relative, POSIX) of what a previous export in ``folder`` did not write: files and symbolic links at
    any depth, and empty folders, outside its manifest. These stay when the export is replaced."""
    folder = Path(folder)
    written = set(read_manifest(folder))
    found = []
    for current, dirs, files in os.walk(folder, followlinks=False):
        here = Path(current)
        for entry in files + [d for d in dirs if (here / d).is_symlink() or not any((here / d).iterdir())]:
            name = (here / entry).relative_to(folder).as_posix()
            if name not in written:
                found.append(name)
    return sorted(found)


def stage_dir(out_dir: Path) -> tuple[Path, list[Path]]:
    """(a fresh folder next to ``out_dir``, the missing parents of ``out_dir`` this created, outermost first)."""
    out_dir = Path(out_dir)
    created = []
    parent = out_dir.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    return stage, created[::-1]


def discard_stage(stage: Path, created: list[Path]) -> None:
    """Remove a stage folder and the parents :func:`stage_dir` created for it (those still empty)."""
    shutil.rmtree(stage, ignore_errors=True)
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            break


def swap_into_place(stage: Path, out_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """Move the finished ``stage`` folder (a sibling of ``out_dir``) to ``out_dir``. An existing ``out_dir`` is
    renamed aside, the stage renamed in, the entries named in ``keep`` (what the previous export did not write) moved
    back from the old folder into the new one, then the old one removed; if the second rename fails the old folder is
    renamed back, so ``out_dir`` holds either the new export or its old content. On failure ``stage`` is left for
    the caller to remove."""
    stage, out_dir = Path(stage), Path(out_dir)
    if not out_dir.exists():
        os.rename(stage, out_dir)
        return
    clash = sorted(name for name in keep if os.path.lexists(stage / name))
    if clash:
        raise ValueError(f"out_dir {str(out_dir)!r} holds {clash}, which the previous export did not write and this "
                         "one would replace; move them away, or export to a new folder")
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rmdir(aside)  # only the unique name is needed: renaming onto an existing folder is not portable
    os.rename(out_dir, aside)
    try:
        os.rename(stage, out_dir)
    except BaseException:
        try:
            os.rename(aside, out_dir)
        except OSError as error:
            raise OSError(
                f"moving the new export to {str(out_dir)!r} failed and putting the old folder back failed too "
                f"({error}); the old content is in {str(aside)!r}"
            ) from error
        raise
    try:
        for name in keep:
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            os.rename(aside / name, out_dir / name)
    except OSError as error:
        logger.warning("the export is in %s; moving the files it did not write back from %s failed (%s): they are "
                       "still there", out_dir, aside, error)
        return
    try:
        shutil.rmtree(aside)
    except OSError as error:
        logger.warning("the export is in %s; removing the replaced folder %s failed: %s", out_dir, aside, error)
