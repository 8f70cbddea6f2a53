"""toolkit/data.py: loading both formats, Megatron's document split, deterministic windows,
batches, corrupt data."""
import json
import os
import struct

import numpy as np
import pytest
import torch

from toolkit.cli import CLIError
from toolkit.batches import get_batch, window_offsets
from toolkit.data import Corpus, load_corpus
from toolkit.prepare import ensure_default_corpus
from toolkit.tokenizers import load_tokenizer

FACTS = {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}


def write_nanogpt(folder, train: np.ndarray, val: np.ndarray, dtype: str = "uint16", **meta) -> str:
    os.makedirs(folder, exist_ok=True)
    train.astype(dtype).tofile(os.path.join(folder, "train.bin"))
    val.astype(dtype).tofile(os.path.join(folder, "val.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"format": "nanogpt", **FACTS, "dtype": dtype, **meta}, f)
    return str(folder)


def write_megatron(prefix: str, documents: list[np.ndarray], sidecar: bool = True) -> str:
    """Megatron .bin/.idx from the byte layout (uint16, one item per document)."""
    sizes = np.array([len(d) for d in documents], "<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1]) * 2]).astype("<i8")
    doc_idx = np.arange(len(documents) + 1, dtype="<i8")
    np.concatenate(documents).astype("<u2").tofile(prefix + ".bin")
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(sizes), len(doc_idx)))
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    if sidecar:
        with open(prefix + ".json", "w") as f:
            json.dump({"format": "megatron", **FACTS}, f)
    return prefix


def documents(n: int) -> list[np.ndarray]:
    """Document i holds the value i (mod 256), repeated 1 + i % 5 times: its tokens say where it
    came from."""
    return [np.full(1 + i % 5, i % 256) for i in range(n)]


def test_load_nanogpt(tmp_path):
    folder = write_nanogpt(tmp_path / "d", np.arange(1000) % 257, np.arange(100) % 257)
    corpus = load_corpus(folder)
    assert isinstance(corpus, Corpus) and isinstance(corpus.train, np.memmap)
    assert corpus.train.dtype == np.uint16 and len(corpus.train) == 1000 and len(corpus.val) == 100
    assert corpus.meta["vocab_size"] == 257 and corpus.meta["tokenizer"] == "byte"
    wide = load_corpus(write_nanogpt(tmp_path / "w", np.arange(70_000), np.arange(10),
                                     dtype="uint32", vocab_size=70_000))
    assert wide.train.dtype == np.uint32 and wide.train[-1] == 69_999


def test_token_ids_and_counts_are_checked_once_at_load(tmp_path):
    with pytest.raises(CLIError, match="token ids outside the vocabulary of 257 .largest 300."):
        load_corpus(write_nanogpt(tmp_path / "a", np.arange(301), np.arange(10)))
    with pytest.raises(CLIError, match="train.bin holds 500 tokens but meta.json records 1,000"):
        load_corpus(write_nanogpt(tmp_path / "b", np.arange(500) % 257, np.arange(10),
                                  train_tokens=1000))
    with pytest.raises(CLIError, match="meta.json records 'many'"):  # a hand-edited count
        load_corpus(write_nanogpt(tmp_path / "c", np.arange(500) % 257, np.arange(10),
                                  train_tokens="many"))
    prefix = write_megatron(str(tmp_path / "m"), documents(10))
    with open(prefix + ".json", "w") as f:
        json.dump({"format": "megatron", **FACTS, "vocab_size": 5}, f)
    with pytest.raises(CLIError, match="outside the vocabulary of 5"):
        load_corpus(prefix)


def test_load_megatron_every_way_of_naming_it(tmp_path):
    prefix = write_megatron(str(tmp_path / "m_text_document"), documents(100))
    # ... including the bare --output-prefix given to tokenizer.py (it writes PREFIX_text_document)
    for path in (prefix, prefix + ".bin", prefix + ".idx", str(tmp_path), str(tmp_path / "m")):
        corpus = load_corpus(path)
        assert isinstance(corpus.train, np.memmap) and corpus.meta["tokenizer"] == "byte"
        # Megatron's --split 969,30,1 over 100 documents: 97 train, 3 val, 0 test
        assert np.array_equal(corpus.train, np.concatenate(documents(97)))
        assert np.array_equal(corpus.val, np.concatenate(documents(100)[97:]))


@pytest.mark.parametrize("n_docs, split, train_docs, val_docs", [
    (1000, "969,30,1", 969, 30), (2, "969,30,1", 1, 1), (10, "969,30,1", 9, 1), (10, "80,20", 8, 2),
    (10, "8/1/1", 8, 1)])
def test_megatron_split_by_documents(tmp_path, n_docs, split, train_docs, val_docs):
    corpus = load_corpus(write_megatron(str(tmp_path / "m"), documents(n_docs)), split=split)
    assert np.array_equal(corpus.train, np.concatenate(documents(n_docs)[:train_docs]))
    assert np.array_equal(corpus.val,
                          np.concatenate(documents(n_docs)[train_docs: train_docs + val_docs]))


def test_megatron_without_sidecar_assumes_gpt2(tmp_path, capsys):
    corpus = load_corpus(write_megatron(str(tmp_path / "m"), documents(5), sidecar=False))
    assert corpus.meta["tokenizer"] == "gpt2" and corpus.meta["vocab_size"] == 50257
    assert "assuming the GPT-2 tokenizer" in capsys.readouterr().err


def test_window_offsets_are_deterministic_and_in_range():
    a = window_offsets(1000, 64, 5000, seed=1, step=7)
    assert a.dtype == np.int64 and a.shape == (5000,)
    # the last window fits exactly
    assert a.min() >= 0 and a.max() <= 1000 - 65 and a.max() == 1000 - 65
    assert np.array_equal(a, window_offsets(1000, 64, 5000, seed=1, step=7))
    assert not np.array_equal(a, window_offsets(1000, 64, 5000, seed=1, step=8))
    assert not np.array_equal(a, window_offsets(1000, 64, 5000, seed=1, step=7, stream=1))
    assert not np.array_equal(a, window_offsets(1000, 64, 5000, seed=2, step=7))
    assert window_offsets(65, 64, 3, seed=0, step=0).tolist() == [0, 0, 0]


def test_window_longer_than_data():
    with pytest.raises(CLIError, match=r"data has 64 tokens, shorter than one window of "
                                       r"block_size\+1 = 65 tokens"):
        window_offsets(64, 64, 1, seed=0, step=0)


def test_get_batch(tmp_path):
    corpus = load_corpus(write_nanogpt(tmp_path / "d", np.arange(1000) % 257, np.arange(100)))
    offsets = window_offsets(len(corpus.train), 16, 8, seed=0, step=0)
    x, y = get_batch(corpus.train, offsets, 16, "cpu")
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, o in enumerate(offsets):
        assert x[row].tolist() == corpus.train[o: o + 16].tolist()
        assert y[row].tolist() == corpus.train[o + 1: o + 17].tolist()


def corrupt(prefix: str, how: str) -> None:
    idx = bytearray(open(prefix + ".idx", "rb").read())
    if how == "magic":
        idx[:4] = b"XXXX"
    elif how == "version":
        idx[9:17] = struct.pack("<Q", 2)
    elif how == "truncated":
        idx = idx[:-8]
    elif how == "negative-size":  # the sizes' sum, and so the .bin's size, kept
        idx[34:42] = np.array([-1, 4], "<i4").tobytes()
    elif how == "pointer":  # the second document starts inside the first
        idx[34 + 10 * 4 + 8:34 + 10 * 4 + 16] = struct.pack("<q", 1)
    elif how == "bin-size":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\x00\x00")
    open(prefix + ".idx", "wb").write(bytes(idx))


@pytest.mark.parametrize("how, message", [
    ("magic", "bad magic"), ("version", "version 2"), ("truncated", "truncated"),
    ("bin-size", "describes"), ("negative-size", "corrupt sizes or pointers"),
    ("pointer", "corrupt sizes or pointers")])
def test_corrupt_megatron(tmp_path, how, message):
    prefix = write_megatron(str(tmp_path / "m"), documents(10))
    corrupt(prefix, how)
    with pytest.raises(CLIError, match=message):
        load_corpus(prefix)


def test_missing_empty_or_invalid_files(tmp_path):
    with pytest.raises(CLIError, match="not found"):
        load_corpus(str(tmp_path / "nothing"))
    with pytest.raises(CLIError, match="neither"):
        load_corpus(str(tmp_path))
    folder = write_nanogpt(tmp_path / "d", np.arange(100), np.arange(0))
    with pytest.raises(CLIError, match="val.bin is empty"):
        load_corpus(folder)
    write_nanogpt(folder, np.arange(100), np.arange(10))
    open(os.path.join(folder, "meta.json"), "w").write("{not json")
    with pytest.raises(CLIError, match="meta.json: invalid JSON"):
        load_corpus(folder)
    os.remove(os.path.join(folder, "meta.json"))
    with pytest.raises(CLIError, match="meta.json is missing"):
        load_corpus(folder)
    write_megatron(str(tmp_path / "one"), documents(1))
    with pytest.raises(CLIError, match="at least 2 documents"):
        load_corpus(str(tmp_path / "one"))


def test_corpus_from_tokenizer_script(tmp_path):
    """The real pipeline end to end: the default corpus loads and batches."""
    corpus = load_corpus(ensure_default_corpus(str(tmp_path / "pydoc_char")))
    x, y = get_batch(corpus.train, window_offsets(len(corpus.train), 32, 4, seed=0, step=0), 32,
                     "cpu")
    text = load_tokenizer(corpus.meta).decode(x[0].tolist())
    assert len(text) == 32 and int(x.max()) < corpus.meta["vocab_size"]
