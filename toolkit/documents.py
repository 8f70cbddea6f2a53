"""Reading documents: a plain text file is one document, a JSON line is one document; folders are
walked in a fixed order; .gz, .bz2 and .xz files are decompressed on the fly. tokenizer.py streams
its input from here (read_documents); embed.py reads a corpus of texts with ids (read_corpus).
"""
import bz2
import fnmatch
import gzip
import json
import lzma
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from toolkit.cli import CLIError

COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
JSON_SUFFIXES = (".jsonl", ".json")


@dataclass
class ReadStats:
    bad_lines: int = 0


def input_files(paths: list[str], pattern: str) -> list[str]:
    """The files to read, in a fixed order: files as given, directories walked recursively (sorted,
    glob-filtered)."""
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs.sort()
                # "a.txt.gz" matches "*.txt": compression is not part of what the file is
                found += [os.path.join(root, n) for n in sorted(names)
                          if fnmatch.fnmatch(n, pattern) or fnmatch.fnmatch(without_compression(n), pattern)]
            if not found:
                raise CLIError(f"no files matching --glob {pattern!r} under {path}")
            files += found
        else:
            raise CLIError(f"input not found: {path}")
    return files


def without_compression(path: str) -> str:
    base, suffix = os.path.splitext(path)
    return base if suffix in COMPRESSED else path


def open_binary(path: str):
    return COMPRESSED.get(os.path.splitext(path)[1], open)(path, "rb")


def is_json_lines(path: str) -> bool:
    return without_compression(path).endswith(JSON_SUFFIXES)


def decode_utf8(data: bytes, path: str, offset: int, errors: str, where: str = "") -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        compressed = " (after decompression)" if os.path.splitext(path)[1] in COMPRESSED else ""
        raise CLIError(f"{path}{where}: invalid UTF-8 at byte offset {offset + e.start}{compressed}; "
                       "use --errors replace to go on") from None


def json_documents(path: str, key: str, errors: str, skip_bad_lines: bool,
                   stats: ReadStats) -> Iterator[tuple[str, int]]:
    offset = 0
    with open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            text = decode_utf8(line, path, offset, errors, where=f" line {number}")
            offset += len(line)
            if not text.strip():
                continue
            try:
                value = json.loads(text)
                good = isinstance(value, dict) and isinstance(value.get(key), str)
                problem = None if good else f"no string {key!r} key"
            except json.JSONDecodeError as e:
                problem = f"invalid JSON ({e.msg})"
            if problem is None:
                yield value[key], len(line)
            elif skip_bad_lines:
                stats.bad_lines += 1
            else:
                raise CLIError(f"{path} line {number}: {problem}; use --skip-bad-lines to go on (or --json-key)")


def read_documents(files: list[str], key: str = "text", errors: str = "strict", skip_bad_lines: bool = False,
                   stats: ReadStats | None = None) -> Iterator[tuple[str, int]]:
    """(document text, its size in input bytes) for every document of every file, streaming."""
    stats = stats if stats is not None else ReadStats()
    for path in files:
        try:
            if is_json_lines(path):
                yield from json_documents(path, key, errors, skip_bad_lines, stats)
            else:
                with open_binary(path) as f:
                    data = f.read()
                yield decode_utf8(data, path, 0, errors), len(data)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:  # a corrupt or truncated .gz/.bz2/.xz
            raise CLIError(f"cannot read {path}: {e}") from None


def read_text(path: str, what: str = "file") -> str:
    """A whole UTF-8 text file (.gz/.bz2/.xz decompressed), or a one-line CLIError naming it
    (missing, a folder, unreadable, corrupt, not UTF-8)."""
    if not os.path.isfile(path):
        raise CLIError(f"{what} not found: {path}")
    try:
        with open_binary(path) as f:
            data = f.read()
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:
        raise CLIError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"{path} is not UTF-8 text (byte offset {e.start})") from None


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) of a text or JSON-lines file, .gz/.bz2/.xz
    decompressed."""
    if not os.path.isfile(path):
        raise CLIError(f"file not found: {path}")
    with open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            try:
                yield number, line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise CLIError(f"{path} line {number}: invalid UTF-8") from None


def json_lines(path: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSON-lines file; a line that is not JSON is
    a one-line error naming the file and the line."""
    for number, line in read_lines(path):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise CLIError(f"{path} line {number}: invalid JSON ({e.msg})") from None


# ----- a corpus of texts with ids (embed.py) -----

@dataclass
class Document:
    id: str
    text: str
    source: str
    line: int | None  # None: the whole file is the text

    def where(self) -> str:
        return self.source if self.line is None else f"{self.source} line {self.line}"


def json_records(path: str, keys: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of every non-blank line, each with a string under each key, or a
    one-line error naming file and line."""
    for number, record in json_lines(path):
        if not isinstance(record, dict):
            raise CLIError(f"{path} line {number}: expected a JSON object")
        for key in keys:
            if not isinstance(record.get(key), str):
                raise CLIError(f"{path} line {number}: no string {key!r} key")
        yield number, record


def record_id(path: str, number: int, value) -> str:
    """Ids are compared as text, so 7 and "7" name the same document."""
    if type(value) not in (str, int):
        raise CLIError(f"{path} line {number}: the id must be a string or an integer, "
                       f"got {value!r}")
    return str(value)


def read_corpus(path: str, json_key: str, id_key: str, glob: str) -> list[Document]:
    """The non-blank texts of a text file (one per line), a JSON-lines file (one per line) or a
    folder (one per file), each with a unique id: a JSON line's id_key, else its line number; a
    file's path in the folder."""
    if os.path.isdir(path):
        documents = [Document(os.path.relpath(file, path), read_text(file), file, None)
                     for file in input_files([path], glob)]
    elif is_json_lines(path):
        documents = []
        for number, record in json_records(path, (json_key,)):
            doc_id = record_id(path, number, record[id_key]) if id_key in record else str(number)
            documents.append(Document(doc_id, record[json_key], path, number))
    else:
        documents = [Document(str(number), line, path, number) for number, line in read_lines(path)]
    documents = [d for d in documents if d.text.strip()]
    if not documents:
        raise CLIError(f"no texts in {path}; nothing to encode")
    first_use = {}
    for d in documents:
        if d.id in first_use:
            raise CLIError(f"{d.where()}: id {d.id!r} is already used by {first_use[d.id]}")
        first_use[d.id] = d.where()
    return documents
