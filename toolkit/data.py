"""
The token formats on disk as the trainers read them; toolkit/writers.py writes them (tokenizer.py),
toolkit/batches.py draws batches from them. Nothing here needs torch, so data preparation never
loads it.

Formats:
  * nanoGPT: a folder with train.bin and val.bin (raw token ids, uint16 or uint32, no header) and
    meta.json (tokenizer facts, dtype and token counts).
  * Megatron-LM's MMapIndexedDataset: PREFIX.bin (token ids of all documents) + PREFIX.idx (34-byte
    header: magic, version 1, dtype code, item count, doc count; then int32 sizes, int64 byte
    pointers, int64 doc_idx), one item per document; plus this toolkit's PREFIX.json sidecar of
    tokenizer facts.

    corpus = load_corpus("data/pydoc_char")            # nanoGPT folder
    corpus = load_corpus("data/oscar_text_document")  # Megatron prefix, split by documents
"""
import os
import re
import struct
import sys
from dataclasses import dataclass

import numpy as np

from toolkit.cli import CLIError
from toolkit.files import read_json
from toolkit.flags import split_weights
from toolkit.gpt2_vocab import GPT2_FACTS


@dataclass
class Corpus:
    train: np.ndarray  # 1-D memory-mapped token ids
    val: np.ndarray
    # tokenizer facts (same keys as meta.json: tokenizer, vocab_size, eot_id, chars, ...)
    meta: dict


NANOGPT_FILES = ("train.bin", "val.bin", "meta.json")
# the embedded corpus, prepared on first use (toolkit/prepare.py)
DEFAULT_CORPUS_DIR = "data/pydoc_char"
MEGATRON_EXTENSIONS = (".bin", ".idx", ".json")
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len, doc_count: 34 bytes
# integer codes only
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
# llm.c's shards (dev/data/data_common.py): a header of 256 int32 (magic, version, token count),
# then the ids
LLMC_HEADER_INTS, LLMC_MAGIC = 256, 20240520
LLMC_VERSIONS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # GPT-2's and Llama 3's
LLMC_SHARD = re.compile(r".+_(val|train)(_\d+)?\.bin")


def is_prepared(folder: str) -> bool:
    """Whether folder holds a nanoGPT dataset: train.bin, val.bin, meta.json."""
    return all(os.path.exists(os.path.join(folder, name)) for name in NANOGPT_FILES)

def megatron_document_prefix(output_prefix: str, json_key: str = "text") -> str:
    """The file prefix Megatron's preprocess_data.py writes for --output-prefix:
    PREFIX_text_document."""
    return f"{output_prefix}_{json_key}_document"


# ----- reading -----

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
        nanogpt = all(os.path.exists(os.path.join(path, name)) for name in NANOGPT_FILES)
        if any(LLMC_SHARD.fullmatch(name) for name in os.listdir(path)) and \
                not (nanogpt and folder_format(path) == "nanogpt"):  # (beside an earlier run's)
            return load_llmc(path)
        if any(os.path.exists(os.path.join(path, name)) for name in NANOGPT_FILES):
            return load_nanogpt(path)
        prefixes = sorted(name[:-4] for name in os.listdir(path)
                          if name.endswith(".idx")
                          and os.path.exists(os.path.join(path, name[:-4] + ".bin")))
        if len(prefixes) != 1:
            found = (f"{len(prefixes)} Megatron .bin/.idx pairs ({', '.join(prefixes)})"
                     if prefixes else "neither")
            raise CLIError(f"{path} should hold train.bin/val.bin/meta.json or one Megatron "
                           f".bin/.idx pair; found {found}")
        return load_megatron(os.path.join(path, prefixes[0]), split)
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    if os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin"):
        return load_megatron(prefix, split)
    # the --output-prefix given to tokenizer.py
    if os.path.exists(megatron_document_prefix(prefix) + ".idx"):
        return load_megatron(megatron_document_prefix(prefix), split)
    raise CLIError(f"data not found: {path} (expected a folder with train.bin/val.bin/meta.json or "
                   f"llm.c shards, or a Megatron prefix)")


def folder_format(folder: str) -> str | None:
    """The format meta.json records in a folder, if it names one."""
    path = os.path.join(folder, "meta.json")
    meta = read_json(path, "token data metadata") if os.path.isfile(path) else None
    return meta.get("format") if isinstance(meta, dict) else None


class Shards:
    """Token shards (memory maps) read as one sequence: len(), and indexing by integer arrays as a
    batch of windows does (a window may run from one shard into the next)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays, self.dtype = arrays, arrays[0].dtype
        self.starts = np.cumsum([0] + [len(a) for a in arrays])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty(index.shape, self.dtype)
        for s in np.unique(shard):
            mine = shard == s
            out[mine] = self.arrays[s][index[mine] - self.starts[s]]
        return out


def read_llmc_shard(path: str) -> np.ndarray:
    """The token ids of one llm.c shard, memory-mapped, after its header is checked."""
    header = np.fromfile(path, np.int32, count=LLMC_HEADER_INTS)
    if len(header) < LLMC_HEADER_INTS or int(header[0]) not in LLMC_VERSIONS:
        raise CLIError(f"{path} is not an llm.c shard (its magic is not "
                       f"{' or '.join(map(str, LLMC_VERSIONS))})")
    version, dtype = LLMC_VERSIONS[int(header[0])]
    if header[1] != version:
        raise CLIError(f"{path}: llm.c shard version {header[1]}, expected {version} for magic "
                       f"{header[0]}")
    size, expected = (os.path.getsize(path),
                      4 * LLMC_HEADER_INTS + int(header[2]) * np.dtype(dtype).itemsize)
    if size != expected or header[2] < 1:
        raise CLIError(f"{path} has {size:,} bytes but its header says {int(header[2]):,} tokens, "
                       f"{expected:,} bytes (truncated or corrupt)")
    return np.memmap(path, dtype, "r", offset=4 * LLMC_HEADER_INTS, shape=(int(header[2]),))


def load_llmc(folder: str) -> Corpus:
    """llm.c's shards: NAME_val_*.bin validate, NAME_train_*.bin train, each split one sequence in
    shard order; meta.json holds the tokenizer facts (GPT-2's without one, as llm.c writes them)."""
    found = sorted(name for name in os.listdir(folder) if LLMC_SHARD.fullmatch(name))
    shards, named = {"train": [], "val": []}, []
    for name in found:
        named.append((name, read_llmc_shard(os.path.join(folder, name))))
        shards[LLMC_SHARD.fullmatch(name).group(1)].append(named[-1][1])
    for split, arrays in shards.items():
        if not arrays:
            raise CLIError(f"{folder} holds llm.c shards but none for {split} (*_{split}_*.bin)")
    meta = read_meta(os.path.join(folder, "meta.json"), gpt2_source="as llm.c's shards use")
    listed = meta.get("shards")  # tokenizer.py's list: any other shard is not of this dataset
    if isinstance(listed, list) and sorted(listed) != found:
        others = sorted(set(found) ^ set(listed))
        raise CLIError(f"{folder} holds llm.c shards other than those its meta.json lists "
                       f"({', '.join(others[:3])}{' ...' if len(others) > 3 else ''}): prepare "
                       "the data again")
    for name, tokens in named:
        check_token_ids(tokens, meta["vocab_size"], os.path.join(folder, name))
    train, val = (arrays[0] if len(arrays) == 1 else Shards(arrays) for arrays in shards.values())
    return Corpus(train=train, val=val, meta=meta)


def read_meta(path: str, gpt2_source: str | None = None) -> dict:
    """Tokenizer facts of prepared data (meta.json or a Megatron .json sidecar); GPT-2's, with a
    warning, when there is none and gpt2_source says why those are likely."""
    if gpt2_source and not os.path.isfile(path):
        print(f"warning: {path} is missing; assuming the GPT-2 tokenizer ({gpt2_source})",
              file=sys.stderr)
        return dict(GPT2_FACTS)
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
        raise CLIError(f"{os.path.join(folder, 'meta.json')} has an unknown dtype {dtype!r} "
                       f"(uint16 or uint32)")
    splits = {}
    for split in ("train", "val"):
        path = os.path.join(folder, f"{split}.bin")
        splits[split] = check_token_ids(memmap_tokens(path, np.dtype(dtype)), meta["vocab_size"],
                                        path)
        expected = meta.get(f"{split}_tokens")
        if expected is not None and expected != len(splits[split]):
            recorded = f"{expected:,}" if isinstance(expected, int) else repr(expected)
            raise CLIError(f"{path} holds {len(splits[split]):,} tokens but meta.json records "
                           f"{recorded} (truncated or replaced); prepare the data again")
    return Corpus(train=splits["train"], val=splits["val"], meta=meta)


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: str) -> np.ndarray:
    """Every id below vocab_size (checked once here, not in every forward pass)."""
    largest = max((int(tokens[i:i + 2**26].max()) for i in range(0, len(tokens), 2**26)), default=0)
    if largest >= vocab_size or (tokens.dtype.kind == "i" and len(tokens)
                                 and int(tokens.min()) < 0):
        raise CLIError(f"{path} holds token ids outside the vocabulary of {vocab_size} (largest "
                       f"{largest}); the data and its metadata do not belong together")
    return tokens


def read_megatron_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sizes, pointers, doc_idx) of an MMapIndexedDataset .idx, checked for consistency."""
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
        raise CLIError(f"{idx_path} has {file_size} bytes, its header implies {expected} "
                       f"(truncated or corrupt)")

    def array(dtype: str, offset: int, count: int) -> np.ndarray:
        if not count:
            return np.zeros(0, dtype)
        return np.memmap(idx_path, dtype=dtype, mode="r", offset=offset, shape=(count,))

    sizes = array("<i4", MEGATRON_HEADER.size, n)
    pointers = array("<i8", MEGATRON_HEADER.size + n * 4, n)
    doc_idx = array("<i8", MEGATRON_HEADER.size + n * 12, doc_count)
    if doc_count < 1 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
        raise CLIError(f"{idx_path}: corrupt doc_idx (must run from 0 to {n} without going back)")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    # Megatron's writer: each item starts where the one before it ends
    if n and (np.any(sizes < 0) or pointers[0] != 0 or
              np.any(np.diff(pointers) != sizes[:-1].astype(np.int64) * dtype.itemsize)):
        raise CLIError(f"{idx_path}: corrupt sizes or pointers (each item must hold at least 0 "
                       "tokens and start where the one before it ends)")
    return dtype, sizes, pointers, doc_idx


def megatron_split(n_docs: int, split: str) -> tuple[int, int]:
    """Document boundaries (train end, val end) for Megatron's --split weights, e.g. "969,30,1"."""
    weights = split_weights(split)
    if weights is None:
        raise CLIError(f"--split {split!r} is not up to 3 comma-separated finite weights >= 0 with "
                       "a positive sum, e.g. 969,30,1")
    if n_docs < 2:
        raise CLIError(f"need at least 2 documents to split into train and val, got {n_docs}")
    # Megatron's get_train_valid_test_split_: rounded cumulative counts, rounding error taken off
    # every boundary
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

    if not os.path.exists(prefix + ".json") and dtype != np.uint16:
        raise CLIError(f"{prefix}.json (tokenizer facts) is missing and {dtype.name} tokens are "
                       f"not GPT-2's")
    meta = read_meta(prefix + ".json", gpt2_source="Megatron's preprocess_data.py")
    check_token_ids(tokens, meta["vocab_size"], prefix + ".bin")
    train, val = (tokens[: token_offset(train_end)],
                  tokens[token_offset(train_end): token_offset(val_end)])
    if len(train) == 0 or len(val) == 0:
        empty = "train" if len(train) == 0 else "val"
        raise CLIError(f"{prefix}: the {empty} documents of split {split!r} hold no tokens")
    return Corpus(train=train, val=val, meta=meta)
