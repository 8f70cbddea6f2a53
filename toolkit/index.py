"""The index that `embed.py index` writes and `search` and `eval` read, the queries encoded for it,
and the retrieval metrics of `eval`. An index is a folder:

    vectors.npy      (rows, dim) float32 unit vectors, one per chunk, memory-mapped by search
    rows.npy         (rows, 3) int64: each vector's document number, first token and end token
    documents.jsonl  one {"id", "source", "line", "text"} line per document
    offsets.npy      (documents + 1,) int64 byte offsets of those lines
    index.json       written last: the encoder (path and sha256), tokenizer, pooling, dtype,
                     chunking, counts and input; a folder without it is no index

Queries are encoded as the texts were, by the encoder the index records and by no other (its
fingerprint is checked). docs/embed.md describes the files.
"""
import os

import numpy as np
import torch

from model import GPT
from toolkit.cli import CLIError
from toolkit.device import DTYPES, resolve_dtype
from toolkit.documents import json_records
from toolkit.embedding import (POOLINGS, Document, encode, encoder_identity, load_encoder,
                               record_id, text_room, token_ids, top_k)
from toolkit.files import lock_folder, parse_json, read_json, save_array, write_json, write_jsonl
from toolkit.tokenizers import Tokenizer

INDEX_FORMAT = "embed.py index"
INDEX_FILE = "index.json"  # written last: an index is complete when it is there
INDEX_FILES = ("vectors.npy", "rows.npy", "documents.jsonl", "offsets.npy", INDEX_FILE)
METRIC_KS = (1, 5, 10)


def write_index(folder: str, documents: list[Document], rows: np.ndarray, vectors: np.ndarray,
                encoding: dict, corpus: dict) -> None:
    """The index of the documents' chunks (rows) and their vectors; encoding says how they were
    encoded (encoder, tokenizer, pooling, dtype, chunking), corpus where the documents came from.
    One writer at a time; an old index.json goes first, so a half-written folder is no index."""
    paths = {name: os.path.join(folder, name) for name in INDEX_FILES}
    lock_folder(folder, "--out")  # embed.py index --out
    if os.path.exists(paths[INDEX_FILE]):
        os.remove(paths[INDEX_FILE])
    save_array(paths["vectors.npy"], vectors)
    save_array(paths["rows.npy"], rows)
    lines = ({"id": d.id, "source": d.source, "line": d.line, "text": d.text} for d in documents)
    offsets = write_jsonl(paths["documents.jsonl"], lines)
    save_array(paths["offsets.npy"], offsets)
    counts = {"documents": len(documents), "rows": len(rows), "dim": vectors.shape[1],
              "max_chunks": int(np.bincount(rows[:, 0]).max())}
    facts = {"format": INDEX_FORMAT, "version": 1, **encoding, **counts, **corpus}
    write_json(paths[INDEX_FILE], facts)


class Index:
    """An index opened for search: its facts and memory-mapped arrays (opening reads no vectors)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.meta = read_json(os.path.join(folder, INDEX_FILE), "index")
        if self.meta.get("format") != INDEX_FORMAT:
            raise CLIError(f"{folder} is not an index of embed.py (its {INDEX_FILE} has no format "
                           f"{INDEX_FORMAT!r})")
        self.check_facts()
        self.vectors = self.array("vectors.npy", (self.meta["rows"], self.meta["dim"]), np.float32)
        self.rows = self.array("rows.npy", (self.meta["rows"], 3), np.int64)
        self.offsets = self.array("offsets.npy", (self.meta["documents"] + 1,), np.int64)
        numbers = self.rows[:, 0]
        if len(numbers) and not (0 <= numbers.min() and numbers.max() < self.meta["documents"]):
            raise CLIError(f"{folder}/rows.npy names documents the index does not hold; rebuild "
                           "the index")

    def check_facts(self) -> None:
        """index.json as write_index writes it: an edited or foreign one is one line."""
        meta, encoder = self.meta, self.meta.get("encoder")
        counts = ("rows", "dim", "documents", "max_chunks", "chunk_tokens", "overlap")
        wrong = [key for key in counts if type(meta.get(key)) is not int or
                 meta[key] < (0 if key == "overlap" else 1)]
        wrong += [] if isinstance(encoder, dict) and all(
            isinstance(encoder.get(key), str) for key in ("path", "sha256")) else ["encoder"]
        wrong += [key for key, allowed in (("version", (1,)), ("pooling", POOLINGS),
                                           ("dtype", DTYPES)) if meta.get(key) not in allowed]
        if wrong:
            raise CLIError(f"{self.folder}/{INDEX_FILE}: {', '.join(wrong)} missing or not as "
                           "embed.py index writes them; rebuild the index")

    def array(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        path = os.path.join(self.folder, name)
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError, EOFError) as e:
            raise CLIError(f"cannot read {path}: {e}") from None
        if array.shape != shape or array.dtype != dtype:
            raise CLIError(f"{path} holds an array of {array.dtype} {array.shape} but "
                           f"{INDEX_FILE} says {np.dtype(dtype)} {shape}; rebuild the index")
        return array

    def document(self, number: int) -> dict:
        """One document's id, source and text, read from its place in documents.jsonl."""
        path = os.path.join(self.folder, "documents.jsonl")
        with open(path, "rb") as f:
            f.seek(int(self.offsets[number]))
            line = f.read(int(self.offsets[number + 1] - self.offsets[number]))
        return parse_json(line, f"{path} document {number}")

    def document_numbers(self) -> dict[str, int]:
        """Every document's number by its id."""
        path = os.path.join(self.folder, "documents.jsonl")
        with open(path, "rb") as f:
            return {parse_json(line, f"{path} line {number + 1}")["id"]: number
                    for number, line in enumerate(f)}

    def search(self, queries: torch.Tensor, k: int) -> list[list[tuple[int, float, int]]]:
        """The k best documents of each query, best first: (document number, score, row of its best
        chunk). A document scores as its best chunk; enough rows are taken for k distinct documents
        even when the best rows are all chunks of a few documents."""
        wanted = (min(k, self.meta["documents"]) - 1) * self.meta["max_chunks"] + 1
        scores, rows = top_k(self.vectors, queries, wanted)
        results = []
        for query_scores, query_rows in zip(scores.tolist(), rows.tolist()):
            hits, seen = [], set()
            for score, row in zip(query_scores, query_rows):
                number = int(self.rows[row, 0])
                if number not in seen and len(hits) < k:
                    seen.add(number)
                    hits.append((number, score, row))
            results.append(hits)
        return results

    def result(self, tokenizer: Tokenizer, rank: int, number: int, score: float, row: int) -> dict:
        """A search hit: its document (id, source, line, text) and best chunk (tokens, passage)."""
        document = self.document(number)
        start, end = self.rows[row, 1:].tolist()
        # a chunk of byte-level tokens may start inside a character: its bytes are no text
        passage = tokenizer.decode(tokenizer.encode(document["text"])[start:end]).lstrip("\ufffd")
        return {"rank": rank, "score": round(score, 6), **document, "tokens": [start, end],
                "passage": passage}


def open_encoder(index: Index, ckpt: str | None, device: torch.device) -> tuple[GPT, Tokenizer]:
    """The index's encoder, from ckpt or the recorded path; refused unless its fingerprint is the
    one the index recorded (another model, another tokenizer, or the same file since changed)."""
    recorded = index.meta["encoder"]
    path = ckpt or recorded["path"]
    if ckpt is None and os.path.isabs(path) and not os.path.exists(path):  # (an HF name is not)
        raise CLIError(f"the encoder of the index {index.folder}, {path}, is not there; pass "
                       "--ckpt with the checkpoint it was built with")
    if encoder_identity(path)["sha256"] != recorded["sha256"]:
        if ckpt is None:
            raise CLIError(f"the encoder {path} changed since the index {index.folder} was built "
                           f"(sha256 differs); rebuild the index, or pass --ckpt with the "
                           f"checkpoint it was built with")
        raise CLIError(f"--ckpt {ckpt} is not the encoder of the index {index.folder}, which was "
                       f"built with {recorded['path']} (sha256 differs); queries must be encoded "
                       f"by the same model")
    model, tokenizer, _ = load_encoder(path, device)
    return model, tokenizer


def encode_queries(model: GPT, tokenizer: Tokenizer, index: Index, texts: list[str],
                   places: list[str], batch_size: int, device: torch.device) -> torch.Tensor:
    """Queries encoded like the index's texts: same pooling and dtype, cut to its chunk length,
    after the BOS."""
    meta = index.meta
    length = min(meta["chunk_tokens"], text_room(model, tokenizer))  # chunks that filled the block
    token_lists = [tokenizer.with_bos(token_ids(tokenizer, text, place)[:length])
                   for text, place in zip(texts, places)]
    dtype = resolve_dtype(meta["dtype"], device)
    vectors = encode(model, token_lists, meta["pooling"], batch_size, dtype, desc="queries")
    return torch.from_numpy(vectors)


def read_eval_pairs(path: str, ids: dict[str, int],
                    index_folder: str) -> tuple[list[str], list[str], list[int]]:
    """(queries, their places, the relevant document number of each) from {"query", "id"} lines."""
    queries, places, relevant = [], [], []
    for number, record in json_records(path, ("query",)):
        if not record["query"].strip():
            raise CLIError(f"{path} line {number}: 'query' is empty")
        if "id" not in record:
            raise CLIError(f"{path} line {number}: no 'id' key")
        doc_id = record_id(path, number, record["id"])
        if doc_id not in ids:
            raise CLIError(f"{path} line {number}: id {doc_id!r} is not a document of the index "
                           f"{index_folder}")
        queries.append(record["query"])
        places.append(f"{path} line {number}")
        relevant.append(ids[doc_id])
    if not queries:
        raise CLIError(f"no pairs in {path}")
    return queries, places, relevant


def retrieval_metrics(hits: list[list[tuple[int, float, int]]], relevant: list[int]) -> dict:
    """Recall@1/5/10 and MRR@10 of each query's relevant document among its hits (Index.search's,
    best first): the share of queries with it in the top k, and the mean 1/rank (0 past 10)."""
    ranks = []
    for found, want in zip(hits, relevant):
        numbers = [number for number, _, _ in found][: max(METRIC_KS)]
        if want in numbers:
            ranks.append(numbers.index(want))
    metrics = {f"recall@{k}": sum(r < k for r in ranks) / len(relevant) for k in METRIC_KS}
    metrics["mrr@10"] = sum(1 / (r + 1) for r in ranks) / len(relevant)
    return {**metrics, "queries": len(relevant)}
