"""Sharing tuned profiles on the Hub, as a pull request by default: the `generation_config.json`
(with the draft adapters and lookup corpora its profiles name), or a folder written by `hf-selfspec package`.

A pull request is the default because a tuned profile changes how everyone's `generate` runs on
that hardware; the repository's owners should get to look first. Local files are only read.
"""

from __future__ import annotations

from pathlib import Path

from hf_selfspec.tuner_api import adapter_files
from hf_selfspec.hub.package import (
    BUNDLED_PROFILES_MODULE,
    CUSTOM_GENERATE_DIR,
    bundled_profiles_for_repository,
    check_package_folder,
)
from hf_selfspec.tuner_api import files_named_by, read_config_json, read_profiles_file

from .. import TuningError
from .export import CONFIG_NAME


class PushError(TuningError):
    pass


def _commit_text(profiles) -> tuple[str, str]:
    keys = ", ".join(sorted(profiles))
    lines = []
    for key, profile in sorted(profiles.items()):
        measured = profile.measured
        speed = f"{measured['speedup']:.2f}x" if "speedup" in measured else "speedup not recorded"
        lines.append(f"- `{key}`: `{profile.strategy}`, {speed} (study {measured.get('study', '?')!r})")
    description = "Tuned self-speculative decoding profiles (hf-selfspec):\n\n" + "\n".join(lines)
    return f"Add self-speculative profiles for {keys}", description


def push_config(
    config_path: str | Path,
    repo_id: str,
    create_pr: bool = True,
    endpoint: str | None = None,
    token: str | None = None,
) -> str:
    """Upload `config_path` as the repository's `generation_config.json`, with the files (adapters, corpora)
    its profiles name at those names, in one commit; returns the URL of the pull request (or of
    the commit, with `create_pr=False`)."""
    from huggingface_hub import CommitOperationAdd

    path = Path(config_path)
    try:
        read_config_json(path, "--config")  # missing, a directory, not text, not JSON: said plainly
    except ValueError as error:
        raise PushError(str(error)) from None
    profiles, named_files = _profiles_to_push(path)
    operations = [CommitOperationAdd(path_in_repo=CONFIG_NAME, path_or_fileobj=path.read_bytes())]
    for name in named_files:
        for file in adapter_files(name):
            operations.append(CommitOperationAdd(path_in_repo=file.as_posix(), path_or_fileobj=path.parent / file))
    return _upload(
        profiles,
        repo_id,
        create_pr,
        endpoint,
        token,
        lambda api, **commit: api.create_commit(operations=operations, **commit),
    )


def push_folder(
    folder: str | Path,
    repo_id: str,
    create_pr: bool = True,
    endpoint: str | None = None,
    token: str | None = None,
) -> str:
    """Upload a folder written by `hf-selfspec package` (a model directory it was written into
    included) into the repository, in one commit; returns the pull request's (or commit's) URL.
    Where a profile drafts with an adapter, the uploaded bundled profiles name it by its address
    in that repository (the folder itself is left as it is)."""
    folder = Path(folder)
    check_package_folder(folder, "--folder")
    profiles, named_files = _profiles_to_push(folder / CONFIG_NAME)  # the folder holds the files it names
    operations = _folder_operations(folder, repo_id if named_files else None)
    return _upload(
        profiles,
        repo_id,
        create_pr,
        endpoint,
        token,
        lambda api, **commit: api.create_commit(operations=operations, **commit),
    )


def _folder_operations(folder: Path, adapter_repo: str | None) -> list:
    """One addition per file, as a single commit (`upload_folder` may split a large folder into
    several); hidden folders such as .git and Python caches stay behind. With `adapter_repo`,
    the bundled profiles are rewritten to fetch their adapters from it."""
    from huggingface_hub import CommitOperationAdd

    bundled = f"{CUSTOM_GENERATE_DIR}/{BUNDLED_PROFILES_MODULE}.py"
    operations = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
            continue
        content = path
        if relative.as_posix() == bundled and adapter_repo is not None:
            content = bundled_profiles_for_repository(folder, adapter_repo).encode()
        operations.append(CommitOperationAdd(path_in_repo=relative.as_posix(), path_or_fileobj=content))
    return operations


def _profiles_to_push(path: Path):
    """The config's profiles and the files (draft adapters, lookup corpora) they name, refusing a config whose profiles
    would not load once pushed: malformed, or naming an adapter that is not beside it."""
    try:
        profiles = read_profiles_file(path)
        named_files = files_named_by(profiles, path.parent)
    except (ValueError, OSError) as error:
        raise PushError(f"{path}: {error}") from None
    if not profiles:
        raise PushError(f"{path} holds no self-speculative profile; write one with `hf-selfspec export`")
    return profiles, named_files


def _upload(profiles, repo_id: str, create_pr: bool, endpoint: str | None, token: str | None, send) -> str:
    """Check what can be checked locally, then `send(api, repo_id=..., create_pr=..., commit_message=...,
    commit_description=...)`, turning the Hub client's failures into a `PushError` that says which."""
    import httpx2
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.constants import is_offline_mode
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    if is_offline_mode():
        raise PushError("cannot push while offline: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set; unset it")
    token = token or get_token()
    if not token:
        raise PushError("no Hugging Face token: log in with `hf auth login`, or set HF_TOKEN")
    message, description = _commit_text(profiles)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = send(
            api, repo_id=repo_id, create_pr=create_pr, commit_message=message, commit_description=description
        )
    except HFValidationError as error:
        raise PushError(f"--repo {repo_id!r}: {error}") from None
    except OfflineModeIsEnabled as error:
        raise PushError(f"cannot push while offline: {error}") from None
    except HfHubHTTPError as error:
        raise PushError(f"the Hub refused the upload to {repo_id}: {error}") from None
    except (httpx2.TransportError, OSError) as error:
        raise PushError(f"cannot reach {api.endpoint}: {error}") from None
    return info.pr_url if create_pr else info.commit_url
