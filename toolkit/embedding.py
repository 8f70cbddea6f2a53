"""Text embeddings from a GPT: pooling of its last hidden states, the corpus of texts with ids,
texts cut into token chunks, the encoder's identity, and exact top-k search over the vectors.
embed.py is the command line around it; toolkit/index.py is the index that search reads,
toolkit/contrastive.py the tuning of the encoder.

Pooling follows SGPT (Muennighoff 2022, arXiv:2202.08904). In a causal model only the last position
has seen the whole text, so SGPT's position-weighted mean gives position t (1..n) the weight
t/sum(1..n): later positions, which summarise more of the text, count more. "mean" (equal weights)
and "last" (the last token's state) are the usual alternatives. Texts of a batch are right-padded:
the model is causal, so real positions never see the padding, and pooling reads real positions only;
a text's vector does not depend on its batch. Each text (a chunk, a query, a crop) starts with the
BOS of a tokenizer that puts one before every text (Llama 3's), as HF's tokenizer(text) gives it.
"""
import itertools
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from model import GPT
from toolkit.cli import CLIError
from toolkit.device import autocast
from toolkit.documents import input_files, is_json_lines
from toolkit.files import fingerprint
from toolkit.hf import find_model_dir
from toolkit.model_sources import is_hf_source, load_model
from toolkit.records import holds_json_array, json_records
from toolkit.textfiles import read_lines, read_text
from toolkit.tokenizers import Tokenizer, load_tokenizer

POOLINGS = ("weighted-mean", "mean", "last")
SEARCH_BLOCK_BYTES = 64 * 2**20  # vectors scored per product: memory bounded whatever the index


def pad(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids right-padded with token 0, and each text's length (B,)."""
    lengths = torch.tensor([len(ids) for ids in token_lists], device=device)
    if int(lengths.min()) < 1:
        raise ValueError("cannot embed an empty text (no tokens)")
    ids = torch.zeros(len(token_lists), int(lengths.max()), dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = torch.tensor(tokens)
    return ids.to(device), lengths


def pooling_weights(lengths: torch.Tensor, T: int, pooling: str) -> torch.Tensor:
    """(B, T) weights over positions, each row summing to 1; padding positions weigh 0."""
    position = torch.arange(1, T + 1, device=lengths.device, dtype=torch.float32)
    position = position.expand(len(lengths), T)
    real = position <= lengths[:, None]
    if pooling == "weighted-mean":
        weights = position * real
    elif pooling == "mean":
        weights = real.float()
    elif pooling == "last":
        weights = (position == lengths[:, None]).float()
    else:
        raise ValueError(f"unknown pooling {pooling!r}; choose from {', '.join(POOLINGS)}")
    return weights / weights.sum(dim=1, keepdim=True)


def embed(model: GPT, token_lists: list[list[int]], pooling: str,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, n_embd) float32 unit vectors of the texts, differentiable when autograd is on. The model
    runs under autocast in dtype; pooling and normalisation run in float32."""
    device = next(model.parameters()).device
    ids, lengths = pad(token_lists, device)
    with autocast(device, dtype):
        hidden = model.hidden_states(ids).float()
    with torch.autocast(device.type, enabled=False):  # also when the caller runs under autocast
        weights = pooling_weights(lengths, ids.size(1), pooling)
        pooled = torch.einsum("bt,btc->bc", weights, hidden)
        return F.normalize(pooled, dim=-1)


@torch.no_grad()
def encode(model: GPT, token_lists: list[list[int]], pooling: str, batch_size: int,
           dtype: torch.dtype = torch.float32, desc: str | None = "encoding") -> np.ndarray:
    """(N, n_embd) float32 unit vectors, in batches of similar lengths (less padding; the order of
    the result is the order of token_lists), a progress bar named desc (None: no bar). The model's
    training mode is restored."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    vectors = np.empty((len(token_lists), model.config.n_embd), dtype=np.float32)
    try:
        starts = range(0, len(order), batch_size)
        bar = tqdm(starts, desc=desc, unit="batch", disable=True if desc is None else None,
                   leave=False)
        for start in bar:
            rows = order[start:start + batch_size]
            texts = [token_lists[i] for i in rows]
            vectors[rows] = embed(model, texts, pooling, dtype).cpu().numpy()
    finally:
        model.train(was_training)
    return vectors


# ----- a corpus of texts with ids -----

def batches(items: Iterable, n: int) -> Iterator[list]:
    """items n at a time (the last batch may hold fewer)."""
    items = iter(items)
    while batch := list(itertools.islice(items, n)):
        yield batch


@dataclass
class Document:
    id: str
    text: str
    source: str
    line: int | None  # None: the whole file is the text

    def where(self) -> str:
        return self.source if self.line is None else f"{self.source} line {self.line}"


def record_id(path: str, number: int, value) -> str:
    """Ids are compared as text, so 7 and "7" name the same document."""
    if type(value) not in (str, int):
        raise CLIError(f"{path} line {number}: the id must be a string or an integer, "
                       f"got {value!r}")
    return str(value)


def corpus_documents(path: str, json_key: str, id_key: str, glob: str) -> Iterator[Document]:
    """The non-blank texts of a text file (one per line), a JSON-lines file (one per line, or one
    per item of a JSON array) or a folder (one per file), one at a time, each with its id: a
    record's id_key, else its line number (its position in an array); a file's path in the
    folder."""
    if os.path.isdir(path):
        documents = (Document(os.path.relpath(file, path), read_text(file), file, None)
                     for file in input_files([path], glob))
    elif is_json_lines(path):
        documents = json_documents(path, json_key, id_key)
    else:
        documents = (Document(str(number), line, path, number)
                     for number, line in read_lines(path))
    return (d for d in documents if d.text.strip())


def json_documents(path: str, json_key: str, id_key: str) -> Iterator[Document]:
    array, records = holds_json_array(path), json_records(path, (json_key,), "--json-key")
    for index, (number, record) in enumerate(records, start=1):
        default = str(index if array else number)  # an array's items may share a line
        doc_id = record_id(path, number, record[id_key]) if id_key in record else default
        yield Document(doc_id, record[json_key], path, number)


def read_corpus(path: str, json_key: str, id_key: str, glob: str) -> list[Document]:
    """corpus_documents as a list, each id once."""
    documents, first_use = [], {}
    for d in corpus_documents(path, json_key, id_key, glob):
        if d.id in first_use:
            raise CLIError(f"{d.where()}: id {d.id!r} is already used by {first_use[d.id]}")
        first_use[d.id] = d.where()
        documents.append(d)
    if not documents:
        raise CLIError(f"no texts in {path}; nothing to encode")
    return documents


# ----- the encoder, and texts as token chunks -----

def load_encoder(path: str, device: torch.device) -> tuple[GPT, Tokenizer, dict]:
    """(model in eval mode on device, tokenizer, its facts) of a ckpt.pt or an HF folder."""
    model, facts = load_model(path)
    return model.to(device).eval(), load_tokenizer(facts), facts


def encoder_identity(path: str) -> dict:
    """What an index (or a tuned checkpoint) records of its encoder: its path, and the fingerprint
    of its ckpt.pt or HF folder (even one found by name in the Hugging Face cache)."""
    if os.path.exists(path):
        return {"path": os.path.abspath(path), "sha256": fingerprint(path)}
    if is_hf_source(path):
        return {"path": path, "sha256": fingerprint(find_model_dir(path))}
    raise CLIError(f"checkpoint not found: {path}")


def text_room(model: GPT, tokenizer: Tokenizer) -> int:
    """How many of a text's tokens one vector reads: the block, less the tokenizer's BOS."""
    return model.config.block_size - (tokenizer.bos_id is not None)


def token_ids(tokenizer: Tokenizer, text: str, where: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as e:  # e.g. a character outside a char vocabulary
        raise CLIError(f"{where}: {e}") from None


def settle_chunking(chunk_tokens: int | None, overlap: int | None,
                    room: int) -> tuple[int, int]:
    """(--chunk-tokens, --overlap): by default all the room a text has (text_room), and an eighth
    of a chunk."""
    chunk_tokens = room if chunk_tokens is None else chunk_tokens
    if not 1 <= chunk_tokens <= room:
        raise CLIError(f"--chunk-tokens must be between 1 and the tokens a text may hold, {room}, "
                       f"got {chunk_tokens}")
    overlap = chunk_tokens // 8 if overlap is None else overlap
    if not 0 <= overlap < chunk_tokens:
        raise CLIError(f"--overlap must be at least 0 and less than --chunk-tokens {chunk_tokens}, "
                       f"got {overlap}")
    return chunk_tokens, overlap


def chunk_spans(n: int, chunk_tokens: int, overlap: int) -> list[tuple[int, int]]:
    """(start, end) of the chunks that cover n tokens: chunk_tokens long (the last may be shorter),
    each sharing overlap tokens with the one before."""
    starts = range(0, max(1, n - overlap), chunk_tokens - overlap)
    return [(start, min(start + chunk_tokens, n)) for start in starts]


def chunk_documents(documents: list[Document], tokenizer: Tokenizer, chunk_tokens: int,
                    overlap: int) -> tuple[list[list[int]], np.ndarray]:
    """Each chunk's tokens (after the BOS), and one row per chunk: (document number, first token,
    end token) of the document's tokens."""
    chunks, rows = [], []
    for number, document in enumerate(documents):
        ids = token_ids(tokenizer, document.text, document.where())
        for start, end in chunk_spans(len(ids), chunk_tokens, overlap):
            chunks.append(tokenizer.with_bos(ids[start:end]))
            rows.append((number, start, end))
    return chunks, np.array(rows, dtype=np.int64)


def chunk_records(documents: list[Document], rows: np.ndarray) -> list[dict]:
    """What encode writes of each vector (PREFIX.jsonl): its document, where that came from, and
    which tokens its chunk covers."""
    records, chunk = [], 0
    for i, (number, start, end) in enumerate(rows.tolist()):
        chunk = chunk + 1 if i and rows[i - 1, 0] == number else 0
        d = documents[number]
        records.append({"row": i, "id": d.id, "source": d.source, "line": d.line, "chunk": chunk,
                        "tokens": [start, end]})
    return records


# ----- search -----

def top_k(vectors: np.ndarray, queries: torch.Tensor, k: int,
          block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k rows of vectors (N, C; float16 or float32) by dot product with each query
    (Q, C): (scores, rows), each (Q, k), best first. Rows are scored in blocks with a running
    top-k, so a memory-mapped array is read once, never copied whole (default block:
    SEARCH_BLOCK_BYTES of vectors). float16 vectors are multiplied in float16 (accumulated in
    float32: 20x faster than converting each block), then the k found are scored again in float32,
    so the top k are exact to float16's rounding of a score (about 5e-4)."""
    n, dim = vectors.shape
    block_rows = block_rows or max(1, SEARCH_BLOCK_BYTES // (vectors.itemsize * dim))
    asked = queries.to(torch.float16 if vectors.dtype == np.float16 else torch.float32)
    best_scores = queries.new_empty(len(queries), 0)
    best_rows = torch.empty(len(queries), 0, dtype=torch.long)
    for start in range(0, n, block_rows):
        with warnings.catch_warnings():
            # torch warns that a read-only memory map is not writable
            warnings.simplefilter("ignore")
            block = torch.from_numpy(np.asarray(vectors[start:start + block_rows]))  # no copy
        # block @ asked.T reads the row-major block as it lies (faster than asked @ block.T)
        scores = (block @ asked.T).T.float()
        rows = torch.arange(start, start + scores.size(1)).expand(len(queries), -1)
        candidates = torch.cat([best_scores, scores], dim=1)
        best_scores, picked = candidates.topk(min(k, candidates.size(1)), dim=1)
        best_rows = torch.cat([best_rows, rows], dim=1).gather(1, picked)
    if vectors.dtype != np.float16 or not best_rows.numel():
        return best_scores, best_rows
    found = torch.from_numpy(np.asarray(vectors[best_rows.numpy()], np.float32))  # (Q, k, C)
    best_scores, order = torch.einsum("qkc,qc->qk", found, queries.float()).sort(
        dim=1, descending=True)
    return best_scores, best_rows.gather(1, order)
