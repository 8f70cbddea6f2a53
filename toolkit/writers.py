"""Writing the token formats that toolkit/data.py reads (tokenizer.py and the default corpus call
these): a nanoGPT folder (train.bin, val.bin, meta.json) with a per-document train/val split,
Megatron-LM's PREFIX.bin/.idx with this toolkit's PREFIX.json of tokenizer facts, and llm.c's
shards. Every file is written under a temporary name (of this process: toolkit/prepare.py removes
them when a run fails) and renamed only when complete; the metadata file comes last, so its
presence means the data is whole."""
import hashlib
import os
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from toolkit.cli import CLIError
from toolkit.data import (LLMC_HEADER_INTS, LLMC_MAGIC, LLMC_SHARD, MEGATRON_DTYPES,
                          MEGATRON_EXTENSIONS, MEGATRON_HEADER, MEGATRON_MAGIC, NANOGPT_FILES)
from toolkit.files import atomic_write, make_folder, temporary_name, write_json

INDEX_BLOCK = 1 << 20  # Megatron's .idx is written a million documents at a time


def commit(moves: dict[str, str], meta_path: str, meta: dict, stale: list[str] = ()) -> None:
    """The finished files (temporary path -> final path) put in place, then their metadata, whose
    presence means complete: an earlier run's metadata goes before its files are replaced, and its
    files this run does not replace (stale) go with it."""
    if os.path.exists(meta_path):
        os.remove(meta_path)
    for path in stale:
        if os.path.isfile(path):
            os.remove(path)
    for tmp, final in moves.items():
        os.replace(tmp, final)
    write_json(meta_path, meta)


def refuse_empty_split(tokens: dict[str, int]) -> None:
    if not all(tokens.values()):
        raise CLIError(f"the input holds {sum(tokens.values()):,} tokens: too few for a train and "
                       "a val split; give more text")


def write_nanogpt(folder: str, train: np.ndarray, val: np.ndarray, meta: dict) -> dict:
    """A nanoGPT folder from two token arrays (already split); returns the meta.json written."""
    make_folder(folder)
    meta = {"format": "nanogpt", **meta, "dtype": train.dtype.name, "train_tokens": len(train),
            "val_tokens": len(val)}
    for name, ids in (("train.bin", train), ("val.bin", val)):
        atomic_write(os.path.join(folder, name), ids.tofile)
    write_json(os.path.join(folder, "meta.json"), meta)  # last: its presence means complete
    return meta


def output_dtype(vocab_size: int, requested: str, fmt: str) -> np.dtype:
    """uint16 when every id fits, else uint32, or int32 for Megatron, which has no uint32 code."""
    wide = "int32" if fmt == "megatron" else "uint32"
    name = requested if requested != "auto" else ("uint16" if vocab_size <= 2**16 else wide)
    if name not in ("uint16", wide):
        raise CLIError(f"--token-dtype {name} is not available for --format {fmt} (use uint16 or "
                       f"{wide})")
    if vocab_size - 1 > np.iinfo(name).max:
        raise CLIError(f"vocabulary of {vocab_size} ids does not fit --token-dtype {name}; use "
                       f"--token-dtype {wide} or auto")
    return np.dtype(name)


def is_val_document(seed: int, index: int, val_fraction: float) -> bool:
    """Deterministic per (seed, document index), so the split streams, independent of --workers."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


class NanoGPTWriter:
    """train.bin / val.bin (raw token ids) and meta.json in one folder; documents are split by
    is_val_document."""

    def __init__(self, out_dir: str, dtype: np.dtype, val_fraction: float, seed: int):
        make_folder(out_dir, "--output-dir")
        self.final = {name: os.path.join(out_dir, name) for name in NANOGPT_FILES}
        self.tmp = {name: temporary_name(self.final[name]) for name in ("train.bin", "val.bin")}
        self.files = {split: open(self.tmp[f"{split}.bin"], "wb+") for split in ("train", "val")}
        self.dtype, self.val_fraction, self.seed = dtype, val_fraction, seed
        self.documents = {"train": 0, "val": 0}
        self.tokens = {"train": 0, "val": 0}
        self.last_is_val = False  # the split of the last document, which the next may go on

    def add(self, arrays: list[np.ndarray], lengths: np.ndarray, starts: np.ndarray) -> None:
        """The parts of documents in arrays (their tokens back to back), each of lengths tokens;
        one that does not start its document (starts) goes on the last one, in its split."""
        first = self.documents["train"] + self.documents["val"]
        is_val = np.zeros(len(lengths), bool)
        for i, index in enumerate(np.flatnonzero(starts)):
            is_val[index] = is_val_document(self.seed, first + i, self.val_fraction)
        if len(starts) and not starts[0]:
            is_val[0] = self.last_is_val
        for split, mine in (("train", ~is_val), ("val", is_val)):
            if not mine.any():
                continue
            # a chunk all of one split (as a huge document is): written as it is, no copy
            if mine.all():
                for tokens in arrays:
                    self.files[split].write(tokens)
            else:
                self.files[split].write(np.concatenate(arrays)[np.repeat(mine, lengths)])
            self.documents[split] += int((mine & starts).sum())
            self.tokens[split] += int(lengths[mine].sum())
        if len(is_val):
            self.last_is_val = bool(is_val[-1])

    def move_tail(self, source: str, target: str, n: int) -> None:
        """Move the last n tokens from one split's file to the other's (a document's counted where
        it starts)."""
        f = self.files[source]
        start = f.seek(-n * self.dtype.itemsize, os.SEEK_END)
        while piece := f.read(2**26):  # in pieces: the tail may be most of a large corpus
            self.files[target].write(piece)
        f.seek(start)
        f.truncate()
        self.tokens[source] -= n
        self.tokens[target] += n

    def finish(self, meta: dict, extra: dict[str, str], stale: list[str]) -> dict:
        """Split, then commit the files with extra ones (temporary -> final: a tokenizer.json),
        removing stale ones and an earlier run's llm.c shards (which readers would take first)."""
        total = self.documents["train"] + self.documents["val"]
        # one text file (e.g. shakespeare's input.txt): its last val_fraction becomes val
        if total == 1:
            if self.documents["val"]:  # it was drawn for val: swap the files so it is train's
                for d in (self.files, self.documents, self.tokens):
                    d["train"], d["val"] = d["val"], d["train"]
                self.tmp["train.bin"], self.tmp["val.bin"] = \
                    self.tmp["val.bin"], self.tmp["train.bin"]
            self.move_tail("train", "val", max(1, int(self.tokens["train"] * self.val_fraction)))
        else:
            # few documents of uneven sizes can give val far more or less than its share (one
            # novel of three): then the split is by tokens, the tail of the larger side cut off
            share = max(1, int((self.tokens["train"] + self.tokens["val"]) * self.val_fraction))
            if self.tokens["val"] > 2 * share:
                self.move_tail("val", "train", self.tokens["val"] - share)
            elif self.tokens["val"] < share / 2:
                self.move_tail("train", "val", share - self.tokens["val"])
        meta = {"format": "nanogpt", **meta, "dtype": self.dtype.name, "documents": total,
                "train_documents": self.documents["train"], "val_documents": self.documents["val"],
                "train_tokens": self.tokens["train"], "val_tokens": self.tokens["val"],
                "val_fraction": self.val_fraction, "seed": self.seed}
        refuse_empty_split(self.tokens)
        for f in self.files.values():
            f.close()
        folder = os.path.dirname(self.final["meta.json"])
        commit({**{self.tmp[name]: self.final[name] for name in ("train.bin", "val.bin")}, **extra},
               self.final["meta.json"], meta,
               [*stale, *(os.path.join(folder, name) for name in llmc_shards(folder))])
        return meta


def write_megatron_index(path: str, dtype: np.dtype, sizes: BinaryIO, count: int) -> None:
    """MMapIndexedDataset .idx: header, sizes, byte pointers, doc_idx (one item per document), from
    count sizes (int32) in the file sizes, INDEX_BLOCK of them at a time."""
    code = next(c for c, t in MEGATRON_DTYPES.items() if np.dtype(t) == dtype)
    with open(path, "wb") as f:
        f.write(MEGATRON_HEADER.pack(MEGATRON_MAGIC, 1, code, count, count + 1))
        for block in blocks_of(sizes):
            f.write(block.astype("<i4").tobytes())
        start = 0  # the byte where the next document begins
        for block in blocks_of(sizes):
            ends = start + np.cumsum(block.astype("<i8") * dtype.itemsize)
            f.write(np.concatenate([[start], ends[:-1]]).astype("<i8").tobytes())
            start = int(ends[-1])
        for first in range(0, count + 1, INDEX_BLOCK):
            f.write(np.arange(first, min(first + INDEX_BLOCK, count + 1), dtype="<i8").tobytes())


def blocks_of(sizes: BinaryIO) -> Iterator[np.ndarray]:
    """The int32 sizes in a file, INDEX_BLOCK at a time, from its start."""
    sizes.seek(0)
    while block := sizes.read(4 * INDEX_BLOCK):
        yield np.frombuffer(block, np.int32)


class MegatronWriter:
    """{prefix}.bin (token ids), .idx (Megatron MMapIndexedDataset) and .json (tokenizer facts). The
    documents' sizes go to a temporary file as they come (the .idx needs them all before the
    pointers), so memory does not grow with their number."""

    def __init__(self, prefix: str, dtype: np.dtype):
        if os.path.dirname(prefix):
            make_folder(os.path.dirname(prefix), "--output-prefix")
        self.final = {ext: prefix + ext for ext in MEGATRON_EXTENSIONS}
        self.tmp = {ext: temporary_name(prefix + ext) for ext in (".bin", ".idx", ".sizes")}
        self.file, self.sizes = open(self.tmp[".bin"], "wb"), open(self.tmp[".sizes"], "wb+")
        self.dtype = dtype
        self.last = None  # the size of the last document, which the next part may continue
        self.documents = self.tokens = 0

    def add(self, arrays: list[np.ndarray], lengths: np.ndarray, starts: np.ndarray) -> None:
        """The parts of documents in arrays (their tokens back to back), each of lengths tokens;
        one that does not start its document (starts) goes on the last one."""
        for tokens in arrays:
            self.file.write(tokens)
        self.tokens += int(lengths.sum())
        if len(starts) and not starts[0]:
            self.last += int(lengths[0])
            lengths = lengths[1:]
        if len(lengths):  # the last document is whole once another starts
            done = [self.last] * (self.last is not None) + lengths[:-1].tolist()
            self.sizes.write(np.array(done, np.int32).tobytes())
            self.last, self.documents = int(lengths[-1]), self.documents + len(lengths)
        if self.last is not None and self.last > np.iinfo(np.int32).max:
            raise CLIError("a document of over 2**31 tokens: Megatron's .idx holds a document's "
                           "size as int32; use --format nanogpt")

    def finish(self, meta: dict, extra: dict[str, str], stale: list[str]) -> dict:
        if self.last is not None:
            self.sizes.write(np.array([self.last], np.int32).tobytes())
        self.file.close()
        meta = {"format": "megatron", **meta, "dtype": self.dtype.name,
                "documents": self.documents, "tokens": self.tokens}
        write_megatron_index(self.tmp[".idx"], self.dtype, self.sizes, self.documents)
        self.sizes.close()
        os.remove(self.tmp[".sizes"])
        commit({**{self.tmp[ext]: self.final[ext] for ext in (".bin", ".idx")}, **extra},
               self.final[".json"], meta, stale)
        return meta


def llmc_shards(folder: str) -> list[str]:
    """The names of the llm.c shards in a folder (none when it does not exist)."""
    return (sorted(n for n in os.listdir(folder) if LLMC_SHARD.fullmatch(n))
            if os.path.isdir(folder) else [])


class LlmcWriter:
    """llm.c's shards in a folder, as its dev/data/fineweb.py writes them: NAME_val_000000.bin, then
    NAME_train_000001.bin, ... (NAME: the folder's name), each a header of 256 int32 (magic
    20240520, version 1, token count) and then uint16 ids; shard_tokens tokens a shard, a document
    running on into the next. The first shard is validation; when the input does not fill more than
    it, its last (1 - val_fraction) become the one training shard. meta.json describes them."""

    def __init__(self, folder: str, shard_tokens: int, val_fraction: float):
        self.dtype = np.dtype(np.uint16)
        make_folder(folder, "--output-dir")
        self.folder, self.shard_tokens, self.val_fraction = folder, shard_tokens, val_fraction
        self.name = os.path.basename(os.path.abspath(folder))
        self.written: list[tuple[str, int]] = []  # (temporary path, tokens) of each closed shard
        self.file, self.filled, self.documents = None, 0, 0

    def shard_path(self, index: int) -> str:
        return os.path.join(self.folder,
                            f"{self.name}_{'val' if index == 0 else 'train'}_{index:06d}.bin")

    def add(self, arrays: list[np.ndarray], lengths: np.ndarray, starts: np.ndarray) -> None:
        """The parts of documents in arrays (their tokens back to back, each document starting with
        end-of-text), each of lengths tokens, starts telling which start a document."""
        self.documents += int(starts.sum())
        for tokens in arrays:
            while len(tokens):
                if self.file is None:
                    self.file = open(temporary_name(self.shard_path(len(self.written))), "wb+")
                    # the count is known at the end
                    self.file.write(np.zeros(LLMC_HEADER_INTS, np.int32))
                part, tokens = (tokens[:self.shard_tokens - self.filled],
                                tokens[self.shard_tokens - self.filled:])
                self.file.write(np.asarray(part, np.uint16))
                self.filled += len(part)
                if self.filled == self.shard_tokens:
                    self.close_shard()

    def close_shard(self) -> None:
        header = np.zeros(LLMC_HEADER_INTS, np.int32)
        header[:3] = LLMC_MAGIC, 1, self.filled
        self.file.seek(0)
        self.file.write(header)
        self.written.append((self.file.name, self.filled))
        self.file.close()
        self.file, self.filled = None, 0

    def finish(self, meta: dict, extra: dict[str, str], stale: list[str]) -> dict:
        if self.file is not None:
            self.close_shard()
        if len(self.written) == 1:  # all of it in the validation shard: give training its share
            path, tokens = self.written[0]
            val = max(1, int(tokens * self.val_fraction))
            shard = np.memmap(path, np.uint16, "r", offset=4 * LLMC_HEADER_INTS)
            self.file = open(temporary_name(self.shard_path(1)), "wb+")
            self.file.write(np.zeros(LLMC_HEADER_INTS, np.int32))
            self.file.write(shard[val:])
            self.filled = tokens - val
            del shard
            self.close_shard()
            self.written[0] = (path, val)
            with open(path, "rb+") as f:
                f.truncate(4 * LLMC_HEADER_INTS + 2 * val)
                f.seek(8)
                f.write(np.int32(val).tobytes())
        names = [os.path.basename(self.shard_path(index)) for index in range(len(self.written))]
        meta = {"format": "llmc", **meta, "dtype": "uint16", "documents": self.documents,
                "shards": names, "val_tokens": self.written[0][1],
                "train_tokens": sum(n for _, n in self.written[1:])}
        refuse_empty_split({"val": meta["val_tokens"], "train": meta["train_tokens"]})
        # an earlier run's shards and nanoGPT files (--overwrite) go with its meta.json
        stale = [*stale, *(os.path.join(self.folder, name) for name in
                           [*set(llmc_shards(self.folder)) - set(names), "train.bin", "val.bin"])]
        commit({**{path: self.shard_path(index) for index, (path, _) in enumerate(self.written)},
                **extra}, os.path.join(self.folder, "meta.json"), meta, stale)
        return meta
