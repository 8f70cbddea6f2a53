"""The index that `embed.py index` writes and `search` and `eval` read: dense vectors of the
documents' chunks (a document scores as its best chunk) and a lexical (BM25) index of the
documents, searched alone or fused; the queries encoded for it; and the retrieval metrics of
`eval`. An index is a folder (docs/embed.md):

    index.json       written last, the commit point: format version, the encoder (path and
                     sha256), tokenizer, pooling, dtype, chunking, modes, counts, the input
    documents.jsonl  one {"id", "source", "line", "text"} line per document
    offsets.bin      (documents + 1,) int64: the byte offset of each line, and the end
    chunks.bin       (chunks, 3) int64: each chunk's document number, first token and end token
    vectors.bin      (chunks, dim) float16 unit vectors, one per chunk           [dense]
    ann-G.faiss      an HNSW graph over the vectors, from ANN_BYTES of them on   [dense]
    lexical-G/       BM25's term counts of the documents (toolkit/lexical.py)     [lexical]

The .bin files are raw little-endian arrays that only grow: `index --append` adds to their ends,
writes the lexical index and graph anew under the next generation G, then index.json. index.json's
counts say how much of each file is the index, so an append cut short leaves the index as it was.
"""
import glob
import json
import math
import os
import shutil
from collections.abc import Iterable

import numpy as np
import torch

from model import GPT
from toolkit import ann
from toolkit.cli import CLIError
from toolkit.device import DTYPES, resolve_dtype
from toolkit.records import json_records
from toolkit.embedding import (POOLINGS, Document, encode, encoder_identity, load_encoder,
                               record_id, text_room, token_ids, top_k)
from toolkit.files import lock_folder, parse_json, read_json, write_json
from toolkit.lexical import Lexical, Postings, terms
from toolkit.tokenizers import Tokenizer

INDEX_FORMAT = "embed.py index"
VERSION = 2
INDEX_FILE = "index.json"  # written last: an index is complete when it is there
MODES = ("hybrid", "dense", "lexical")
METRIC_KS = (1, 5, 10)
# from this many bytes of vectors on, dense search walks a graph: exact search of them takes
# about 15 ms a query (2 cores, AVX2 or AVX512; docs/performance.md, Retrieval)
ANN_BYTES = 256 * 2**20
CANDIDATES = 100  # documents each half hands to the fusion
DENSE_WEIGHT = 0.1  # dense's share of a fused score: docs/performance.md, Retrieval
DTYPE = {"vectors.bin": np.float16, "chunks.bin": np.int64, "offsets.bin": np.int64}

Hit = tuple[int, float, int]  # (document number, score, chunk): a document and its best chunk


# ----- writing -----

class IndexWriter:
    """Writes an index as its documents come, a batch at a time (memory: one batch, the lexical
    index's counts and the ids seen), or appends to an existing one. finish() commits it."""

    def __init__(self, folder: str, facts: dict, previous: "Index | None" = None):
        """facts: what index.json says of the encoding (encoder, tokenizer, pooling, dtype,
        chunking), the modes and the input."""
        lock_folder(folder, "--out")  # one writer at a time
        self.folder, self.facts = folder, facts
        self.modes = facts["modes"]
        if previous is None:
            if os.path.exists(self.path(INDEX_FILE)):  # --overwrite: no longer an index
                os.remove(self.path(INDEX_FILE))
            self.counts = {"documents": 0, "chunks": 0, "documents_bytes": 0, "max_chunks": 0,
                           "generation": 0}
            self.ids: dict[str, str] = {}
            self.postings = Postings() if "lexical" in self.modes else None
        else:
            self.counts = {key: previous.meta[key] for key in
                           ("documents", "chunks", "documents_bytes", "max_chunks", "generation")}
            self.ids = {i: f"document {n + 1} of the index" for i, n in
                        previous.document_numbers().items()}
            self.postings = Postings(previous.lexical) if previous.lexical else None
        sizes = {"vectors.bin": self.counts["chunks"] * 2 * facts.get("dim", 0),
                 "chunks.bin": self.counts["chunks"] * 24,
                 "offsets.bin": (self.counts["documents"] + 1) * 8 if previous else 0,
                 "documents.jsonl": self.counts["documents_bytes"]}
        self.fresh, self.sizes, self.files, self.committed = previous is None, sizes, {}, False
        for name, size in sizes.items():
            if name == "vectors.bin" and "dense" not in self.modes:
                continue
            f = open(self.path(name), "r+b" if previous else "wb")
            f.truncate(size)  # an append cut short left more: not the index's
            f.seek(size)
            self.files[name] = f
        if previous is None:
            self.files["offsets.bin"].write(np.zeros(1, "<i8").tobytes())

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def abort(self) -> None:
        """Undo what was written, unless index.json was (a build stopped by bad input or a
        signal): a new index's files go, an appended-to index's files are cut back to what it
        holds, and this generation's lexical index and graph go."""
        if self.committed:
            return
        for name, f in self.files.items():
            if not f.closed:
                f.truncate(self.sizes[name])
                f.close()
            if self.fresh:
                os.remove(self.path(name))
        generation = self.counts["generation"] + 1
        for part in (f"lexical-{generation}", f"ann-{generation}.faiss"):
            if os.path.isdir(self.path(part)):
                shutil.rmtree(self.path(part))
            elif os.path.exists(self.path(part)):
                os.remove(self.path(part))

    def add(self, documents: list[Document], rows: np.ndarray,
            vectors: np.ndarray | None) -> None:
        """The next documents, their chunks (rows: document number within this batch, first
        token, end token) and the chunks' vectors (dense)."""
        for d in documents:
            if d.id in self.ids:
                raise CLIError(f"{d.where()}: id {d.id!r} is already used by {self.ids[d.id]}")
            self.ids[d.id] = d.where()
        lines = [json.dumps({"id": d.id, "source": d.source, "line": d.line, "text": d.text},
                            ensure_ascii=False).encode() + b"\n" for d in documents]
        ends = self.counts["documents_bytes"] + np.cumsum([len(line) for line in lines])
        self.files["documents.jsonl"].write(b"".join(lines))
        self.files["offsets.bin"].write(ends.astype("<i8").tobytes())
        rows = rows + np.array([self.counts["documents"], 0, 0])
        self.files["chunks.bin"].write(rows.astype("<i8").tobytes())
        if vectors is not None:
            self.files["vectors.bin"].write(vectors.astype("<f2").tobytes())
        if self.postings is not None:
            self.postings.add([d.text for d in documents])
        if len(rows):
            most = int(np.bincount(rows[:, 0]).max())
            self.counts["max_chunks"] = max(self.counts["max_chunks"], most)
        self.counts["documents"] += len(documents)
        self.counts["chunks"] += len(rows)
        self.counts["documents_bytes"] = int(ends[-1]) if lines else self.counts["documents_bytes"]

    def finish(self) -> dict:
        """Flush the files, write the lexical index and the graph of this generation, then
        index.json; the previous generation's go last. Returns index.json's facts."""
        if not self.counts["documents"]:
            raise CLIError(f"no texts in {self.facts['input']}; nothing to index")
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        generation = self.counts["generation"] + 1
        parts = {}
        if self.postings is not None:
            parts["lexical"] = f"lexical-{generation}"
            self.postings.write(self.path(parts["lexical"]))
        if "dense" in self.modes and self.counts["chunks"] * 2 * self.facts["dim"] >= ANN_BYTES:
            parts["ann"] = f"ann-{generation}.faiss"
            ann.build(self.path(parts["ann"]), self.path("vectors.bin"), self.counts["chunks"],
                      self.facts["dim"])
        facts = {"format": INDEX_FORMAT, "version": VERSION, **self.facts, **self.counts,
                 "generation": generation, **parts}
        write_json(self.path(INDEX_FILE), facts)
        self.committed = True
        for old in glob.glob(self.path("lexical-*")) + glob.glob(self.path("ann-*")):
            if os.path.basename(old) not in parts.values():
                shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        return facts


def map_array(path: str, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """A raw little-endian file's first prod(shape) items, memory-mapped read-only."""
    if not math.prod(shape):  # (np.memmap refuses an empty file)
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=shape)


# ----- reading and search -----

class Index:
    """An index opened for search: its facts and memory-mapped arrays (opening reads no vectors)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.meta = read_json(os.path.join(folder, INDEX_FILE), "index")
        if self.meta.get("format") != INDEX_FORMAT:
            raise CLIError(f"{folder} is not an index of embed.py (its {INDEX_FILE} has no format "
                           f"{INDEX_FORMAT!r})")
        if self.meta.get("version") != VERSION:
            raise CLIError(f"{folder} was written by another version of embed.py (index version "
                           f"{self.meta.get('version')!r}; this one reads {VERSION}); rebuild it: "
                           f"{self.rebuild_command()}")
        self.check_facts()
        meta = self.meta
        self.modes = meta["modes"]
        self.chunks = self.array("chunks.bin", (meta["chunks"], 3))
        self.offsets = self.array("offsets.bin", (meta["documents"] + 1,))
        self.vectors = (self.array("vectors.bin", (meta["chunks"], meta["dim"]))
                        if "dense" in self.modes else None)
        self.lexical = self.open_lexical() if "lexical" in self.modes else None
        self.graph = (ann.open_graph(self.path(meta["ann"]), meta["chunks"], meta["dim"],
                                     self.rebuild_command()) if "ann" in meta else None)
        numbers = self.chunks[:, 0]
        if len(numbers) and not (0 <= numbers.min() and numbers.max() < meta["documents"]):
            raise CLIError(f"{folder}/chunks.bin names documents the index does not hold; "
                           f"rebuild the index: {self.rebuild_command()}")
        size = os.path.getsize(self.path("documents.jsonl"))
        if size < meta["documents_bytes"] or self.offsets[-1] != meta["documents_bytes"]:
            raise CLIError(f"{folder}/documents.jsonl changed since the index was built (it holds "
                           f"{size:,} bytes, the index {meta['documents_bytes']:,}); rebuild it: "
                           f"{self.rebuild_command()}")

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def rebuild_command(self) -> str:
        meta = self.meta
        encoder = meta.get("encoder") if isinstance(meta.get("encoder"), dict) else {}
        return (f"embed.py index --ckpt {encoder.get('path', 'CKPT')} --input "
                f"{meta.get('input', 'INPUT')} --out {self.folder} --overwrite")

    def check_facts(self) -> None:
        """index.json as IndexWriter writes it: an edited or foreign one is one line."""
        meta, encoder = self.meta, self.meta.get("encoder")
        counts = ("chunks", "dim", "documents", "max_chunks", "chunk_tokens", "overlap",
                  "documents_bytes", "generation")
        wrong = [key for key in counts if type(meta.get(key)) is not int or
                 meta[key] < (0 if key == "overlap" else 1)]
        wrong += [] if isinstance(encoder, dict) and all(
            isinstance(encoder.get(key), str) for key in ("path", "sha256")) else ["encoder"]
        wrong += [key for key, allowed in (("pooling", POOLINGS), ("dtype", DTYPES))
                  if meta.get(key) not in allowed]
        modes = meta.get("modes")
        if not (isinstance(modes, list) and modes and set(modes) <= {"dense", "lexical"}):
            wrong.append("modes")
        elif "lexical" in modes and not isinstance(meta.get("lexical"), str):
            wrong.append("lexical")
        wrong += [key for key in ("lexical", "ann") if key in meta and (
            not isinstance(meta[key], str) or os.path.basename(meta[key]) != meta[key])]
        if wrong:
            raise CLIError(f"{self.folder}/{INDEX_FILE}: {', '.join(wrong)} missing or not as "
                           f"embed.py index writes them; rebuild the index: "
                           f"{self.rebuild_command()}")

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """One of the raw files, its first prod(shape) items (it may hold more: an append cut
        short)."""
        path, dtype = self.path(name), DTYPE[name]
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise CLIError(f"cannot read {path}: {(e.strerror or str(e)).lower()}") from None
        if size < math.prod(shape) * np.dtype(dtype).itemsize:
            raise CLIError(f"{path} holds {size:,} bytes, fewer than the {math.prod(shape):,} "
                           f"{np.dtype(dtype)} numbers {INDEX_FILE} says; rebuild the index: "
                           f"{self.rebuild_command()}")
        return map_array(path, dtype, shape)

    def open_lexical(self) -> Lexical:
        """The lexical index, its arrays memory-mapped and checked against each other."""
        folder = self.path(self.meta["lexical"])
        terms = self.npy(os.path.join(folder, "terms.npy"), None, np.int64)
        indptr = self.npy(os.path.join(folder, "indptr.npy"), (len(terms) + 1,), np.int64)
        postings = (int(indptr[-1]),)
        return Lexical({"terms": terms, "indptr": indptr,
                        "texts": self.npy(os.path.join(folder, "texts.npy"), postings, np.int32),
                        "counts": self.npy(os.path.join(folder, "counts.npy"), postings, np.int32),
                        "lengths": self.npy(os.path.join(folder, "lengths.npy"),
                                            (self.meta["documents"],), np.int32)})

    def npy(self, path: str, shape: tuple[int, ...] | None, dtype: type) -> np.ndarray:
        """One of the lexical index's arrays, memory-mapped, checked against what it must be."""
        try:
            array = np.load(path, mmap_mode="r")  # (allow_pickle stays False: data, no code)
        except (OSError, ValueError, EOFError) as e:
            raise CLIError(f"cannot read {path}: {e}; rebuild the index: "
                           f"{self.rebuild_command()}") from None
        if array.dtype != dtype or array.ndim != 1 or (shape and array.shape != shape):
            raise CLIError(f"{path} holds {array.dtype} {array.shape}, not the "
                           f"{np.dtype(dtype)} {shape or '(n,)'} of this index: it is stale or "
                           f"damaged; rebuild the index: {self.rebuild_command()}")
        return array

    def check_mode(self, mode: str) -> None:
        wanted = {"hybrid": ("dense", "lexical")}.get(mode, (mode,))
        missing = [m for m in wanted if m not in self.modes]
        if missing:
            raise CLIError(f"the index {self.folder} has no {missing[0]} part (it was built with "
                           f"--mode {self.mode}); search it with --mode {self.mode}, or rebuild "
                           f"it with --mode {mode}")

    @property
    def mode(self) -> str:
        """What the index was built for: hybrid when it holds both parts."""
        return "hybrid" if len(self.modes) == 2 else self.modes[0]

    def document(self, number: int) -> dict:
        """One document's id, source and text, read from its place in documents.jsonl."""
        path = self.path("documents.jsonl")
        with open(path, "rb") as f:
            f.seek(int(self.offsets[number]))
            line = f.read(int(self.offsets[number + 1] - self.offsets[number]))
        return parse_json(line, f"{path} document {number}")

    def document_numbers(self) -> dict[str, int]:
        """Every document's number by its id."""
        path = self.path("documents.jsonl")
        with open(path, "rb") as f:
            return {parse_json(f.readline(), f"{path} line {number + 1}")["id"]: number
                    for number in range(self.meta["documents"])}

    def search(self, texts: list[str], vectors: torch.Tensor | None, k: int,
               mode: str) -> list[list[Hit]]:
        """The k best documents of each query, best first, by mode: dense (the query's vectors;
        cosine), lexical (its text; BM25) or hybrid (both halves' best CANDIDATES, fused)."""
        if mode == "dense":
            return self.dense(vectors, k)
        if mode == "lexical":
            return [self.lexical_hits(text, k) for text in texts]
        n = max(k, CANDIDATES)
        return [fuse(dense, self.lexical_hits(text, n), k)
                for text, dense in zip(texts, self.dense(vectors, n))]

    def dense(self, queries: torch.Tensor, k: int) -> list[list[Hit]]:
        """The k best documents of each query vector by its best chunk's cosine: exact, or
        through the graph of a large index."""
        n = min(k, self.meta["documents"])
        wanted = (n - 1) * self.meta["max_chunks"] + 1  # rows enough for n distinct documents
        if self.graph is None:
            scores, rows = top_k(self.vectors, queries, wanted)
            return [self.best_documents(r, s, n) for r, s in zip(rows.numpy(), scores.numpy())]
        return [ann.search_documents(self.graph, q, n, wanted, self.best_documents)
                for q in queries.numpy()]

    def lexical_hits(self, text: str, k: int) -> list[Hit]:
        """The k best documents of the query text by BM25 (documents sharing no term with it are
        not found); their chunk is left to result() (-1)."""
        numbers, scores = self.lexical.scores(text)
        if len(scores) > k:  # the k best, unordered, so that only they are sorted
            keep = np.argpartition(-scores, k)[:k]
            numbers, scores = numbers[keep], scores[keep]
        best = np.lexsort((numbers, -scores))  # ties: the earlier document first
        return [(int(numbers[i]), float(scores[i]), -1) for i in best]

    def best_documents(self, chunks: np.ndarray, scores: np.ndarray, k: int) -> list[Hit]:
        """The first k distinct documents of chunks (best first), each with its best chunk."""
        numbers = self.chunks[chunks, 0] if len(chunks) else np.zeros(0, np.int64)
        _, first = np.unique(numbers, return_index=True)
        first = np.sort(first)[:k]
        return [(int(numbers[i]), float(scores[i]), int(chunks[i])) for i in first]

    def result(self, tokenizer: Tokenizer, query: str, rank: int, number: int, score: float,
               chunk: int) -> dict:
        """A search hit: its document (id, source, line, text) and best chunk (tokens, passage);
        a chunk of -1 is the document's that holds the most of the query's terms (by idf)."""
        document = self.document(number)
        ids = tokenizer.encode(document["text"])
        self.check_document(number, document["text"], ids)
        if chunk < 0:
            chunk = self.chunk_of_terms(tokenizer, ids, number, query)
        start, end = self.chunks[chunk, 1:].tolist()
        # a chunk of byte-level tokens may start inside a character: its bytes are no text
        passage = tokenizer.decode(ids[start:end]).lstrip("\ufffd")
        return {"rank": rank, "score": round(score, 6), **document, "tokens": [start, end],
                "passage": passage}

    def check_document(self, number: int, text: str, ids: list[int]) -> None:
        """A document read back as indexed: as many tokens as its chunks cover, as many terms
        as BM25 counted (an edited documents.jsonl, or a lexical index of other texts, is not)."""
        first, end = np.searchsorted(self.chunks[:, 0], [number, number + 1])
        covered = int(self.chunks[end - 1, 2]) if end > first else -1
        if covered != len(ids) or (self.lexical is not None and
                                   int(self.lexical.lengths[number]) != len(terms(text))):
            raise CLIError(f"{self.path('documents.jsonl')} changed since the index was built "
                           f"(document {number + 1} is not the text indexed); rebuild the index: "
                           f"{self.rebuild_command()}")

    def chunk_of_terms(self, tokenizer: Tokenizer, ids: list[int], number: int,
                       query: str) -> int:
        """The chunk of document number whose terms weigh most (the query terms' idf; the first
        chunk of the best)."""
        first, end = np.searchsorted(self.chunks[:, 0], [number, number + 1])
        idf = self.lexical.idf(terms(query))
        weights = [sum(idf.get(t, 0.0) for t in set(terms(tokenizer.decode(ids[s:e]))))
                   for s, e in self.chunks[first:end, 1:].tolist()]
        return int(first + np.argmax(weights))


def fuse(dense: list[Hit], lexical: list[Hit], k: int) -> list[Hit]:
    """Convex score fusion: each half's scores min-max scaled to [0, 1] over the documents it
    returned (a document it did not return scores 0 there), then DENSE_WEIGHT of dense's plus the
    rest of lexical's; a document's chunk is dense's best, where dense found it."""
    scores, chunks = {}, {}
    for weight, hits in ((1 - DENSE_WEIGHT, lexical), (DENSE_WEIGHT, dense)):
        values = [score for _, score, _ in hits]
        low, span = min(values, default=0.0), max(values, default=0.0) - min(values, default=0.0)
        for number, score, chunk in hits:
            scaled = (score - low) / span if span > 0 else 1.0
            scores[number] = scores.get(number, 0.0) + weight * scaled
            chunks[number] = chunk
    order = sorted(scores, key=lambda n: -scores[n])[:k]
    return [(number, scores[number], chunks[number]) for number in order]


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


def retrieval_metrics(hits: Iterable[list[Hit]], relevant: list[int]) -> dict:
    """Recall@1/5/10, MRR@10 and nDCG@10 of each query's relevant document among its hits (best
    first): the share of queries with it in the top k; the mean 1/rank and 1/log2(rank + 1), 0
    past rank 10 (one relevant document: the ideal DCG is 1)."""
    ranks = []
    for found, want in zip(hits, relevant):
        numbers = [number for number, _, _ in found][: max(METRIC_KS)]
        if want in numbers:
            ranks.append(numbers.index(want) + 1)
    n = len(relevant)
    metrics = {f"recall@{k}": sum(r <= k for r in ranks) / n for k in METRIC_KS}
    metrics["mrr@10"] = sum(1 / r for r in ranks) / n
    metrics["ndcg@10"] = sum(1 / math.log2(r + 1) for r in ranks) / n
    return metrics
