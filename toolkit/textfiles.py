"""Text files as the toolkit reads them: compressed or not (.gz, .bz2, .xz and .zst are
decompressed on the fly, .zst with bounded memory), whole or a line at a time, UTF-8 checked; a
leading UTF-8 byte-order mark (Windows editors write one) is no text. Every problem is one CLIError
naming the file.
"""
import bz2
import codecs
import gzip
import io
import lzma
import os
import zlib
from collections.abc import Iterator

import zstandard

from toolkit.cli import CLIError
from toolkit.files import require_file

TABLES = (".parquet", ".arrow")  # a row a document, the text in one column


class ZstdReader(io.RawIOBase):
    """A .zst file's bytes, frame after frame, with bounded memory: compressed input goes in STEP
    bytes at a time, and zstd makes at most ~32,000 bytes of one (a 128 KiB block of one repeated
    byte takes 4), so a step yields at most ~32 MB, however the file was made. One that ends inside
    a frame raises EOFError, as a truncated .gz does (zstandard's own reader would end there
    quietly)."""

    STEP = 1 << 10

    def __init__(self, path: str):
        self.file, self.pending, self.at, self.unused = open(path, "rb"), b"", 0, b""
        self.frame, self.started = zstandard.ZstdDecompressor().decompressobj(), False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.pending):
            data, self.unused = self.unused or self.file.read(self.STEP), b""
            if not data:
                if self.started and not self.frame.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            if self.frame.eof:  # the next frame (which may start exactly where a step does)
                self.frame = zstandard.ZstdDecompressor().decompressobj()
            self.pending, self.at, self.started = self.frame.decompress(data), 0, True
            if self.frame.eof:
                self.unused = self.frame.unused_data
        # (an offset: slicing off the front would copy the rest of the block on every read)
        n = min(len(buffer), len(self.pending) - self.at)
        buffer[:n] = self.pending[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        self.file.close()
        super().close()


COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open,
              ".zst": lambda path, mode: io.BufferedReader(ZstdReader(path))}
# what reading a (compressed) file raises when it is unreadable, corrupt or cut short
READ_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error, zstandard.ZstdError)


def without_compression(path: str) -> str:
    base, suffix = os.path.splitext(path)
    return base if suffix in COMPRESSED else path


def open_binary(path: str):
    return COMPRESSED.get(os.path.splitext(path)[1], open)(path, "rb")


def read_text(path: str, what: str = "file") -> str:
    """A whole UTF-8 text file (.gz/.bz2/.xz decompressed), or a one-line CLIError naming it
    (missing, a folder, unreadable, corrupt, not UTF-8)."""
    require_file(path, what)
    try:
        with open_binary(path) as f:
            data = f.read()
    except READ_ERRORS as e:
        raise CLIError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # (not text)
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"{path} is not UTF-8 text (byte offset {bom + e.start})") from None


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline) of a text file, .gz/.bz2/.xz decompressed."""
    require_file(path)
    if path.endswith(TABLES):  # binary: no lines to read
        raise CLIError(f"{path} is a table: this reads JSON lines (tokenizer.py reads tables)")
    try:
        with open_binary(path) as f:
            for number, line in enumerate(f, start=1):
                if number == 1:
                    line = line.removeprefix(codecs.BOM_UTF8)  # a byte-order mark: not text
                try:
                    yield number, line.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    raise CLIError(f"{path} line {number}: invalid UTF-8") from None
    except READ_ERRORS as e:  # corrupt or cut
        raise CLIError(f"cannot read {path}: {e}") from None


