"""
Prepare token data for training: text in, token ids out (nanoGPT train.bin/val.bin or Megatron .bin/.idx).

    python tokenizer.py                                  # default corpus: Python's pydoc topics, char-level
    python tokenizer.py --install-gpt2-vocab             # once: the GPT-2 vocabulary for offline use
    python tokenizer.py --input docs/ --glob '*.md' --tokenizer gpt2 --append-eod --output-dir data/docs
    python tokenizer.py --input oscar-1GB.jsonl.xz --tokenizer gpt2 --append-eod --workers 4 \\
        --format megatron --output-prefix data/oscar     # -> data/oscar_text_document.bin/.idx/.json

One plain text file is one document, one JSON line is one document. Also importable: Tokenizer,
load_tokenizer (rebuilds a tokenizer from the facts stored in meta.json), ensure_default_corpus,
install_gpt2_vocab.
"""
import argparse
import bz2
import fnmatch
import gzip
import hashlib
import json
import lzma
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str
from tqdm import tqdm

from cli import CLIError, run

DEFAULT_CORPUS_DIR = "data/pydoc_char"
EOT_TEXT = "<|endoftext|>"
# tiktoken caches r50k_base (= GPT-2) under sha1 of its download URL; openai-whisper's sdist ships the same file
R50K_CACHE_NAME = "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"
INSTALL_HINT = "python tokenizer.py --install-gpt2-vocab"

# -----------------------------------------------------------------------------
# The GPT-2 vocabulary, offline


def tiktoken_cache_dir() -> str:
    """Where tiktoken looks for its downloaded vocabularies (same rules as tiktoken.load)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def gpt2_vocab_installed() -> bool:
    """True when tiktoken will find r50k_base in its cache, i.e. will not try the network."""
    cache_dir = tiktoken_cache_dir()
    if not cache_dir:  # an empty TIKTOKEN_CACHE_DIR disables tiktoken's cache
        return False
    path = os.path.join(cache_dir, R50K_CACHE_NAME)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:  # tiktoken deletes a file with the wrong hash and downloads again
        return hashlib.sha256(f.read()).hexdigest() == R50K_SHA256


def install_gpt2_vocab() -> str:
    """Put GPT-2's vocabulary (from the openai-whisper sdist on PyPI) into tiktoken's cache; returns its path."""
    cache_dir = tiktoken_cache_dir()
    if not cache_dir:
        raise CLIError("TIKTOKEN_CACHE_DIR is set but empty, which disables tiktoken's cache; unset it or name a folder")
    path = os.path.join(cache_dir, R50K_CACHE_NAME)
    if gpt2_vocab_installed():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHISPER_SDIST, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last_line = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CLIError(f"'{' '.join(cmd[1:])}' failed: {last_line}")
        sdists = [name for name in os.listdir(tmp) if name.endswith(".tar.gz")]
        if len(sdists) != 1:
            raise CLIError(f"expected one .tar.gz from pip download of {WHISPER_SDIST}, got {sorted(os.listdir(tmp))}")
        with tarfile.open(os.path.join(tmp, sdists[0])) as tar:
            members = [m for m in tar.getmembers() if m.name.endswith("/" + WHISPER_MEMBER)]
            if len(members) != 1:
                raise CLIError(f"{sdists[0]} has no {WHISPER_MEMBER}")
            data = tar.extractfile(members[0]).read()
    if hashlib.sha256(data).hexdigest() != R50K_SHA256:
        raise CLIError(f"{WHISPER_MEMBER} from {sdists[0]} has an unexpected sha256; refusing to install it")
    os.makedirs(cache_dir, exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    return path


def load_local_ranks(vocab_file: str, merge_file: str | None) -> dict[bytes, int]:
    """BPE ranks from a .tiktoken file, or from Megatron-style gpt2-vocab.json + gpt2-merges.txt."""
    for path in (vocab_file, merge_file):
        if path is not None and not os.path.isfile(path):
            raise CLIError(f"vocabulary file not found: {path}")
    # tiktoken caches even local files, keyed by their path (a stale copy would win): turn its cache off here
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        if merge_file is None:
            return tiktoken.load.load_tiktoken_bpe(vocab_file)
        return tiktoken.load.data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=merge_file, encoder_json_file=vocab_file)
    except (AssertionError, KeyError, json.JSONDecodeError, ValueError) as e:
        raise CLIError(f"cannot read the vocabulary from {vocab_file}{' + ' + merge_file if merge_file else ''}: {e!r}")
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


def gpt2_encoding(vocab_file: str | None = None, merge_file: str | None = None) -> tiktoken.Encoding:
    """GPT-2's BPE: tiktoken's r50k_base, or the same split pattern and <|endoftext|> over ranks from files."""
    if vocab_file is None:
        if not gpt2_vocab_installed():
            raise CLIError(f"the GPT-2 vocabulary is not in tiktoken's cache ({tiktoken_cache_dir()}); run: {INSTALL_HINT}")
        return tiktoken.get_encoding("r50k_base")
    ranks = load_local_ranks(vocab_file, merge_file)
    return tiktoken.Encoding(name=f"gpt2:{os.path.basename(vocab_file)}", pat_str=r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)})


# -----------------------------------------------------------------------------
# Tokenizers: GPT-2 BPE, characters of the data, raw bytes


class Tokenizer:
    """GPT-2 BPE, char-level or byte-level; facts() holds all that load_tokenizer needs to rebuild it."""

    def __init__(self, name: str, chars: str | None = None, char_eot: bool = False,
                 vocab_file: str | None = None, merge_file: str | None = None):
        self.name = name
        self.chars = chars
        self.vocab_file = os.path.abspath(vocab_file) if vocab_file else None
        self.merge_file = os.path.abspath(merge_file) if merge_file else None
        if name == "gpt2":
            self.encoding = gpt2_encoding(self.vocab_file, self.merge_file)
            self.vocab_size, self.eot_id = self.encoding.n_vocab, self.encoding.eot_token
        elif name == "char":
            if not chars or len(set(chars)) != len(chars):
                raise CLIError("a char tokenizer needs its table of distinct characters")
            codepoints = [ord(c) for c in chars]
            self.char_ids = np.full(max(codepoints) + 2, -1, dtype=np.int64)  # code point -> id; the last is -1
            self.char_ids[codepoints] = np.arange(len(chars))
            self.eot_id = len(chars) if char_eot else None
            self.vocab_size = len(chars) + int(char_eot)
        elif name == "byte":
            self.vocab_size, self.eot_id = 257, 256
        else:
            raise CLIError(f"unknown tokenizer {name!r} (expected gpt2, char or byte)")

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of text (special-token text such as <|endoftext|> is encoded as ordinary text)."""
        if self.name == "gpt2":
            try:
                return self.encoding.encode_to_numpy(text, disallowed_special=())
            except UnicodeEncodeError:  # lone surrogates (JSON allows them): replace them, as tiktoken does
                text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
                return self.encoding.encode_to_numpy(text, disallowed_special=())
        if self.name == "byte":
            return np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = self.char_ids[np.minimum(points, len(self.char_ids) - 1)]
        if (ids < 0).any():
            raise ValueError(f"character {chr(points[(ids < 0).argmax()])!r} is not in the char vocabulary")
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids: list[int]) -> str:
        """Text of ids; never fails: EOT is skipped for char/byte, invalid bytes and unknown ids become U+FFFD."""
        if self.name == "gpt2":
            return self.encoding.decode([i for i in ids if 0 <= i < self.vocab_size])
        if self.name == "byte":
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return "".join(self.chars[i] if 0 <= i < len(self.chars) else "\ufffd" for i in ids if i != self.eot_id)

    def facts(self) -> dict:
        """JSON-able description of this tokenizer (stored in meta.json and in checkpoints)."""
        facts = {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id}
        if self.name == "gpt2":
            facts["encoding"] = "files" if self.vocab_file else "r50k_base"
            if self.vocab_file:
                facts.update(vocab_file=self.vocab_file, merge_file=self.merge_file)
        if self.name == "char":
            facts["chars"] = self.chars
        return facts


def load_tokenizer(facts: dict) -> Tokenizer:
    """The tokenizer that facts() described (e.g. the meta.json of a prepared corpus)."""
    name = facts.get("tokenizer")
    if name == "char":
        tokenizer = Tokenizer("char", chars=facts.get("chars"), char_eot=facts.get("eot_id") is not None)
    elif name in ("gpt2", "byte"):
        tokenizer = Tokenizer(name, vocab_file=facts.get("vocab_file"), merge_file=facts.get("merge_file"))
    else:
        raise CLIError(f"unknown tokenizer {name!r} in the tokenizer facts (expected gpt2, char or byte)")
    if "vocab_size" in facts and facts["vocab_size"] != tokenizer.vocab_size:
        raise CLIError(f"rebuilt {name} tokenizer has vocab_size {tokenizer.vocab_size}, the facts say {facts['vocab_size']}")
    return tokenizer


# -----------------------------------------------------------------------------
# Reading documents: text files (one document each), JSON lines (one document per line), compressed streams

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


def json_documents(path: str, key: str, errors: str, skip_bad_lines: bool, stats: ReadStats) -> Iterator[tuple[str, int]]:
    offset = 0
    with open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            text = decode_utf8(line, path, offset, errors, where=f" line {number}")
            offset += len(line)
            if not text.strip():
                continue
            try:
                value = json.loads(text)
                problem = None if isinstance(value, dict) and isinstance(value.get(key), str) else f"no string {key!r} key"
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


# -----------------------------------------------------------------------------
# Encoding in parallel, in order, with bounded memory


def output_dtype(vocab_size: int, requested: str, fmt: str) -> np.dtype:
    """uint16 when every id fits, else 32 bits (uint32 for nanoGPT; int32 for Megatron, which has no uint32 code)."""
    wide = "int32" if fmt == "megatron" else "uint32"
    name = requested if requested != "auto" else ("uint16" if vocab_size <= 2**16 else wide)
    if name not in ("uint16", wide):
        raise CLIError(f"--dtype {name} is not available for --format {fmt} (use uint16 or {wide})")
    if vocab_size - 1 > np.iinfo(name).max:
        raise CLIError(f"vocabulary of {vocab_size} ids does not fit --dtype {name}; use --dtype {wide} or auto")
    return np.dtype(name)


def encode_chunk(tokenizer: Tokenizer, texts: list[str], append_eod: bool, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """All documents' tokens back to back (EOT after each non-empty one if asked), and each document's length."""
    # one thread per process: 2 tiktoken threads in one process measured 21 MB/s, 2 processes 25 MB/s (1: 15.5)
    arrays = [tokenizer.encode_array(text) for text in texts]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    if append_eod:  # Megatron: empty documents get no EOT (they are dropped)
        eot = np.array([tokenizer.eot_id], dtype=dtype)
        arrays = [piece for a in arrays if len(a) for piece in (a, eot)]
        lengths[lengths > 0] += 1
    tokens = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return tokens, lengths


def chunks_of(documents: Iterator[tuple[str, int]], chunk_bytes: int) -> Iterator[tuple[list[str], int]]:
    """Group documents into lists of about chunk_bytes of input (the unit of work of one worker)."""
    texts, size = [], 0
    for text, nbytes in documents:
        texts.append(text)
        size += nbytes
        if size >= chunk_bytes:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


_worker_job = None  # (tokenizer, append_eod, dtype), set once per worker process


def _init_worker(facts: dict, append_eod: bool, dtype: str) -> None:
    global _worker_job
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (it ends the pool)
    _worker_job = (load_tokenizer(facts), append_eod, np.dtype(dtype))


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tokenizer, append_eod, dtype = _worker_job
    return encode_chunk(tokenizer, texts, append_eod, dtype)


def encode_in_order(chunks: Iterator[tuple[list[str], int]], tokenizer: Tokenizer, append_eod: bool,
                    dtype: np.dtype, workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens, lengths, input bytes) per chunk, in input order; at most 2*workers chunks in flight."""
    if workers == 1:
        for texts, nbytes in chunks:
            yield *encode_chunk(tokenizer, texts, append_eod, dtype), nbytes
        return
    # Pool.imap would read the whole input ahead (its feeder thread); apply_async + a bounded deque does not
    with multiprocessing.Pool(workers, _init_worker, (tokenizer.facts(), append_eod, dtype.name)) as pool:
        pending = deque()
        for texts, nbytes in chunks:
            pending.append((pool.apply_async(_encode_in_worker, (texts,)), nbytes))
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield *result.get(), size
        while pending:
            result, size = pending.popleft()
            yield *result.get(), size


# -----------------------------------------------------------------------------
# Writers: temporary files next to the outputs, renamed to the final names only on success


def temporary_name(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")


def refuse_existing(paths: list[str], overwrite: bool) -> None:
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise CLIError(f"{existing[0]} already exists; use --overwrite to replace it")


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def is_val_document(seed: int, index: int, val_fraction: float) -> bool:
    """Deterministic per (seed, document index), so the split streams and does not depend on --workers."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


class NanoGPTWriter:
    """train.bin / val.bin (raw token ids) and meta.json in one folder; documents are split by is_val_document."""

    def __init__(self, out_dir: str, dtype: np.dtype, val_fraction: float, seed: int):
        os.makedirs(out_dir, exist_ok=True)
        self.final = {name: os.path.join(out_dir, name) for name in ("train.bin", "val.bin", "meta.json")}
        self.tmp = {name: temporary_name(path) for name, path in self.final.items()}
        self.files = {split: open(self.tmp[f"{split}.bin"], "wb+") for split in ("train", "val")}
        self.dtype, self.val_fraction, self.seed = dtype, val_fraction, seed
        self.documents = {"train": 0, "val": 0}
        self.tokens = {"train": 0, "val": 0}
        self.last_length = {"train": 0, "val": 0}  # tokens of each split's last document

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        lengths = lengths[lengths > 0]  # empty documents are dropped
        first = self.documents["train"] + self.documents["val"]
        is_val = np.array([is_val_document(self.seed, first + i, self.val_fraction) for i in range(len(lengths))], bool)
        token_is_val = np.repeat(is_val, lengths)
        for split, doc_mask, token_mask in (("train", ~is_val, ~token_is_val), ("val", is_val, token_is_val)):
            if doc_mask.any():
                self.files[split].write(tokens[token_mask].tobytes())
                self.documents[split] += int(doc_mask.sum())
                self.tokens[split] += int(lengths[doc_mask].sum())
                self.last_length[split] = int(lengths[doc_mask][-1])

    def move_tail(self, source: str, target: str, n: int, documents: int) -> None:
        """Move the last n tokens (the last `documents` documents) from one split's file to the other's."""
        f = self.files[source]
        f.seek(-n * self.dtype.itemsize, os.SEEK_END)
        self.files[target].write(f.read())
        f.seek(-n * self.dtype.itemsize, os.SEEK_END)
        f.truncate()
        self.documents[source] -= documents
        self.documents[target] += documents
        self.tokens[source] -= n
        self.tokens[target] += n

    def finish(self, meta: dict) -> dict:
        total = self.documents["train"] + self.documents["val"]
        if total == 1:  # one text file (e.g. shakespeare's input.txt): its last val_fraction becomes val
            if self.documents["val"]:  # it was drawn for val: swap the files so it is train's
                for d in (self.files, self.documents, self.tokens):
                    d["train"], d["val"] = d["val"], d["train"]
                self.tmp["train.bin"], self.tmp["val.bin"] = self.tmp["val.bin"], self.tmp["train.bin"]
            self.move_tail("train", "val", max(1, int(self.tokens["train"] * self.val_fraction)), documents=0)
        else:
            for empty, full in (("val", "train"), ("train", "val")):
                if self.documents[empty] == 0:  # give the empty split one whole document
                    self.move_tail(full, empty, self.last_length[full], documents=1)
        meta = {"format": "nanogpt", **meta, "dtype": self.dtype.name, "documents": total,
                "train_documents": self.documents["train"], "val_documents": self.documents["val"],
                "train_tokens": self.tokens["train"], "val_tokens": self.tokens["val"],
                "val_fraction": self.val_fraction, "seed": self.seed}
        for f in self.files.values():
            f.close()
        write_json(self.tmp["meta.json"], meta)
        for name in ("train.bin", "val.bin", "meta.json"):  # meta.json last: its presence means complete
            os.replace(self.tmp[name], self.final[name])
        return meta

    def discard(self) -> None:
        for f in self.files.values():
            f.close()
        for path in self.tmp.values():
            if os.path.exists(path):
                os.remove(path)


MEGATRON_DTYPE_CODES = {np.dtype("uint16"): 8, np.dtype("int32"): 4}


def write_megatron_index(path: str, dtype: np.dtype, sizes: np.ndarray) -> None:
    """MMapIndexedDataset .idx: header, sizes, byte pointers, doc_idx (one item per document)."""
    sizes = sizes.astype("<i4")
    pointers = np.zeros(len(sizes), dtype="<i8")
    np.cumsum(sizes[:-1].astype("<i8") * dtype.itemsize, out=pointers[1:])
    doc_idx = np.arange(len(sizes) + 1, dtype="<i8")
    with open(path, "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<QBQQ", 1, MEGATRON_DTYPE_CODES[dtype], len(sizes), len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())


class MegatronWriter:
    """{prefix}.bin (token ids) + {prefix}.idx (Megatron MMapIndexedDataset) + {prefix}.json (tokenizer facts)."""

    def __init__(self, prefix: str, dtype: np.dtype):
        if os.path.dirname(prefix):
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
        self.final = {ext: prefix + ext for ext in (".bin", ".idx", ".json")}
        self.tmp = {ext: temporary_name(path) for ext, path in self.final.items()}
        self.file = open(self.tmp[".bin"], "wb")
        self.dtype = dtype
        self.sizes = []  # one int32 array per chunk: the .idx needs all sizes before the pointers
        self.tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self.file.write(tokens.tobytes())
        self.sizes.append(lengths[lengths > 0].astype(np.int32))  # empty documents are dropped
        self.tokens += len(tokens)

    def finish(self, meta: dict) -> dict:
        sizes = np.concatenate(self.sizes) if self.sizes else np.zeros(0, np.int32)
        self.file.close()
        meta = {"format": "megatron", **meta, "dtype": self.dtype.name, "documents": len(sizes), "tokens": self.tokens}
        write_megatron_index(self.tmp[".idx"], self.dtype, sizes)
        write_json(self.tmp[".json"], meta)
        for ext in (".bin", ".idx", ".json"):
            os.replace(self.tmp[ext], self.final[ext])
        return meta

    def discard(self) -> None:
        self.file.close()
        for path in self.tmp.values():
            if os.path.exists(path):
                os.remove(path)


# -----------------------------------------------------------------------------
# The default corpus: Python's own documentation, shipped with every CPython


def default_corpus_documents() -> list[str]:
    from pydoc_data.topics import topics
    return [topics[key].strip("\n") for key in sorted(topics)]


def prepare_default_corpus(data_dir: str = DEFAULT_CORPUS_DIR) -> dict:
    """pydoc topics, char-level, split by characters like nanoGPT's shakespeare_char: the last 10% is val."""
    documents = default_corpus_documents()
    text = "\n\n".join(documents) + "\n"  # a blank line between documents reads naturally; no EOT
    tokenizer = Tokenizer("char", chars="".join(sorted(set(text))))
    ids = tokenizer.encode_array(text).astype(np.uint16)
    n_train = int(len(ids) * 0.9)
    os.makedirs(data_dir, exist_ok=True)
    final = {name: os.path.join(data_dir, name) for name in ("train.bin", "val.bin", "meta.json")}
    meta = {"format": "nanogpt", **tokenizer.facts(), "dtype": "uint16", "documents": len(documents),
            "train_tokens": n_train, "val_tokens": len(ids) - n_train, "source": "pydoc_data.topics"}
    ids[:n_train].tofile(temporary_name(final["train.bin"]))
    ids[n_train:].tofile(temporary_name(final["val.bin"]))
    write_json(temporary_name(final["meta.json"]), meta)
    for path in final.values():
        os.replace(temporary_name(path), path)
    return meta


def describe_default_corpus(data_dir: str, meta: dict) -> str:
    return (f"prepared {data_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val characters, "
            f"vocab {meta['vocab_size']}")


def ensure_default_corpus(data_dir: str = DEFAULT_CORPUS_DIR) -> str:
    """Prepare the default corpus in data_dir unless it is already there; returns data_dir."""
    if not all(os.path.exists(os.path.join(data_dir, n)) for n in ("train.bin", "val.bin", "meta.json")):
        print(describe_default_corpus(data_dir, prepare_default_corpus(data_dir)), file=sys.stderr)
    return data_dir


# -----------------------------------------------------------------------------
# The command line


@dataclass
class Summary:
    documents: int
    tokens: int
    seconds: float
    megabytes: float
    bad_lines: int

    def __str__(self) -> str:
        s = max(self.seconds, 1e-9)
        line = (f"{self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s "
                f"({self.megabytes / s:.1f} MB/s, {self.tokens / s:,.0f} tokens/s)")
        return line + (f", {self.bad_lines:,} bad lines skipped" if self.bad_lines else "")


def build_tokenizer(args: argparse.Namespace, files: list[str]) -> Tokenizer:
    if args.tokenizer != "char":
        return Tokenizer(args.tokenizer, vocab_file=args.vocab_file, merge_file=args.merge_file)
    chars = set()  # the char vocabulary is whatever the data holds: one extra pass over the input
    for text, _ in read_documents(files, args.json_key, args.errors, args.skip_bad_lines):
        chars.update(text)
    if not chars:
        raise CLIError(f"no text in the input ({len(files)} file(s)); nothing to tokenize")
    return Tokenizer("char", chars="".join(sorted(chars)), char_eot=args.append_eod)


def prepare(args: argparse.Namespace) -> dict:
    """Tokenize args.input into the chosen format; returns the metadata written."""
    files = input_files(args.input, args.glob)
    tokenizer = build_tokenizer(args, files)
    dtype = output_dtype(tokenizer.vocab_size, args.dtype, args.format)
    if args.format == "nanogpt":
        writer = NanoGPTWriter(args.output_dir, dtype, args.val_fraction, args.seed)
    else:
        writer = MegatronWriter(f"{args.output_prefix}_{args.json_key}_document", dtype)
    stats = ReadStats()
    start, documents, tokens, nbytes = time.time(), 0, 0, 0
    try:
        chunks = chunks_of(read_documents(files, args.json_key, args.errors, args.skip_bad_lines, stats),
                           int(args.chunk_mb * 2**20))
        quiet = args.quiet or not sys.stderr.isatty()
        known_size = not any(path != without_compression(path) for path in files)
        total = sum(os.path.getsize(path) for path in files) if known_size else None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet, desc="tokenizing") as bar:
            for chunk_tokens, lengths, size in encode_in_order(chunks, tokenizer, args.append_eod, dtype, args.workers):
                writer.add(chunk_tokens, lengths)
                documents += int((lengths > 0).sum())
                tokens += len(chunk_tokens)
                nbytes += size
                bar.update(size)
                bar.set_postfix_str(f"{documents / max(time.time() - start, 1e-9):,.0f} docs/s", refresh=False)
        if documents == 0:
            raise CLIError(f"no non-empty documents in the input ({len(files)} file(s)); nothing to write")
        meta = writer.finish({**tokenizer.facts(), "append_eod": args.append_eod})
    except BaseException:
        writer.discard()
        raise
    print(Summary(documents, tokens, time.time() - start, nbytes / 2**20, stats.bad_lines))
    return meta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="text files, folders (recursive, see --glob) or JSON-lines files (.jsonl/.json); "
                        ".gz/.bz2/.xz are decompressed on the fly. Without --input: the default pydoc corpus")
    p.add_argument("--glob", default="*.txt", help="file name pattern inside --input folders (default: %(default)s)")
    p.add_argument("--json-key", default="text", help="field holding the text in JSON lines (default: %(default)s)")
    p.add_argument("--tokenizer", choices=["gpt2", "char", "byte"],
                   help="gpt2 = tiktoken r50k_base (default); char = the characters of the data; byte = 256 bytes + EOT")
    p.add_argument("--vocab-file", help="GPT-2 vocabulary: gpt2-vocab.json (with --merge-file) or a .tiktoken file")
    p.add_argument("--merge-file", help="gpt2-merges.txt, with a gpt2-vocab.json --vocab-file")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    p.add_argument("--format", choices=["nanogpt", "megatron"], default="nanogpt",
                   help="nanogpt: DIR/train.bin, val.bin, meta.json; megatron: PREFIX_text_document.bin/.idx/.json")
    p.add_argument("--output-dir", help=f"output folder (--format nanogpt; default corpus: {DEFAULT_CORPUS_DIR})")
    p.add_argument("--output-prefix", help="output path prefix (--format megatron)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of documents for val.bin (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the train/val document split (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32", "int32"], default="auto",
                   help="token id type on disk; auto = uint16 when the vocabulary fits (default: %(default)s)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: %(default)s)")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="input MB per unit of work (default: %(default)s)")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="invalid UTF-8: stop (strict) or use U+FFFD (replace) (default: %(default)s)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) invalid JSON lines instead of stopping")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--install-gpt2-vocab", action="store_true",
                   help=f"download GPT-2's vocabulary (from the {WHISPER_SDIST} sdist on PyPI) into tiktoken's cache")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if not args.input:
        needs_input = {"--tokenizer": args.tokenizer not in (None, "char"), "--format": args.format != "nanogpt",
                       "--output-prefix": args.output_prefix, "--vocab-file": args.vocab_file,
                       "--merge-file": args.merge_file, "--append-eod": args.append_eod}
        for flag, given in needs_input.items():
            if given:
                raise CLIError(f"{flag} needs --input (without --input, tokenizer.py prepares the default char corpus)")
        return
    args.tokenizer = args.tokenizer or "gpt2"
    if args.format == "nanogpt" and not args.output_dir:
        raise CLIError("--output-dir is required with --input (--format nanogpt)")
    if args.format == "megatron" and not args.output_prefix:
        raise CLIError("--output-prefix is required with --format megatron")
    if (args.vocab_file or args.merge_file) and args.tokenizer != "gpt2":
        raise CLIError("--vocab-file/--merge-file only apply to --tokenizer gpt2")
    if args.merge_file and not args.vocab_file:
        raise CLIError("--merge-file needs --vocab-file (gpt2-vocab.json)")
    if args.vocab_file and args.vocab_file.endswith(".json") and not args.merge_file:
        raise CLIError("a .json --vocab-file needs --merge-file (gpt2-merges.txt)")
    if not 0 < args.val_fraction < 1:
        raise CLIError(f"--val-fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    if args.workers < 1 or args.chunk_mb <= 0:
        raise CLIError("--workers must be >= 1 and --chunk-mb > 0")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.install_gpt2_vocab:
        print(f"GPT-2 vocabulary installed: {install_gpt2_vocab()}")
        if not args.input:
            return
    check_args(args)
    if not args.input:
        out_dir = args.output_dir or DEFAULT_CORPUS_DIR
        if os.path.exists(os.path.join(out_dir, "meta.json")) and not args.overwrite:
            print(f"{out_dir} is already prepared (use --overwrite to rebuild it)")
        else:
            print(describe_default_corpus(out_dir, prepare_default_corpus(out_dir)))
        return
    if args.format == "nanogpt":
        outputs = [os.path.join(args.output_dir, n) for n in ("train.bin", "val.bin", "meta.json")]
    else:
        outputs = [f"{args.output_prefix}_{args.json_key}_document{ext}" for ext in (".bin", ".idx", ".json")]
    refuse_existing(outputs, args.overwrite)
    prepare(args)


if __name__ == "__main__":
    run(main)
