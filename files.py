"""Files that are never half-written, outputs that never replace inputs, and JSON that fails in one line.

Every output of the toolkit (checkpoints, token files, HF folders, JSON state) is written under a
temporary name in the same folder and renamed at the end, so a crash or a full disk never leaves a
half-written file under the final name, and an old file is only replaced by a complete new one.
A failed write is one line naming the file and the cause.
"""
import json
import os
import re
import shutil
from typing import Any, Callable

from cli import CLIError

try:
    import fcntl
    import resource
except ImportError:  # Windows: no advisory locks, no file size limit
    fcntl = resource = None

CODE_DIR = os.path.dirname(os.path.abspath(__file__))
TEMPORARY = re.compile(r"\..+\.tmp\d+")


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
    except (OSError, RuntimeError) as e:  # torch's zip writer hides ENOSPC behind a RuntimeError
        raise CLIError(f"cannot write {path}: {_why_write_failed(e, tmp)}; nothing was replaced") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _why_write_failed(error: Exception, tmp: str) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource else None
    if limit not in (None, getattr(resource, "RLIM_INFINITY", None)) and written >= limit:
        return f"the file size limit of {limit:,} bytes was reached (ulimit -f)"
    free = shutil.disk_usage(os.path.dirname(tmp) or ".").free
    if free < max(written, 1 << 20):
        return f"no space left on device ({free:,} bytes free)"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def lock_folder(folder: str) -> int | None:
    """Hold an advisory lock on folder/.lock for the life of this process (which also proves the folder
    writable); a second process that asks gets a CLIError naming the first one's PID."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise CLIError(f"{folder} is in use by another run (PID {other}); wait for it to finish or use "
                       f"another --out-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def remove_temporaries(folder: str) -> None:
    """Delete temporary files a killed writer left in folder (call it while holding the folder's lock)."""
    for name in os.listdir(folder):
        if TEMPORARY.fullmatch(name) and os.path.isfile(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))


def check_output(path: str, inputs: list[str], flag: str) -> None:
    """Refuse (CLIError) an output path that is one of the inputs, lies inside an input folder, or is a file
    of this toolkit's code."""
    target = os.path.realpath(path)
    for source in filter(None, inputs):
        source = os.path.realpath(source)
        if target == source or os.path.isdir(source) and target.startswith(source + os.sep):
            raise CLIError(f"{flag} {path} would overwrite the input {source}; choose another path")
    if os.path.dirname(target) == CODE_DIR and target.endswith(".py"):
        raise CLIError(f"{flag} {path} would overwrite this toolkit's {os.path.basename(target)}")


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
