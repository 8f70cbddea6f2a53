"""Data preparation, tokenizer.py's work: text in, token ids out. Documents are tokenized in
parallel, in order and with bounded memory, by the tokenizer chosen (or trained on the input), into
the format chosen; and the embedded default corpus (Python's own documentation, shipped with every
CPython) is prepared on first use.

    prepare(args)                 # tokenizer.py's flags, checked: the files written, their metadata
    ensure_default_corpus()       # data/pydoc_char: train.bin, val.bin, meta.json (char level)
"""
import argparse
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from toolkit.cli import CLIError
from toolkit.data import DEFAULT_CORPUS_DIR, NANOGPT_FILES, is_prepared, megatron_document_prefix
from toolkit.documents import ReadStats, input_files, read_documents, read_text, without_compression
from toolkit.files import (check_output, refuse_existing, remove_temporaries, temporary_name,
                           write_error)
from toolkit.tokenizers import CUT, Tokenizer, load_tokenizer, train_bpe
from toolkit.writers import (LlmcWriter, MegatronWriter, NanoGPTWriter, llmc_shards, output_dtype,
                             write_nanogpt)
PIECE_CHARS = 1 << 22  # a longer piece of text is tokenized 4M characters at a time: bounded memory


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


def encode_chunk(tokenizer: Tokenizer, documents: list[list[str]], eod: str | None,
                 dtype: np.dtype) -> tuple[list[np.ndarray], np.ndarray]:
    """The documents' tokens back to back, end-of-text after each non-empty one (eod "append",
    Megatron's --append-eod) or before it ("prepend", llm.c's shards), each after the tokenizer's
    BOS if it has one (Llama 3's), as arrays to write one after the other, and each document's
    length."""
    # one thread per process: processes outrun tiktoken's own threads (docs/performance.md)
    encoded = [encode_document(tokenizer, pieces, dtype) for pieces in documents]
    lengths = np.array([sum(map(len, arrays)) for arrays in encoded], dtype=np.int64)
    eot = [np.array([tokenizer.eot_id], dtype=dtype)] if eod else []
    bos = [] if tokenizer.bos_id is None else [np.array([tokenizer.bos_id], dtype=dtype)]
    before, after = (eot + bos, []) if eod == "prepend" else (bos, eot)
    arrays = [a for arrays, n in zip(encoded, lengths) if n for a in (*before, *arrays, *after)]
    lengths[lengths > 0] += len(eot) + len(bos)  # empty documents get neither (they are dropped)
    return arrays, lengths


def chunks_of(documents: Iterator[tuple[list[str], int]], chunk_bytes: int,
              seen: set[str] | None = None) -> Iterator[tuple[list[list[str]], int]]:
    """Group documents into lists of about chunk_bytes of input (the unit of work of one worker);
    seen, when given, gathers the characters of the text."""
    texts, size = [], 0
    for pieces, nbytes in documents:
        if seen is not None:
            for piece in pieces:
                seen.update(piece)
        texts.append(pieces)
        size += nbytes
        if size >= chunk_bytes:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


_worker_job = None  # (tokenizer, eod, dtype), set once per worker process


def _init_worker(facts: dict, eod: str | None, dtype: str) -> None:
    global _worker_job
    # Ctrl-C is the main process's to handle (it ends the pool)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the pool ends its workers with SIGTERM: die, no cleanup to run
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _worker_job = (load_tokenizer(facts), eod, np.dtype(dtype))


def _encode_in_worker(texts: list[list[str]]) -> tuple[list[np.ndarray], np.ndarray]:
    tokenizer, eod, dtype = _worker_job
    return encode_chunk(tokenizer, texts, eod, dtype)


def encode_in_order(chunks: Iterator[tuple[list[list[str]], int]], tokenizer: Tokenizer,
                    eod: str | None, dtype: np.dtype,
                    workers: int) -> Iterator[tuple[list[np.ndarray], np.ndarray, int]]:
    """(token arrays, lengths, input bytes) per chunk in order; at most 2*workers in flight."""
    if workers == 1:
        for texts, nbytes in chunks:
            yield *encode_chunk(tokenizer, texts, eod, dtype), nbytes
        return
    # Pool.imap reads all input ahead (its feeder thread); apply_async + a bounded deque does not
    with multiprocessing.Pool(workers, _init_worker, (tokenizer.facts(), eod, dtype.name)) as pool:
        pending = deque()
        for texts, nbytes in chunks:
            pending.append((pool.apply_async(_encode_in_worker, (texts,)), nbytes))
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
    from pydoc_data.topics import topics
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
    return (text for pieces, _ in read_documents(files, args.json_key, args.errors,
                                                 args.skip_bad_lines)
            for text in pieces)


def build_tokenizer(args: argparse.Namespace, files: list[str]) -> Tokenizer:
    if args.tokenizer_file:
        return Tokenizer("bpe", tokenizer_json=read_text(args.tokenizer_file, "--tokenizer-file"),
                         source=args.tokenizer_file)
    if args.tokenizer == "bpe":
        start = time.time()
        tokenizer = Tokenizer("bpe", tokenizer_json=train_bpe(texts(files, args), args.vocab_size))
        print(f"trained a byte-level BPE of {tokenizer.vocab_size:,} tokens on the input in "
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
    start, documents, tokens, nbytes = time.time(), 0, 0, 0
    try:  # from the first file the writer opens: a signal may land anywhere after that
        writer, tokenizer_file = make_writer(args, tokenizer)
        tokenizer_file = tokenizer_file or os.path.join(args.output_dir, "tokenizer.json")
        documents_read = read_documents(files, args.json_key, args.errors, args.skip_bad_lines,
                                        stats)
        quiet = args.quiet or not sys.stderr.isatty()
        known_size = not any(path != without_compression(path) for path in files)
        total = sum(os.path.getsize(path) for path in files) if known_size else None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
                  desc="tokenizing") as bar:
            seen = set() if tokenizer.may_drop_characters() else None
            chunks = chunks_of(documents_read, int(args.chunk_mb * 2**20), seen)
            for arrays, lengths, size in encode_in_order(chunks, tokenizer, eod, writer.dtype,
                                                         args.workers):
                writer.add(arrays, lengths)
                documents += int((lengths > 0).sum())
                tokens += int(lengths.sum())
                nbytes += size
                bar.update(size)
                bar.set_postfix_str(f"{documents / max(time.time() - start, 1e-9):,.0f} docs/s",
                                    refresh=False)
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
