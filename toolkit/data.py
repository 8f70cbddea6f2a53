"""
The token formats on disk as the trainers read them, and batches: random windows for pretraining,
epochs of examples for fine-tuning. toolkit/writers.py writes the formats (tokenizer.py).

Formats:
  * nanoGPT: a folder with train.bin and val.bin (raw token ids, uint16 or uint32, no header) and
    meta.json (tokenizer facts, dtype and token counts).
  * Megatron-LM's MMapIndexedDataset: PREFIX.bin (token ids of all documents) + PREFIX.idx (34-byte
    header: magic, version 1, dtype code, item count, doc count; then int32 sizes, int64 byte pointers,
    int64 doc_idx), one item per document; plus this toolkit's PREFIX.json sidecar of tokenizer facts.

    corpus = load_corpus("data/pydoc_char")            # nanoGPT folder
    corpus = load_corpus("data/oscar_text_document")  # Megatron prefix, split by documents
    offsets = window_offsets(len(corpus.train), block_size, batch_size, seed, step=iter_num)
    x, y = get_batch(corpus.train, offsets, block_size, device)

Windows are drawn from (seed, step, stream) alone, so every run and every DDP rank sees the same
global draw; each rank takes its own slice of it.
"""
import os
import struct
import sys
from dataclasses import dataclass

import numpy as np
import torch

from toolkit import distributed
from toolkit.cli import CLIError
from toolkit.files import read_json
from toolkit.gpt2_vocab import GPT2_FACTS


@dataclass
class Corpus:
    train: np.ndarray  # 1-D memory-mapped token ids
    val: np.ndarray
    meta: dict  # tokenizer facts (same keys as meta.json: tokenizer, vocab_size, eot_id, chars, ...)


NANOGPT_FILES = ("train.bin", "val.bin", "meta.json")
MEGATRON_EXTENSIONS = (".bin", ".idx", ".json")
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len, doc_count: 34 bytes
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # integer codes only


def megatron_document_prefix(output_prefix: str, json_key: str = "text") -> str:
    """The file prefix Megatron's preprocess_data.py writes for --output-prefix:
    PREFIX_text_document."""
    return f"{output_prefix}_{json_key}_document"


# -----------------------------------------------------------------------------
# Reading


def load_corpus(path: str, split: str = "969,30,1") -> Corpus:
    """Memory-map a prepared corpus: a nanoGPT folder, or a Megatron prefix (P, P.bin, P.idx, or a
    folder holding one pair).

    nanoGPT data comes split already (train.bin / val.bin). Megatron data is one stream of
    documents, split like Megatron's --split "969,30,1": the first 96.9% of the documents train, the
    next 3% are val (the last 0.1%, test, is not used here). Counts are rounded as Megatron does;
    val gets at least one document (taken from the end of train) when there are two or more. Both
    parts are contiguous token ranges of the .bin (found via the .idx).
    """
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, name)) for name in NANOGPT_FILES):
            return load_nanogpt(path)
        prefixes = sorted(name[:-4] for name in os.listdir(path)
                          if name.endswith(".idx") and os.path.exists(os.path.join(path, name[:-4] + ".bin")))
        if len(prefixes) != 1:
            found = f"{len(prefixes)} Megatron .bin/.idx pairs ({', '.join(prefixes)})" if prefixes else "neither"
            raise CLIError(f"{path} should hold train.bin/val.bin/meta.json or one Megatron "
                           f".bin/.idx pair; found {found}")
        return load_megatron(os.path.join(path, prefixes[0]), split)
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin"):
        return load_megatron(prefix, split)
    if os.path.exists(megatron_document_prefix(prefix) + ".idx"):  # the --output-prefix given to tokenizer.py
        return load_megatron(megatron_document_prefix(prefix), split)
    raise CLIError(f"data not found: {path} (expected a folder with train.bin/val.bin/meta.json or "
                   "a Megatron prefix)")


def read_meta(path: str) -> dict:
    """Tokenizer facts of prepared data (meta.json or a Megatron .json sidecar)."""
    meta = read_json(path, "token data metadata")
    vocab_size = meta.get("vocab_size")
    if type(vocab_size) is not int or not 0 < vocab_size <= 2**32:
        raise CLIError(f"{path}: vocab_size must be an integer from 1 to 2**32, got {vocab_size!r}")
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
            raise CLIError(f"{os.path.join(folder, name)} is missing (prepare the data with "
                           "tokenizer.py)")
    meta = read_meta(os.path.join(folder, "meta.json"))
    dtype = meta.get("dtype", "uint16")
    if dtype not in ("uint16", "uint32"):
        raise CLIError(f"{os.path.join(folder, 'meta.json')} has an unknown dtype {dtype!r} (uint16 or uint32)")
    splits = {}
    for split in ("train", "val"):
        path = os.path.join(folder, f"{split}.bin")
        splits[split] = check_token_ids(memmap_tokens(path, np.dtype(dtype)), meta["vocab_size"], path)
        expected = meta.get(f"{split}_tokens")
        if expected is not None and expected != len(splits[split]):
            raise CLIError(f"{path} holds {len(splits[split]):,} tokens but meta.json records "
                           f"{expected:,} (truncated or replaced); prepare the data again")
    return Corpus(train=splits["train"], val=splits["val"], meta=meta)


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: str) -> np.ndarray:
    """Every id below vocab_size (checked once here, not in every forward pass)."""
    largest = max((int(tokens[i:i + 2**26].max()) for i in range(0, len(tokens), 2**26)), default=0)
    if largest >= vocab_size or (tokens.dtype.kind == "i" and len(tokens) and int(tokens.min()) < 0):
        raise CLIError(f"{path} holds token ids outside the vocabulary of {vocab_size} (largest "
                       f"{largest}); the data and its metadata do not belong together")
    return tokens


def read_megatron_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sizes, pointers, doc_idx) of a Megatron MMapIndexedDataset .idx, checked for
    consistency."""
    file_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(MEGATRON_HEADER.size)
    if len(header) < MEGATRON_HEADER.size or not header.startswith(MEGATRON_MAGIC):
        raise CLIError(f"{idx_path} is not a Megatron index (bad magic or shorter than its 34-byte "
                       "header)")
    _, version, code, n, doc_count = MEGATRON_HEADER.unpack(header)
    if version != 1:
        raise CLIError(f"{idx_path}: unsupported index version {version} (expected 1)")
    if code not in MEGATRON_DTYPES:
        raise CLIError(f"{idx_path}: unsupported token dtype code {code}")
    expected = MEGATRON_HEADER.size + n * 4 + n * 8 + doc_count * 8
    if file_size != expected:
        raise CLIError(f"{idx_path} has {file_size} bytes, its header implies {expected} (truncated or corrupt)")

    def array(dtype: str, offset: int, count: int) -> np.ndarray:
        if not count:
            return np.zeros(0, dtype)
        return np.memmap(idx_path, dtype=dtype, mode="r", offset=offset, shape=(count,))

    sizes = array("<i4", MEGATRON_HEADER.size, n)
    pointers = array("<i8", MEGATRON_HEADER.size + n * 4, n)
    doc_idx = array("<i8", MEGATRON_HEADER.size + n * 12, doc_count)
    if doc_count < 1 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
        raise CLIError(f"{idx_path}: corrupt doc_idx (must run from 0 to {n} without going back)")
    return np.dtype(MEGATRON_DTYPES[code]), sizes, pointers, doc_idx


def megatron_split(n_docs: int, split: str) -> tuple[int, int]:
    """Document boundaries (end of train, end of val) for Megatron's --split weights, e.g.
    "969,30,1"."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise CLIError(f"split {split!r} is not comma-separated numbers like 969,30,1") from None
    weights = (weights + [0.0, 0.0])[:3]
    if min(weights) < 0 or sum(weights) <= 0:
        raise CLIError(f"split {split!r} needs non-negative weights with a positive sum")
    if n_docs < 2:
        raise CLIError(f"need at least 2 documents to split into train and val, got {n_docs}")
    # Megatron's get_train_valid_test_split_: rounded cumulative counts, rounding error taken off every
    # boundary
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
    end = pointers[-1] + sizes[-1] * dtype.itemsize if len(pointers) else 0
    if bin_size != n_tokens * dtype.itemsize or (len(pointers) and end != bin_size):
        raise CLIError(f"{prefix}.bin has {bin_size} bytes but {prefix}.idx describes {n_tokens} "
                       f"{dtype.name} tokens")
    tokens = memmap_tokens(prefix + ".bin", dtype)
    train_end, val_end = megatron_split(len(doc_idx) - 1, split)

    def token_offset(doc: int) -> int:  # first token of a document (or the end of the data)
        item = int(doc_idx[doc])
        return int(pointers[item]) // dtype.itemsize if item < len(pointers) else n_tokens

    if os.path.exists(prefix + ".json"):
        meta = read_meta(prefix + ".json")
    else:
        if dtype != np.uint16:
            raise CLIError(f"{prefix}.json (tokenizer facts) is missing and {dtype.name} tokens are not GPT-2's")
        print(f"warning: {prefix}.json is missing; assuming the GPT-2 tokenizer (Megatron's "
              "preprocess_data.py)",
              file=sys.stderr)
        meta = dict(GPT2_FACTS)
    check_token_ids(tokens, meta["vocab_size"], prefix + ".bin")
    train, val = tokens[: token_offset(train_end)], tokens[token_offset(train_end): token_offset(val_end)]
    if len(train) == 0 or len(val) == 0:
        empty = "train" if len(train) == 0 else "val"
        raise CLIError(f"{prefix}: the {empty} documents of split {split!r} hold no tokens")
    return Corpus(train=train, val=val, meta=meta)


# -----------------------------------------------------------------------------
# Batches


def window_offsets(n_tokens: int, block_size: int, count: int, seed: int, step: int, stream: int = 0) -> np.ndarray:
    """Start offsets of count random windows of block_size+1 tokens; the same for a given (seed,
    step, stream) everywhere."""
    if n_tokens < block_size + 1:
        raise CLIError(f"data has {n_tokens} tokens, shorter than one window of block_size+1 = "
                       f"{block_size + 1} tokens; use a smaller --block-size")
    rng = np.random.Generator(np.random.PCG64([seed, step, stream]))
    return rng.integers(0, n_tokens - block_size, size=count, dtype=np.int64)


def get_batch(tokens: np.ndarray, offsets: np.ndarray, block_size: int,
              device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x = tokens[o:o+T] and targets y = tokens[o+1:o+T+1] per offset, int64 tensors of shape
    (B, T) on device."""
    # one gather of every window (B, T+1) from the memmap, far cheaper than nanoGPT's per-row torch.stack;
    # x and y are two views of it
    windows = torch.from_numpy(tokens[np.asarray(offsets)[:, None] + np.arange(block_size + 1)].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if torch.device(device).type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def epoch_batches(n: int, global_batch: int, micro_batches: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Fine-tuning's global batches of an epoch of n examples, in an order drawn from (seed, epoch)
    alone, so every rank and every run sees the same; a last batch with fewer examples than
    micro-batches is left out."""
    order = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)
    batches = [order[i : i + global_batch] for i in range(0, n, global_batch)]
    return batches if len(batches[-1]) >= micro_batches else batches[:-1]


def step_batches(step: int, n: int, cfg, steps_per_epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the example indices of a step's global batch, this rank's micro-batches of it); cfg gives
    batch_size, grad_accum and seed."""
    epoch, index = divmod(step, steps_per_epoch)
    batch = epoch_batches(n, cfg.batch_size * cfg.grad_accum, cfg.grad_accum, cfg.seed, epoch)[index]
    micro_steps = cfg.grad_accum // distributed.world_size()
    return batch, np.array_split(batch, cfg.grad_accum)[distributed.rank() * micro_steps:][:micro_steps]


def rank_share(n: int) -> np.ndarray:
    """The indices of this process's contiguous share of n items."""
    return np.array_split(np.arange(n), distributed.world_size())[distributed.rank()]
