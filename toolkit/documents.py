"""Reading documents: a plain text file is one document, a JSON line is one document; folders are walked in a
fixed order; .gz, .bz2 and .xz files are decompressed on the fly. tokenizer.py and embed.py read their inputs here.
"""
import bz2
import fnmatch
import gzip
import json
import lzma
import os
import zlib
from dataclasses import dataclass
from typing import Iterator

from toolkit.cli import CLIError

COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
JSON_SUFFIXES = (".jsonl", ".json")


@dataclass
class ReadStats:
    bad_lines: int = 0


def input_files(paths: list[str], pattern: str) -> list[str]:
    """The files to read, in a fixed order: files as given, directories walked recursively (sorted, glob-filtered)."""
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
        raise CLIError(f"{path}{where}: invalid UTF-8 at byte offset {offset + e.start}"
                       f"{' (after decompression)' if os.path.splitext(path)[1] in COMPRESSED else ''}; "
                       f"use --errors replace to go on")


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
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:  # e.g. a corrupt or truncated .gz/.bz2/.xz
            raise CLIError(f"cannot read {path}: {e}")


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) of a text or JSON-lines file, .gz/.bz2/.xz decompressed."""
    if not os.path.isfile(path):
        raise CLIError(f"file not found: {path}")
    with open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            try:
                yield number, line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise CLIError(f"{path} line {number}: invalid UTF-8") from None


def json_lines(path: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSON-lines file; a line that is not JSON is a one-line
    error naming the file and the line."""
    for number, line in read_lines(path):
        if line.strip():
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise CLIError(f"{path} line {number}: invalid JSON ({e.msg})") from None
