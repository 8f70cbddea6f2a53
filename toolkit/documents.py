"""Reading documents: a plain text file is one document, and so is a JSON line (or an item of a
.json file that holds one JSON array), or a row of a parquet or arrow file (the text under
--json-key); folders are walked in a fixed order, and one that HF `datasets` wrote (save_to_disk) is
read as its arrow files; compressed files are read as toolkit/textfiles.py opens them. The same
rows give the same documents whatever holds them, streamed in pieces of bounded size: a text file
of any size is one document that never has to fit in memory. tokenizer.py streams its input from
here (read_documents); embed.py's corpus of texts with ids (toolkit/embedding.py) reads its files
here.
"""
import codecs
import fnmatch
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from toolkit.cli import CLIError
from toolkit.files import parse_json, read_json
from toolkit.records import RECORD_LIMIT, ArrayItems, holds_json_array, missing_key
from toolkit.textfiles import COMPRESSED, READ_ERRORS, TABLES, open_binary, without_compression
from toolkit.tokenizers import CUT


BLOCK = 1 << 24  # a text file is read and decoded 16 MB at a time
PARQUET_BUFFER = 1 << 20  # the bytes of a parquet column read at once
# the characters of text with no place where the tokenizers split (CUT): 64 Mi
UNCUT_LIMIT = 1 << 26
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # arrow IPC's end-of-stream marker



@dataclass
class ReadStats:
    bad_lines: int = 0


def input_files(paths: list[str], pattern: str) -> list[str]:
    """Files to read, in fixed order: files as given, whole folder trees (sorted, glob-filtered)."""
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isfile(os.path.join(path, "state.json")):  # written by datasets' save_to_disk
            files += saved_dataset_files(path)
        elif os.path.isfile(os.path.join(path, "dataset_dict.json")):  # its splits, each a folder
            splits = sorted(name for name in os.listdir(path)
                            if os.path.isfile(os.path.join(path, name, "state.json")))
            raise CLIError(f"{path} holds a DatasetDict that datasets saved (splits: "
                           f"{', '.join(splits) or 'none'}): give the split to read, e.g. "
                           f"--input {os.path.join(path, splits[0] if splits else 'train')}")
        elif os.path.isdir(path):
            # "a.txt.gz" matches "*.txt": compression is not part of what the file is
            found = [file for file in tree(path)
                     if fnmatch.fnmatch(os.path.basename(file), pattern) or
                     fnmatch.fnmatch(without_compression(os.path.basename(file)), pattern)]
            if not found:
                raise CLIError(f"no files matching --glob {pattern!r} under "
                               f"{path}{other_kinds(path)}")
            files += found
        else:
            raise CLIError(f"input {path} is neither a file nor a folder (a broken link, a pipe "
                           "or a device)" if os.path.lexists(path) else f"input not found: {path}")
    return files


def tree(folder: str) -> list[str]:
    """The regular files under folder (pipes, devices and broken links are no documents), sorted
    within each folder, linked folders followed: each folder once, so a link back up is no loop.
    Hidden files and folders are left out, as a shell's glob leaves them (Jupyter's
    .ipynb_checkpoints copies, macOS's ._ files, .git)."""
    files, seen = [], set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        dirs[:] = [] if real in seen else sorted(d for d in dirs if not d.startswith("."))
        if real not in seen:
            seen.add(real)
            files += filter(os.path.isfile, (os.path.join(root, name) for name in sorted(names)
                                             if not name.startswith(".")))
    return files


def other_kinds(folder: str) -> str:
    """What a folder holds instead, as the --glob that would take it, e.g. " (it holds 2 .parquet
    files: --glob '*.parquet')"; empty when it holds no file of a readable kind."""
    kinds = Counter(os.path.splitext(without_compression(path))[1] for path in tree(folder))
    readable = [(kind, n) for kind, n in kinds.most_common()
                if kind in (".txt", *TABLES, *JSON_SUFFIXES)]
    if not readable:
        return ""
    kind, n = readable[0]
    return f" (it holds {n} {kind} file{'s' * (n > 1)}: --glob '*{kind}')"


def saved_dataset_files(folder: str) -> list[str]:
    """The arrow files of a dataset that HF `datasets` saved (save_to_disk), in its order."""
    state = read_json(os.path.join(folder, "state.json"), "datasets state")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    names = ([entry.get("filename") for entry in entries if isinstance(entry, dict)]
             if isinstance(entries, list) else [])
    if not names or len(names) != len(entries) or \
            not all(isinstance(n, str) and os.path.basename(n) == n for n in names):
        raise CLIError(f"{folder}/state.json lists no arrow files as "
                       "datasets' save_to_disk writes them "
                       '("_data_files": [{"filename": "data-00000-of-00001.arrow"}, ...])')
    return [os.path.join(folder, name) for name in names]


def table_documents(path: str, key: str, errors: str, skip_bad_lines: bool,
                    stats: ReadStats) -> Iterator[tuple[str, int, bool]]:
    """(text, input bytes, True) of each row of a parquet file (256 rows at a time) or an arrow file
    (a record batch at a time, the file or the stream format): the column named key. Both are read,
    not memory-mapped, and a parquet column a page at a time: memory holds one batch."""
    try:
        if path.endswith(".parquet"):
            # streamed a buffer at a time, not a row group's column at once (one group may be
            # the whole file)
            table = pq.ParquetFile(path, buffer_size=PARQUET_BUFFER, pre_buffer=False)
            columns, sizes = table.schema_arrow.names, \
                os.path.getsize(path) / max(1, table.metadata.num_rows)
            # batches of rows, not whole row groups: one group may expand to gigabytes
            # (lazily: the key is checked first)
            batches = table.iter_batches(batch_size=256, columns=[key])
        else:
            source = pa.OSFile(path)  # (a memory map's pages would stay in RSS as it is read)
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # the stream format, as datasets writes it
                reader = pa.ipc.open_stream(pa.OSFile(path))
                batches = iter(reader)
                # a stream cut between two batches reads as a shorter one: only its end tells
                if source.size() < 8 or source.read_at(8, source.size() - 8) != STREAM_END:
                    raise CLIError(f"cannot read {path}: the arrow stream is cut short (no "
                                   "end-of-stream marker)") from None
            columns, sizes = reader.schema.names, 0
        if key not in columns:
            raise CLIError(f"{path} has no column {key!r} (--json-key); its columns: "
                           f"{', '.join(columns)}")
        row = 0
        for batch in batches:
            column = text_column(batch.column(batch.schema.get_field_index(key)), path, key)
            try:
                texts = column.to_pylist()
            except UnicodeDecodeError:  # arrow's strings are not checked when written
                texts = decoded_rows(column, path, row, errors)
            for text in texts:
                row += 1
                if text is None and not skip_bad_lines:
                    raise CLIError(f"{path} row {row}: no text in {key!r}; "
                                   "use --skip-bad-lines to go on")
                if text is None:
                    stats.bad_lines += 1
                    continue
                yield text, sizes or len(text), True
    except (pa.ArrowException, OSError) as e:  # not parquet or arrow, corrupt, truncated
        raise CLIError(f"cannot read {path}: {' '.join(str(e).split())[:200]}") from None


def decoded_rows(column: pa.Array, path: str, before: int, errors: str) -> list[str | None]:
    """A column of strings that are not all UTF-8, row by row: --errors replace puts U+FFFD for
    the invalid bytes, else the first bad row is named."""
    rows = column.cast(pa.large_binary()).to_pylist()
    for number, value in enumerate(rows, start=before + 1):
        try:
            rows[number - before - 1] = None if value is None else value.decode("utf-8", errors)
        except UnicodeDecodeError as e:
            raise CLIError(f"{path} row {number}: invalid UTF-8 at byte {e.start} of its text; "
                           "use --errors replace to go on") from None
    return rows


def text_column(column: pa.Array, path: str, key: str) -> pa.Array:
    """A column's strings, whichever of arrow's string types holds them (string views, a
    categorical's dictionary of strings)."""
    kind = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    if kind not in (pa.string(), pa.large_string(), pa.string_view()):
        raise CLIError(f"{path}: column {key!r} holds {column.type}, not text")
    return column.cast(pa.large_string())


def is_json_lines(path: str) -> bool:
    return without_compression(path).endswith(JSON_SUFFIXES)


def invalid_utf8(path: str, offset: int, where: str = "") -> CLIError:
    compressed = " (after decompression)" if os.path.splitext(path)[1] in COMPRESSED else ""
    return CLIError(f"{path}{where}: invalid UTF-8 at byte offset {offset}{compressed}; "
                    "use --errors replace to go on")


def json_documents(path: str, key: str, errors: str, skip_bad_lines: bool,
                   stats: ReadStats) -> Iterator[tuple[str, int, bool]]:
    """(text, input bytes, True) of each JSON line: the string under key."""
    if holds_json_array(path):
        yield from array_documents(path, key, errors, skip_bad_lines, stats)
        return
    offset = number = 0
    with open_binary(path) as f:
        while line := f.readline(RECORD_LIMIT + 1):
            number += 1
            if len(line) > RECORD_LIMIT:
                raise CLIError(f"{path} line {number} is longer than {RECORD_LIMIT >> 20} MiB, "
                               "the most one JSON record may hold here; split the document, "
                               "or give it as a text file")
            try:
                text = line.decode("utf-8", errors=errors)
            except UnicodeDecodeError as e:
                raise invalid_utf8(path, offset + e.start, f" line {number}") from None
            offset, size = offset + len(line), len(line)
            del line  # a single huge record: its bytes go before its text is tokenized
            if text.isspace() or not text:
                continue
            where = f"{path} line {number}"
            try:
                document = document_text(parse_json(text, where), key, where)
            except CLIError as e:
                skip_or_raise(e, skip_bad_lines, stats)
                continue
            del text
            yield unicode_text(document, where, errors), size, True


def array_documents(path: str, key: str, errors: str, skip_bad_lines: bool,
                    stats: ReadStats) -> Iterator[tuple[str, int, bool]]:
    """json_documents' for a file of one JSON array (json_array), each item the bytes read for
    it."""
    items, counted = ArrayItems(path), 0
    for number, value in items:
        share, counted = items.read_bytes - counted, items.read_bytes
        where = f"{path} line {number}"
        try:
            document = document_text(value, key, where)
        except CLIError as e:
            skip_or_raise(e, skip_bad_lines, stats)
            continue
        yield unicode_text(document, where, errors), share, True


def document_text(value, key: str, where: str) -> str:
    """The string under key of a JSON object, taken out of it (its memory goes with the
    document)."""
    if not (isinstance(value, dict) and isinstance(value.get(key), str)):
        raise missing_key(where, key, value)
    return value.pop(key)


def unicode_text(text: str, where: str, errors: str) -> str:
    """A JSON string as Unicode text: JSON may escape half of a UTF-16 pair alone ("\\ud83d", a
    cut emoji), which no UTF-8 file can hold; with --errors replace it becomes U+FFFD, as invalid
    UTF-8 does."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        if errors == "replace":
            return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        raise CLIError(f"{where}: a lone surrogate (U+{ord(text[e.start]):04X}, half of an escaped "
                       f"UTF-16 pair) at character {e.start} is not Unicode text; use --errors "
                       "replace to go on") from None


def skip_or_raise(error: CLIError, skip_bad_lines: bool, stats: ReadStats) -> None:
    """A bad record is counted with --skip-bad-lines, else it stops the run."""
    if not skip_bad_lines:
        raise CLIError(f"{error}; use --skip-bad-lines to go on (or --json-key)") from None
    stats.bad_lines += 1


def text_pieces(f, path: str, errors: str) -> Iterator[tuple[str, int, bool]]:
    """A text file's text as (piece, its input bytes, whether it is the last) of about BLOCK bytes
    each, cut where every tokenizer splits anyway (tokenizers.CUT). Read and decoded a block at a
    time: a file of any size is one document that never has to fit in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    rest, size, counted = "", 0, 0
    while True:
        block = f.read(BLOCK)
        if not size and block.startswith(codecs.BOM_UTF8):  # a byte-order mark: not text
            block, size = block[len(codecs.BOM_UTF8):], len(codecs.BOM_UTF8)
        pending = len(decoder.getstate()[0])  # the bytes of a character cut by the last block
        try:
            text = rest + decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise invalid_utf8(path, size - pending + e.start) from None
        size += len(block)
        if not block:
            yield text, size - counted, True
            return
        cuts = [m.start() for m in CUT.finditer(text, max(1, len(text) - 65536))]
        if cuts:  # (none in the last 64K characters: the text goes on whole into the next piece)
            yield text[:cuts[-1]], size - counted, False
            text, counted = text[cuts[-1]:], size
        if len(text) > UNCUT_LIMIT:
            raise CLIError(f"{path}: over {UNCUT_LIMIT >> 20} Mi characters without a space or a "
                           f"line break (byte offset {size}): not text a tokenizer can split; "
                           "is it binary, or zeros?")
        rest = text


def read_documents(files: list[str], key: str = "text", errors: str = "strict",
                   skip_bad_lines: bool = False,
                   stats: ReadStats | None = None) -> Iterator[tuple[str, int, bool]]:
    """(a piece of text, its input bytes, whether it ends its document) for every document of every
    file, streaming. A JSON line or a table's row is one piece, a text file as many as it takes
    (text_pieces)."""
    stats = stats if stats is not None else ReadStats()
    for path in files:
        try:
            if is_json_lines(path):
                yield from json_documents(path, key, errors, skip_bad_lines, stats)
            elif path.endswith(TABLES):
                yield from table_documents(path, key, errors, skip_bad_lines, stats)
            else:
                with open_binary(path) as f:
                    yield from text_pieces(f, path, errors)
        except READ_ERRORS as e:  # corrupt or cut
            raise CLIError(f"cannot read {path}: {e}") from None
