"""
Prepare token data for training: text in, token ids out (nanoGPT train.bin/val.bin or Megatron .bin/.idx).

    python tokenizer.py                                  # default corpus: Python's pydoc topics, char-level
    python tokenizer.py --install-gpt2-vocab             # once: the GPT-2 vocabulary for offline use
    python tokenizer.py --input docs/ --glob '*.md' --tokenizer gpt2 --append-eod --output-dir data/docs
    python tokenizer.py --input oscar-1GB.jsonl.xz --tokenizer gpt2 --append-eod --workers 4 \\
        --format megatron --output-prefix data/oscar     # -> data/oscar_text_document.bin/.idx/.json

One plain text file is one document, one JSON line is one document. The file holds the tokenizers
(Tokenizer; load_tokenizer rebuilds one from the facts stored in meta.json and checkpoints), the document
readers, the parallel encoder, the embedded default corpus and the command line; the on-disk formats are
data.py's, the GPT-2 vocabulary installer is gpt2_vocab.py.
"""
import argparse
import bz2
import fnmatch
import gzip
import json
import lzma
import multiprocessing
import os
import signal
import sys
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

import cli
import gpt2_vocab
from cli import CLIError
from data import NANOGPT_FILES, MegatronWriter, NanoGPTWriter, megatron_document_prefix, output_dtype, \
    refuse_existing, write_nanogpt

DEFAULT_CORPUS_DIR = "data/pydoc_char"
EOT_TEXT = "<|endoftext|>"

# -----------------------------------------------------------------------------
# The GPT-2 BPE: tiktoken's r50k_base (installed by gpt2_vocab.py), or the same from vocabulary files


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
        if not gpt2_vocab.installed():
            raise CLIError(f"the GPT-2 vocabulary is not in tiktoken's cache ({gpt2_vocab.tiktoken_cache_dir()}); "
                           f"run: {gpt2_vocab.INSTALL_HINT}")
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
        self.special_tokens: dict[str, int] = {}
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

    def add_special_tokens(self, special_tokens: dict[str, int]) -> None:
        """Name ids past the vocabulary as special tokens (fine-tuning's start, delimiter, extract): encode never
        makes them, decode skips them, and vocab_size grows to include them."""
        ids = list(special_tokens.values())
        if len(set(ids)) != len(ids) or any(type(i) is not int or i < self.vocab_size for i in ids):
            raise CLIError(f"special token ids must be distinct integers from the vocabulary size {self.vocab_size} "
                           f"on, got {special_tokens}")
        self.special_tokens.update(special_tokens)
        self.vocab_size = max(ids, default=self.vocab_size - 1) + 1

    def decode(self, ids: list[int]) -> str:
        """Text of ids; never fails: EOT and special tokens are skipped for char/byte, special tokens for gpt2,
        invalid bytes and unknown ids become U+FFFD."""
        if self.special_tokens:
            special = set(self.special_tokens.values())
            ids = [i for i in ids if i not in special]
        if self.name == "gpt2":
            return self.encoding.decode([i for i in ids if 0 <= i < self.encoding.n_vocab])
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
        if self.special_tokens:
            facts["special_tokens"] = dict(self.special_tokens)
        return facts


def load_tokenizer(facts: dict) -> Tokenizer:
    """The tokenizer that facts() described (e.g. the meta.json of a prepared corpus, or a fine-tuned checkpoint's
    facts, whose special tokens count in its vocab_size)."""
    name = facts.get("tokenizer")
    if name == "char":
        tokenizer = Tokenizer("char", chars=facts.get("chars"), char_eot=facts.get("eot_id") is not None)
    elif name in ("gpt2", "byte"):
        tokenizer = Tokenizer(name, vocab_file=facts.get("vocab_file"), merge_file=facts.get("merge_file"))
    else:
        raise CLIError(f"unknown tokenizer {name!r} in the tokenizer facts (expected gpt2, char or byte)")
    special_tokens = facts.get("special_tokens") or {}
    if not isinstance(special_tokens, dict):
        raise CLIError(f"special_tokens in the tokenizer facts must map names to ids, got {special_tokens!r}")
    tokenizer.add_special_tokens(special_tokens)
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
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool ends its workers with SIGTERM: die, no cleanup to run
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
        pool.close()  # let the workers finish on their own; leaving the block terminates them only on an error
        pool.join()


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
    meta = {**tokenizer.facts(), "documents": len(documents), "source": "pydoc_data.topics"}
    return write_nanogpt(data_dir, ids[:n_train], ids[n_train:], meta)


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
        writer = MegatronWriter(megatron_document_prefix(args.output_prefix, args.json_key), dtype)
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
    p = cli.argument_parser(__doc__)
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="text files, folders (recursive, see --glob) or JSON-lines files (.jsonl/.json); "
                        ".gz/.bz2/.xz are decompressed on the fly. Without --input: the default pydoc corpus")
    p.add_argument("--glob", default="*.txt", help="file name pattern inside --input folders (default: %(default)s)")
    p.add_argument("--json-key", "--json-keys", default="text",
                   help="field holding the text in JSON lines (default: %(default)s)")
    p.add_argument("--tokenizer", choices=["gpt2", "char", "byte"],
                   help="gpt2 = tiktoken r50k_base (default); char = the characters of the data; byte = 256 bytes + EOT")
    p.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer"],
                   help="Megatron's name for --tokenizer gpt2 (its preprocess_data.py command runs as written)")
    p.add_argument("--vocab-file", "--vocab",
                   help="GPT-2 vocabulary: gpt2-vocab.json (with --merge-file) or a .tiktoken file")
    p.add_argument("--merge-file", help="gpt2-merges.txt, with a gpt2-vocab.json --vocab-file")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    p.add_argument("--format", choices=["nanogpt", "megatron"],
                   help="nanogpt: DIR/train.bin, val.bin, meta.json; megatron: PREFIX_text_document.bin/.idx/.json "
                        "(default: megatron with --output-prefix or --dataset-impl, else nanogpt)")
    p.add_argument("--dataset-impl", choices=["mmap"], help="Megatron's name for --format megatron (its mmap .bin/.idx)")
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
                   help=f"download GPT-2's vocabulary (from the {gpt2_vocab.WHISPER_SDIST} sdist on PyPI) "
                        f"into tiktoken's cache")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    megatron_flags = args.dataset_impl or args.output_prefix
    if args.format == "nanogpt" and args.dataset_impl:
        raise CLIError("--dataset-impl mmap writes Megatron's format; it cannot be combined with --format nanogpt")
    args.format = args.format or ("megatron" if megatron_flags else "nanogpt")
    if args.tokenizer_type:
        if args.tokenizer not in (None, "gpt2"):
            raise CLIError(f"--tokenizer-type {args.tokenizer_type} is GPT-2's BPE; it cannot be combined with "
                           f"--tokenizer {args.tokenizer}")
        args.tokenizer = "gpt2"
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
    if args.workers < 1 or not 0 < args.chunk_mb <= 1024:
        raise CLIError(f"--workers must be >= 1 and --chunk-mb between 0 and 1024, got {args.workers} and "
                       f"{args.chunk_mb}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.install_gpt2_vocab:
        print(f"GPT-2 vocabulary installed: {gpt2_vocab.install()}")
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
        outputs = [os.path.join(args.output_dir, n) for n in NANOGPT_FILES]
    else:
        prefix = megatron_document_prefix(args.output_prefix, args.json_key)
        outputs = [prefix + ext for ext in (".bin", ".idx", ".json")]
    refuse_existing(outputs, args.overwrite)
    prepare(args)


if __name__ == "__main__":
    cli.run(main)
