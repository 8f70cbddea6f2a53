"""Data preparation shared by the scripts: tokenizing documents in parallel, in order and with
bounded memory, and the embedded default corpus (Python's own documentation, shipped with every
CPython).

    ensure_default_corpus()            # data/pydoc_char: train.bin, val.bin, meta.json (char level)
"""
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Iterator

import numpy as np

from toolkit.data import NANOGPT_FILES
from toolkit.tokenizers import CUT, Tokenizer, load_tokenizer
from toolkit.writers import write_nanogpt

DEFAULT_CORPUS_DIR = "data/pydoc_char"
PIECE_CHARS = 1 << 22  # a longer piece of text is tokenized 4M characters at a time: bounded memory


def encode_document(tokenizer: Tokenizer, pieces: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """A document's token ids, a piece at a time; a piece longer than PIECE_CHARS is cut where the
    tokenizer splits anyway (tokenizers.CUT), so the ids are those of the whole text."""
    arrays = []
    for text in pieces:
        start = 0
        while len(text) - start > PIECE_CHARS:
            end = start + PIECE_CHARS
            cut = CUT.search(text[end:end + PIECE_CHARS])
            if cut is None:  # nowhere to cut within reach: the rest goes whole
                break
            arrays.append(tokenizer.encode_array(text[start:end + cut.start()]).astype(dtype, copy=False))
            start = end + cut.start()
        arrays.append(tokenizer.encode_array(text[start:]).astype(dtype, copy=False))
    return arrays


def encode_chunk(tokenizer: Tokenizer, documents: list[list[str]], eod: str | None,
                 dtype: np.dtype) -> tuple[list[np.ndarray], np.ndarray]:
    """The documents' tokens back to back, end-of-text after each non-empty one (eod "append",
    Megatron's --append-eod) or before it ("prepend", llm.c's shards), as arrays to write one after
    the other, and each document's length."""
    # one thread per process: processes outrun tiktoken's own threads (docs/performance.md)
    encoded = [encode_document(tokenizer, pieces, dtype) for pieces in documents]
    lengths = np.array([sum(map(len, arrays)) for arrays in encoded], dtype=np.int64)
    eot = [np.array([tokenizer.eot_id], dtype=dtype)] if eod else []
    before, after = (eot, []) if eod == "prepend" else ([], eot)
    arrays = [a for arrays, n in zip(encoded, lengths) if n for a in (*before, *arrays, *after)]
    lengths[lengths > 0] += len(eot)  # empty documents get no end-of-text (they are dropped)
    return arrays, lengths


def chunks_of(documents: Iterator[tuple[list[str], int]],
              chunk_bytes: int) -> Iterator[tuple[list[list[str]], int]]:
    """Group documents into lists of about chunk_bytes of input (the unit of work of one worker)."""
    texts, size = [], 0
    for pieces, nbytes in documents:
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (it ends the pool)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool ends its workers with SIGTERM: die, no cleanup to run
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
        pool.close()  # let the workers finish on their own; leaving the block terminates them only on an error
        pool.join()


def default_corpus_documents() -> list[str]:
    from pydoc_data.topics import topics
    return [topics[key].strip("\n") for key in sorted(topics)]


def prepare_default_corpus(data_dir: str = DEFAULT_CORPUS_DIR) -> dict:
    """pydoc topics, char-level as nanoGPT's shakespeare_char: the last 10% of characters is val."""
    documents = default_corpus_documents()
    text = "\n\n".join(documents) + "\n"  # a blank line between documents reads naturally; no EOT
    tokenizer = Tokenizer("char", chars="".join(sorted(set(text))))
    ids = tokenizer.encode_array(text).astype(np.uint16)
    n_train = int(len(ids) * 0.9)
    meta = {**tokenizer.facts(), "documents": len(documents), "source": "pydoc_data.topics"}
    return write_nanogpt(data_dir, ids[:n_train], ids[n_train:], meta)


def describe_default_corpus(data_dir: str, meta: dict) -> str:
    return (f"prepared {data_dir}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
            f"characters, vocab {meta['vocab_size']}")


def ensure_default_corpus(data_dir: str = DEFAULT_CORPUS_DIR) -> str:
    """Prepare the default corpus in data_dir unless it is already there; returns data_dir."""
    if not all(os.path.exists(os.path.join(data_dir, n)) for n in NANOGPT_FILES):
        print(describe_default_corpus(data_dir, prepare_default_corpus(data_dir)), file=sys.stderr)
    return data_dir
