"""Data preparation, tokenizer.py's work: text in, token ids out. Documents are tokenized in
parallel, in order and with bounded memory, by the tokenizer chosen (or trained on the input), into
the format chosen; and the embedded default corpus (Python's own documentation, shipped with every
CPython) is prepared on first use.

    prepare(args)                 # tokenizer.py's flags, checked: the files written, their metadata
    ensure_default_corpus()       # data/pydoc_char: train.bin, val.bin, meta.json (char level)
    train_bpe(texts, vocab_size)  # a byte-level BPE trained on texts, as tokenizer.json text
"""
import argparse
import hashlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pydoc_data.topics import topics

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from toolkit import gpt2_vocab
from toolkit.cli import CLIError
from toolkit.data import DEFAULT_CORPUS_DIR, NANOGPT_FILES, is_prepared, megatron_document_prefix
from toolkit.documents import ReadStats, input_files, read_documents
from toolkit.files import (atomic_open, check_output, refuse_existing, remove_temporaries,
                           temporary_name, write_error)
from toolkit.textfiles import read_text, without_compression
from toolkit.tokenizers import CUT, EOT_TEXT, Tokenizer, load_tokenizer
from toolkit.writers import (LlmcWriter, MegatronWriter, NanoGPTWriter, llmc_shards, output_dtype,
                             write_nanogpt)

PIECE_CHARS = 1 << 22  # a longer piece of text is tokenized 4M characters at a time: bounded memory
BPE_SAMPLE = 1 << 28  # the text a BPE is trained on: 256 MiB at most (docs/performance.md)
# A run of letters (Chinese without punctuation, OCR output) is one word to GPT-2's pattern, and
# HF's BPE trainer takes time that grows faster than its length (200,000 such characters: minutes);
# the trainer sees such runs cut every this many letters (merges across a cut are not counted)
TRAINING_RUN = 256
LONG_RUN = re.compile(rf"[^\W\d_]{{{TRAINING_RUN + 1},}}")
MAX_BPE_VOCAB = 1 << 20  # the largest BPE trained here
# the PyPI source package that ships GPT-2's vocabulary, the file tiktoken downloads, unchanged
WHISPER_SDIST = "openai-whisper==20250625"
WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE of vocab_size entries (the 256 bytes, the merges and <|endoftext|>, a
    special token) trained on texts, streamed, by HF `tokenizers` on its own threads; as
    tokenizer.json text. GPT-2's pre-tokenizing pattern and byte alphabet, as its own BPE was
    trained."""
    if vocab_size < 257:
        raise CLIError(f"--vocab-size {vocab_size} is too small: a byte-level BPE holds the 256 "
                       f"bytes and {EOT_TEXT}, 257 at least")
    if vocab_size > MAX_BPE_VOCAB:
        raise CLIError(f"--vocab-size {vocab_size} is more than {MAX_BPE_VOCAB:,}: larger than any "
                       "BPE in use (Qwen3's has 151,669 tokens) and than HF tokenizers can train "
                       "in memory")
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(cut_long_runs(texts), trainer=trainer)
    return bpe.to_str()


def cut_long_runs(texts: Iterable[str]) -> Iterable[str]:
    """texts in pieces, cut inside every run of more than TRAINING_RUN letters."""
    for text in texts:
        start = 0
        for run in LONG_RUN.finditer(text):
            for cut in range(run.start() + TRAINING_RUN, run.end(), TRAINING_RUN):
                yield text[start:cut]
                start = cut
        yield text[start:]


def encode_document(tokenizer: Tokenizer, pieces: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """A document's token ids, a piece at a time; a piece longer than PIECE_CHARS is cut where the
    tokenizer splits anyway (tokenizers.CUT), so the ids are those of the whole text. A tokenizer
    that may not split there encodes the document whole."""
    if not tokenizer.cuts_keep_ids():
        return [tokenizer.encode_array("".join(pieces)).astype(dtype, copy=False)]
    arrays = []
    for text in pieces:
        start = 0
        while len(text) - start > PIECE_CHARS:
            end = start + PIECE_CHARS
            cut = CUT.search(text[end:end + PIECE_CHARS])
            if cut is None:  # nowhere to cut within reach: the rest goes whole
                break
            arrays.append(
                tokenizer.encode_array(text[start:end + cut.start()]).astype(dtype, copy=False))
            start = end + cut.start()
        arrays.append(tokenizer.encode_array(text[start:]).astype(dtype, copy=False))
    return arrays


def encode_chunk(tokenizer: Tokenizer, pieces: list[tuple[str, bool]], continues: bool,
                 eod: str | None,
                 dtype: np.dtype) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The tokens of a chunk's pieces of text (each with whether it ends its document; the first
    continues the chunk before's last document when continues), as arrays to write one after the
    other, with the length of each document's part and whether that part starts its document.
    End-of-text goes after each non-empty document (eod "append", Megatron's --append-eod) or
    before it ("prepend", llm.c's shards), after the tokenizer's BOS if it has one (Llama 3's)."""
    parts, starts, texts = [], [], []
    for text, ends in pieces:
        texts.append(text)
        if ends:
            parts.append((texts, not continues or bool(parts), True))
            texts = []
    if texts:  # a document that goes on into the next chunk
        parts.append((texts, not continues or bool(parts), False))
    # one thread per process: processes outrun tiktoken's own threads (docs/performance.md)
    encoded = [encode_document(tokenizer, texts, dtype) for texts, _, _ in parts]
    eot = [np.array([tokenizer.eot_id], dtype=dtype)] if eod else []
    bos = [] if tokenizer.bos_id is None else [np.array([tokenizer.bos_id], dtype=dtype)]
    first, last = (eot + bos, []) if eod == "prepend" else (bos, eot)
    arrays, lengths = [], []
    for (_, start, end), ids in zip(parts, encoded):
        n = sum(map(len, ids))
        if start and end and not n:  # an empty document gets no tokens: it is dropped
            continue
        arrays += [*(first if start else []), *ids, *(last if end else [])]
        lengths.append(n + len(first) * start + len(last) * end)
        starts.append(start)
    return arrays, np.array(lengths, np.int64), np.array(starts, bool)


def chunks_of(pieces: Iterator[tuple[str, int, bool]], chunk_bytes: int, seen: set[str] | None,
              whole_documents: bool) -> Iterator[tuple[list[tuple[str, bool]], bool, int]]:
    """Group pieces of text into lists of about chunk_bytes of input (the unit of work of one
    worker), each with whether its first piece continues a document and its input bytes; seen,
    when given, gathers the characters of the text. With whole_documents a chunk ends only where
    a document does (for a tokenizer whose ids change where the text is cut: memory then holds a
    whole text file)."""
    chunk, size, continues, ended = [], 0, False, True
    for text, nbytes, ends in pieces:
        if seen is not None:
            seen.update(text)
        if not chunk:
            continues = not ended
        chunk.append((text, ends))
        size, ended = size + nbytes, ends
        if size >= chunk_bytes and (ends or not whole_documents):
            yield chunk, continues, size
            chunk, size = [], 0
    if chunk:
        yield chunk, continues, size


_worker_job = None  # (tokenizer, eod, dtype), set once per worker process


def _init_worker(facts: dict, eod: str | None, dtype: str) -> None:
    global _worker_job
    # Ctrl-C is the main process's to handle (it ends the pool)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the pool ends its workers with SIGTERM: die, no cleanup to run
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_job = (load_tokenizer(facts), eod, np.dtype(dtype))


def text_bytes(pieces: list[tuple[str, bool]]) -> int:
    """The bytes of the pieces' text in UTF-8: throughput is counted in them, whatever the input
    (a compressed file's bytes, or a parquet file's, say little about the work)."""
    return sum(len(text.encode("utf-8", "surrogatepass")) for text, _ in pieces)


def encode_work(job: tuple, pieces: list[tuple[str, bool]], continues: bool) -> tuple:
    tokenizer, eod, dtype = job
    return *encode_chunk(tokenizer, pieces, continues, eod, dtype), text_bytes(pieces)


def _encode_in_worker(pieces: list[tuple[str, bool]], continues: bool) -> tuple:
    return encode_work(_worker_job, pieces, continues)


def encode_in_order(chunks: Iterator[tuple[list[tuple[str, bool]], bool, int]],
                    tokenizer: Tokenizer, eod: str | None, dtype: np.dtype,
                    workers: int) -> Iterator[tuple]:
    """(token arrays, lengths, starts, text bytes, input bytes) per chunk in order (encode_chunk's
    and text_bytes'); at most 2*workers chunks in flight."""
    if workers == 1:
        for pieces, continues, nbytes in chunks:
            yield *encode_work((tokenizer, eod, dtype), pieces, continues), nbytes
        return
    # Pool.imap reads all input ahead (its feeder thread); apply_async + a bounded deque does not
    with multiprocessing.Pool(workers, _init_worker, (tokenizer.facts(), eod, dtype.name)) as pool:
        pending = deque()
        for pieces, continues, nbytes in chunks:
            pending.append((pool.apply_async(_encode_in_worker, (pieces, continues)), nbytes))
            if len(pending) >= 2 * workers:
                result, size = pending.popleft()
                yield *result.get(), size
        while pending:
            result, size = pending.popleft()
            yield *result.get(), size
        # let the workers finish on their own; leaving the block terminates them only on an error
        pool.close()
        pool.join()


def default_corpus_documents() -> list[str]:
    return [topics[key].strip("\n") for key in sorted(topics)]


def prepare_default_corpus(data_dir: str = DEFAULT_CORPUS_DIR) -> dict:
    """pydoc topics, char-level as nanoGPT's shakespeare_char: the last 10% of characters is val."""
    documents = default_corpus_documents()
    # a blank line between documents reads naturally; no EOT in it
    text = "\n\n".join(documents) + "\n"
    # (its id, as every vocabulary)
    tokenizer = Tokenizer("char", chars="".join(sorted(set(text))), char_eot=True)
    ids = tokenizer.encode_array(text).astype(np.uint16)
    n_train = int(len(ids) * 0.9)
    meta = {**tokenizer.facts(), "documents": len(documents), "source": "pydoc_data.topics"}
    return write_nanogpt(data_dir, ids[:n_train], ids[n_train:], meta)


def describe_default_corpus(data_dir: str, meta: dict) -> str:
    return (f"prepared {data_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
            f"characters, vocab {meta['vocab_size']}")


def ensure_default_corpus(data_dir: str = DEFAULT_CORPUS_DIR) -> str:
    """Prepare the default corpus in data_dir unless it is already there; returns data_dir."""
    if not is_prepared(data_dir):
        print(describe_default_corpus(data_dir, prepare_default_corpus(data_dir)), file=sys.stderr)
    return data_dir


# ----- tokenizer.py -----

def outputs(args: argparse.Namespace) -> list[str]:
    """The files a run would write (or find, for llm.c's shards); only --overwrite replaces them."""
    bpe = args.tokenizer == "bpe" or bool(args.tokenizer_file)  # with its tokenizer.json
    if args.format == "megatron":
        prefix = megatron_document_prefix(args.output_prefix, args.json_key)
        return [prefix + ext for ext in (".bin", ".idx", ".json", *[".tokenizer.json"] * bpe)]
    names = [*NANOGPT_FILES] if args.format == "nanogpt" else \
        ["meta.json", *llmc_shards(args.output_dir)]
    return [os.path.join(args.output_dir, name) for name in (*names, *["tokenizer.json"] * bpe)]


def texts(files: list[str], args: argparse.Namespace):
    """Every piece of text of the input, streaming: one extra pass for what the vocabulary needs."""
    return (text for text, _, _ in read_documents(files, args.json_key, args.errors,
                                                  args.skip_bad_lines))


def input_bytes(files: list[str]) -> int | None:
    """The input's size in bytes, None when a file is compressed (its text's size is unknown)."""
    if any(path != without_compression(path) for path in files):
        return None
    return sum(os.path.getsize(path) for path in files)


def bpe_sample(files: list[str], args: argparse.Namespace) -> Iterator[str]:
    """At most BPE_SAMPLE bytes of the input's text (a BPE trainer's memory grows with its text),
    spread over the input: every k-th piece, k from the input's size, or where that is unknown
    (compressed) its first pieces."""
    size = input_bytes(files)
    every, taken = max(1, round(size / BPE_SAMPLE)) if size else 1, 0
    for i, text in enumerate(texts(files, args)):
        if i % every == 0 and taken < BPE_SAMPLE:
            taken += len(text.encode("utf-8", "surrogatepass"))
            yield text


def build_tokenizer(args: argparse.Namespace, files: list[str]) -> Tokenizer:
    if args.tokenizer_file:
        return Tokenizer("bpe", tokenizer_json=read_text(args.tokenizer_file, "--tokenizer-file"),
                         source=args.tokenizer_file)
    if args.tokenizer == "bpe":
        start = time.time()
        tokenizer = Tokenizer("bpe", tokenizer_json=train_bpe(bpe_sample(files, args),
                                                              args.vocab_size))
        print(f"trained a byte-level BPE of {tokenizer.vocab_size:,} tokens on the input (at most "
              f"{BPE_SAMPLE >> 20} MiB of its text, spread over it) in "
              f"{time.time() - start:.1f} s", file=sys.stderr)
        return tokenizer
    if args.tokenizer != "char":
        return Tokenizer(args.tokenizer, vocab_file=args.vocab_file, merge_file=args.merge_file)
    chars = set()  # the char vocabulary is whatever the data holds
    for text in texts(files, args):
        chars.update(text)
    if not chars:
        raise CLIError(f"no text in the input ({len(files)} file(s)); nothing to tokenize")
    # an end-of-text id past the characters, as every vocabulary here has, used or not
    # (--append-eod); it ends generation in llama.cpp (toolkit/gguf_export.py)
    return Tokenizer("char", chars="".join(sorted(chars)), char_eot=True)


def make_writer(args: argparse.Namespace, tokenizer: Tokenizer):
    """The writer of the chosen format, and where a trained tokenizer's tokenizer.json goes beside
    it."""
    if args.format == "megatron":
        prefix = megatron_document_prefix(args.output_prefix, args.json_key)
        dtype = output_dtype(tokenizer.vocab_size, args.token_dtype, args.format)
        return MegatronWriter(prefix, dtype), prefix + ".tokenizer.json"
    if args.format == "llmc":
        if tokenizer.vocab_size > 2**16:
            raise CLIError("llm.c's shards hold uint16 ids; a vocabulary of "
                           f"{tokenizer.vocab_size:,} does not fit: use --format nanogpt")
        return LlmcWriter(args.output_dir, args.shard_tokens, args.val_fraction), None
    dtype = output_dtype(tokenizer.vocab_size, args.token_dtype, args.format)
    return NanoGPTWriter(args.output_dir, dtype, args.val_fraction, args.seed), None


def remove_own_temporaries(folder: str) -> None:
    """The unfinished files of this run, however far its writer got (it names them by this PID)."""
    if os.path.isdir(folder):
        remove_temporaries(folder, os.getpid())


def prepare(args: argparse.Namespace) -> dict | None:
    """tokenizer.py's work, its flags checked: without --input the default corpus (unless it is
    there already); else args.input tokenized into the chosen format, replacing earlier outputs
    only with --overwrite. Returns the metadata written."""
    if not args.input:
        out_dir = args.output_dir or DEFAULT_CORPUS_DIR
        if os.path.exists(os.path.join(out_dir, "meta.json")) and not args.overwrite:
            print(f"{out_dir} is already prepared (use --overwrite to rebuild it)")
            return None
        meta = prepare_default_corpus(out_dir)
        print(describe_default_corpus(out_dir, meta))
        return meta
    files = input_files(args.input, args.glob)
    flag = "--output-prefix" if args.format == "megatron" else "--output-dir"
    for path in outputs(args):  # (before --overwrite is named: it never replaces an input)
        check_output(path, [*files, args.tokenizer_file], f"{flag}'s file", replaces_data=True)
    refuse_existing(outputs(args), args.overwrite)
    tokenizer = build_tokenizer(args, files)
    replacing = any(os.path.exists(path) for path in outputs(args))  # (--overwrite was given)
    folder = os.path.dirname(outputs(args)[0]) or "."
    eod = "prepend" if args.format == "llmc" else "append" if args.append_eod else None
    stats = ReadStats()
    start, documents, tokens, nbytes = time.time(), 0, 0, 0  # (nbytes: of text)
    try:  # from the first file the writer opens: a signal may land anywhere after that
        writer, tokenizer_file = make_writer(args, tokenizer)
        tokenizer_file = tokenizer_file or os.path.join(args.output_dir, "tokenizer.json")
        documents_read = read_documents(files, args.json_key, args.errors, args.skip_bad_lines,
                                        stats)
        quiet = args.quiet or not sys.stderr.isatty()
        total = input_bytes(files)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
                  desc="tokenizing") as bar:
            seen = set() if tokenizer.may_drop_characters() else None
            chunks = chunks_of(documents_read, int(args.chunk_mb * 2**20), seen,
                               not tokenizer.cuts_keep_ids())
            for arrays, lengths, starts, text_size, size in encode_in_order(
                    chunks, tokenizer, eod, writer.dtype, args.workers):
                writer.add(arrays, lengths, starts)
                documents += int(starts.sum())
                tokens += int(lengths.sum())
                nbytes += text_size
                bar.update(size)
                bar.set_postfix_str(f"{nbytes / 2**20 / max(time.time() - start, 1e-9):,.1f} "
                                    "MB/s of text", refresh=False)
        if documents == 0:
            raise CLIError(f"no non-empty documents in the input ({len(files)} file(s)); nothing "
                           "to write")
        # beside the token files, for HF's tools (the facts hold it too), put in place with them;
        # without a BPE, a replaced dataset's tokenizer.json goes
        extra, stale = {}, [tokenizer_file] if replacing else []
        if tokenizer.name == "bpe":
            extra, stale = {temporary_name(tokenizer_file): tokenizer_file}, []
            with open(next(iter(extra)), "w", encoding="utf-8") as f:
                f.write(tokenizer.tokenizer_json)
        meta = writer.finish({**tokenizer.facts(), "append_eod": args.append_eod}, extra, stale)
    except OSError as e:  # reading errors are CLIErrors already: this is the output failing
        remove_own_temporaries(folder)
        raise write_error(outputs(args)[0] if args.format == "megatron" else folder, e) from None
    except BaseException:
        remove_own_temporaries(folder)
        raise
    lost = tokenizer.unknown_characters(seen or ())
    if lost:
        shown = " ".join(repr(char) for char in lost[:20]) + (" ..." if len(lost) > 20 else "")
        print(f"warning: {args.tokenizer_file} has no token for {len(lost):,} character(s) of the "
              f"input, which the data leaves out or holds as its unknown token: {shown}",
              file=sys.stderr)
    seconds = max(time.time() - start, 1e-9)
    print(f"{documents:,} documents, {tokens:,} tokens in {seconds:.1f} s "
          f"({nbytes / 2**20 / seconds:.1f} MB/s, {tokens / seconds:,.0f} tokens/s)" +
          (f", {stats.bad_lines:,} bad lines skipped" if stats.bad_lines else ""))
    return meta


def install_gpt2_vocab() -> str:
    """The path of GPT-2's vocabulary, put in tiktoken's cache from PyPI's openai-whisper sdist: the
    package (~800 KB) is downloaded, not installed, and its copy of r50k_base checked by sha256."""
    cache_dir = gpt2_vocab.tiktoken_cache_dir()
    if not cache_dir:
        raise CLIError("TIKTOKEN_CACHE_DIR is set but empty, which disables tiktoken's cache; "
                       "unset it or name a folder")
    path = os.path.join(cache_dir, gpt2_vocab.R50K_CACHE_NAME)
    if gpt2_vocab.installed():
        return path
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHISPER_SDIST, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            last_line = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CLIError(f"'{' '.join(cmd[1:])}' failed: {last_line}")
        sdists = [name for name in os.listdir(tmp) if name.endswith(".tar.gz")]
        if len(sdists) != 1:
            raise CLIError(f"expected one .tar.gz from pip download of {WHISPER_SDIST}, got "
                           f"{sorted(os.listdir(tmp))}")
        with tarfile.open(os.path.join(tmp, sdists[0])) as tar:
            members = [m for m in tar.getmembers() if m.name.endswith("/" + WHISPER_MEMBER)]
            if len(members) != 1:
                raise CLIError(f"{sdists[0]} has no {WHISPER_MEMBER}")
            data = tar.extractfile(members[0]).read()
    if hashlib.sha256(data).hexdigest() != gpt2_vocab.R50K_SHA256:
        raise CLIError(f"{WHISPER_MEMBER} from {sdists[0]} has an unexpected sha256; refusing to "
                       "install it")
    with atomic_open(path, "wb") as f:
        f.write(data)
    return path
