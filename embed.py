"""Text embeddings and semantic search with a GPT checkpoint (SGPT's pooling of its last hidden states).

    python embed.py encode --ckpt ckpt/ckpt.pt --input texts.txt --out vectors      # vectors.npy + vectors.jsonl
    python embed.py index --ckpt ckpt/ckpt.pt --input docs.jsonl --out my_index      # a folder that search reads
    python embed.py search --index my_index --query "how do I read a file" --top-k 5
    python embed.py tune --ckpt ckpt/ckpt.pt --pairs pairs.jsonl --out-dir ckpt/tuned   # contrastive fine-tuning
    python embed.py eval --index my_index --pairs queries.jsonl                       # recall@1/5/10, MRR@10

Texts: a text file holds one text per line, a .jsonl/.json file one per JSON line (--json-key; ids from --id-key,
else the line number), a folder one per file (--glob). Texts longer than --chunk-tokens are cut into chunks
with --overlap tokens in common, one vector each. An index records its encoder (path and sha256), tokenizer,
pooling and dtype, so queries are always encoded the same way. File formats: docs/embed.md.
"""
import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np
import torch

from model import GPT
from toolkit import cli, flags
from toolkit.checkpoint import CHECKPOINT_FILE
from toolkit.cli import CLIError
from toolkit.device import describe, resolve_device, resolve_dtype
from toolkit.documents import input_files, is_json_lines, json_lines, open_binary, read_lines
from toolkit.embedding import POOLINGS, embed, encode, info_nce, top_k
from toolkit.files import atomic_write, check_output, lock_folder, read_json, refuse_existing, write_json
from toolkit.flags import option
from toolkit.hf import find_model_dir
from toolkit.load import load_model
from toolkit.optim import make_optimizer
from toolkit.tokenizers import Tokenizer, load_tokenizer
from toolkit.training import LoopConfig, Schedule, TorchEngine, Trainer, claim_out_dir

INDEX_FORMAT = "embed.py index"
INDEX_FILE = "index.json"  # written last: an index is complete when it is there
ENCODER_SUFFIXES = (".json", ".safetensors", ".bin")  # what defines a model in an HF folder
METRIC_KS = (1, 5, 10)


# ----- texts in -----

@dataclass
class Document:
    id: str
    text: str
    source: str
    line: int | None  # None: the whole file is the text

    def where(self) -> str:
        return self.source if self.line is None else f"{self.source} line {self.line}"


def json_records(path: str, keys: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of every non-blank line, each with a string under each key, or a one-line error
    naming file and line."""
    for number, record in json_lines(path):
        if not isinstance(record, dict):
            raise CLIError(f"{path} line {number}: expected a JSON object")
        for key in keys:
            if not isinstance(record.get(key), str):
                raise CLIError(f"{path} line {number}: no string {key!r} key")
        yield number, record


def record_id(path: str, number: int, value) -> str:
    """Ids are compared as text, so 7 and "7" name the same document."""
    if type(value) not in (str, int):
        raise CLIError(f"{path} line {number}: the id must be a string or an integer, got {value!r}")
    return str(value)


def read_corpus(path: str, json_key: str, id_key: str, glob: str) -> list[Document]:
    """The non-blank texts of a text file (one per line), a JSON-lines file (one per line) or a folder (one per
    file), each with a unique id."""
    if os.path.isdir(path):
        documents = [Document(os.path.relpath(file, path), read_text(file), file, None)
                     for file in input_files([path], glob)]
    elif is_json_lines(path):
        documents = []
        for number, record in json_records(path, (json_key,)):
            doc_id = record_id(path, number, record[id_key]) if id_key in record else str(number)
            documents.append(Document(doc_id, record[json_key], path, number))
    else:
        documents = [Document(str(number), line, path, number) for number, line in read_lines(path)]
    documents = [d for d in documents if d.text.strip()]
    if not documents:
        raise CLIError(f"no texts in {path}; nothing to encode")
    first_use = {}
    for d in documents:
        if d.id in first_use:
            raise CLIError(f"{d.where()}: id {d.id!r} is already used by {first_use[d.id]}")
        first_use[d.id] = d.where()
    return documents


def read_text(path: str) -> str:
    with open_binary(path) as f:
        try:
            return f.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise CLIError(f"{path}: invalid UTF-8 at byte offset {e.start}") from None


def token_ids(tokenizer: Tokenizer, text: str, where: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as e:  # e.g. a character outside a char vocabulary
        raise CLIError(f"{where}: {e}") from None


def chunk_spans(n: int, chunk_tokens: int, overlap: int) -> list[tuple[int, int]]:
    """(start, end) of the chunks that cover n tokens: chunk_tokens long (the last may be shorter), each sharing
    overlap tokens with the one before."""
    starts = range(0, max(1, n - overlap), chunk_tokens - overlap)
    return [(start, min(start + chunk_tokens, n)) for start in starts]


def chunk_documents(documents: list[Document], tokenizer: Tokenizer, chunk_tokens: int,
                    overlap: int) -> tuple[list[list[int]], np.ndarray]:
    """The tokens of every chunk, and one row per chunk: (document number, first token, end token)."""
    chunks, rows = [], []
    for number, document in enumerate(documents):
        ids = token_ids(tokenizer, document.text, document.where())
        for start, end in chunk_spans(len(ids), chunk_tokens, overlap):
            chunks.append(ids[start:end])
            rows.append((number, start, end))
    return chunks, np.array(rows, dtype=np.int64)


# ----- the encoder -----

def encoder_sha256(path: str) -> str | dict[str, str]:
    """The sha256 of a ckpt.pt, or of each file that defines an HF folder's model (config, weights, tokenizer
    facts) by name: the encoder's identity wherever it lies."""
    if os.path.isfile(path):
        return sha256(path)
    if os.path.isdir(path) or not path.endswith(".pt"):
        folder = find_model_dir(path)
        return {name: sha256(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
                if name.endswith(ENCODER_SUFFIXES) and not name.startswith(".")}
    raise CLIError(f"checkpoint not found: {path}")


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**20):
            digest.update(block)
    return digest.hexdigest()


def encoder_identity(path: str) -> dict:
    """What an index records of its encoder: where it was, and what it was."""
    return {"path": os.path.abspath(path) if os.path.exists(path) else path, "sha256": encoder_sha256(path)}


def load_encoder(path: str, device: torch.device) -> tuple[GPT, Tokenizer, dict]:
    """(model in eval mode on device, its tokenizer, the tokenizer facts) of a ckpt.pt or an HF GPT-2 folder."""
    model, facts = load_model(path)
    return model.to(device).eval(), load_tokenizer(facts), facts


def settle_chunking(args: argparse.Namespace, model: GPT) -> None:
    """--chunk-tokens defaults to the model's block size, --overlap to an eighth of a chunk."""
    block_size = model.config.block_size
    args.chunk_tokens = args.chunk_tokens or block_size
    if not 1 <= args.chunk_tokens <= block_size:
        raise CLIError(f"--chunk-tokens must be between 1 and the model's block size {block_size}, "
                       f"got {args.chunk_tokens}")
    args.overlap = args.chunk_tokens // 8 if args.overlap is None else args.overlap
    if not 0 <= args.overlap < args.chunk_tokens:
        raise CLIError(f"--overlap must be at least 0 and less than --chunk-tokens {args.chunk_tokens}, "
                       f"got {args.overlap}")


def encode_corpus(args: argparse.Namespace) -> tuple[list[Document], np.ndarray, np.ndarray, dict]:
    """Read, chunk and encode --input with --ckpt: (documents, rows, vectors, the encoding's facts)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer, facts = load_encoder(args.ckpt, device)
    settle_chunking(args, model)
    documents = read_corpus(args.input, args.json_key, args.id_key, args.glob)
    chunks, rows = chunk_documents(documents, tokenizer, args.chunk_tokens, args.overlap)
    start = time.perf_counter()
    vectors = encode(model, chunks, args.pooling, args.batch_size, dtype)
    seconds = time.perf_counter() - start
    print(f"encoded {len(documents):,} texts as {len(chunks):,} vectors of {vectors.shape[1]} in {seconds:.1f} s "
          f"({len(documents) / seconds:,.0f} texts/s; {describe(device)}, {args.pooling} pooling)", file=sys.stderr)
    encoding = {"encoder": encoder_identity(args.ckpt), "tokenizer": facts, "pooling": args.pooling,
                "dtype": str(dtype).removeprefix("torch."), "chunk_tokens": args.chunk_tokens, "overlap": args.overlap}
    return documents, rows, vectors, encoding


# ----- files out -----

def save_array(path: str, array: np.ndarray) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.save would add .npy to the temporary name
            np.save(f, array)

    atomic_write(path, write)


def write_jsonl(path: str, records: list[dict]) -> np.ndarray:
    """Write records as JSON lines, atomically; returns the byte offset of every line and of the end."""
    lines = [(json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in records]

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.writelines(lines)

    atomic_write(path, write)
    return np.cumsum([0] + [len(line) for line in lines], dtype=np.int64)


def row_records(documents: list[Document], rows: np.ndarray) -> list[dict]:
    """encode's PREFIX.jsonl: each vector's document, where that came from, and which tokens it covers."""
    records, chunk = [], 0
    for i, (number, start, end) in enumerate(rows.tolist()):
        chunk = chunk + 1 if i and rows[i - 1, 0] == number else 0
        d = documents[number]
        records.append({"row": i, "id": d.id, "source": d.source, "line": d.line, "chunk": chunk,
                        "tokens": [start, end]})
    return records


def check_outputs(outputs: list[str], inputs: list[str], flag: str, overwrite: bool) -> None:
    for path in outputs:
        check_output(path, inputs, flag)
    refuse_existing(outputs, overwrite)


def encode_command(args: argparse.Namespace) -> None:
    outputs = [args.out + ".npy", args.out + ".jsonl"]
    check_outputs(outputs, [args.input, args.ckpt], "--out", args.overwrite)
    documents, rows, vectors, _ = encode_corpus(args)
    save_array(outputs[0], vectors)
    write_jsonl(outputs[1], row_records(documents, rows))
    print(f"wrote {outputs[0]} ({vectors.shape[0]:,} x {vectors.shape[1]} float32) and {outputs[1]}")


# ----- the index -----

def index_command(args: argparse.Namespace) -> None:
    paths = {name: os.path.join(args.out, name)
             for name in ("vectors.npy", "rows.npy", "documents.jsonl", "offsets.npy", INDEX_FILE)}
    check_outputs(list(paths.values()), [args.input, args.ckpt], "--out", args.overwrite)
    documents, rows, vectors, encoding = encode_corpus(args)
    lock_folder(args.out)  # one writer at a time
    if os.path.exists(paths[INDEX_FILE]):  # --overwrite: the folder is no index until the new one is complete
        os.remove(paths[INDEX_FILE])
    save_array(paths["vectors.npy"], vectors)
    save_array(paths["rows.npy"], rows)
    offsets = write_jsonl(paths["documents.jsonl"], [{"id": d.id, "source": d.source, "line": d.line,
                                                      "text": d.text} for d in documents])
    save_array(paths["offsets.npy"], offsets)
    write_json(paths[INDEX_FILE], {
        "format": INDEX_FORMAT, "version": 1, **encoding, "documents": len(documents), "rows": len(rows),
        "dim": vectors.shape[1], "max_chunks": int(np.bincount(rows[:, 0]).max()),
        "input": os.path.abspath(args.input), "json_key": args.json_key, "id_key": args.id_key, "glob": args.glob})
    print(f"wrote index {args.out}: {len(documents):,} documents, {len(rows):,} vectors of {vectors.shape[1]}")


class Index:
    """An index folder opened for search: its facts, and its arrays memory-mapped (opening reads no vectors)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.meta = read_json(os.path.join(folder, INDEX_FILE), "index")
        if self.meta.get("format") != INDEX_FORMAT:
            raise CLIError(f"{folder} is not an index of embed.py (its {INDEX_FILE} has no format {INDEX_FORMAT!r})")
        self.vectors = self.array("vectors.npy", (self.meta["rows"], self.meta["dim"]))
        self.rows = self.array("rows.npy", (self.meta["rows"], 3))
        self.offsets = self.array("offsets.npy", (self.meta["documents"] + 1,))

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        path = os.path.join(self.folder, name)
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read {path}: {e}") from None
        if array.shape != shape:
            raise CLIError(f"{path} holds an array of shape {array.shape} but {INDEX_FILE} says {shape}; rebuild "
                           f"the index")
        return array

    def document(self, number: int) -> dict:
        """One document's id, source and text, read from its place in documents.jsonl."""
        with open(os.path.join(self.folder, "documents.jsonl"), "rb") as f:
            f.seek(int(self.offsets[number]))
            return json.loads(f.read(int(self.offsets[number + 1] - self.offsets[number])))

    def document_numbers(self) -> dict[str, int]:
        """Every document's number by its id."""
        with open(os.path.join(self.folder, "documents.jsonl"), encoding="utf-8") as f:
            return {json.loads(line)["id"]: number for number, line in enumerate(f)}

    def search(self, queries: torch.Tensor, k: int) -> list[list[tuple[int, float, int]]]:
        """The k best documents of each query, best first: (document number, score, row of its best chunk).
        A document scores as its best chunk; enough rows are taken for k distinct documents even when the
        best rows are all chunks of a few documents."""
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


def open_encoder(index: Index, ckpt: str | None, device: torch.device) -> tuple[GPT, Tokenizer]:
    """The index's encoder, from --ckpt or the path the index recorded; refused unless its files have the
    sha256 the index recorded (another model, another tokenizer, or the same file since changed)."""
    recorded = index.meta["encoder"]
    path = ckpt or recorded["path"]
    if encoder_sha256(path) != recorded["sha256"]:
        if ckpt is None:
            raise CLIError(f"the encoder {path} changed since the index {index.folder} was built (sha256 differs); "
                           f"rebuild the index, or pass --ckpt with the checkpoint it was built with")
        raise CLIError(f"--ckpt {ckpt} is not the encoder of the index {index.folder}, which was built with "
                       f"{recorded['path']} (sha256 differs); queries must be encoded by the same model")
    model, tokenizer, _ = load_encoder(path, device)
    return model, tokenizer


def encode_queries(model: GPT, tokenizer: Tokenizer, index: Index, texts: list[str], places: list[str],
                   batch_size: int, device: torch.device) -> torch.Tensor:
    """Queries encoded as the index's texts were: same pooling and dtype, cut to the index's chunk length."""
    meta = index.meta
    token_lists = [token_ids(tokenizer, text, place)[: meta["chunk_tokens"]] for text, place in zip(texts, places)]
    dtype = resolve_dtype(meta["dtype"], device)
    return torch.from_numpy(encode(model, token_lists, meta["pooling"], batch_size, dtype, desc="queries"))


def search_command(args: argparse.Namespace) -> None:
    if args.top_k < 1:
        raise CLIError(f"--top-k must be at least 1, got {args.top_k}")
    for query in args.query:
        if not query.strip():
            raise CLIError("--query is empty")
    index = Index(args.index)
    device = resolve_device(args.device)
    model, tokenizer = open_encoder(index, args.ckpt, device)
    places = [f"--query {q!r}" for q in args.query]
    queries = encode_queries(model, tokenizer, index, args.query, places, args.batch_size, device)
    for query, hits in zip(args.query, index.search(queries, args.top_k)):
        results = [search_result(index, tokenizer, rank, *hit) for rank, hit in enumerate(hits, 1)]
        if args.json:
            print(json.dumps({"query": query, "results": results}, ensure_ascii=False))
        else:
            print_table(query, results)


def search_result(index: Index, tokenizer: Tokenizer, rank: int, number: int, score: float, row: int) -> dict:
    """A hit as search prints it: the document (id, source, text) and its best chunk (tokens, passage)."""
    document = index.document(number)
    start, end = index.rows[row, 1:].tolist()
    passage = tokenizer.decode(tokenizer.encode(document["text"])[start:end])
    return {"rank": rank, "score": round(score, 6), **document, "tokens": [start, end], "passage": passage}


def print_table(query: str, results: list[dict]) -> None:
    print(f"query: {query}")
    width = max(len("id"), *(len(r["id"]) for r in results))
    print(f"{'rank':>4}  {'score':>7}  {'id':<{width}}  passage")
    for r in results:
        text = " ".join(r["passage"].split())
        print(f"{r['rank']:>4}  {r['score']:7.4f}  {r['id']:<{width}}  {text[:70] + '...' if len(text) > 73 else text}")
    print()


# ----- evaluation -----

def read_eval_pairs(path: str, ids: dict[str, int], index_folder: str) -> tuple[list[str], list[str], list[int]]:
    """(queries, their places, the number of each one's relevant document) from {"query", "id"} lines."""
    queries, places, relevant = [], [], []
    for number, record in json_records(path, ("query",)):
        if not record["query"].strip():
            raise CLIError(f"{path} line {number}: 'query' is empty")
        if "id" not in record:
            raise CLIError(f"{path} line {number}: no 'id' key")
        doc_id = record_id(path, number, record["id"])
        if doc_id not in ids:
            raise CLIError(f"{path} line {number}: id {doc_id!r} is not a document of the index {index_folder}")
        queries.append(record["query"])
        places.append(f"{path} line {number}")
        relevant.append(ids[doc_id])
    if not queries:
        raise CLIError(f"no pairs in {path}")
    return queries, places, relevant


def retrieval_metrics(ranks: list[int | None]) -> dict:
    """Recall@k and MRR@10 of the relevant documents' ranks (0 = first; None = not in the top 10)."""
    found = [r for r in ranks if r is not None]
    metrics = {f"recall@{k}": sum(r < k for r in found) / len(ranks) for k in METRIC_KS}
    metrics["mrr@10"] = sum(1 / (r + 1) for r in found) / len(ranks)
    return {**metrics, "queries": len(ranks)}


def eval_command(args: argparse.Namespace) -> None:
    index = Index(args.index)
    queries, places, relevant = read_eval_pairs(args.pairs, index.document_numbers(), args.index)
    device = resolve_device(args.device)
    model, tokenizer = open_encoder(index, args.ckpt, device)
    vectors = encode_queries(model, tokenizer, index, queries, places, args.batch_size, device)
    ranks = []
    for hits, want in zip(index.search(vectors, max(METRIC_KS)), relevant):
        numbers = [number for number, _, _ in hits]
        ranks.append(numbers.index(want) if want in numbers else None)
    metrics = retrieval_metrics(ranks)
    for name, value in metrics.items():
        print(f"{name:10s} {value}" if name == "queries" else f"{name:10s} {value:.4f}")
    print(json.dumps(metrics))


# ----- contrastive fine-tuning -----

def read_tune_pairs(path: str, tokenizer: Tokenizer, max_tokens: int) -> list[tuple[list[int], ...]]:
    """(query, positive[, negative]) token lists from JSON lines, each cut to max_tokens (the block size)."""
    pairs = []
    for number, record in json_records(path, ("query", "positive")):
        fields = ["query", "positive"]
        if "negative" in record:
            if not isinstance(record["negative"], str):
                raise CLIError(f"{path} line {number}: 'negative' must be a string")
            fields.append("negative")
        texts = []
        for field in fields:
            ids = token_ids(tokenizer, record[field], f"{path} line {number}")[:max_tokens]
            if not ids:
                raise CLIError(f"{path} line {number}: {field!r} is empty")
            texts.append(ids)
        pairs.append(tuple(texts))
    if not pairs:
        raise CLIError(f"no pairs in {path}")
    return pairs


@dataclass
class TuneConfig:
    ckpt: str = option(None, "the model to tune: a ckpt.pt, or an HF GPT-2 folder / cached name", required=True)
    pairs: str = option(None, 'JSON lines {"query": ..., "positive": ...[, "negative": ...]}', required=True)
    out_dir: str = option(None, "where ckpt.pt and tensorboard/ go", required=True)
    overwrite: bool = option(False, "replace a ckpt.pt in --out-dir")
    bias_only: bool = option(False, "train the bias parameters only (SGPT's BitFit)")
    pooling: str = option("weighted-mean", "as encode's", choices=list(POOLINGS))
    temperature: float = option(0.05, "InfoNCE temperature", check="positive-number")
    max_iters: int = option(200, "optimizer steps", check="positive")
    batch_size: int = option(32, "pairs per step, in each process; each query's negatives are the other pairs' "
                                 "documents", check="positive")
    lr: float = option(1e-4, "peak learning rate", check="positive-number")
    warmup_iters: int = option(10, "linear warmup steps, then cosine decay to lr/10", check="non-negative")
    weight_decay: float = option(0.0, "AdamW weight decay (2-D weights only)", check="non-negative-number")
    beta1: float = option(0.9, "AdamW beta1", check="probability")
    beta2: float = option(0.99, "AdamW beta2", check="probability")
    grad_clip: float = option(1.0, "clip gradients at this global norm (0 = off)", check="non-negative-number")
    seed: int = option(1337, "seed of the batch order")
    log_interval: int = option(10, "print the training loss every N steps", check="positive")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "autocast dtype; auto = bfloat16 where the hardware computes it natively, else "
                                "float32", choices=["auto", "float32", "bfloat16"])
    tensorboard_dir: str | None = option(None, "TensorBoard log dir (default OUT_DIR/tensorboard)")
    run_name: str | None = option(None, "TensorBoard run name (default: the start time)", check="folder-name")


def train_bias_only(model: GPT) -> None:
    """SGPT's BitFit variant: only the bias parameters (linear layers and LayerNorms) learn."""
    for name, p in model.named_parameters():
        p.requires_grad = name.endswith(".bias")
    if not any(p.requires_grad for p in model.parameters()):
        raise CLIError("--bias-only: this model has no bias parameters (it was trained with --no-bias)")


class Contrastive:
    """The loop's objective for tune: InfoNCE of each batch of pairs, each query against all positives of the batch,
    then the hard negatives it holds. Every epoch is a new seeded permutation of the pairs; an incomplete last batch
    is left out, so every batch has the same number of in-batch negatives."""

    def __init__(self, cfg: TuneConfig, model: GPT, facts: dict, pairs: list[tuple[list[int], ...]],
                 dtype: torch.dtype):
        self.cfg, self.model, self.facts, self.pairs, self.dtype = cfg, model, facts, pairs, dtype
        self.batch_size = min(cfg.batch_size, len(pairs))

    def micro_batches(self, step: int) -> list[tuple[list[tuple[list[int], ...]], float]]:
        epoch, index = divmod(step, len(self.pairs) // self.batch_size)
        order = torch.randperm(len(self.pairs), generator=torch.Generator().manual_seed(self.cfg.seed + epoch))
        rows = order[index * self.batch_size:][: self.batch_size].tolist()
        return [([self.pairs[i] for i in rows], 1.0)]

    def loss(self, model: GPT, batch: list[tuple[list[int], ...]]) -> torch.Tensor:
        queries = embed(model, [pair[0] for pair in batch], self.cfg.pooling, self.dtype)
        documents = embed(model, [pair[1] for pair in batch] + [pair[2] for pair in batch if len(pair) > 2],
                          self.cfg.pooling, self.dtype)
        with torch.autocast(queries.device.type, enabled=False):  # the scores in float32, whatever the model ran in
            return info_nce(queries, documents, self.cfg.temperature)

    def throughput(self) -> tuple[int, str, None]:
        return self.batch_size, "pairs", None

    def evaluate(self, engine) -> dict:
        return {}  # `embed.py eval` measures recall against an index

    def good_weights(self, engine) -> bool:
        return engine.weights_finite()

    def checkpoint_state(self, best: dict | None) -> dict:
        cfg = self.cfg
        return {"model_config": asdict(self.model.config), "train_config": asdict(cfg), "tokenizer": self.facts,
                "embedding": {"base": encoder_identity(cfg.ckpt), "pairs": os.path.abspath(cfg.pairs),
                              "pooling": cfg.pooling, "temperature": cfg.temperature, "bias_only": cfg.bias_only}}


def tune_command(args: argparse.Namespace) -> None:
    cfg = TuneConfig(**flags.values(args, TuneConfig))
    flags.check_values(cfg)
    cfg.run_name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
    check_outputs([path], [cfg.ckpt, cfg.pairs], "--out-dir", cfg.overwrite)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    model, tokenizer, facts = load_encoder(cfg.ckpt, device)
    pairs = read_tune_pairs(cfg.pairs, tokenizer, model.config.block_size)
    if cfg.bias_only:
        train_bias_only(model)
    model.train()
    objective = Contrastive(cfg, model, facts, pairs, dtype)
    optimizer = make_optimizer(model, "adamw", cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                               device_type=device.type)
    engine = TorchEngine(path, model, model, optimizer, device, dtype, objective.loss, cfg.grad_clip)
    claim_out_dir(cfg.out_dir, path, resuming=False, overwrite=True)  # check_outputs refused an existing one
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"tuning {trained / 1e6:.3f}M of {model.num_params(non_embedding=False) / 1e6:.3f}M parameters on "
          f"{len(pairs):,} pairs, batch {objective.batch_size}, {cfg.pooling} pooling, temperature "
          f"{cfg.temperature}; device {describe(device)}, dtype {str(dtype).removeprefix('torch.')}")
    loop = LoopConfig(max_iters=cfg.max_iters, log_interval=cfg.log_interval,
                      hint="a lower --lr or a higher --temperature")
    schedule = Schedule(cfg.lr, cfg.warmup_iters, cfg.max_iters, cfg.lr / 10)
    Trainer(engine, objective, schedule, loop, cfg.out_dir, cfg.run_name, cfg.tensorboard_dir, desc="tune").fit()


# ----- the command line -----

def add_encoding_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="the encoder: a ckpt.pt, or an HF GPT-2 folder / cached name")
    p.add_argument("--input", required=True, help="a text file (one text per line), a .jsonl/.json file (one text "
                                                  "per JSON line) or a folder (one text per file); .gz/.bz2/.xz read")
    p.add_argument("--json-key", default="text", help="field holding the text in JSON lines (default: %(default)s)")
    p.add_argument("--id-key", default="id", help="field holding a JSON line's id; a line without it is named by "
                                                  "its line number (default: %(default)s)")
    p.add_argument("--glob", default="*.txt", help="file name pattern inside an --input folder (default: %(default)s)")
    p.add_argument("--pooling", choices=POOLINGS, default="weighted-mean",
                   help="weighted-mean: SGPT's position-weighted mean of the last hidden states (default); mean; "
                        "last: the last token's state")
    p.add_argument("--chunk-tokens", type=int, help="longer texts are cut into chunks of this many tokens, one "
                                                    "vector each (default: the model's block size)")
    p.add_argument("--overlap", type=int, help="tokens each chunk shares with the one before (default: an eighth "
                                               "of --chunk-tokens)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="autocast dtype of the model, recorded in an index for its queries; auto = bfloat16 where "
                        "the hardware computes it natively, else float32 (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=16,
                   help="texts per forward pass, in each process (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: %(default)s)")


def add_index_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", required=True, help="an index folder written by `embed.py index`")
    p.add_argument("--ckpt", help="the index's encoder at another path (default: the path it records); refused "
                                  "unless its sha256 is the one recorded")


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_flags(p, TuneConfig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.argument_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run, description: str) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=description, description=description, allow_abbrev=False)
        p.set_defaults(run=run)
        return p

    p = command("encode", encode_command, "texts -> PREFIX.npy (float32 unit vectors) + PREFIX.jsonl (one line per "
                                          "vector: id, source, chunk)")
    add_encoding_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.npy and PREFIX.jsonl")

    p = command("index", index_command, "a corpus -> an index folder: vectors, ids, texts and the encoder's identity")
    add_encoding_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the index folder")

    p = command("search", search_command, "the top-k documents of each query by cosine score, exact")
    add_index_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--query", action="append", required=True, help="a query; repeat for several")
    p.add_argument("--top-k", type=int, default=10, help="documents per query (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON line per query instead of a table")

    p = command("eval", eval_command, 'recall@1/5/10 and MRR@10 of {"query", "id"} lines against an index; the last '
                                      "line printed is JSON")
    add_index_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--pairs", required=True, help='JSON lines {"query": ..., "id": the relevant document\'s id}')

    p = command("tune", tune_command, "contrastive fine-tuning (InfoNCE, in-batch negatives) -> OUT_DIR/ckpt.pt, "
                                      "still a GPT")
    add_tune_arguments(p)

    args = parser.parse_args(argv)
    if getattr(args, "batch_size", 1) < 1:
        raise CLIError(f"--batch-size must be at least 1, got {args.batch_size}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    cli.run(main)
