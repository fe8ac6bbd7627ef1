"""``push``: publish an exported NOSA folder to the Hugging Face Hub in one commit, and ``hf-nosa push``.

The folder is verified (config, weights, remote-code hashes, card) before any network call, without running its
code unless ``load_check=True``. Only the files an export writes are uploaded (weights and index, config, generation
config, tokenizer files, remote-code files, custom_generate/, README.md, nosa_retrofit.json, nosa_export.json);
anything else in the folder is left out and listed, and a folder holding a symbolic link is refused. A repo that already has files at the
target revision is left alone unless ``overwrite=True``, which replaces them (stale files are deleted in the same
commit).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

from .verify import verify_folder

logger = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
KEEP_REMOTE = {".gitattributes"}


class PushError(RuntimeError):
    """Publishing failed before or at the Hub (offline, not logged in, no access, repo not empty, ...)."""


def _offline() -> bool:
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return bool(check()) if callable(check) else bool(constants.HF_HUB_OFFLINE)


def _existing_files(api, repo_id: str, revision: str | None) -> set[str] | None:
    """Files of the repo at ``revision``; None when that branch does not exist yet."""
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        info = api.model_info(repo_id, revision=revision)
    except RevisionNotFoundError:
        return None
    return {sibling.rfilename for sibling in (info.siblings or [])}


def _hub_error(error: Exception, repo_id: str, endpoint: str) -> PushError:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(error, OfflineModeIsEnabled):
        return PushError(f"offline mode is on (HF_HUB_OFFLINE=1): unset it to push to {repo_id}. {error}")
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        if status == 401:
            return PushError(
                f"the Hub at {endpoint} refused the token (401 Unauthorized): log in with `hf auth login` or set "
                "HF_TOKEN to a token with write access"
            )
        if status == 403:
            return PushError(f"the token has no write access to {repo_id} (403 Forbidden); use a write token")
        return PushError(f"the Hub at {endpoint} answered {status} while pushing {repo_id}: {error}")
    return PushError(f"cannot reach the Hub at {endpoint}: {type(error).__name__}: {error}")


def push(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    load_check: bool = False,
    commit_message: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """Verify an exported NOSA folder, then create the repo and upload the files export writes in one commit.

    Returns ``{"repo_id", "revision", "files", "skipped", "commit_url", "dry_run"}``: ``files`` are uploaded (or would
    be, with ``dry_run``), ``skipped`` are the folder's other files, never uploaded. ``dry_run`` stops after the
    checks. The checks run none of the folder's code; ``load_check=True`` also loads the model's remote code and
    custom generate through transformers, which runs the folder's Python files. Raises ValueError /
    FileNotFoundError for a folder that does not verify (a symbolic link in it, remote-code files that differ from
    the ones hf_nosa writes, ...), PushError for the Hub side (offline, not logged in, no access, or a repo that
    already has files and ``overwrite=False``).
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token

    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id):
        raise ValueError(f"repo_id={repo_id!r} must be ORG/NAME (letters, digits, '-', '_', '.')")
    folder = Path(folder)
    summary = verify_folder(folder, load_check=load_check)
    files = summary["files"]
    result = {"repo_id": repo_id, "revision": revision or "main", "files": files, "skipped": summary["skipped"]}
    result.update(commit_url=None, dry_run=dry_run)
    if dry_run:
        return result
    if _offline():
        raise PushError(
            f"offline mode is on (HF_HUB_OFFLINE=1): nothing was pushed to {repo_id}. Unset HF_HUB_OFFLINE to push, "
            "or use --dry-run to check the folder only."
        )
    token = token or get_token()
    if not token:
        raise PushError(
            f"not logged in to the Hugging Face Hub: nothing was pushed to {repo_id}. Run `hf auth login` or set "
            "HF_TOKEN to a token with write access."
        )
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
        existing = _existing_files(api, repo_id, revision)
        if existing is None and revision is not None:  # a new branch, made from main
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        existing = existing or set()
        occupied = sorted(existing - KEEP_REMOTE)
        if occupied and not overwrite:
            raise PushError(
                f"{repo_id} already has {len(occupied)} file(s) at revision {result['revision']} "
                f"(e.g. {occupied[:3]}); nothing was pushed. Pass overwrite=True (--overwrite) to replace them."
            )
        stale = sorted(set(occupied) - set(files))
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in files]
        operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or f"Upload NOSA {summary['family']} checkpoint",
            repo_type="model",
            revision=revision,
        )
    except PushError:
        raise
    except Exception as error:  # the Hub client raises HTTP, offline and transport errors of several types
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(error, (HfHubHTTPError, OfflineModeIsEnabled, OSError)) or "httpx" in type(error).__module__:
            raise _hub_error(error, repo_id, api.endpoint) from error
        raise
    result["commit_url"] = str(getattr(commit, "commit_url", commit))
    return result


def run(args) -> int:
    try:
        result = push(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            overwrite=args.overwrite,
            dry_run=args.dry_run,
            load_check=args.load_check,
            commit_message=args.commit_message,
        )
    except PushError as error:
        print(f"hf-nosa push: error: {error}", file=sys.stderr)
        return 1
    target = f"{result['repo_id']}@{result['revision']}"
    checked = "loaded with its remote code" if args.load_check else "its code was not run; --load-check loads it"
    if result["dry_run"]:
        print(f"dry run: {args.folder} verifies ({checked}); nothing was sent. Would upload {len(result['files'])} "
              f"files to {target}:")
    else:
        print(f"pushed {len(result['files'])} files to {target} in one commit: {result['commit_url']}")
    for name in result["files"]:
        print(f"  {name}")
    if result["skipped"]:
        print(f"left out {len(result['skipped'])} files that export does not write (never uploaded):")
        for name in result["skipped"]:
            print(f"  {name}")
    return 0
