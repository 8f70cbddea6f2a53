"""JSON records, a record at a time: JSON lines, or one JSON array (alpaca_data.json's layout,
however laid out) read in pieces, so a file of any size takes the memory of one record. Every
problem is one CLIError naming the file and the line.
"""
import codecs
import json
import re
from collections.abc import Iterator

from toolkit.cli import CLIError
from toolkit.files import parse_json, require_file
from toolkit.textfiles import READ_ERRORS, open_binary, read_lines

RECORD_LIMIT = 1 << 28  # the bytes of one JSON line (a record, held whole to parse it): 256 MiB
BLANKS = re.compile(r"[ \t\r\n]*")  # JSON's whitespace
ARRAY_READ = 1 << 20  # a JSON array file is read a megabyte at a time


def json_lines(path: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSON-lines file, or of every item of a file
    that holds one JSON array (json_array); a line that is not JSON is a one-line error naming the
    file and the line."""
    if holds_json_array(path):
        yield from json_array(path)
        return
    for number, line in read_lines(path):
        if line.strip():
            yield number, parse_json(line, f"{path} line {number}")


def holds_json_array(path: str) -> bool:
    """Whether a JSON file's first value is an array: the file is one array (alpaca_data.json),
    however laid out, not JSON lines."""
    try:
        with open_binary(path) as f:
            while chunk := f.read(4096).removeprefix(codecs.BOM_UTF8):
                if chunk.strip():
                    return chunk.lstrip()[:1] == b"["
    except READ_ERRORS:  # missing, a folder, corrupt: its reader says so
        pass
    return False


def json_array(path: str) -> Iterator[tuple[int, object]]:
    """(the line it starts on, value) of each item of a file that holds one JSON array, as HF
    datasets' json loader reads it too; read ARRAY_READ bytes at a time and each item parsed once
    it is whole, so memory holds one item, not the file."""
    return iter(ArrayItems(path))


class ArrayItems:
    """The items of a JSON array file as it is read: a buffer of its text, the position in it, its
    line and the bytes read so far."""

    def __init__(self, path: str):
        require_file(path)
        self.path, self.file = path, open_binary(path)
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.decoder_json = json.JSONDecoder()
        self.text, self.at, self.line, self.read_bytes, self.eof = "", 0, 1, 0, False

    def __iter__(self) -> Iterator[tuple[int, object]]:
        self.expect("[")
        if self.skip_space() == "]":
            self.at += 1
        else:
            while True:
                self.skip_space()  # (the line an item starts on names it)
                yield self.line, self.value()
                if self.skip_space() != ",":
                    break
                self.at += 1
            self.expect("]")
        if self.skip_space():
            raise self.invalid("extra data after the array")

    def more(self, size: int = 0) -> None:
        """Read on (size characters or more when given); at the end of the file the file closes."""
        if self.at > len(self.text) // 2:  # what was parsed goes
            self.text, self.at = self.text[self.at:], 0
        try:
            while not self.eof and len(self.text) - self.at <= size:
                block = self.file.read(max(ARRAY_READ, size))
                if not self.read_bytes:
                    block = block.removeprefix(codecs.BOM_UTF8)  # (not text)
                self.read_bytes += len(block)
                self.text += self.decoder.decode(block, final=not block)
                self.eof = not block
        except UnicodeDecodeError as e:
            raise CLIError(f"{self.path} is not UTF-8 text (byte offset "
                           f"{self.read_bytes - len(block) + e.start})") from None
        except READ_ERRORS as e:
            raise CLIError(f"cannot read {self.path}: {e}") from None
        if self.eof:
            self.file.close()

    def skip_space(self) -> str:
        """The next character after blanks ("" at the end of the file)."""
        while True:
            end = BLANKS.match(self.text, self.at).end()
            self.line += self.text.count("\n", self.at, end)
            self.at = end
            if self.at < len(self.text) or self.eof:
                return self.text[self.at:self.at + 1]
            self.more()

    def invalid(self, why: str) -> CLIError:
        return CLIError(f"{self.path} line {self.line}: invalid JSON ({why})")

    def expect(self, char: str) -> None:
        if self.skip_space() != char:
            raise self.invalid(f"expected {char!r}")
        self.at += 1

    def value(self) -> object:
        """The next item, read on until it is whole: parsed when a character follows it (a number
        cut by a read would parse as a shorter one) or the file ends."""
        while True:
            try:
                value, end = self.decoder_json.raw_decode(self.text, self.at)
                if end < len(self.text) or self.eof:
                    break
            except json.JSONDecodeError as e:
                # an item cut by a read fails at the end of the text, or in a string not ended
                cut = e.pos > len(self.text) - 10 or e.msg.startswith("Unterminated string")
                if self.eof or not cut:
                    self.line += self.text.count("\n", self.at, e.pos)
                    raise self.invalid(e.msg.removesuffix(" at")) from None
            except RecursionError:
                raise self.invalid("nested too deeply to read") from None
            except ValueError as e:  # a number of more digits than Python converts
                raise self.invalid(str(e).split(";")[0]) from None
            if len(self.text) - self.at > RECORD_LIMIT:
                raise CLIError(f"{self.path} line {self.line}: an item longer than "
                               f"{RECORD_LIMIT >> 20} MiB, the most one JSON record may hold here")
            self.more(2 * (len(self.text) - self.at))  # twice as much: each retry parses it all
        self.line += self.text.count("\n", self.at, end)
        self.at = end
        return value


# ----- JSON records -----

def json_records(path: str, keys: tuple[str, ...], flag: str | None = None
                 ) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of every non-blank line, each with a string under each key, or a
    one-line error naming file and line (and flag, the option that names the key)."""
    for number, record in json_lines(path):
        if not isinstance(record, dict):
            raise CLIError(f"{path} line {number}: expected a JSON object")
        for key in keys:
            if not isinstance(record.get(key), str):
                error = missing_key(f"{path} line {number}", key, record)
                raise CLIError(f"{error}; choose the field with {flag}") if flag else error
        yield number, record


def missing_key(where: str, key: str, value) -> CLIError:
    """A JSON line without a string under key, naming the string keys it has instead."""
    found = [k for k, v in value.items() if isinstance(v, str)] if isinstance(value, dict) else []
    listed = f" (its string keys: {', '.join(found)})" if found else ""
    return CLIError(f"{where}: no string {key!r} key{listed}")
