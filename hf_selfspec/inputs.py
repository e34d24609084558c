"""Checks of what a user names: a file to read, a directory to write into, a file stem, a model,
a device. Each fails with one `InputError` line that names the input and what to do, and none
loads a model or writes anything, so every command can run them before its work starts.

The library raises `InputError` as the `ValueError` it is; the command line prints its one line
and exits with status 2.
"""

from __future__ import annotations

from pathlib import Path


class InputError(ValueError):
    pass


def _named(what: str, path: object) -> str:
    return f"{what} {path}" if what else str(path)


def existing_file(path: str | Path, what: str = "") -> Path:
    """`path`, once it is a file this process may read (not missing, not a directory)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{_named(what, path)}: is a directory; name the file in it")
    if not path.is_file():
        raise InputError(f"{_named(what, path)}: no such file")
    return path


def read_text_file(path: str | Path, what: str = "") -> str:
    """A text file's contents, refusing one that is missing, a directory, unreadable or not UTF-8."""
    path = existing_file(path, what)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(
            f"{_named(what, path)}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset {error.start}); "
            "is it the right file?"
        ) from None
    except OSError as error:
        raise InputError(f"{_named(what, path)}: cannot read it ({error.strerror or error})") from None


def output_directory(path: str | Path, what: str) -> Path:
    """A directory to write into, created later by whoever writes: refused now if a file is in the
    way, so that no work is spent on a result that cannot be written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{what} {path}: is a file; give a directory to write into")
    blocker = next((parent for parent in path.parents if parent.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise InputError(f"{what} {path}: {blocker} is a file, so the directory cannot be made")
    return path


def file_stem(name: str, what: str) -> str:
    """A bare file name without a directory, so that what is written lands where it is meant to."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise InputError((f"{what}: " if what else "") + f"must be a file name without a directory, got {name!r}")
    return name


def model_name(name: str, what: str = "--model") -> str:
    """A path-like model name (`/x`, `./x`, `../x`, `~/x`) must be a directory: otherwise
    transformers takes it for a Hub id and answers with the Hub's naming rule. Returns it with
    `~` expanded. Any other name (`embedded`, a Hub id) is for the loader to judge."""
    if not name.startswith(("/", ".", "~")):
        return name
    path = Path(name).expanduser()
    if not path.is_dir():
        problem = "not a directory" if path.exists() else "no such directory"
        raise InputError(f"{what} {name}: {problem}; give a model directory, a Hub id or 'embedded'")
    return str(path)


def usable_device(device: str, what: str = "--device") -> str:
    """A device torch knows and this machine has."""
    import torch

    try:
        device_type = torch.device(device).type
    except RuntimeError:
        raise InputError(f"{what} {device}: not a device torch knows, e.g. cpu, cuda or cuda:1") from None
    if device_type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{what} {device}: CUDA is not available in this torch build or on this machine; use cpu")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"{what} {device}: MPS is not available on this machine; use cpu")
    return device
