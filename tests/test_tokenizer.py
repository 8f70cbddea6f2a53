"""tokenizer.py and the tokenizers: exact GPT-2 ids, the output formats (read back independently),
parallel determinism, bad input, failed writes."""
import bz2
import errno
import gzip
import json
import lzma
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tiktoken

import conftest
from toolkit import documents, gpt2_vocab, prepare, writers
from toolkit.cli import CLIError
from toolkit.data import load_corpus
from toolkit.documents import input_files
from toolkit.files import write_error
from toolkit.tokenizers import Tokenizer, load_tokenizer
from toolkit.writers import is_val_document

SCRIPT = str(conftest.ROOT / "tokenizer.py")
SAMPLE = "Hello world! The café's naïve 123 tokens\n\n\tdon't  break — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 <|endoftext|> ok"


@pytest.fixture(scope="module")
def r50k(gpt2_vocabulary) -> tiktoken.Encoding:
    """GPT-2 tests run, never skip: conftest installs the vocabulary when it is missing."""
    return tiktoken.get_encoding("r50k_base")


def run_script(*args: str, cwd: str | None = None,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`python tokenizer.py ARGS`, run in this process."""
    return conftest.run_main("tokenizer.py", *args, cwd=cwd, env=env)


def write_jsonl(path, texts: list[str], opener=open) -> str:
    with opener(path, "wt", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return str(path)


def read_megatron(prefix: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Independent reader of Megatron's MMapIndexedDataset, from the byte layout: (dtype code,
    documents' tokens)."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n, doc_count = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1 and len(idx) == 34 + n * 4 + n * 8 + doc_count * 8
    sizes = np.frombuffer(idx, "<i4", n, 34)
    pointers = np.frombuffer(idx, "<i8", n, 34 + 4 * n)
    doc_idx = np.frombuffer(idx, "<i8", doc_count, 34 + 12 * n)
    dtype = {8: np.uint16, 4: np.int32}[code]
    itemsize = np.dtype(dtype).itemsize
    assert list(doc_idx) == list(range(n + 1))  # one item per document
    assert list(pointers) == [int(sizes[:i].sum()) * itemsize for i in range(n)]
    tokens = np.fromfile(prefix + ".bin", dtype=dtype)
    assert len(tokens) == sizes.sum()
    return code, [tokens[p // itemsize: p // itemsize + s] for p, s in zip(pointers, sizes)]


def documents_text(n: int, seed: int = 0) -> list[str]:
    """n varied documents of prose from pydoc topics (some empty, which get dropped)."""
    from pydoc_data.topics import topics
    rng = np.random.default_rng(seed)
    keys = sorted(topics)
    docs = []
    for i in range(n):
        text = topics[keys[rng.integers(len(keys))]]
        start = int(rng.integers(len(text)))
        docs.append("" if i % 17 == 5 else text[start: start + int(rng.integers(1, 2000))])
    return docs


# ----------------------------------------------------------------------------- GPT-2 vocabulary


def test_gpt2_ids_exact(r50k):
    tok = Tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    # <|endoftext|> in text stays ordinary text
    assert tok.encode(SAMPLE) == r50k.encode_ordinary(SAMPLE)
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def data_gym_files(ranks: dict[bytes, int], folder) -> tuple[str, str]:
    """gpt2-vocab.json + gpt2-merges.txt (OpenAI's data_gym format) made from tiktoken ranks."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    byte_to_char = {b: chr(b) for b in printable}
    byte_to_char.update({b: chr(256 + n)
                         for n, b in enumerate(b for b in range(256) if b not in printable)})

    def to_str(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    # BPE with the merges ranked below this token
    def split_in_two(token: bytes, rank: int) -> list[bytes]:
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
            i = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            assert pair_ranks[i] < rank
            parts[i: i + 2] = [parts[i] + parts[i + 1]]
        return parts

    merges = [split_in_two(token, rank)
              for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]) if rank >= 256]
    vocab, merge_file = (os.path.join(folder, "gpt2-vocab.json"),
                         os.path.join(folder, "gpt2-merges.txt"))
    with open(vocab, "w") as f:
        json.dump({**{to_str(t): r for t, r in ranks.items()}, "<|endoftext|>": 50256}, f)
    with open(merge_file, "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{to_str(a)} {to_str(b)}\n" for a, b in merges))
    return vocab, merge_file


def test_vocab_and_merge_files_equal_r50k(r50k, tmp_path):
    vocab, merges = data_gym_files(r50k._mergeable_ranks, tmp_path)
    from_files = Tokenizer("gpt2", vocab_file=vocab, merge_file=merges)
    text = SAMPLE + " ".join(documents_text(20))
    assert from_files.encode(text) == r50k.encode_ordinary(text)
    assert (from_files.vocab_size, from_files.eot_id) == (50257, 50256)
    rebuilt = load_tokenizer(json.loads(json.dumps(from_files.facts())))
    assert rebuilt.encode(text) == r50k.encode_ordinary(text)


def test_tiktoken_vocab_file_equals_r50k(r50k, tmp_path):
    cached = os.path.join(gpt2_vocab.tiktoken_cache_dir(), gpt2_vocab.R50K_CACHE_NAME)
    path = tmp_path / "gpt2.tiktoken"
    path.write_bytes(open(cached, "rb").read())
    tok = Tokenizer("gpt2", vocab_file=str(path))
    assert tok.encode(SAMPLE) == r50k.encode_ordinary(SAMPLE)
    assert tok.facts()["vocab_file"] == str(path) and tok.facts()["encoding"] == "files"


def test_install_fills_an_empty_cache_from_the_package_registry(tmp_path):
    cache = tmp_path / "cache"
    result = run_script("--install-gpt2-vocab", env={"TIKTOKEN_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    installed = cache / gpt2_vocab.R50K_CACHE_NAME
    assert installed.read_bytes() == open(os.path.join(gpt2_vocab.tiktoken_cache_dir(),
                                                       gpt2_vocab.R50K_CACHE_NAME), "rb").read()
    assert [p.name for p in cache.iterdir()] == [installed.name]  # no temporary file left


def test_missing_gpt2_vocabulary_names_the_install_command(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    result = run_script("--input", src, "--output-dir", str(tmp_path / "out"),
                        env={"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache")})
    assert_one_error_line(result, "--install-gpt2-vocab")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- char and byte, facts


def test_char_round_trip_and_decode_never_fails():
    text = "héllo wörld\n\tend 𝔘"
    tok = Tokenizer("char", chars="".join(sorted(set(text))), char_eot=True)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.eot_id == len(set(text)) == tok.vocab_size - 1
    assert tok.decode(ids[:3] + [tok.eot_id] + ids[3:] + [999]) == text + "\ufffd"
    with pytest.raises(ValueError, match="not in the char vocabulary"):
        tok.encode("x")


def test_byte_round_trip_and_invalid_bytes():
    tok = Tokenizer("byte")
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert tok.decode([104, 0xC3, 256, 105]) == "h\ufffdi"  # a byte that starts no character
    # a character still being spelled is not shown yet
    assert tok.decode([104, 256, 105, 0xC3]) == "hi"


def test_facts_round_trip(r50k):
    tokenizers = (Tokenizer("gpt2"), Tokenizer("byte"), Tokenizer("char", chars="ab\n"),
                  Tokenizer("char", chars="xy", char_eot=True))
    for tok in tokenizers:
        facts = json.loads(json.dumps(tok.facts()))
        rebuilt = load_tokenizer(facts)
        assert rebuilt.facts() == facts
        assert ((rebuilt.vocab_size, rebuilt.eot_id, rebuilt.name) ==
                (tok.vocab_size, tok.eot_id, tok.name))


def test_special_tokens_count_in_the_vocabulary_and_decode_to_nothing(r50k):
    """Fine-tuning's start/delimiter/extract tokens: past the vocabulary (of the model, which may be
    the larger), rebuilt from the facts, skipped by decode, never produced by encode."""
    for tok, first in ((Tokenizer("char", chars="ab\n"), 3), (Tokenizer("gpt2"), 50304),
                       (Tokenizer("byte"), 257)):
        special = {"start": first, "delimiter": first + 1, "extract": first + 2}
        tok.add_special_tokens(special)
        facts = json.loads(json.dumps(tok.facts()))
        rebuilt = load_tokenizer(facts)
        assert (rebuilt.special_tokens == special and
                rebuilt.vocab_size == facts["vocab_size"] == first + 3)
        ids = rebuilt.encode("ab")
        assert max(ids) < first and rebuilt.decode([first, *ids, first + 1, first + 2]) == "ab"
    with pytest.raises(CLIError, match="special token ids"):
        load_tokenizer({"tokenizer": "char", "chars": "ab", "special_tokens": {"start": 1}})


# ----------------------------------------------------------------------------- outputs


def test_megatron_output_is_tiktoken_plus_eot_per_document(r50k, tmp_path, monkeypatch):
    """(The .idx written a block of 3 sizes at a time here: its pointers run on across blocks.)"""
    monkeypatch.setattr(writers, "INDEX_BLOCK", 3)
    docs = ["Hello world", "", "The second document.\nTwo lines.", "   ", "<|endoftext|> as text",
            "a sixth", "数据在平坦的内存中。"]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    result = run_script("--input", src, "--append-eod", "--format", "megatron",
                        "--output-prefix", str(tmp_path / "gpt"))
    assert result.returncode == 0, result.stderr
    code, read_back = read_megatron(str(tmp_path / "gpt_text_document"))
    # the empty document is dropped
    expected = [r50k.encode_ordinary(d) + [50256] for d in docs if d]
    assert code == 8 and [list(d) for d in read_back] == expected
    sidecar = json.load(open(tmp_path / "gpt_text_document.json"))
    assert sidecar["format"] == "megatron" and sidecar["documents"] == 6
    assert sorted(os.listdir(tmp_path)) == ["gpt_text_document.bin", "gpt_text_document.idx",
                                            "gpt_text_document.json", "in.jsonl"]
    assert load_tokenizer(sidecar).encode("Hello world") == [15496, 995]


@pytest.fixture(scope="module")
def big_input(tmp_path_factory) -> str:
    """A .jsonl.xz of ~300 KB, i.e. many chunks at --chunk-mb 0.01."""
    return write_jsonl(tmp_path_factory.mktemp("big") / "docs.jsonl.xz", documents_text(400),
                       opener=lzma.open)


@pytest.mark.parametrize("fmt", ["nanogpt", "megatron"])
def test_workers_give_identical_bytes(r50k, big_input, tmp_path, fmt):
    outputs = {}
    for workers in (1, 4):
        out = str(tmp_path / f"w{workers}")
        where = ["--output-dir", out] if fmt == "nanogpt" else ["--output-prefix", out + "/p"]
        result = run_script("--input", big_input, "--append-eod", "--format", fmt, *where,
                            "--workers", str(workers), "--chunk-mb", "0.01")
        assert result.returncode == 0, result.stderr
        outputs[workers] = {name: open(os.path.join(out, name), "rb").read()
                            for name in sorted(os.listdir(out))}
    assert outputs[1] == outputs[4]
    assert len(outputs[1]) == 3 and all(outputs[1].values())
    corpus = load_corpus(str(tmp_path / "w1"))  # data.py reads both formats back
    if fmt == "megatron":
        _, read_back = read_megatron(str(tmp_path / "w1/p_text_document"))
        expected = [r50k.encode_ordinary(d) + [50256] for d in documents_text(400) if d]
        assert [list(d) for d in read_back] == expected
        both = np.concatenate([corpus.train, corpus.val]).tolist()
        assert both == sum(expected, [])[:len(both)]
    else:
        meta = json.loads(outputs[1]["meta.json"])
        assert meta["documents"] == meta["train_documents"] + meta["val_documents"] == 376
        assert 0.05 < meta["val_documents"] / meta["documents"] < 0.15
        assert (len(corpus.train), len(corpus.val)) == (meta["train_tokens"], meta["val_tokens"])
        assert len(outputs[1]["train.bin"]) == 2 * meta["train_tokens"]


def test_gz_text_folder_char_level(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    with gzip.open(folder / "a.txt.gz", "wt") as f:
        f.write("first document\n")
    with bz2.open(folder / "sub" / "b.txt.bz2", "wt") as f:
        f.write("second document, ünïcode\n")
    (folder / "ignored.md").write_text("not matched by --glob *.txt")
    out = tmp_path / "out"
    result = run_script("--input", str(folder), "--tokenizer", "char", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    meta = json.load(open(out / "meta.json"))
    tok = load_tokenizer(meta)
    assert meta["chars"] == "".join(sorted(set("first document\nsecond document, ünïcode\n")))
    # both documents drawn for train (a document counts where it starts)
    assert ((meta["eot_id"], meta["documents"], meta["train_documents"], meta["val_documents"]) ==
            (17, 2, 2, 0))
    # the end-of-text id, past the characters (unused here)
    assert meta["vocab_size"] == len(meta["chars"]) + 1
    train, val = [tok.decode(np.fromfile(out / name, np.uint16).tolist())
                  for name in ("train.bin", "val.bin")]
    # a val of no document, or of one of the two (37% or 62% of the tokens), would be far from
    # --val-fraction: the split is by tokens then, val the last 10% of them
    assert (meta["train_tokens"], meta["val_tokens"]) == (36, 4)
    assert train + val == "first document\nsecond document, ünïcode\n" and len(val) == 4


def test_few_documents_of_uneven_sizes_keep_the_val_fraction(tmp_path):
    """Three novels, one drawn for val, would make val a third of the data; the split moves to
    tokens, --val-fraction of them, and many documents keep the per-document split."""
    folder = tmp_path / "novels"
    folder.mkdir()
    novels = {"a": "短文，一篇。" * 20, "b": "你好，世界。" * 2000, "c": "长篇。" * 500}
    for name, text in novels.items():
        (folder / f"{name}.txt").write_text(text)
    for val_fraction in ("0.1", "0.3"):
        out = tmp_path / f"out{val_fraction}"
        assert run_script("--input", folder, "--tokenizer", "char", "--output-dir", out,
                          "--val-fraction", val_fraction).returncode == 0
        meta = json.load(open(out / "meta.json"))
        total = meta["train_tokens"] + meta["val_tokens"]
        assert total == 120 + 12000 + 1500
        assert meta["val_tokens"] == int(total * float(val_fraction))
        assert os.path.getsize(out / "val.bin") == 2 * meta["val_tokens"]


def test_a_folder_of_other_files_names_the_glob_that_takes_them(tmp_path):
    for name in ("shard_0.parquet", "shard_1.parquet", "notes.jsonl.zst", "README"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(CLIError) as error:
        input_files([str(tmp_path)], "*.txt")
    assert str(error.value) == (f"no files matching --glob '*.txt' under {tmp_path} "
                                "(it holds 2 .parquet files: --glob '*.parquet')")
    assert input_files([str(tmp_path)], "*.parquet")[-1].endswith("shard_1.parquet")
    (tmp_path / "README").rename(tmp_path / "README.md")
    for name in ("shard_0.parquet", "shard_1.parquet", "notes.jsonl.zst"):
        (tmp_path / name).unlink()
    with pytest.raises(CLIError, match=r"under \S+$"):  # nothing it could read: no advice
        input_files([str(tmp_path)], "*.txt")


def test_large_vocabulary_needs_32_bits(tmp_path):
    text = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 70_000) if not 0xD800 <= c < 0xE000)
    src = write_jsonl(tmp_path / "wide.jsonl", [text[:35_000], text[35_000:]])
    refused = run_script("--input", src, "--tokenizer", "char", "--token-dtype", "uint16",
                         "--output-dir", str(tmp_path / "a"))
    assert_one_error_line(refused, "does not fit --token-dtype uint16")
    result = run_script("--input", src, "--tokenizer", "char", "--format", "megatron",
                        "--output-prefix", str(tmp_path / "w"))
    assert result.returncode == 0, result.stderr
    code, read_back = read_megatron(str(tmp_path / "w_text_document"))
    assert code == 4 and len(read_back) == 2 and read_back[1].max() == len(text) - 1


def test_default_corpus(tmp_path):
    result = run_script(cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "data" / "pydoc_char"
    meta = json.load(open(folder / "meta.json"))
    train, val = (np.fromfile(folder / "train.bin", np.uint16),
                  np.fromfile(folder / "val.bin", np.uint16))
    documents = len(prepare.default_corpus_documents())
    assert (meta["format"], meta["tokenizer"], meta["documents"]) == ("nanogpt", "char", documents)
    assert (80 <= meta["vocab_size"] <= 130 and
            meta["vocab_size"] == len(meta["chars"]) + 1 == meta["eot_id"] + 1)
    # an id of its own, not in the text
    assert meta["eot_id"] not in train and meta["eot_id"] not in val
    assert 0.09 < len(val) / (len(train) + len(val)) < 0.11
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert (load_tokenizer(meta).decode(train[:200].tolist()) ==
            "\n\n".join(prepare.default_corpus_documents())[:200])
    before = os.path.getmtime(folder / "train.bin")
    assert prepare.ensure_default_corpus(str(folder)) == str(folder)
    assert os.path.getmtime(folder / "train.bin") == before
    # it is always prepared one way: the flags of tokenizing an input are refused, not ignored
    for flags in (["--val-fraction", "0.5"], ["--token-dtype", "uint32"], ["--tokenizer", "gpt2"],
                  ["--tokenizer-file", "x.json"], ["--seed", "1"], ["--format", "llmc"]):
        assert_one_error_line(run_script(*flags, "--output-dir", str(tmp_path / "other")),
                              f"{flags[0]} needs --input")
    assert not (tmp_path / "other").exists()


# ----------------------------------------------------------------------------- bad input


def assert_one_error_line(result: subprocess.CompletedProcess, *phrases: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert (result.returncode != 0 and len(lines) == 1 and
            lines[0].startswith("error: ")), result.stderr
    assert "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def bad_inputs(tmp_path) -> dict:
    """name -> (extra args, phrases the error line must hold); inputs are written here."""
    many = [json.dumps({"text": f"document {i}"}) for i in range(3000)]
    # a raw tab inside a string: JSON's "Invalid control character at", said once
    (tmp_path / "bad.jsonl").write_text("\n".join(many + ['{"text": "a\tb"}'] + many) + "\n")
    (tmp_path / "nokey.jsonl").write_text('{"text": "fine"}\n{"content": "no text key"}\n')
    (tmp_path / "latin1.txt").write_bytes("ok text, then caf\xe9".encode("latin-1"))
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n\n')
    (tmp_path / "one.txt").write_text("a second document")
    # JSON may escape half of a UTF-16 pair alone: a cut emoji
    (tmp_path / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "cut \\ud83d here"}\n')
    (tmp_path / "bigint.jsonl").write_text('{"text": "fine"}\n{"text": "a", "n": ' + "9" * 5000 +
                                           "}\n")
    (tmp_path / "tiny.txt").write_text("a")
    os.mkfifo(tmp_path / "pipe")
    return {
        "missing": (["--input", str(tmp_path / "nope.txt")], ["nope.txt", "not found"]),
        "empty": (["--input", str(tmp_path / "empty.jsonl")], ["no non-empty documents"]),
        "non-utf8": (["--input", str(tmp_path / "latin1.txt")],
                     ["latin1.txt", "byte offset 17", "--errors replace"]),
        "bad-json": (["--input", str(tmp_path / "bad.jsonl")],
                     ["bad.jsonl line 3001", "(Invalid control character at line 1 column 12)",
                      "--skip-bad-lines"]),
        "no-key": (["--input", str(tmp_path / "nokey.jsonl")],
                   ["nokey.jsonl line 2", "no string 'text' key (its string keys: content)"]),
        "surrogate": (["--input", str(tmp_path / "surrogate.jsonl")],
                      ["surrogate.jsonl line 2", "lone surrogate (U+D83D", "--errors replace"]),
        "huge-number": (["--input", str(tmp_path / "bigint.jsonl")],
                        ["bigint.jsonl line 2", "invalid JSON (Exceeds the limit (4300 digits)",
                         "--skip-bad-lines"]),
        "one-token": (["--input", str(tmp_path / "tiny.txt")], ["1 tokens: too few"]),
        "pipe": (["--input", str(tmp_path / "pipe")], ["neither a file nor a folder"]),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "non-utf8", "bad-json", "no-key",
                                  "surrogate", "huge-number", "one-token", "pipe"])
def test_bad_input_is_one_error_line_and_leaves_nothing(tmp_path, case):
    args, phrases = bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    result = run_script(*args, "--tokenizer", "byte", "--output-dir", str(out),
                        "--chunk-mb", "0.001")
    assert_one_error_line(result, *phrases)
    assert not out.exists() or os.listdir(out) == []  # no final names, no temporary files either


def test_a_flag_that_would_do_nothing_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["some text"] * 20)
    for flags, says in [(["--tokenizer", "char", "--vocab-size", "500"],
                         "--vocab-size is the size of the BPE that --tokenizer bpe trains"),
                        (["--tokenizer", "char", "--shard-tokens", "1000"],
                         "--shard-tokens sizes llm.c's shards (--format llmc); --format nanogpt")]:
        result = run_script("--input", src, *flags, "--output-dir", str(tmp_path / "o"))
        assert_one_error_line(result, says)
        assert not (tmp_path / "o").exists()


def test_vocabulary_files_that_are_none_are_one_short_line(tmp_path):
    text = tmp_path / "zh.txt"
    text.write_text("常见的问题" * 400 + "\n第二行\n")  # a long first line: not quoted whole
    (tmp_path / "vocab.json").write_text('{"a": 1}')
    (tmp_path / "merges.txt").write_text("#version\na b\n")
    for files, says in [([text], "ValueError: Error parsing line"),
                        ([tmp_path / "vocab.json", tmp_path / "merges.txt"], ": AssertionError;"),
                        ([tmp_path], "is a folder, not a vocabulary file")]:
        flags = ["--vocab-file", files[0]] + (["--merge-file", files[1]] if len(files) > 1 else [])
        result = run_script("--input", str(text), *map(str, flags), "--output-dir",
                            str(tmp_path / "o"))
        assert_one_error_line(result, says)
        assert len(result.stderr) < 400, result.stderr


def test_bad_input_escape_hatches(tmp_path):
    bad_inputs(tmp_path)
    replaced = run_script("--input", str(tmp_path / "latin1.txt"), str(tmp_path / "one.txt"),
                          "--tokenizer", "byte", "--errors", "replace",
                          "--output-dir", str(tmp_path / "r"))
    assert replaced.returncode == 0, replaced.stderr
    skipped = run_script("--input", str(tmp_path / "bad.jsonl"), "--tokenizer", "byte",
                         "--skip-bad-lines", "--format", "megatron",
                         "--output-prefix", str(tmp_path / "s"))
    assert skipped.returncode == 0, skipped.stderr
    assert "1 bad lines skipped" in skipped.stdout and "6,000 documents" in skipped.stdout
    skipped = run_script("--input", str(tmp_path / "bigint.jsonl"), "--tokenizer", "byte",
                         "--skip-bad-lines", "--output-dir", str(tmp_path / "b"))
    assert "1 bad lines skipped" in skipped.stdout, skipped.stderr
    # the half pair is U+FFFD, as invalid UTF-8 is
    replaced = run_script("--input", str(tmp_path / "surrogate.jsonl"), "--tokenizer", "char",
                          "--errors", "replace", "--output-dir", str(tmp_path / "c"))
    assert replaced.returncode == 0, replaced.stderr
    assert "\ufffd" in json.loads((tmp_path / "c" / "meta.json").read_text())["chars"]


def test_a_failing_rerun_keeps_the_dataset_it_would_replace(tmp_path):
    """--overwrite replaces an earlier dataset only with a complete new one."""
    src = write_jsonl(tmp_path / "a.jsonl", ["one", "two", "three"] * 20)
    out = tmp_path / "out"
    assert run_script("--input", src, "--tokenizer", "char", "--output-dir",
                      str(out)).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad_inputs(tmp_path)
    assert_one_error_line(run_script("--input", str(tmp_path / "surrogate.jsonl"), "--tokenizer",
                                     "char", "--output-dir", str(out), "--overwrite"),
                          "lone surrogate")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_dataset_replaced_by_one_of_another_tokenizer_keeps_no_tokenizer_json(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["one two", "three 四五"] * 30)
    out = tmp_path / "out"
    assert run_script("--input", src, "--tokenizer", "bpe", "--vocab-size", "300", "--output-dir",
                      str(out)).returncode == 0
    assert (out / "tokenizer.json").is_file()
    assert run_script("--input", src, "--tokenizer", "char", "--output-dir", str(out),
                      "--overwrite").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    # a folder that held no dataset keeps what it holds
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "tokenizer.json").write_text("{}")
    assert run_script("--input", src, "--tokenizer", "char", "--output-dir",
                      str(tmp_path / "own")).returncode == 0
    assert (tmp_path / "own" / "tokenizer.json").read_text() == "{}"


def test_a_dataset_replaced_in_another_format_leaves_nothing_of_the_old_one(tmp_path):
    """llm.c shards replaced by a nanoGPT dataset (and back): readers would take the old shards
    first, so they go; a corpus read back is the new one."""
    src = write_jsonl(tmp_path / "a.jsonl", ["一二三四五六七八九十" * 20] * 40)
    out = tmp_path / "out"
    assert run_script("--input", src, "--tokenizer", "gpt2", "--format", "llmc",
                      "--output-dir", out).returncode == 0
    assert run_script("--input", src, "--tokenizer", "char", "--output-dir", out,
                      "--overwrite").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert load_corpus(str(out)).meta["tokenizer"] == "char"
    assert run_script("--input", src, "--tokenizer", "gpt2", "--format", "llmc",
                      "--output-dir", out, "--overwrite").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "out_train_000001.bin",
                                                     "out_val_000000.bin"]
    # shards its meta.json does not list (an older tool's) are refused, not read as this data
    shutil.copy(out / "out_train_000001.bin", out / "out_train_000002.bin")
    with pytest.raises(CLIError, match="other than those its meta.json lists"):
        load_corpus(str(out))


def test_a_failed_replacement_keeps_the_old_dataset_and_its_tokenizer_json(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["one two", "three 四五"] * 30)
    out = tmp_path / "out"
    assert run_script("--input", src, "--tokenizer", "bpe", "--vocab-size", "300",
                      "--output-dir", out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "one.txt").write_text("a")  # too short for two splits: fails at the end
    failed = run_script("--input", tmp_path / "one.txt", "--tokenizer", "bpe", "--vocab-size",
                        "260", "--output-dir", out, "--overwrite")
    assert failed.returncode == 1 and "too few for a train and a val split" in failed.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_output_named_like_an_input_is_refused_even_with_overwrite(tmp_path):
    """Megatron's PREFIX.json metadata where the input JSON is: the input stays."""
    src = write_jsonl(tmp_path / "c_text_document.json", ["one", "two", "three"])
    before = open(src).read()
    for overwrite in ([], ["--overwrite"]):  # said as such, not as a file --overwrite replaces
        assert_one_error_line(run_script("--input", src, "--tokenizer", "byte", "--format",
                                         "megatron", "--output-prefix", str(tmp_path / "c"),
                                         *overwrite),
                              f"--output-prefix's file {src} would overwrite the input")
    assert open(src).read() == before


def test_pipes_and_broken_links_in_an_input_folder_are_no_documents(tmp_path):
    """A pipe would block the reading forever, a broken link has nothing to read."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("the only document")
    os.mkfifo(tmp_path / "in" / "pipe.txt")
    (tmp_path / "in" / ".#a.txt").symlink_to("user@host.1234")  # as Emacs locks a file
    result = conftest.run_script("tokenizer.py", "--input", tmp_path / "in", "--tokenizer", "byte",
                                 "--output-dir", tmp_path / "out", timeout=60)
    assert result.returncode == 0 and "1 documents" in result.stdout, result.stderr


def test_existing_output_and_missing_output_dir(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["one", "two", "three"])
    assert_one_error_line(run_script("--input", src, "--tokenizer", "byte"), "--output-dir")
    assert_one_error_line(run_script("--input", src, "--format", "megatron"), "--output-prefix")
    out = str(tmp_path / "out")
    assert run_script("--input", src, "--tokenizer", "byte", "--output-dir", out).returncode == 0
    before = open(os.path.join(out, "meta.json")).read()
    assert_one_error_line(run_script("--input", src, "--tokenizer", "char", "--output-dir", out),
                          "already exists", "--overwrite")
    assert open(os.path.join(out, "meta.json")).read() == before
    assert run_script("--input", src, "--tokenizer", "char", "--output-dir", out,
                      "--overwrite").returncode == 0
    assert json.load(open(os.path.join(out, "meta.json")))["tokenizer"] == "char"


# seed 0 draws the one document for train, seed 7 for val
@pytest.mark.parametrize("seed", ["0", "7"])
def test_one_text_file_is_split_by_tokens(tmp_path, seed):
    text = "".join(f"line {i} of the only document\n" for i in range(100))
    (tmp_path / "input.txt").write_text(text)
    out = tmp_path / "out"
    result = run_script("--input", str(tmp_path / "input.txt"), "--tokenizer", "byte",
                        "--output-dir", str(out), "--seed", seed)
    assert result.returncode == 0, result.stderr
    assert is_val_document(int(seed), 0, 0.1) == (seed == "7")
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert len(val) == int(len(text) * 0.1)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == text.encode()  # val is the tail


@pytest.mark.parametrize("fmt", ["nanogpt", "megatron", "llmc"])
def test_a_text_file_streams_in_pieces_with_the_ids_of_the_whole(r50k, tmp_path, monkeypatch,
                                                                  fmt):
    """A text file of any size is one document read a block at a time and tokenized a chunk at a
    time (both small here, two workers for Megatron's): GPT-2's ids of the whole text, one
    end-of-text, one document, as when it was held whole."""
    monkeypatch.setattr(documents, "BLOCK", 4096)
    big = "\n".join(documents_text(80, seed=3)) + "\n数据在平坦的内存中。\n" * 50
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(big)
    (tmp_path / "in" / "b.txt").write_text("a second, small document")
    source = tmp_path / "in" / ("a.txt" if fmt == "nanogpt" else "")
    where = ["--output-prefix", str(tmp_path / "out" / "p")] if fmt == "megatron" else \
        ["--output-dir", str(tmp_path / "out")]
    result = run_script("--input", str(source), "--format", fmt, *where, "--chunk-mb", "0.001",
                        *["--append-eod"] * (fmt != "llmc"),
                        *["--workers", "2"] * (fmt == "megatron"))
    assert result.returncode == 0, result.stderr
    ids = [r50k.encode_ordinary(text) for text in (big, "a second, small document")]
    assert len(big.encode()) > 10 * 4096
    if fmt == "nanogpt":
        train, val = (np.fromfile(tmp_path / "out" / name, np.uint16).tolist()
                      for name in ("train.bin", "val.bin"))
        meta = json.load(open(tmp_path / "out" / "meta.json"))
        assert train + val == ids[0] + [50256] and meta["documents"] == 1
        assert len(val) == int(len(train + val) * 0.1)
    elif fmt == "megatron":
        _, read_back = read_megatron(str(tmp_path / "out" / "p_text_document"))
        assert [list(d) for d in read_back] == [ids[0] + [50256], ids[1] + [50256]]
    else:
        meta = json.load(open(tmp_path / "out" / "meta.json"))
        tokens = [np.fromfile(tmp_path / "out" / name, np.uint16, offset=1024).tolist()
                  for name in meta["shards"]]  # (the val shard first, the start of the text)
        assert sum(tokens, []) == [50256] + ids[0] + [50256] + ids[1] and meta["documents"] == 2


def test_an_output_folder_in_the_way_of_a_file_is_one_line(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    (tmp_path / "taken").write_text("a file")
    result = run_script("--input", src, "--tokenizer", "byte", "--output-dir",
                        str(tmp_path / "taken"))
    assert_one_error_line(result, f"{tmp_path / 'taken'} is a file, not a folder")
    assert "Errno" not in result.stderr


def limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))


@pytest.mark.parametrize("filesystem", ["tmp", "tmpfs"])
def test_a_write_that_fails_names_the_output_and_leaves_nothing(tmp_path, filesystem):
    """The file size limit stands in for a full disk (the limit of a process: a process of its own);
    on tmpfs too, whose folders' sizes are no block."""
    if filesystem == "tmpfs" and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    src = write_jsonl(tmp_path / "a.jsonl", [f"document {i} " * 20 for i in range(200)])
    out = (tmp_path / "out" if filesystem == "tmp" else
           Path(tempfile.mkdtemp(dir="/dev/shm")) / "out")
    try:
        result = subprocess.run([sys.executable, SCRIPT, "--input", src, "--tokenizer", "byte",
                                 "--output-dir", str(out)], capture_output=True, text=True,
                                timeout=120, preexec_fn=limit_file_size)
        assert_one_error_line(result, f"cannot write {out}", "file size limit",
                              "nothing was replaced")
        assert os.listdir(out) == []
    finally:
        if filesystem == "tmpfs":
            shutil.rmtree(out.parent)


def test_a_full_disk_is_said_in_words():
    error = write_error("data/x/train.bin", OSError(errno.ENOSPC, "No space left on device"))
    assert str(error).startswith("cannot write data/x/train.bin: no space left on device (")
    assert "bytes free); nothing was replaced" in str(error) and "Errno" not in str(error)
