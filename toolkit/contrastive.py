"""Contrastive tuning of a GPT as a text encoder, `embed.py tune`: InfoNCE with in-batch negatives
and hard negatives mined by BM25, from documents alone (two random spans of one are a pair, as
Contriever) or from labelled pairs. The result is a ckpt.pt, still a GPT.
"""
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from model import GPT
from toolkit import flags
from toolkit.checkpoint import CHECKPOINT_FILE, run_state
from toolkit.cli import CLIError
from toolkit.config import RunConfig, settle_run
from toolkit.device import describe, num_params, run_device
from toolkit.records import json_records
from toolkit.embedding import (POOLINGS, embed, encoder_identity, load_encoder, read_corpus,
                               text_room, token_ids)
from toolkit.files import check_output, claim_out_dir, refuse_existing
from toolkit.flags import option
from toolkit.lexical import Lexical, Postings
from toolkit.lora import lora_base
from toolkit.optim import Schedule
from toolkit.tokenizers import Tokenizer
from toolkit.training import Engine, LoopConfig, Objective, TorchEngine, Trainer


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
    hard_negatives: bool = option(True, "give each example without a negative of its own the "
                                        "training text BM25 ranks first for its query (DPR's "
                                        "recipe)")
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
    An example without a negative of its own gets one mined by BM25, as DPR does: the training
    text (a document, or a pair's positive) that ranks first for the query, but its own, cropped
    as a positive is. Every epoch is a new seeded permutation of the examples; an incomplete last
    batch is left out, so every batch has the same number of in-batch negatives. A held-out share
    of the examples, with crops drawn once and no mined negatives, is the evaluation: its InfoNCE
    loss among themselves."""

    def __init__(self, cfg: TuneConfig, model: GPT, tokenizer: Tokenizer, facts: dict,
                 examples: list, dtype: torch.dtype):
        self.cfg, self.model, self.facts, self.dtype = cfg, model, facts, dtype
        self.with_bos, self.decode = tokenizer.with_bos, tokenizer.decode
        self.bos = int(tokenizer.bos_id is not None)  # tokens before a text's own
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
        self.lexical = self.lexical_index() if cfg.hard_negatives else None

    def lexical_index(self) -> Lexical:
        """BM25 over the training texts: each document, each pair's positive."""
        postings = Postings()
        postings.add([self.decode(e[1][self.bos:] if isinstance(e, tuple) else e)
                      for e in self.examples])
        return Lexical(postings.arrays())

    def span(self, ids: list[int], rng: np.random.Generator) -> list[int]:
        """A random span of crop_tokens / 4 to crop_tokens of ids, after the BOS."""
        n = min(len(ids), int(rng.integers(max(1, self.crop_tokens // 4), self.crop_tokens + 1)))
        start = int(rng.integers(0, len(ids) - n + 1))
        return self.with_bos(ids[start:start + n])

    def crops(self, examples: list, rng: np.random.Generator) -> list[tuple[list[int], ...]]:
        """Pairs as they are; each document as two spans."""
        return [example if isinstance(example, tuple) else
                (self.span(example, rng), self.span(example, rng)) for example in examples]

    def hard_negative(self, query: list[int], own: int,
                      rng: np.random.Generator) -> list[list[int]]:
        """The training text BM25 ranks first for query but the example's own (none shares a
        term: none), as a positive is cut from it."""
        texts, scores = self.lexical.scores(self.decode(query[self.bos:]))
        for text in texts[np.argsort(-scores, kind="stable")][:2].tolist():
            if text != own:
                example = self.examples[text]
                return [example[1] if isinstance(example, tuple) else self.span(example, rng)]
        return []

    def micro_batches(self, step: int) -> list[tuple[list[tuple[list[int], ...]], float]]:
        epoch, index = divmod(step, len(self.examples) // self.batch_size)
        seeded = torch.Generator().manual_seed(self.cfg.seed + epoch)
        order = torch.randperm(len(self.examples), generator=seeded)
        rows = order[index * self.batch_size:][: self.batch_size].tolist()
        rng = np.random.default_rng([self.cfg.seed, step])  # a step's crops, the same when resumed
        batch = self.crops([self.examples[i] for i in rows], rng)
        if self.lexical is not None:
            batch = [example if len(example) > 2 else
                     (*example, *self.hard_negative(example[0], own, rng))
                     for example, own in zip(batch, rows)]
        return [(batch, 1.0)]

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
    total = num_params(model.config, non_embedding=False)
    held = f", {len(objective.val):,} held out for the best checkpoint" if objective.val else ""
    print(f"tuning {trained / 1e6:.3f}M of {total / 1e6:.3f}M parameters on {len(pairs):,} "
          f"pairs and {len(documents):,} documents{held}, batch {objective.batch_size}, "
          f"{cfg.pooling} pooling, temperature {cfg.temperature}; device {describe(device)}, "
          f"dtype {str(dtype).removeprefix('torch.')}")
    loop = LoopConfig(max_iters=cfg.max_iters, eval_interval=max(1, cfg.max_iters // 10),
                      keep_best=bool(objective.val), hint="a lower --lr or a higher --temperature")
    schedule = Schedule(cfg.lr, cfg.warmup_iters, cfg.max_iters, cfg.lr / 10)
    return Trainer(engine, objective, schedule, loop, cfg, desc="tune")
