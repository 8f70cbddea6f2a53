"""
Token data for training: load a prepared corpus (memory-mapped) and draw batches of random windows.

    corpus = load_corpus("data/pydoc_char")            # nanoGPT folder: train.bin, val.bin, meta.json
    corpus = load_corpus("data/oscar_text_document")  # Megatron .bin/.idx prefix, split by documents
    offsets = window_offsets(len(corpus.train), block_size, batch_size, seed, step=iter_num)
    x, y = get_batch(corpus.train, offsets, block_size, device)

Windows are drawn from (seed, step, stream) alone, so every run and every DDP rank sees the same global
draw; each rank takes its own slice of it.
"""
import json
import os
import struct
import sys
from dataclasses import dataclass

import numpy as np
import torch

from cli import CLIError


@dataclass
class Corpus:
    train: np.ndarray  # 1-D memory-mapped token ids
    val: np.ndarray
    meta: dict  # tokenizer facts (same keys as meta.json: tokenizer, vocab_size, eot_id, chars, ...)


NANOGPT_FILES = ("train.bin", "val.bin", "meta.json")
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len, doc_count: 34 bytes
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # integer codes only
# what Megatron's own preprocess_data.py writes with the GPT-2 tokenizer, for data that has no .json sidecar
MEGATRON_GPT2_FACTS = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256, "encoding": "r50k_base"}


def load_corpus(path: str, split: str = "969,30,1") -> Corpus:
    """Memory-map a prepared corpus: a nanoGPT folder, or a Megatron prefix (P, P.bin, P.idx, or a folder holding one pair).

    nanoGPT data comes split already (train.bin / val.bin). Megatron data is one stream of documents, split like
    Megatron's --split "969,30,1": the first 96.9% of the documents train, the next 3% are val (the last 0.1%, test,
    is not used here). Counts are rounded as Megatron does; val gets at least one document (taken from the end of
    train) when there are two or more. Both parts are contiguous token ranges of the .bin (found via the .idx).
    """
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, name)) for name in NANOGPT_FILES):
            return load_nanogpt(path)
        prefixes = sorted(name[:-4] for name in os.listdir(path)
                          if name.endswith(".idx") and os.path.exists(os.path.join(path, name[:-4] + ".bin")))
        if len(prefixes) != 1:
            found = f"{len(prefixes)} Megatron .bin/.idx pairs ({', '.join(prefixes)})" if prefixes else "neither"
            raise CLIError(f"{path} should hold train.bin/val.bin/meta.json or one Megatron .bin/.idx pair; found {found}")
        return load_megatron(os.path.join(path, prefixes[0]), split)
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin"):
        return load_megatron(prefix, split)
    raise CLIError(f"data not found: {path} (expected a folder with train.bin/val.bin/meta.json or a Megatron prefix)")


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CLIError(f"{path} is not valid JSON: {e}")
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int):
        raise CLIError(f"{path} has no integer vocab_size")
    return meta


def memmap_tokens(path: str, dtype: np.dtype) -> np.ndarray:
    size = os.path.getsize(path)
    if size == 0:
        raise CLIError(f"{path} is empty")
    if size % dtype.itemsize:
        raise CLIError(f"{path} has {size} bytes, not a whole number of {dtype.name} tokens")
    return np.memmap(path, dtype=dtype, mode="r")


def load_nanogpt(folder: str) -> Corpus:
    for name in NANOGPT_FILES:
        if not os.path.isfile(os.path.join(folder, name)):
            raise CLIError(f"{os.path.join(folder, name)} is missing (prepare the data with tokenizer.py)")
    meta = read_json(os.path.join(folder, "meta.json"))
    try:
        dtype = np.dtype(meta.get("dtype", "uint16"))
    except TypeError:
        raise CLIError(f"{os.path.join(folder, 'meta.json')} has an unknown dtype {meta.get('dtype')!r}")
    train = memmap_tokens(os.path.join(folder, "train.bin"), dtype)
    val = memmap_tokens(os.path.join(folder, "val.bin"), dtype)
    return Corpus(train=train, val=val, meta=meta)


def read_megatron_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sizes, pointers, doc_idx) of a Megatron MMapIndexedDataset .idx, checked for consistency."""
    file_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(MEGATRON_HEADER.size)
    if len(header) < MEGATRON_HEADER.size or not header.startswith(MEGATRON_MAGIC):
        raise CLIError(f"{idx_path} is not a Megatron index (bad magic or shorter than its 34-byte header)")
    _, version, code, n, doc_count = MEGATRON_HEADER.unpack(header)
    if version != 1:
        raise CLIError(f"{idx_path}: unsupported index version {version} (expected 1)")
    if code not in MEGATRON_DTYPES:
        raise CLIError(f"{idx_path}: unsupported token dtype code {code}")
    expected = MEGATRON_HEADER.size + n * 4 + n * 8 + doc_count * 8
    if file_size != expected:
        raise CLIError(f"{idx_path} has {file_size} bytes, its header implies {expected} (truncated or corrupt)")
    sizes = np.memmap(idx_path, dtype="<i4", mode="r", offset=MEGATRON_HEADER.size, shape=(n,)) if n else np.zeros(0, "<i4")
    pointers = np.memmap(idx_path, dtype="<i8", mode="r", offset=MEGATRON_HEADER.size + n * 4, shape=(n,)) if n else np.zeros(0, "<i8")
    doc_idx = np.memmap(idx_path, dtype="<i8", mode="r", offset=MEGATRON_HEADER.size + n * 12, shape=(doc_count,))
    if doc_count < 1 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
        raise CLIError(f"{idx_path}: corrupt doc_idx (must run from 0 to {n} without going back)")
    return np.dtype(MEGATRON_DTYPES[code]), sizes, pointers, doc_idx


def megatron_split(n_docs: int, split: str) -> tuple[int, int]:
    """Document boundaries (end of train, end of val) for Megatron's --split weights, e.g. "969,30,1"."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise CLIError(f"split {split!r} is not comma-separated numbers like 969,30,1")
    weights = (weights + [0.0, 0.0])[:3]
    if min(weights) < 0 or sum(weights) <= 0:
        raise CLIError(f"split {split!r} needs non-negative weights with a positive sum")
    if n_docs < 2:
        raise CLIError(f"need at least 2 documents to split into train and val, got {n_docs}")
    # Megatron's get_train_valid_test_split_: rounded cumulative counts, rounding error taken off every boundary
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / sum(weights) * n_docs)))
    bounds = [0] + [b - (bounds[-1] - n_docs) for b in bounds[1:]]
    train_end, val_end = max(bounds[1], 0), min(max(bounds[2], 0), n_docs)
    if val_end <= train_end:  # too few documents for the weights to give val one: take train's last
        train_end, val_end = min(train_end, n_docs - 1), min(train_end, n_docs - 1) + 1
    if train_end == 0:
        raise CLIError(f"split {split!r} leaves no training documents out of {n_docs}")
    return train_end, val_end


def load_megatron(prefix: str, split: str) -> Corpus:
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise CLIError(f"{prefix + ext} is missing")
    dtype, sizes, pointers, doc_idx = read_megatron_index(prefix + ".idx")
    n_tokens = int(sizes.sum(dtype=np.int64))
    bin_size = os.path.getsize(prefix + ".bin")
    if bin_size != n_tokens * dtype.itemsize or (len(pointers) and pointers[-1] + sizes[-1] * dtype.itemsize != bin_size):
        raise CLIError(f"{prefix}.bin has {bin_size} bytes but {prefix}.idx describes {n_tokens} {dtype.name} tokens")
    tokens = memmap_tokens(prefix + ".bin", dtype)
    train_end, val_end = megatron_split(len(doc_idx) - 1, split)

    def token_offset(doc: int) -> int:  # first token of a document (or the end of the data)
        item = int(doc_idx[doc])
        return int(pointers[item]) // dtype.itemsize if item < len(pointers) else n_tokens

    if os.path.exists(prefix + ".json"):
        meta = read_json(prefix + ".json")
    else:
        if dtype != np.uint16:
            raise CLIError(f"{prefix}.json (tokenizer facts) is missing and {dtype.name} tokens are not GPT-2's")
        print(f"warning: {prefix}.json is missing; assuming the GPT-2 tokenizer (Megatron's preprocess_data.py)", file=sys.stderr)
        meta = dict(MEGATRON_GPT2_FACTS)
    train, val = tokens[: token_offset(train_end)], tokens[token_offset(train_end): token_offset(val_end)]
    if len(train) == 0 or len(val) == 0:
        raise CLIError(f"{prefix}: the {'train' if len(train) == 0 else 'val'} documents of split {split!r} hold no tokens")
    return Corpus(train=train, val=val, meta=meta)


def window_offsets(n_tokens: int, block_size: int, count: int, seed: int, step: int, stream: int = 0) -> np.ndarray:
    """Start offsets of count random windows of block_size+1 tokens; the same for a given (seed, step, stream) everywhere."""
    if n_tokens < block_size + 1:
        raise CLIError(f"data has {n_tokens} tokens, shorter than one window of block_size+1 = {block_size + 1} tokens; "
                       f"use a smaller --block-size")
    rng = np.random.Generator(np.random.PCG64([seed, step, stream]))
    return rng.integers(0, n_tokens - block_size, size=count, dtype=np.int64)


def get_batch(tokens: np.ndarray, offsets: np.ndarray, block_size: int,
              device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x = tokens[o:o+T] and targets y = tokens[o+1:o+T+1] per offset, int64 tensors of shape (B, T) on device."""
    # one gather of every window (B, T+1) from the memmap; x and y are two views of it
    # (measured 15 us vs 240 us for nanoGPT's per-row torch.stack at B=16, T=256)
    windows = torch.from_numpy(tokens[np.asarray(offsets)[:, None] + np.arange(block_size + 1)].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if torch.device(device).type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)
