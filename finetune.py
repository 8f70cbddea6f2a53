"""Fine-tune a pretrained GPT for classification, entailment, similarity or multiple choice, as GPT-1 did.

    python finetune.py --task classify --train train.jsonl --val val.jsonl --init-from ckpt/ckpt.pt --out-dir ckpt/cls
    python finetune.py --init-from ckpt/cls/ckpt.pt --predict new.jsonl --out predictions.jsonl
    torchrun --standalone --nproc_per_node 2 finetune.py [the same flags]

Examples are JSON lines (schemas: docs/finetune.md); tasks.py lays each task out in tokens and holds the head.
--init-from is a ckpt.pt of this toolkit, a DeepSpeed checkpoint folder (or the zero_to_fp32 output inside
it), or an HF GPT-2 folder. The loss is the task's plus --lm-weight times the language-model loss on the same
inputs. After every epoch the validation file is scored, and the best epoch's model is kept as OUT_DIR/ckpt.pt
(train.py's format plus the head and the task; test.py samples from it). --predict labels a file with a
fine-tuned checkpoint: the one given as --init-from, or after training the one just written. The last line
printed is one JSON object: the best epoch's validation metrics (or, for --predict alone, what was written).
Under torchrun --batch-size is the global batch, split over the processes, so N processes train like one.
"""
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from tqdm import tqdm

import cli
from checkpoint import CHECKPOINT_FILE, is_deepspeed_folder, load_checkpoint, load_deepspeed_model, load_model, \
    make_checkpoint, model_from_checkpoint, save_checkpoint
from cli import CLIError
from device import autocast, describe, keep_freed_memory_in_heap, resolve_device, resolve_dtype
from files import atomic_write, check_output, lock_folder, remove_temporaries
from model import GPT
from tasks import TASKS, Example, TaskModel, add_special_tokens, encode_records, label_names, lm_target_count, \
    pad_batch, read_records
from tokenizer import Tokenizer, load_tokenizer
from train_ddp import extra_arguments, init_distributed
from training import StopRequest, add_field_arguments, option, tensorboard_writer


@dataclass
class FinetuneConfig:
    # task and files
    task: str | None = option(None, f"{', '.join(TASKS)} (--predict alone: the checkpoint's own)")
    train: str | None = option(None, "training examples, JSON lines (schemas: docs/finetune.md)")
    val: str | None = option(None, "validation examples, JSON lines, scored after every epoch")
    labels: str = option("class", "class: labels are classes; float: similarity scores, learnt by regression",
                       choices=["class", "float"])
    init_from: str = option("ckpt/ckpt.pt", "pretrained model: a ckpt.pt, a DeepSpeed folder or its zero_to_fp32 "
                                          "output, an HF GPT-2 folder; with --predict alone, a fine-tuned ckpt.pt")
    out_dir: str = option("ckpt/finetune", "where the best epoch's ckpt.pt and the TensorBoard logs go")
    overwrite: bool = option(False, "replace an existing OUT_DIR/ckpt.pt or --out")
    predict: str | None = option(None, "examples to label with the fine-tuned model (JSON lines, labels not needed)")
    out: str | None = option(None, "where --predict writes one JSON line per example")
    # optimisation: GPT-1's settings
    epochs: int = option(3, "passes over the training examples")
    batch_size: int = option(32, "examples per optimizer step, over all processes")
    lr: float = option(6.25e-5, "peak learning rate")
    warmup: float = option(0.002, "share of the steps with linear warmup, followed by linear decay to 0")
    lm_weight: float = option(0.5, "weight of the language-model loss on the same inputs (0 = off)")
    weight_decay: float = option(0.01, "AdamW weight decay (2-D weights only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.999, "AdamW beta2")
    grad_clip: float = option(1.0, "clip gradients at this global norm (0 = off)")
    dropout: float = option(0.1, "dropout in the network")
    head_dropout: float = option(0.1, "dropout before the head")
    block_size: int | None = option(None, "longest sequence in tokens (default: the model's); longer ones lose "
                                        "tokens from the left of the context")
    # logging and system
    tensorboard_dir: str | None = option(None, "TensorBoard log dir (default OUT_DIR/tensorboard); one subfolder per "
                                             "run")
    run_name: str | None = option(None, "TensorBoard run name (default: the start time)")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "autocast dtype; auto = bfloat16 where the hardware has it, else float32",
                      choices=["auto", "float32", "bfloat16", "float16"])
    seed: int = option(1337, "seed of the new weights, of dropout and of the order of the examples")


def parse_config(argv: list[str] | None = None) -> tuple[FinetuneConfig, object]:
    parser = cli.argument_parser(__doc__)
    add_field_arguments(parser, FinetuneConfig)
    extra_arguments(parser)  # --backend and --timeout, used under torchrun
    args = parser.parse_args(argv)
    cfg = FinetuneConfig(**{f.name: getattr(args, f.name) for f in fields(FinetuneConfig)})
    check_config(cfg)
    cfg.run_name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S")
    return cfg, args


def check_config(cfg: FinetuneConfig) -> None:
    """Every value in range and the flags consistent, before anything is read or written (CLIError)."""
    if cfg.task is not None and cfg.task not in TASKS:
        raise CLIError(f"unknown task {cfg.task!r}; choose from {', '.join(TASKS)}")
    if cfg.train is None and cfg.predict is None:
        raise CLIError("nothing to do: give --task, --train and --val to fine-tune, or --predict and --out")
    for a, b in (("train", "val"), ("predict", "out")):
        if (getattr(cfg, a) is None) != (getattr(cfg, b) is None):
            raise CLIError(f"--{a} and --{b} go together")
    if cfg.train and cfg.task is None:
        raise CLIError(f"--task is required to fine-tune; choose from {', '.join(TASKS)}")
    if cfg.labels == "float" and cfg.task not in (None, "similarity"):
        raise CLIError("--labels float is for --task similarity (regression on a score)")
    for name in ("epochs", "batch_size"):
        if getattr(cfg, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.block_size is not None and cfg.block_size < 4:
        raise CLIError(f"--block-size must be at least 4 (three special tokens and one more), got {cfg.block_size}")
    for name in ("lr", "lm_weight", "weight_decay", "grad_clip"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value >= 0):
            raise CLIError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if cfg.lr == 0:
        raise CLIError("--lr must be positive")
    if not 0 <= cfg.warmup <= 1:
        raise CLIError(f"--warmup must be in [0, 1], got {cfg.warmup}")
    for name in ("dropout", "head_dropout", "beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.run_name is not None and (not cfg.run_name or os.sep in cfg.run_name or cfg.run_name in (".", "..")):
        raise CLIError(f"--run-name must be a plain folder name, got {cfg.run_name!r}")


def check_outputs(cfg: FinetuneConfig) -> None:
    """Outputs that replace no input, and no earlier result unless --overwrite."""
    inputs = [cfg.init_from, cfg.train, cfg.val, cfg.predict]
    outputs = []
    if cfg.train:
        outputs.append(("--out-dir", os.path.join(cfg.out_dir, CHECKPOINT_FILE)))
    if cfg.out:
        outputs.append(("--out", cfg.out))
    for flag, path in outputs:
        check_output(path, inputs, flag)
        if os.path.exists(path) and not cfg.overwrite:
            raise CLIError(f"{path} exists; choose another {flag} or pass --overwrite to replace it")
        inputs.append(path)


# ----- models -----

def load_pretrained(path: str, dropout: float) -> tuple[GPT, dict]:
    """The body to fine-tune and its tokenizer facts, from a ckpt.pt, a DeepSpeed folder (OUT_DIR, OUT_DIR/ds, a
    tag folder or the zero_to_fp32 output inside it) or an HF GPT-2 folder."""
    parent = os.path.dirname(os.path.abspath(path.rstrip("/\\")))
    if any(map(is_deepspeed_folder, (path, os.path.join(path, "ds"), parent))):
        model, state, _ = load_deepspeed_model(path, dropout=dropout)
        return model, state["tokenizer"]
    return load_model(path, dropout=dropout)


def base_tokenizer(body: GPT, facts: dict, source: str) -> Tokenizer:
    """The tokenizer the body was pretrained with; one that does not fit the body is an error."""
    if facts.get("special_tokens"):
        raise CLIError(f"{source} is already fine-tuned; use it with --predict, or fine-tune the model it came from")
    tokenizer = load_tokenizer(facts)
    if tokenizer.vocab_size > body.config.vocab_size:
        raise CLIError(f"{source} has a model of {body.config.vocab_size} tokens but its {tokenizer.name} tokenizer "
                       f"has {tokenizer.vocab_size}: the checkpoint does not fit its tokenizer")
    return tokenizer


def load_finetuned(path: str, device: torch.device) -> tuple[TaskModel, Tokenizer, dict]:
    """(model with its head, tokenizer with the special tokens, the task facts) of a fine-tuned ckpt.pt."""
    checkpoint = load_checkpoint(path)
    task = checkpoint.get("finetune")
    if not isinstance(task, dict) or "head" not in checkpoint:
        raise CLIError(f"{path} is not a fine-tuned checkpoint (it has no task head); fine-tune it with --task, "
                       f"--train and --val first")
    body = model_from_checkpoint(checkpoint, path, dropout=0.0)
    model = TaskModel(body, task["task"], task["outputs"], dropout=0.0)
    model.head.load_state_dict(checkpoint["head"])
    return model.to(device).eval(), load_tokenizer(checkpoint["tokenizer"]), task


# ----- schedule, scores and metrics -----

def learning_rate(step: int, total: int, cfg: FinetuneConfig) -> float:
    """GPT-1's schedule: linear warmup over the first cfg.warmup of the steps, then linear decay to 0."""
    warmup = math.ceil(cfg.warmup * total)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    return cfg.lr * (total - step) / (total - warmup)


def epoch_batches(n: int, batch_size: int, world_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """One epoch's global batches, in an order drawn from (seed, epoch) alone, so every rank and every run sees the
    same; a last batch smaller than the number of processes is left out (each process needs an example)."""
    order = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return batches if len(batches[-1]) >= world_size else batches[:-1]


def rank_share(n: int, rank: int, world_size: int) -> np.ndarray:
    """Indices of this rank's contiguous share of n items."""
    return np.array_split(np.arange(n), world_size)[rank]


@torch.no_grad()
def score(model: TaskModel, examples: list[Example], batch_size: int, device: torch.device, dtype: torch.dtype,
          rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """The head's logits for every example (N, outputs or answers), in eval mode. In a process group each rank
    scores its share and the shares are summed into the whole (a rank's rows are zeros elsewhere)."""
    was_training = model.training
    model.eval()
    columns = len(examples[0].sequences) if model.task == "choice" else model.head.out_features
    scores = torch.zeros(len(examples), columns, device=device)
    mine = rank_share(len(examples), rank, world_size)
    for start in range(0, len(mine), batch_size):
        rows = mine[start : start + batch_size]
        batch = [examples[i] for i in rows]
        idx, extract, _ = pad_batch(batch, device)
        with autocast(device, dtype):
            scores[torch.from_numpy(rows).to(device)] = model(idx, extract, len(batch[0].sequences))[0]
    if world_size > 1:
        dist.all_reduce(scores)
    model.train(was_training)
    return scores.cpu()


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, binary: bool) -> dict[str, float]:
    """Validation loss and accuracy; with two classes also the F1 score of class 1 (the second label in sorted
    order: 1, true, "yes" ...)."""
    predicted = logits.argmax(dim=1)
    metrics = {"val_loss": F.cross_entropy(logits, labels).item(),
               "val_accuracy": (predicted == labels).float().mean().item()}
    if binary:
        true_positives = ((predicted == 1) & (labels == 1)).sum().item()
        errors = (predicted != labels).sum().item()  # false positives + false negatives
        metrics["val_f1"] = 2 * true_positives / (2 * true_positives + errors) if true_positives else 0.0
    return metrics


def regression_metrics(predicted: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"val_loss": F.mse_loss(predicted, targets).item(), "val_pearson": pearson(predicted, targets),
            "val_spearman": pearson(ranks(predicted), ranks(targets))}


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's correlation; 0 when either side is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    norm = (x.norm() * y.norm()).item()
    return (x @ y).item() / norm if norm else 0.0


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks of x (0 = smallest), ties sharing their mean rank, for Spearman's correlation."""
    _, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    first = counts.cumsum(0) - counts
    return (first + (counts - 1) / 2)[inverse].double()


def prediction(logits: torch.Tensor, task: dict) -> dict:
    """One output line: the predicted label and the probabilities of all (a regression: the score alone)."""
    if task["labels"] == "float":
        return {"label": round(logits.item(), 6)}
    probabilities = [round(p, 6) for p in logits.softmax(dim=0).tolist()]
    best = int(logits.argmax())
    if task["task"] == "choice":
        return {"label": best, "probabilities": probabilities}
    names = task["label_names"]
    keys = [name if isinstance(name, str) else json.dumps(name) for name in names]  # JSON keys are strings
    return {"label": names[best], "probabilities": dict(zip(keys, probabilities))}


def write_predictions(cfg: FinetuneConfig, checkpoint_path: str, device: torch.device, dtype: torch.dtype) -> dict:
    """Label cfg.predict with a fine-tuned checkpoint into cfg.out (atomically); returns what was done."""
    model, tokenizer, task = load_finetuned(checkpoint_path, device)
    if cfg.task not in (None, task["task"]):
        raise CLIError(f"{checkpoint_path} was fine-tuned for --task {task['task']}, not {cfg.task}")
    records = read_records(cfg.predict, task["task"], labelled=False)
    examples = encode_records(records, cfg.predict, task["task"], tokenizer, tokenizer.special_tokens,
                              model.body.config.block_size, None, labelled=False)
    lines = [json.dumps(prediction(row, task), ensure_ascii=False) + "\n"
             for row in score(model, examples, cfg.batch_size, device, dtype)]

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)

    atomic_write(cfg.out, write)
    return {"predictions": len(lines), "out": cfg.out, "truncated": sum(e.truncated for e in examples)}


# ----- training -----

class Finetuning:
    """One fine-tuning run, in a single process or in every rank of a torchrun job: each rank computes its share
    of every global batch and DDP averages the gradients."""

    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.master = self.rank == 0
        self.device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()

        body, facts = load_pretrained(cfg.init_from, cfg.dropout)
        tokenizer = base_tokenizer(body, facts, cfg.init_from)
        if cfg.block_size is not None and cfg.block_size > body.config.block_size:
            raise CLIError(f"--block-size {cfg.block_size} is longer than the {body.config.block_size} positions of "
                           f"{cfg.init_from}")
        if cfg.block_size is not None:
            body.crop_block_size(cfg.block_size)
        torch.manual_seed(cfg.seed)  # the new embedding rows and the head, the same in every rank
        special = add_special_tokens(body, tokenizer)
        self.facts = {**facts, "vocab_size": tokenizer.vocab_size, "special_tokens": special}
        self.regression = cfg.labels == "float"

        train = read_records(cfg.train, cfg.task, labelled=True)
        val = read_records(cfg.val, cfg.task, labelled=True)
        self.names = None if self.regression or cfg.task == "choice" else label_names(train, cfg.train)
        block_size = body.config.block_size
        self.train_set = encode_records(train, cfg.train, cfg.task, tokenizer, special, block_size, self.names)
        self.val_set = encode_records(val, cfg.val, cfg.task, tokenizer, special, block_size, self.names)
        self.val_labels = torch.tensor([e.label for e in self.val_set])
        self.steps_per_epoch = len(epoch_batches(len(self.train_set), cfg.batch_size, self.world_size, cfg.seed, 0))
        if self.steps_per_epoch == 0:
            raise CLIError(f"{cfg.train} has {len(self.train_set)} examples, fewer than the {self.world_size} "
                           f"processes")

        outputs = len(self.names) if self.names else 1
        self.model = TaskModel(body, cfg.task, outputs, cfg.head_dropout).to(self.device)
        self.optimizer = body.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2),
                                                   self.device.type, heads=(self.model.head,))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.train_model = self.model
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.train_model = DistributedDataParallel(self.model, device_ids=[self.device.index]
                                                       if self.device.type == "cuda" else None)
        if self.master:  # every input is good: only now is anything written
            self.out_dir_lock = lock_folder(cfg.out_dir)
            remove_temporaries(cfg.out_dir)
        self.step, self.best, self.writer = 0, None, None
        self.history = {"step": [], "val": []}

    def describe(self) -> None:
        cfg, body = self.cfg, self.model.body
        labels = "scores (regression)" if self.regression else "answers" if cfg.task == "choice" else \
            f"labels {', '.join(map(repr, self.names))}"
        print(f"fine-tuning {cfg.task} from {cfg.init_from}: {len(self.train_set)} train, {len(self.val_set)} val "
              f"examples, {labels}")
        print(f"model: {body.num_params() / 1e6:.2f}M parameters, block {body.config.block_size}; {cfg.epochs} "
              f"epochs x {self.steps_per_epoch} steps of {cfg.batch_size} examples over {self.world_size} "
              f"process(es); device {describe(self.device)}, dtype {str(self.dtype).removeprefix('torch.')}")
        for path, examples in ((cfg.train, self.train_set), (cfg.val, self.val_set)):
            cut = sum(e.truncated for e in examples)
            if cut:
                print(f"{path}: {cut} of {len(examples)} examples cut to the block size of "
                      f"{body.config.block_size} tokens, from the left of the context")

    def fit(self) -> dict:
        """Train cfg.epochs epochs (or until SIGINT/SIGTERM), scoring and keeping the best after each; returns the
        best epoch's validation metrics, the epochs and the steps done."""
        cfg = self.cfg
        stop_request = StopRequest()
        if self.master:
            self.describe()
            self.writer = tensorboard_writer(cfg)
        total = cfg.epochs * self.steps_per_epoch
        bar = tqdm(total=total, desc="finetune", disable=not self.master or None, dynamic_ncols=True)
        for epoch in range(cfg.epochs):
            stopped, started = False, time.perf_counter()
            for batch in epoch_batches(len(self.train_set), cfg.batch_size, self.world_size, cfg.seed, epoch):
                lr = learning_rate(self.step, total, cfg)
                loss, stopped = self.all_reduce_sum([self.train_step(batch, lr), float(stop_request.requested)])
                if not math.isfinite(loss):
                    raise CLIError(f"loss is {loss} at step {self.step}; stopped (the best checkpoint so far, if "
                                   f"any, is kept). Try a lower --lr or --dtype bfloat16")
                self.step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                self.log({"loss/train": loss, "lr": lr})
                if stopped:
                    break
            self.evaluate_and_keep_best(bar, time.perf_counter() - started)
            if stopped:
                if self.master:
                    bar.write(f"stopped by signal at step {self.step}; the best checkpoint is {self.path}")
                break
        bar.close()
        if self.master:
            self.writer.close()
        return {**self.best, "epochs": self.step // self.steps_per_epoch, "steps": self.step}

    def train_step(self, batch: np.ndarray, lr: float) -> float:
        """One optimizer step on a global batch, of which this rank computes its share. Each rank's loss is its
        share of the global batch's loss, times the number of ranks, so that DDP's mean of the gradients is the
        gradient of the global batch's loss whatever the split. Returns this rank's share of the loss."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        examples = [self.train_set[i] for i in batch]
        mine = [examples[i] for i in rank_share(len(examples), self.rank, self.world_size)]
        idx, extract, targets = pad_batch(mine, self.device)
        labels = torch.tensor([e.label for e in mine], device=self.device)
        with autocast(self.device, self.dtype):
            logits, lm_loss = self.train_model(idx, extract, len(mine[0].sequences),
                                               targets if self.cfg.lm_weight else None)
        loss = self.task_loss(logits, labels, reduction="sum") / len(examples)
        if lm_loss is not None:
            loss = loss + self.cfg.lm_weight * lm_loss * lm_target_count(mine) / lm_target_count(examples)
        self.scaler.scale(loss * self.world_size).backward()
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def task_loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.regression:
            return F.mse_loss(logits.squeeze(-1), labels.float(), reduction=reduction)
        return F.cross_entropy(logits, labels, reduction=reduction)

    def evaluate(self) -> dict[str, float]:
        logits = score(self.model, self.val_set, self.cfg.batch_size, self.device, self.dtype, self.rank,
                       self.world_size)
        if self.regression:
            metrics = regression_metrics(logits.squeeze(-1), self.val_labels.float())
        else:
            metrics = classification_metrics(logits, self.val_labels, binary=self.names is not None and
                                             len(self.names) == 2)
        return {name: round(value, 4) for name, value in metrics.items()}

    def evaluate_and_keep_best(self, bar: tqdm, seconds: float) -> None:
        """Score the validation set; save a checkpoint when it beats the best so far (accuracy, or Pearson's
        correlation for a regression). seconds: how long the epoch's training steps took."""
        metrics = self.evaluate()
        if not math.isfinite(metrics["val_loss"]):
            raise CLIError(f"the validation loss after step {self.step} is {metrics['val_loss']}; stopped (the best "
                           f"checkpoint so far, if any, is kept). Try a lower --lr or --dtype bfloat16")
        self.history["step"].append(self.step)
        self.history["val"].append(metrics)
        key = "val_pearson" if self.regression else "val_accuracy"
        best = self.best is None or metrics[key] > self.best[key]
        if best:
            self.best = metrics
            self.save(metrics)
        self.log(metrics)
        if self.master:
            shown = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())
            bar.write(f"epoch {self.step / self.steps_per_epoch:.3g}, step {self.step}: {shown} "
                      f"({seconds:.1f} s)" + (f"; saved {self.path}" if best else ""))

    def save(self, metrics: dict) -> None:
        """OUT_DIR/ckpt.pt in train.py's format (without optimizer and RNG: fine-tuning is not resumed), plus the
        head's weights and the task, written by rank 0."""
        if self.master:
            body, cfg = self.model.body, self.cfg
            state = {"model_config": asdict(body.config), "train_config": asdict(cfg), "tokenizer": self.facts,
                     "iter_num": self.step, "best_val_loss": metrics["val_loss"], "history": self.history}
            checkpoint = make_checkpoint(state, body, optimizer=None, scaler=None, rng={})
            checkpoint["head"] = self.model.head.state_dict()
            checkpoint["finetune"] = {"task": cfg.task, "labels": cfg.labels, "label_names": self.names,
                                      "outputs": self.model.head.out_features, "metrics": metrics,
                                      "init_from": cfg.init_from}
            save_checkpoint(checkpoint, self.path)
        if self.world_size > 1:
            dist.barrier()

    def log(self, scalars: dict[str, float]) -> None:
        if self.master:
            for name, value in scalars.items():
                self.writer.add_scalar(name.replace("val_", "val/"), value, self.step)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        return t.tolist()


def main() -> None:
    cfg, args = parse_config()
    check_outputs(cfg)
    if "WORLD_SIZE" in os.environ:
        init_distributed(cfg, args)
    master = not dist.is_initialized() or dist.get_rank() == 0
    if cfg.train is None:
        if master:
            device = resolve_device(cfg.device)
            print(json.dumps(write_predictions(cfg, cfg.init_from, device, resolve_dtype(cfg.dtype, device))))
        return
    finetuning = Finetuning(cfg)
    report = finetuning.fit()
    if master and cfg.predict:
        print(json.dumps(write_predictions(cfg, finetuning.path, finetuning.device, finetuning.dtype)))
    if master:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    (cli.run_distributed if "WORLD_SIZE" in os.environ else cli.run)(main)
