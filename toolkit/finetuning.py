"""Fine-tuning a pretrained GPT, the way finetune.py runs it: for a task as GPT-1 did (the task's loss plus the LM
loss) or for instruction following (sft: the LM loss on the assistant turns), every weight or LoRA adapters. The
options, the starting body, the objectives the loop runs (one global batch split over the processes), the
validation metrics, predictions with a fine-tuned checkpoint, and the merge of LoRA adapters.

    trainer, report = setup(cfg), ...      # see finetune.py
    trainer.fit()

The tasks' token layouts and the head are toolkit/tasks.py's, the chat template toolkit/chat.py's, the adapters
toolkit/lora.py's; the loop is toolkit/training.py.
"""
import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.nn import functional as F

from model import GPT
from toolkit import distributed, flags, hf, lora
from toolkit.chat import add_chat_tokens, encode_conversations, pad_conversations, read_conversations, \
    trained_tokens
from toolkit.checkpoint import CHECKPOINT_FILE, clean_state_dict, load_checkpoint, save_checkpoint
from toolkit.cli import CLIError
from toolkit.device import autocast, describe, keep_freed_memory_in_heap, resolve_device, resolve_dtype
from toolkit.files import atomic_open
from toolkit.flags import option
from toolkit.load import load_model
from toolkit.optim import make_optimizer
from toolkit.tasks import TASKS, Example, TaskModel, add_special_tokens, encode_records, label_names, pad_batch, \
    read_records
from toolkit.tokenizers import Tokenizer, load_tokenizer
from toolkit.training import LoopConfig, Schedule, TorchEngine, Trainer, claim_out_dir


EPOCHS, MIN_STEPS = 3, 200  # GPT-1's epochs; a set too small for them gets more (docs/finetune.md)
LR_WIDTH = 0.128  # lr = LR_WIDTH / n_embd: a larger model takes smaller steps (measured: docs/finetune.md)
PROBE_L2, PROBE_ITERS = 1e-4, 200  # the head's first fit: its L2 penalty and L-BFGS iterations (docs/finetune.md)
LORA_LR = 10  # adapters start at zero and move a rank-r slice: LoRA takes larger steps (measured: docs/finetune.md)
ALL_TASKS = (*TASKS, "sft")
LATEST_FILE = "last.pt"  # OUT_DIR/last.pt: the latest state while a fine-tuning runs, for --init-from resume


@dataclass
class FinetuneConfig:
    # task and files
    task: str | None = option(None, f"{', '.join(TASKS)}, or sft for instruction tuning on conversations "
                                    f"(--predict alone: the checkpoint's own)")
    train: str | None = option(None, "training examples or conversations, JSON lines (schemas: docs/finetune.md)")
    val: str | None = option(None, "validation examples or conversations, JSON lines, scored after every epoch")
    labels: str = option("class", "class: labels are classes; float: similarity scores, learnt by regression",
                         choices=["class", "float"])
    init_from: str = option("ckpt/ckpt.pt", "pretrained model: a ckpt.pt, a DeepSpeed folder or its zero_to_fp32 "
                                            "output, an HF GPT-2 folder; resume: continue the interrupted "
                                            "fine-tuning in OUT_DIR; with --predict alone, a fine-tuned ckpt.pt")
    out_dir: str = option("ckpt/finetune", "where the best epoch's ckpt.pt and the TensorBoard logs go")
    overwrite: bool = option(False, "replace an existing OUT_DIR/ckpt.pt or --out")
    predict: str | None = option(None, "examples to label with the fine-tuned model (JSON lines, labels not needed)")
    out: str | None = option(None, "where --predict writes one JSON line per example")
    merge_lora: str | None = option(None, "a LoRA checkpoint to merge into its base: writes OUT_DIR/ckpt.pt, a full "
                                          "checkpoint every script reads")
    # LoRA: low-rank adapters, the base frozen (toolkit/lora.py)
    lora_rank: int = option(0, "train LoRA adapters of this rank instead of every weight (0 = every weight)",
                            check="non-negative")
    lora_alpha: float = option(16.0, "LoRA's alpha: the update is scaled by alpha / rank", check="positive-number")
    lora_dropout: float = option(0.05, "dropout on the adapters' input", check="probability")
    lora_targets: str = option("all", "the linears that get adapters: attn (c_attn, c_proj), mlp (c_fc, c_proj) "
                                      "or all", choices=list(lora.TARGETS))
    # optimisation: GPT-1's recipe, with a rate that follows the width and enough steps for small sets
    epochs: int | None = option(None, f"passes over the training examples (default: {EPOCHS}, or more when that "
                                      f"is fewer than {MIN_STEPS} steps)", check="positive")
    batch_size: int = option(32, "examples per micro-batch, in each process", check="positive")
    grad_accum: int | None = option(None, "micro-batches per optimizer step over ALL processes (default: one per "
                                          "process)", check="positive")
    lr: float | None = option(None, f"peak learning rate (default: {LR_WIDTH:g} / the model's width: 1e-3 at the "
                                    f"quick start's 128, 1.7e-4 at GPT-2's 768; {LORA_LR}x that with LoRA)",
                              check="positive-number")
    warmup: float = option(0.1, "share of the steps with linear warmup, followed by linear decay to 0",
                           check="share")
    lm_weight: float = option(0.5, "weight of the language-model loss on the same inputs (0 = off)",
                              check="non-negative-number")
    weight_decay: float = option(0.01, "AdamW weight decay (2-D weights only)", check="non-negative-number")
    beta1: float = option(0.9, "AdamW beta1", check="probability")
    beta2: float = option(0.999, "AdamW beta2", check="probability")
    grad_clip: float = option(1.0, "clip gradients at this global norm (0 = off)", check="non-negative-number")
    dropout: float = option(0.0, "dropout in the network, as in train.py", check="probability")
    head_dropout: float = option(0.1, "dropout before the head", check="probability")
    block_size: int | None = option(None, "longest sequence in tokens (default: the model's); longer ones lose "
                                          "tokens from the left of the context")
    # logging and system
    log_interval: int = option(10, "print the training loss every N steps", check="positive")
    tensorboard_dir: str | None = option(None, "TensorBoard log dir (default OUT_DIR/tensorboard); one subfolder per "
                                               "run")
    run_name: str | None = option(None, "TensorBoard run name (default: the start time)", check="folder-name")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "autocast dtype; auto = bfloat16 where the hardware computes it natively, else "
                                "float32", choices=["auto", "float32", "bfloat16", "float16"])
    seed: int = option(1337, "seed of the new weights, of dropout and of the order of the examples")


def resumed_config(cfg: FinetuneConfig, given: set[str]) -> tuple[FinetuneConfig, dict]:
    """--init-from resume: the interrupted run's options (those given now win) and its latest state."""
    path = os.path.join(cfg.out_dir, LATEST_FILE)
    if not os.path.isfile(path):
        raise CLIError(f"nothing to resume in {cfg.out_dir}: {path} exists only while a fine-tuning runs or after one "
                       f"was interrupted")
    checkpoint = load_checkpoint(path)
    saved = {k: v for k, v in checkpoint["train_config"].items() if k in FinetuneConfig.__dataclass_fields__}
    mine = given | {"out_dir", "overwrite"}
    return FinetuneConfig(**{**saved, **{k: getattr(cfg, k) for k in mine if k != "init_from"}}), checkpoint


def check_config(cfg: FinetuneConfig) -> None:
    """Every value in range and the flags consistent, before anything is read or written (CLIError)."""
    flags.check_values(cfg)
    if cfg.task is not None and cfg.task not in ALL_TASKS:
        raise CLIError(f"unknown task {cfg.task!r}; choose from {', '.join(ALL_TASKS)}")
    if cfg.merge_lora and (cfg.train or cfg.predict):
        raise CLIError("--merge-lora goes alone (with --out-dir): merge first, then fine-tune or predict")
    if cfg.train is None and cfg.predict is None and cfg.merge_lora is None:
        raise CLIError("nothing to do: give --task, --train and --val to fine-tune, --predict and --out, or "
                       "--merge-lora")
    for a, b in (("train", "val"), ("predict", "out")):
        if (getattr(cfg, a) is None) != (getattr(cfg, b) is None):
            raise CLIError(f"--{a} and --{b} go together")
    if cfg.train and cfg.task is None:
        raise CLIError(f"--task is required to fine-tune; choose from {', '.join(ALL_TASKS)}")
    if cfg.task == "sft" and cfg.predict:
        raise CLIError("--predict labels examples of a GPT-1 task; an sft model answers with test.py --chat or "
                       "--prompt")
    if cfg.labels == "float" and cfg.task not in (None, "similarity"):
        raise CLIError("--labels float is for --task similarity (regression on a score)")
    if cfg.block_size is not None and cfg.block_size < 4:
        raise CLIError(f"--block-size must be at least 4 (three special tokens and one more), got {cfg.block_size}")


# ----- models -----

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
    if isinstance(task, dict) and task.get("task") == "sft":
        raise CLIError(f"{path} is instruction-tuned, not fine-tuned for a task: talk to it with test.py --ckpt "
                       f"{path} --chat")
    if not isinstance(task, dict) or "head" not in checkpoint:
        raise CLIError(f"{path} is not a fine-tuned checkpoint (it has no task head); fine-tune it with --task, "
                       f"--train and --val first")
    body, _ = load_model(path)
    likelihood = task.get("likelihood", task.get("answer_likelihood"))  # older checkpoints: a choice's alone, or none
    special = checkpoint["tokenizer"]["special_tokens"] if likelihood else None
    model = TaskModel(body, task["task"], task["outputs"], dropout=0.0, special=special,
                      weighted_states=task.get("weighted_states", False))  # older checkpoints: the likelihood alone
    model.head.load_state_dict(checkpoint["head"])
    return model.to(device).eval(), load_tokenizer(checkpoint["tokenizer"]), task


# ----- batches, scores and metrics -----

def epoch_batches(n: int, global_batch: int, micro_batches: int, seed: int, epoch: int) -> list[np.ndarray]:
    """One epoch's global batches, in an order drawn from (seed, epoch) alone, so every rank and every run sees the
    same; a last batch with fewer examples than micro-batches is left out (each needs an example)."""
    order = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)
    batches = [order[i : i + global_batch] for i in range(0, n, global_batch)]
    return batches if len(batches[-1]) >= micro_batches else batches[:-1]


def step_batches(step: int, n: int, cfg: "FinetuneConfig",
                 steps_per_epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the indices of the step's global batch, this rank's micro-batches of it)."""
    epoch, index = divmod(step, steps_per_epoch)
    batch = epoch_batches(n, cfg.batch_size * cfg.grad_accum, cfg.grad_accum, cfg.seed, epoch)[index]
    micro_steps = cfg.grad_accum // distributed.world_size()
    return batch, np.array_split(batch, cfg.grad_accum)[distributed.rank() * micro_steps:][:micro_steps]


def rank_share(n: int, rank: int, world_size: int) -> np.ndarray:
    """Indices of this rank's contiguous share of n items."""
    return np.array_split(np.arange(n), world_size)[rank]


def score(model: TaskModel, examples: list[Example], batch_size: int, device: torch.device,
          dtype: torch.dtype) -> torch.Tensor:
    """The head's logits for every example (N, outputs or answers), in eval mode, shared over the processes."""
    columns = len(examples[0].sequences) if model.task == "choice" else model.head.out_features
    (scores,) = over_examples(model, examples, batch_size, device, dtype, [(columns,)],
                              lambda idx, extract, per_example: [model(idx, extract, per_example)[0]])
    return scores.cpu()


@torch.no_grad()
def over_examples(model: TaskModel, examples: list[Example], batch_size: int, device: torch.device,
                  dtype: torch.dtype, shapes: list[tuple[int, ...]], compute) -> list[torch.Tensor]:
    """compute(idx, extract, per_example) -> one tensor per shape, (batch, *shape), for every example in batches,
    in eval mode. In a process group each rank computes its share and the shares are summed into the whole (a rank's
    rows are zeros elsewhere)."""
    was_training = model.training
    model.eval()
    outputs = [torch.zeros(len(examples), *shape, device=device) for shape in shapes]
    mine = rank_share(len(examples), distributed.rank(), distributed.world_size())
    for start in range(0, len(mine), batch_size):
        rows = mine[start : start + batch_size]
        batch = [examples[i] for i in rows]
        idx, extract, _ = pad_batch(batch, device)
        with autocast(device, dtype):
            results = compute(idx, extract, len(batch[0].sequences))
        for output, result in zip(outputs, results):
            output[torch.from_numpy(rows).to(device)] = result.float()
    if distributed.world_size() > 1:
        for output in outputs:
            torch.distributed.all_reduce(output)
    model.train(was_training)
    return outputs


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
    rows = score(model, examples, cfg.batch_size, device, dtype)
    with atomic_open(cfg.out) as f:
        f.writelines(json.dumps(prediction(row, task), ensure_ascii=False) + "\n" for row in rows)
    return {"predictions": len(rows), "out": cfg.out, "truncated": sum(e.truncated for e in examples)}


# ----- the objective -----

class TaskObjective:
    """What the loop learns when fine-tuning: the task's loss (cross-entropy, or squared error for a regression)
    plus lm_weight times the LM loss on the same inputs, over one epoch order per epoch; evaluated on the val set
    after each epoch."""

    def __init__(self, cfg: FinetuneConfig, model: TaskModel, facts: dict, names: list | None,
                 train_set: list[Example], val_set: list[Example], device: torch.device, dtype: torch.dtype):
        self.cfg, self.model, self.facts, self.names = cfg, model, facts, names
        self.train_set, self.val_set, self.device, self.dtype = train_set, val_set, device, dtype
        self.regression = cfg.labels == "float"
        self.val_labels = torch.tensor([e.label for e in val_set])
        self.global_batch = cfg.batch_size * cfg.grad_accum
        self.steps_per_epoch = len(epoch_batches(len(train_set), self.global_batch, cfg.grad_accum, cfg.seed, 0))
        self.adapters = None  # LoRA's facts when the body trains adapters (setup)

    def micro_batches(self, step: int) -> list[tuple[list[Example], float]]:
        """This rank's micro-batches of the step's global batch, each weighted by its share of the examples."""
        batch, mine = step_batches(step, len(self.train_set), self.cfg, self.steps_per_epoch)
        return [([self.train_set[i] for i in rows], len(rows) / len(batch)) for rows in mine]

    def loss(self, model: torch.nn.Module, examples: list[Example]) -> torch.Tensor:
        idx, extract, targets = pad_batch(examples, self.device)
        labels = torch.tensor([e.label for e in examples], device=self.device)
        logits, lm_loss = model(idx, extract, len(examples[0].sequences), targets if self.cfg.lm_weight else None)
        loss = self.task_loss(logits, labels)
        return loss if lm_loss is None else loss + self.cfg.lm_weight * lm_loss

    def task_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(logits.squeeze(-1), labels.float()) if self.regression else F.cross_entropy(logits, labels)

    def fit_head(self) -> None:
        """Start the head as the best linear probe of the pretrained body (LP-FT: Kumar et al. 2022, "Fine-Tuning can
        Distort Pretrained Features and Underperform Out-of-Distribution"): the task's loss of the head alone on what
        it reads from the frozen body, L2-regularised, minimised by L-BFGS (a convex problem: one answer whatever the
        start, the same in every rank). A random head would first pull the body towards itself; a fitted one starts
        fine-tuning from what the body already knows, its likelihood included."""
        inputs, offset = self.head_inputs(self.train_set)
        labels = torch.tensor([e.label for e in self.train_set], device=self.device)
        head = self.model.head
        optimizer = torch.optim.LBFGS(head.parameters(), max_iter=PROBE_ITERS, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = self.task_loss(self.model.scores(inputs, offset), labels) + PROBE_L2 * head.weight.square().sum()
            loss.backward()
            return loss

        optimizer.step(closure)

    def head_inputs(self, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the head reads of every example and the scores it adds to (TaskModel.head_inputs)."""
        model, answers = self.model, len(examples[0].sequences)
        choice = model.task == "choice"
        shapes = [(answers, model.head.in_features) if choice else (model.head.in_features,)]
        if choice and model.special is not None:
            shapes.append((answers,))

        def compute(idx: torch.Tensor, extract: torch.Tensor, per_example: int) -> list[torch.Tensor]:
            inputs, offset = model.head_inputs(model.body.hidden_states(idx), idx, extract, per_example)
            return [inputs] if offset is None else [inputs, offset]

        inputs, *offset = over_examples(model, examples, self.cfg.batch_size, self.device, self.dtype, shapes, compute)
        return inputs, offset[0] if offset else None

    def throughput(self) -> tuple[int, str, None]:
        return self.global_batch, "examples", None

    def evaluate(self, engine) -> dict[str, float]:
        logits = score(self.model, self.val_set, self.cfg.batch_size, self.device, self.dtype)
        if self.regression:
            metrics = regression_metrics(logits.squeeze(-1), self.val_labels.float())
        else:
            metrics = classification_metrics(logits, self.val_labels, binary=self.names is not None and
                                             len(self.names) == 2)
        return {name: round(value, 4) for name, value in metrics.items()}

    def good_weights(self, engine) -> bool:
        return engine.weights_finite()

    def checkpoint_state(self, best: dict | None) -> dict:
        """train.py's format plus the head's weights and the task (fine-tuning is not resumed: no optimizer)."""
        cfg = self.cfg
        return {**finetuned_state(cfg, self.model.body, self.facts, self.adapters),
                "head": self.model.head.state_dict(),
                "finetune": {"task": cfg.task, "labels": cfg.labels, "label_names": self.names,
                             "outputs": self.model.head.out_features, "metrics": best, "init_from": cfg.init_from,
                             "likelihood": self.model.special is not None,
                             "weighted_states": self.model.weighted_states}}

    def chance(self) -> float:
        """The metric a model that learnt nothing reaches: the commonest val label's share (a choice: one over the
        answers), or no correlation."""
        if self.regression:
            return 0.0
        if self.cfg.task == "choice":
            return 1 / len(self.val_set[0].sequences)
        return torch.bincount(self.val_labels).max().item() / len(self.val_labels)


class ChatObjective:
    """What the loop learns in instruction tuning: the LM loss on the assistant turns' tokens alone (the mask of
    toolkit/chat.py), averaged over all of a global batch's learnt tokens; evaluated by the same loss on the
    held-out conversations after each epoch."""

    def __init__(self, cfg: FinetuneConfig, model: GPT, facts: dict, train_set: list, val_set: list,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.model, self.facts, self.device, self.dtype = cfg, model, facts, device, dtype
        self.train_set, self.val_set = train_set, val_set
        self.global_batch = cfg.batch_size * cfg.grad_accum
        self.steps_per_epoch = len(epoch_batches(len(train_set), self.global_batch, cfg.grad_accum, cfg.seed, 0))
        self.adapters = None

    def micro_batches(self, step: int) -> list[tuple[list, float]]:
        """This rank's micro-batches, each weighted by its share of the global batch's learnt tokens."""
        batch, mine = step_batches(step, len(self.train_set), self.cfg, self.steps_per_epoch)
        total = trained_tokens([self.train_set[i] for i in batch])
        batches = [[self.train_set[i] for i in rows] for rows in mine]
        return [(batch, trained_tokens(batch) / total) for batch in batches]

    def loss(self, model: torch.nn.Module, conversations: list) -> torch.Tensor:
        idx, targets = pad_conversations(conversations, self.device)
        return model(idx, targets, chunked_loss=True)[1]

    def throughput(self) -> tuple[int, str, None]:
        return self.global_batch, "conversations", None

    @torch.no_grad()
    def evaluate(self, engine) -> dict[str, float]:
        """The mean loss per learnt token of the val conversations, each rank scoring its share."""
        was_training = self.model.training
        self.model.eval()
        mine = rank_share(len(self.val_set), distributed.rank(), distributed.world_size())
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # summed loss, tokens
        for start in range(0, len(mine), self.cfg.batch_size):
            batch = [self.val_set[i] for i in mine[start : start + self.cfg.batch_size]]
            with autocast(self.device, self.dtype):
                total[0] += self.loss(self.model, batch).double() * trained_tokens(batch)
            total[1] += trained_tokens(batch)
        if distributed.world_size() > 1:
            torch.distributed.all_reduce(total)
        self.model.train(was_training)
        return {"val_loss": round((total[0] / total[1]).item(), 4)}

    def good_weights(self, engine) -> bool:
        return engine.weights_finite()

    def checkpoint_state(self, best: dict | None) -> dict:
        cfg = self.cfg
        return {**finetuned_state(cfg, self.model, self.facts, self.adapters),
                "finetune": {"task": "sft", "metrics": best, "init_from": cfg.init_from}}


def finetuned_state(cfg: FinetuneConfig, body: GPT, facts: dict, adapters: dict | None) -> dict:
    """What every fine-tuned checkpoint holds besides its task: the body's config, the options, the tokenizer, and
    with LoRA the adapters and their base (toolkit/lora.py; then the checkpoint has no full weights)."""
    state = {"model_config": asdict(body.config), "train_config": asdict(cfg), "tokenizer": facts}
    if adapters is not None:
        state |= {"lora": adapters, "adapters": lora.adapter_state(body)}
    return state


def base_source(path: str) -> str:
    """Where a base model lies on disk: the file or folder given, or an HF name's folder in the local cache."""
    return os.path.abspath(path) if os.path.exists(path) else hf.find_model_dir(path)


def write_merged(cfg: FinetuneConfig) -> dict:
    """The LoRA checkpoint cfg.merge_lora with its adapters added into its base's weights, as OUT_DIR/ckpt.pt."""
    checkpoint = load_checkpoint(cfg.merge_lora)
    if "adapters" not in checkpoint:
        raise CLIError(f"{cfg.merge_lora} holds no LoRA adapters; it is already a full checkpoint")
    model, _ = load_model(cfg.merge_lora)
    merged = {k: v for k, v in checkpoint.items() if k not in ("lora", "adapters")}
    merged["model"] = clean_state_dict(model.state_dict())
    merged["finetune"] = {**checkpoint.get("finetune", {}), "merged_from": cfg.merge_lora,
                          "lora": checkpoint["lora"]}
    path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
    os.makedirs(cfg.out_dir, exist_ok=True)
    save_checkpoint(merged, path)
    return {"merged": cfg.merge_lora, "out": path}


def setup(cfg: FinetuneConfig, resume: dict | None = None) -> Trainer:
    """Read the body and the examples, add the special tokens and the head (or the adapters), and hand the loop an
    engine; nothing is written before every input has been read and checked. resume: an interrupted run's latest
    state (resumed_config), continued exactly."""
    device = resolve_device(cfg.device, distributed.local_rank())
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cpu":
        keep_freed_memory_in_heap()
    world = distributed.world_size()
    cfg.grad_accum = cfg.grad_accum or world
    if cfg.grad_accum % world:
        raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across {world} processes; use a multiple of "
                       f"{world}")
    cfg.run_name = cfg.run_name or time.strftime("%Y%m%d-%H%M%S")

    body, facts = load_model(cfg.init_from, dropout=cfg.dropout)
    tokenizer = base_tokenizer(body, facts, cfg.init_from)
    if cfg.block_size is not None and cfg.block_size > body.config.block_size:
        raise CLIError(f"--block-size {cfg.block_size} is longer than the {body.config.block_size} positions of "
                       f"{cfg.init_from}")
    if cfg.block_size is not None:
        body.crop_block_size(cfg.block_size)
    base_vocab = body.config.vocab_size
    torch.manual_seed(cfg.seed)  # the new embedding rows and the head, the same in every rank
    special = add_chat_tokens(body, tokenizer) if cfg.task == "sft" else add_special_tokens(body, tokenizer)
    facts = {**facts, "vocab_size": tokenizer.vocab_size, "special_tokens": special}
    objective = chat_objective(cfg, body, facts, tokenizer, device, dtype) if cfg.task == "sft" else \
        task_objective(cfg, body, facts, tokenizer, special, device, dtype)
    model = objective.model.to(device)
    if objective.steps_per_epoch == 0:
        raise CLIError(f"{cfg.train} has {len(objective.train_set)} examples, fewer than the {cfg.grad_accum} "
                       f"micro-batches of a step")
    if cfg.lora_rank:
        base = base_source(cfg.init_from)
        objective.adapters = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                              "targets": cfg.lora_targets, "base_vocab": base_vocab,
                              "base": {"path": base, "sha256": lora.fingerprint(base)}}
        lora.add_lora(body, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets, base_vocab)
    if resume is not None:
        restore_trained(objective, resume)
    elif cfg.task != "sft":
        objective.fit_head()
    cfg.epochs = cfg.epochs or max(EPOCHS, math.ceil(MIN_STEPS / objective.steps_per_epoch))
    cfg.lr = cfg.lr or LR_WIDTH / body.config.n_embd * (LORA_LR if cfg.lora_rank else 1)
    optimizer = make_optimizer(model, "adamw", cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                               device_type=device.type)
    path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
    engine = TorchEngine(path, model, body, optimizer, device, dtype, objective.loss, cfg.grad_clip,
                         save_optimizer=False, resume=resume)
    if distributed.rank() == 0:  # every input is good: only now is anything written
        claim_out_dir(cfg.out_dir, path, resuming=resume is not None, overwrite=True)  # finetune.py checked it
        describe_run(cfg, objective, device, dtype)
    total = cfg.epochs * objective.steps_per_epoch
    schedule = Schedule(cfg.lr, math.ceil(cfg.warmup * total), total, 0.0, shape="linear")
    metric = "val_loss" if cfg.task == "sft" else "val_pearson" if cfg.labels == "float" else "val_accuracy"
    loop = LoopConfig(max_iters=total, log_interval=cfg.log_interval, eval_interval=objective.steps_per_epoch,
                      eval_at_start=cfg.task == "sft", metric=metric, maximize=metric != "val_loss",
                      keep_best=True, latest_path=os.path.join(cfg.out_dir, LATEST_FILE))
    if resume is None:
        return Trainer(engine, objective, schedule, loop, cfg.out_dir, cfg.run_name, cfg.tensorboard_dir,
                       desc="finetune")
    return Trainer(engine, objective, schedule, loop, cfg.out_dir, cfg.run_name, cfg.tensorboard_dir,
                   step=resume["iter_num"], history=resume["history"], best=resume["finetune"]["metrics"],
                   desc="finetune")


def restore_trained(objective, checkpoint: dict) -> None:
    """What a fine-tuning trains, from its latest state: the adapters (LoRA; the engine restores full weights) and
    the head."""
    body = getattr(objective.model, "body", objective.model)
    if "adapters" in checkpoint:
        lora.load_adapters(body, checkpoint["adapters"], LATEST_FILE)
    if "head" in checkpoint:
        objective.model.head.load_state_dict(checkpoint["head"])


def task_objective(cfg: FinetuneConfig, body: GPT, facts: dict, tokenizer: Tokenizer, special: dict[str, int],
                   device: torch.device, dtype: torch.dtype) -> TaskObjective:
    """A GPT-1 task's examples, labels and head."""
    train = read_records(cfg.train, cfg.task, labelled=True)
    val = read_records(cfg.val, cfg.task, labelled=True)
    names = None if cfg.labels == "float" or cfg.task == "choice" else label_names(train, cfg.train)
    block_size = body.config.block_size
    train_set = encode_records(train, cfg.train, cfg.task, tokenizer, special, block_size, names)
    val_set = encode_records(val, cfg.val, cfg.task, tokenizer, special, block_size, names)
    model = TaskModel(body, cfg.task, len(names) if names else 1, cfg.head_dropout, special)
    for path, examples in ((cfg.train, train_set), (cfg.val, val_set)):
        cut = sum(e.truncated for e in examples)
        if cut and distributed.rank() == 0:
            print(f"{path}: {cut} of {len(examples)} examples cut to the block size of {block_size} tokens, from the "
                  f"left of the context")
    return TaskObjective(cfg, model, facts, names, train_set, val_set, device, dtype)


def chat_objective(cfg: FinetuneConfig, body: GPT, facts: dict, tokenizer: Tokenizer, device: torch.device,
                   dtype: torch.dtype) -> ChatObjective:
    """The conversations of instruction tuning, cut to the block size by toolkit/chat.py's rule."""
    sets = []
    for path in (cfg.train, cfg.val):
        conversations = read_conversations(path)
        kept, left_out = encode_conversations(conversations, tokenizer, body.config.block_size)
        cut = sum(c.cut for c in kept)
        if (cut or left_out) and distributed.rank() == 0:
            print(f"{path}: {cut} of {len(conversations)} conversations cut at the block size of "
                  f"{body.config.block_size} tokens (their later tokens dropped), {left_out} left out (no assistant "
                  f"token within it)")
        if not kept:
            raise CLIError(f"{path}: no conversation has an assistant token within the block size of "
                           f"{body.config.block_size}; use shorter conversations or a model with a longer block")
        sets.append(kept)
    return ChatObjective(cfg, body, facts, *sets, device, dtype)


def describe_run(cfg: FinetuneConfig, objective, device: torch.device, dtype: torch.dtype) -> None:
    body = getattr(objective.model, "body", objective.model)
    if cfg.task == "sft":
        what = f"conversations, loss on {trained_tokens(objective.train_set):,} assistant tokens"
    else:
        what = "examples, " + ("scores (regression)" if objective.regression else "answers" if cfg.task == "choice"
                               else f"labels {', '.join(map(repr, objective.names))}")
    print(f"fine-tuning {cfg.task} from {cfg.init_from}: {len(objective.train_set)} train, "
          f"{len(objective.val_set)} val {what}")
    trainable = sum(p.numel() for p in objective.model.parameters() if p.requires_grad)
    adapters = f", LoRA rank {cfg.lora_rank} on {cfg.lora_targets}: {trainable:,} trained" if cfg.lora_rank else ""
    print(f"model: {body.num_params() / 1e6:.2f}M parameters{adapters}, block {body.config.block_size}; {cfg.epochs} "
          f"epochs x {objective.steps_per_epoch} steps of {objective.global_batch} over {distributed.world_size()} "
          f"process(es), lr {cfg.lr:.3g}; device {describe(device)}, dtype {str(dtype).removeprefix('torch.')}",
          flush=True)


def learning_warning(trainer: Trainer) -> str | None:
    """One line when the run learnt nothing: its best is no better than chance, or than its first evaluation."""
    objective, loop = trainer.objective, trainer.loop
    metrics = trainer.history["metrics"]
    if not metrics:
        return None
    best, first = trainer.best[loop.metric], metrics[0][loop.metric]
    if not loop.maximize:  # sft's val loss, first evaluated before any step
        if best < first - 0.01:
            return None
        why = f"no lower than before fine-tuning ({first:.4f})"
    else:
        chance = objective.chance()
        if best > chance + 0.02 and (len(metrics) < 2 or best > first):
            return None
        why = f"no better than chance ({chance:.3f})" if best <= chance + 0.02 else \
            "no better than after the first epoch"
    return (f"warning: the best {loop.metric.replace('_', ' ')} {best:.4f} is {why}; try a higher --lr (now "
            f"{objective.cfg.lr:g}), more --epochs or more examples")
