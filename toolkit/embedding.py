"""Text embeddings from a GPT: pooling of its last hidden states, texts cut into token chunks, the
encoder's identity, exact top-k search over the vectors, and contrastive tuning (InfoNCE) of the GPT
as an encoder. embed.py is the command line around it; toolkit/index.py is the index that search
reads.

Pooling follows SGPT (Muennighoff 2022, arXiv:2202.08904). In a causal model only the last position
has seen the whole text, so SGPT's position-weighted mean gives position t (1..n) the weight
t/sum(1..n): later positions, which summarise more of the text, count more. "mean" (equal weights)
and "last" (the last token's state) are the usual alternatives. Texts of a batch are right-padded:
the model is causal, so real positions never see the padding, and pooling reads real positions only;
a text's vector does not depend on its batch. Each text (a chunk, a query, a crop) starts with the
BOS of a tokenizer that puts one before every text (Llama 3's), as HF's tokenizer(text) gives it.
"""
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from model import GPT
from toolkit import flags
from toolkit.checkpoint import CHECKPOINT_FILE, run_state
from toolkit.cli import CLIError
from toolkit.config import RunConfig, settle_run
from toolkit.device import autocast, describe, run_device
from toolkit.documents import (holds_json_array, input_files, is_json_lines, json_records,
                               read_lines, read_text)
from toolkit.files import check_output, claim_out_dir, fingerprint, refuse_existing
from toolkit.flags import option
from toolkit.hf import find_model_dir
from toolkit.lora import lora_base
from toolkit.model_sources import is_hf_source, load_model
from toolkit.optim import Schedule
from toolkit.tokenizers import Tokenizer, load_tokenizer
from toolkit.training import Engine, LoopConfig, Objective, TorchEngine, Trainer

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
           dtype: torch.dtype = torch.float32, desc: str = "encoding") -> np.ndarray:
    """(N, n_embd) float32 unit vectors, in batches of similar lengths (less padding; the order of
    the result is the order of token_lists). The model's training mode is restored."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    vectors = np.empty((len(token_lists), model.config.n_embd), dtype=np.float32)
    try:
        starts = range(0, len(order), batch_size)
        for start in tqdm(starts, desc=desc, unit="batch", disable=None, leave=False):
            rows = order[start:start + batch_size]
            texts = [token_lists[i] for i in rows]
            vectors[rows] = embed(model, texts, pooling, dtype).cpu().numpy()
    finally:
        model.train(was_training)
    return vectors


# ----- a corpus of texts with ids -----

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


def read_corpus(path: str, json_key: str, id_key: str, glob: str) -> list[Document]:
    """The non-blank texts of a text file (one per line), a JSON-lines file (one per line, or one
    per item of a JSON array) or a folder (one per file), each with a unique id: a record's id_key,
    else its line number (its position in an array); a file's path in the folder."""
    if os.path.isdir(path):
        documents = [Document(os.path.relpath(file, path), read_text(file), file, None)
                     for file in input_files([path], glob)]
    elif is_json_lines(path):
        documents, array = [], holds_json_array(path)
        for index, (number, record) in enumerate(json_records(path, (json_key,)), start=1):
            default = str(index if array else number)  # an array's items may share a line
            doc_id = record_id(path, number, record[id_key]) if id_key in record else default
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
    """Exact top-k rows of vectors (N, C) by dot product with each query (Q, C): (scores, rows),
    each (Q, k), best first. Rows are scored in blocks with a running top-k, so a memory-mapped
    array is read once, never copied whole (default block: SEARCH_BLOCK_BYTES of vectors)."""
    n, dim = vectors.shape
    block_rows = block_rows or max(1, SEARCH_BLOCK_BYTES // (4 * dim))
    best_scores = queries.new_empty(len(queries), 0)
    best_rows = torch.empty(len(queries), 0, dtype=torch.long)
    for start in range(0, n, block_rows):
        with warnings.catch_warnings():
            # torch warns that a read-only memory map is not writable
            warnings.simplefilter("ignore")
            block = torch.from_numpy(vectors[start:start + block_rows])  # its memory, not a copy
        # block @ queries.T reads the row-major block as it lies (faster than queries @ block.T)
        scores = (block @ queries.T).T
        rows = torch.arange(start, start + scores.size(1)).expand(len(queries), -1)
        candidates = torch.cat([best_scores, scores], dim=1)
        best_scores, picked = candidates.topk(min(k, candidates.size(1)), dim=1)
        best_rows = torch.cat([best_rows, rows], dim=1).gather(1, picked)
    return best_scores, best_rows


# ----- contrastive tuning: embed.py tune -----

@dataclass(frozen=True)
class TuneConfig(RunConfig):
    """embed.py tune's options: the trainers' (RunConfig), with its own defaults for some."""
    ckpt: str = option(None, "the model to tune: a ckpt.pt, or an HF GPT-2, Llama or Qwen3 "
                             "folder / cached name", required=True)
    input: str | None = option(None, "documents to learn from, read as index's --input: two "
                                     "random spans of one document are a positive pair, the other "
                                     "documents of the batch its negatives (Contriever); no labels "
                                     "needed")
    json_key: str = option("text", "field holding the text in --input's JSON lines")
    glob: str = option("*.txt", "file name pattern inside an --input folder")
    pairs: str | None = option(None, 'labelled pairs, JSON lines {"query": ..., "positive": '
                                     '...[, "negative": ...]}; with --input or alone')
    out_dir: str = option(None, "where the checkpoint, the loss curve and the TensorBoard logs go",
                          required=True)
    crop_tokens: int | None = option(None, "the longest span cut from a document (default: the "
                                           "block size, less a BOS); spans are a quarter of it "
                                           "to all of it",
                                     check="positive")
    val_fraction: float = option(0.1, "documents and pairs held out (10 at least, from 40 "
                                      "examples on; 0: none) to keep the best checkpoint by their "
                                      "InfoNCE loss, the untuned encoder's included",
                                 check="probability")
    bias_only: bool = option(False, "train the bias parameters only (SGPT's BitFit)")
    pooling: str = option("weighted-mean", "as encode's", choices=list(POOLINGS))
    temperature: float = option(0.1, "InfoNCE temperature", check="positive-number")
    max_iters: int = option(200, "optimizer steps", check="positive")
    lr: float = option(1e-3, "peak learning rate", check="positive-number")
    warmup_iters: int = option(10, "linear warmup steps, then cosine decay to lr/10",
                               check="non-negative")
    weight_decay: float = option(0.0, "AdamW weight decay (2-D weights only)",
                                 check="non-negative-number")
    grad_clip: float = option(0.0, "clip gradients at this global norm (0 = off: at 1 recall@10 "
                                   "gained nothing, docs/performance.md)",
                              check="non-negative-number")


def read_tune_pairs(path: str, tokenizer: Tokenizer,
                    max_tokens: int) -> list[tuple[list[int], ...]]:
    """(query, positive[, negative]) token lists from JSON lines, each cut to max_tokens (its
    text_room), then after the BOS."""
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
            texts.append(tokenizer.with_bos(ids))
        pairs.append(tuple(texts))
    if not pairs:
        raise CLIError(f"no pairs in {path}")
    return pairs


def train_bias_only(model: GPT) -> None:
    """SGPT's BitFit variant: only the bias parameters (linear layers and LayerNorms) learn."""
    for name, p in model.named_parameters():
        p.requires_grad = name.endswith(".bias")
    if not any(p.requires_grad for p in model.parameters()):
        raise CLIError(f"--bias-only: this model has no bias parameters (its family, "
                       f"{model.config.arch}, was trained without: --arch llama has none, "
                       "--arch gpt2 has them unless --no-bias)")


class Contrastive(Objective):
    """The loop's objective for tune: InfoNCE of each batch of examples, each query against all
    positives of the batch, then the hard negatives it holds. An example is a labelled pair, or a
    document whose two random spans (crops, seeded by the step) are the query and its positive.
    Every epoch is a new seeded permutation of the examples; an incomplete last batch is left out,
    so every batch has the same number of in-batch negatives. A held-out share of the examples,
    with crops drawn once, is the evaluation: its InfoNCE loss among themselves."""

    def __init__(self, cfg: TuneConfig, model: GPT, tokenizer: Tokenizer, facts: dict,
                 examples: list, dtype: torch.dtype):
        self.cfg, self.model, self.facts, self.dtype = cfg, model, facts, dtype
        self.with_bos = tokenizer.with_bos
        room = text_room(model, tokenizer)
        self.crop_tokens = min(cfg.crop_tokens or room, room)
        order = torch.randperm(len(examples),
                               generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        # a tenth, 10 at least (fewer say little), from 40 examples on (30 or more left to learn
        # from)
        held = (max(10, int(len(examples) * cfg.val_fraction))
                if cfg.val_fraction and len(examples) >= 40 else 0)
        self.examples = [examples[i] for i in order[held:]]
        self.val = self.crops([examples[i] for i in order[:held]], np.random.default_rng(cfg.seed))
        self.batch_size = min(cfg.batch_size, len(self.examples))

    def crops(self, examples: list, rng: np.random.Generator) -> list[tuple[list[int], ...]]:
        """Pairs as they are; each document as two spans of crop_tokens / 4 to crop_tokens
        tokens, each after the BOS."""
        def span(ids: list[int]) -> list[int]:
            n = min(len(ids),
                    int(rng.integers(max(1, self.crop_tokens // 4), self.crop_tokens + 1)))
            start = int(rng.integers(0, len(ids) - n + 1))
            return self.with_bos(ids[start:start + n])

        return [example if isinstance(example, tuple) else (span(example), span(example))
                for example in examples]

    def micro_batches(self, step: int) -> list[tuple[list[tuple[list[int], ...]], float]]:
        epoch, index = divmod(step, len(self.examples) // self.batch_size)
        seeded = torch.Generator().manual_seed(self.cfg.seed + epoch)
        order = torch.randperm(len(self.examples), generator=seeded)
        rows = order[index * self.batch_size:][: self.batch_size].tolist()
        rng = np.random.default_rng([self.cfg.seed, step])  # a step's crops, the same when resumed
        return [(self.crops([self.examples[i] for i in rows], rng), 1.0)]

    def loss(self, model: GPT, batch: list[tuple[list[int], ...]]) -> torch.Tensor:
        positives = [pair[1] for pair in batch]
        negatives = [pair[2] for pair in batch if len(pair) > 2]
        queries = embed(model, [pair[0] for pair in batch], self.cfg.pooling, self.dtype)
        documents = embed(model, positives + negatives, self.cfg.pooling, self.dtype)
        # InfoNCE in float32, whatever dtype the model ran in: documents[i] is the positive of
        # queries[i], every other document (other positives, hard negatives after them) a negative;
        # and both ways (as CLIP): queries[i] is also the one for documents[i] among the queries
        with torch.autocast(queries.device.type, enabled=False):
            logits = queries @ documents.T / self.cfg.temperature
            labels = torch.arange(len(queries), device=queries.device)
            return (F.cross_entropy(logits, labels) +
                    F.cross_entropy(logits[:, :len(queries)].T, labels)) / 2

    def throughput(self) -> tuple[int, str, None]:
        return self.batch_size, "pairs", None

    def evaluate(self, engine: Engine) -> dict[str, float]:
        """The held-out examples' InfoNCE loss (none held out: no evaluation; `embed.py eval`
        measures recall against an index)."""
        if not self.val:
            return {}
        self.model.eval()
        with torch.no_grad():
            loss = self.loss(self.model, self.val).item()
        self.model.train()
        return {"val_loss": round(loss, 4)}

    def checkpoint_state(self, best: dict | None) -> dict:
        cfg = self.cfg
        sources = {"input": cfg.input and os.path.abspath(cfg.input),
                   "pairs": cfg.pairs and os.path.abspath(cfg.pairs)}
        embedding = {"base": encoder_identity(cfg.ckpt), **sources, "pooling": cfg.pooling,
                     "temperature": cfg.temperature, "bias_only": cfg.bias_only, "val": best}
        return {**run_state(self.model, cfg, self.facts), "embedding": embedding}


def setup_tune(cfg: TuneConfig) -> Trainer:
    """The tune run, ready to fit: the options checked, the encoder and its pairs loaded, OUT_DIR
    claimed (a ckpt.pt there is replaced only with --overwrite), the run described on stdout."""
    flags.check_values(cfg)
    if cfg.batch_size < 2:
        raise CLIError(f"--batch-size must be at least 2 for tune, got {cfg.batch_size}: the other "
                       "examples of a batch are each one's negatives")
    if not (cfg.input or cfg.pairs):
        raise CLIError("tune learns from --input (documents, no labels needed), --pairs, or both")
    path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
    check_output(path, [cfg.ckpt, *lora_base(cfg.ckpt), cfg.pairs, cfg.input], "--out-dir")
    refuse_existing([path], cfg.overwrite)
    cfg = settle_run(cfg)
    device, dtype = run_device(cfg.device, cfg.dtype)
    model, tokenizer, facts = load_encoder(cfg.ckpt, device)
    room = text_room(model, tokenizer)
    pairs = read_tune_pairs(cfg.pairs, tokenizer, room) if cfg.pairs else []
    documents = [ids for ids in (token_ids(tokenizer, d.text, d.where())
                                 for d in read_corpus(cfg.input, cfg.json_key, "id", cfg.glob))
                 if len(ids) > 1] if cfg.input else []
    if len(pairs) + len(documents) < 2:
        raise CLIError("tune needs two documents or pairs at least (each batch's others are the "
                       "negatives)")
    if cfg.bias_only:
        train_bias_only(model)
    model.train()
    objective = Contrastive(cfg, model, tokenizer, facts, pairs + documents, dtype)
    engine = TorchEngine(path)
    engine.start(model, cfg, device, dtype, objective.loss)
    claim_out_dir(cfg.out_dir, path, resuming=False, overwrite=True)  # refuse_existing checked
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = model.num_params(non_embedding=False)
    held = f", {len(objective.val):,} held out for the best checkpoint" if objective.val else ""
    print(f"tuning {trained / 1e6:.3f}M of {total / 1e6:.3f}M parameters on {len(pairs):,} "
          f"pairs and {len(documents):,} documents{held}, batch {objective.batch_size}, "
          f"{cfg.pooling} pooling, temperature {cfg.temperature}; device {describe(device)}, "
          f"dtype {str(dtype).removeprefix('torch.')}")
    loop = LoopConfig(max_iters=cfg.max_iters, eval_interval=max(1, cfg.max_iters // 10),
                      keep_best=bool(objective.val), hint="a lower --lr or a higher --temperature")
    schedule = Schedule(cfg.lr, cfg.warmup_iters, cfg.max_iters, cfg.lr / 10)
    return Trainer(engine, objective, schedule, loop, cfg, desc="tune")
