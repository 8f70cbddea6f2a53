"""Files that are never half-written, and JSON that fails in one line.

Every output of the toolkit (checkpoints, token files, HF folders, JSON state) is written under a
temporary name in the same folder and renamed at the end, so a crash or a full disk never leaves a
half-written file under the final name, and an old file is only replaced by a complete new one.
"""
import json
import os
from typing import Any, Callable

from cli import CLIError


def temporary_name(path: str) -> str:
    """A hidden name next to path, unique per process: where path is written before the rename."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """Call write(tmp) to fill a temporary file, flush it to disk, then rename it to path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # some writers (safetensors) create private files
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str, obj: Any) -> None:
    """Write obj as indented JSON, atomically."""
    text = json.dumps(obj, indent=1) + "\n"

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def read_json(path: str, what: str = "JSON file") -> dict:
    """A JSON object from a file, or a one-line CLIError saying what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise CLIError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CLIError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CLIError(f"{path} must hold a JSON object")
    return value
