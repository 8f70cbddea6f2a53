"""Files that are never half-written, outputs that never replace inputs, and JSON that fails in one
line.

Every output of the toolkit (checkpoints, token files, HF folders, JSON state) is written under a
temporary name in the same folder and renamed at the end, so a crash or a full disk never leaves a
half-written file under the final name, and an old file is only replaced by a complete new one.
A failed write is one line naming the file and the cause.
"""
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import numpy as np

from toolkit import cli
from toolkit.cli import CLIError

try:
    import fcntl
    import resource
except ImportError:  # Windows: no advisory locks, no file size limit
    fcntl = resource = None

# the scripts; toolkit/ holds the rest
CODE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPORARY = re.compile(r"\..+\.tmp(\d+)")
# what the toolkit ships beside the scripts, and its folders: never an output
SHIPPED_FILES = re.compile(r".*\.py|README\.md|requirements(-test)?\.txt|hostfile\.txt|"
                           r"ds_config.*\.json|pyproject\.toml|pytest\.ini|\.gitignore")
SHIPPED_FOLDERS = ("toolkit", "docs", "tests", "benchmarks", "examples", ".ci")
MAX_JSON_BYTES = 256 << 20  # the largest tokenizer.json in use (Qwen3's) is 11 MiB


def temporary_name(path: str) -> str:
    """A hidden name next to path, unique per process: where path is written before the rename."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """Call write(tmp) to fill a temporary file, flush it to disk, then rename it to path."""
    make_folder(os.path.dirname(path) or ".")
    refuse_special(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # some writers (safetensors) create private files
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch's zip writer hides ENOSPC behind a RuntimeError
        raise write_error(path, e, tmp) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextmanager
def atomic_open(path: str, mode: str = "w") -> Iterator[IO]:
    """An open file to write path through, e.g. line by line: it lies under a temporary name until
    the block ends, then is renamed to path; if the block fails or is interrupted, the temporary
    file goes and path is untouched."""
    make_folder(os.path.dirname(path) or ".")
    refuse_special(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:
        raise write_error(path, e, tmp) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_error(path: str, error: Exception, tmp: str | None = None) -> CLIError:
    """The one wording of a failed write: `cannot write PATH: WHY; nothing was replaced`."""
    return CLIError(f"cannot write {path}: {_why_write_failed(error, tmp or path)}; nothing was "
                    "replaced")


def _why_write_failed(error: Exception, tmp: str) -> str:
    written = os.path.getsize(tmp) if os.path.isfile(tmp) else 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource else None
    # what a write past the limit gets
    too_large = isinstance(error, OSError) and error.errno == errno.EFBIG
    if limit not in (None, getattr(resource, "RLIM_INFINITY", None)) and \
            (too_large or written >= limit):
        return f"the file size limit of {limit:,} bytes was reached (ulimit -f)"
    folder = os.path.dirname(os.path.abspath(tmp))
    while not os.path.isdir(folder):  # the nearest folder that exists holds the space
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder).free
    if isinstance(error, OSError) and error.errno == errno.ENOSPC or free < max(written, 1 << 20):
        return f"no space left on device ({free:,} bytes free)"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return cli.first_line(error)


def make_folder(path: str, flag: str | None = None) -> None:
    """os.makedirs(path, exist_ok=True); failures (file in the way, no permission) name the flag."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise CLIError(f"{flag + ' ' if flag else ''}{path}: a file is in the way of this folder; "
                       "choose another path") from None
    except OSError as e:
        raise CLIError(f"cannot create the folder {path}: "
                       f"{(e.strerror or str(e)).lower()}") from None


_locks: dict[str, int] = {}  # folder -> the open lock file this process holds
_made: set[str] = set()  # the locked folders this process created


def lock_folder(folder: str, flag: str = "--out-dir") -> None:
    """Hold an advisory lock on folder/.lock until release_locks() or this process ends (also
    proving the folder writable); another process asking gets a CLIError naming the holder's PID."""
    key = os.path.realpath(folder)
    if key in _locks:
        return
    if not os.path.isdir(folder):
        make_folder(folder, flag)
        _made.add(key)
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CLIError(f"{folder} is in use by another run (PID {other}); wait for it to "
                           f"finish or use another {flag}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    _locks[key] = fd
    cli.at_end(release_locks)


def release_locks() -> None:
    """Let go of every folder lock this process holds (cli.run does when a script's main() ends); a
    folder it created and left holding only the lock (the run stopped at a check) goes too."""
    while _locks:
        folder, fd = _locks.popitem()
        os.close(fd)
        if folder in _made and os.listdir(folder) == [".lock"]:
            try:
                os.remove(os.path.join(folder, ".lock"))
                os.rmdir(folder)
            except OSError:  # another run came in meanwhile
                pass
    _made.clear()


def remove_temporaries(folder: str, pid: int | None = None) -> None:
    """Delete the temporary files in folder that a killed writer left (call it holding the folder's
    lock), or only those of process pid (a writer cleaning up after itself)."""
    for name in os.listdir(folder):
        found = TEMPORARY.fullmatch(name)
        if found and pid in (None, int(found[1])) and os.path.isfile(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))


def claim_out_dir(out_dir: str, checkpoint: str, resuming: bool, overwrite: bool) -> None:
    """Lock out_dir for this run (a second run there stops), clear what a killed writer left, and
    refuse to replace a checkpoint this run does not resume from."""
    lock_folder(out_dir)
    remove_temporaries(out_dir)
    if not resuming and os.path.exists(checkpoint) and not overwrite:
        raise CLIError(f"{checkpoint} holds the checkpoint of another run; continue it with "
                       "--init-from resume, use another --out-dir, or pass --overwrite to replace "
                       "it")


def check_output(path: str, inputs: list[str], flag: str, replaces_data: bool = False) -> None:
    """Refuse (CLIError) an output path that is one of the inputs, lies inside an input folder,
    holds an input (a folder output replaces what it holds), is a file this toolkit ships, or
    (unless replaces_data: tokenizer.py's own outputs) prepared data."""
    target = os.path.realpath(path)
    for source in filter(None, inputs):
        source = os.path.realpath(source)
        if target == source or os.path.isdir(source) and target.startswith(source + os.sep):
            raise CLIError(f"{flag} {path} would overwrite the input {source}; choose another path")
        if source.startswith(target + os.sep):
            raise CLIError(f"{flag} {path} holds the input {source}, which it would replace; "
                           "choose another path")
    if is_shipped(target):
        raise CLIError(f"{flag} {path} would overwrite this toolkit's "
                       f"{os.path.relpath(target, CODE_DIR)}")
    if not replaces_data and is_prepared_data(target):
        raise CLIError(f"{flag} {path} would overwrite prepared data (tokenizer.py's output); "
                       "choose another path")
    folder = os.path.dirname(target)
    while not os.path.exists(folder):  # found now, not when the work is done
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise CLIError(f"{flag} {path} cannot be written: {folder} is a file, not a folder")


def is_shipped(path: str) -> bool:
    """Whether a real path is one of the toolkit's own files (SHIPPED_FILES, SHIPPED_FOLDERS)."""
    relative = os.path.relpath(path, CODE_DIR)
    if os.path.dirname(relative) == "":
        return bool(SHIPPED_FILES.fullmatch(relative))
    return relative.split(os.sep)[0] in SHIPPED_FOLDERS


def is_prepared_data(path: str) -> bool:
    """Whether a real path is in a folder tokenizer.py prepared (it holds meta.json beside bins),
    or is half of a Megatron .bin/.idx pair."""
    folder = os.path.dirname(path)
    stem, extension = os.path.splitext(path)
    if extension in (".bin", ".idx") and os.path.exists(stem + {".bin": ".idx",
                                                                 ".idx": ".bin"}[extension]):
        return True
    return os.path.isfile(os.path.join(folder, "meta.json")) and any(
        entry.endswith(".bin") for entry in os.listdir(folder))


def refuse_existing(paths: list[str], overwrite: bool) -> None:
    """Refuse (CLIError) to replace an existing output file unless overwrite, and whatever is not a
    regular file (refuse_special)."""
    for path in paths:
        refuse_special(path)
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise CLIError(f"{existing[0]} already exists; use --overwrite to replace it")


def check_new_outputs(outputs: list[str], inputs: list[str], overwrite: bool,
                      flag: str = "--out") -> None:
    """check_output for each of a command's output files, then refuse_existing."""
    for path in outputs:
        check_output(path, inputs, flag)
    refuse_existing(outputs, overwrite)


def require_file(path: str, what: str = "file") -> None:
    """A CLIError unless path is a file: a folder is said to be one."""
    if os.path.isdir(path):
        raise CLIError(f"{path} is a folder, not a {what}")
    if os.path.exists(path) and not os.path.isfile(path):
        raise CLIError(f"{path} is a pipe or a device, not a {what}")
    if not os.path.isfile(path):
        raise CLIError(f"{what} not found: {path}")


def refuse_special(path: str, flag: str | None = None) -> None:
    """Refuse (CLIError) an output file path where something other than a regular file is: a
    folder, a pipe, a device such as /dev/null (the rename that ends every write would replace
    it)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise CLIError(f"{flag + ' ' if flag else ''}{path} is not a regular file (a folder, pipe "
                       "or device); give the path of a file to write")


def replace_folder(path: str, write: Callable[[str], Any]) -> Any:
    """Call write(tmp) to fill a new folder beside path, then put it in path's place whole: an old
    folder there is removed only once the new one is complete, so no file of the old stays mixed
    in."""
    tmp, old = temporary_name(path), temporary_name(path) + "-old"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        result = write(tmp)
        if os.path.isdir(path):
            os.rename(path, old)
        os.rename(tmp, path)
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return result


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fingerprint(path: str) -> str:
    """sha256 of a file, or of a folder's files (their relative names and contents, in sorted order;
    hidden files such as a folder lock left out): what a model was, wherever it lies."""
    digest = hashlib.sha256()
    if os.path.isfile(path):
        files = [(None, path)]
    else:
        files = sorted((os.path.relpath(os.path.join(root, name), path), os.path.join(root, name))
                       for root, _, names in os.walk(path) for name in names
                       if not name.startswith("."))
    for name, file in files:
        if name is not None:
            digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def write_text(path: str, text: str) -> None:
    """Write a text file (UTF-8), atomically."""
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: str, obj: Any) -> None:
    """Write obj as indented JSON, atomically."""
    write_text(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def write_jsonl(path: str, records: Iterable[dict]) -> np.ndarray:
    """Write records as JSON lines (UTF-8), atomically; returns the byte offset of every line and of
    the end, so that one line can be read without the others."""
    offsets = [0]
    with atomic_open(path, "wb") as f:
        for record in records:
            line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            offsets.append(offsets[-1] + len(line))
    return np.array(offsets, dtype=np.int64)


def save_array(path: str, array: np.ndarray) -> None:
    """np.save, atomically (np.load reads it, memory-mapped too)."""
    with atomic_open(path, "wb") as f:  # a file: np.save would add .npy to the temporary name
        np.save(f, array)


def parse_json(text: str | bytes, where: str):
    """The JSON value of every file and line the toolkit reads, or one CLIError naming where it came
    from: `WHERE: invalid JSON (why)`. Python's parser recurses, so nesting too deep to read (a line
    of 10,000 brackets) is invalid JSON here, not a RecursionError. A leading byte-order mark (as
    Windows editors write) is skipped."""
    try:
        text = (text.decode("utf-8") if isinstance(text, bytes) else text).removeprefix("\ufeff")
        value = json.loads(text)
    except json.JSONDecodeError as e:
        # (one of json's messages ends in "at" already: "Invalid control character at")
        raise CLIError(f"{where}: invalid JSON ({e.msg.removesuffix(' at')} at line "
                       f"{e.lineno} column {e.colno})") from None
    except RecursionError:
        raise CLIError(f"{where}: invalid JSON (nested too deeply to read)") from None
    except UnicodeDecodeError as e:
        raise CLIError(f"{where}: not UTF-8 text (byte offset {e.start})") from None
    except ValueError as e:  # a number of more digits than Python converts
        raise CLIError(f"{where}: invalid JSON ({str(e).split(';')[0]})") from None
    return value


def read_json(path: str, what: str = "JSON file") -> dict:
    """A JSON object from a file, or a one-line CLIError saying what is wrong with it."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # (/dev/zero, say, never ends)
    except FileNotFoundError:
        raise CLIError(f"{what} not found: {path}") from None
    except OSError as e:
        raise CLIError(f"cannot read {path}: {(e.strerror or str(e)).lower()}") from None
    if len(data) > MAX_JSON_BYTES:
        raise CLIError(f"{path} holds more than {MAX_JSON_BYTES >> 20} MiB, more than any {what}")
    value = parse_json(data, path)
    if not isinstance(value, dict):
        raise CLIError(f"{path} must hold a JSON object")
    return value
