"""Fine-tuning a pretrained GPT, the way finetune.py runs it: the starting body, GPT-1's task
objective (the task's loss plus the LM loss, the head fitted before the first step, one global batch
split over the processes), predictions with a fine-tuned checkpoint, the merge of LoRA adapters, and
the setup of a run: for a task or for instruction tuning, of every weight or of LoRA adapters.

    cfg = FinetuneConfig(task="classify", train="t.jsonl", val="v.jsonl", init_from="ckpt/ckpt.pt")
    run(cfg, resume=None, backend=None, timeout=300)   # finetune.py checks cfg first (check_config)

The options are toolkit/finetune_config.py's; the tasks' token layouts, head, scoring and metrics
toolkit/tasks.py's; instruction tuning's objective toolkit/sft.py's, the adapters toolkit/lora.py's;
the loop toolkit/training.py.
"""
import json
import math
import os
import sys
from dataclasses import replace

import torch
from torch.nn import functional as F

from model import GPT
from toolkit import distributed, lora
from toolkit.batches import epoch_batches, step_batches, train_and_val
from toolkit.chat import add_chat_tokens, can_chat
from toolkit.checkpoint import CHECKPOINT_FILE, load_checkpoint, run_state, save_checkpoint
from toolkit.cli import CLIError
from toolkit.config import settle_run
from toolkit.device import describe, num_params, run_device
from toolkit.files import atomic_open, check_output, claim_out_dir
from toolkit.finetune_config import (EPOCHS, LATEST_FILE, LORA_LR, LR_WIDTH, MIN_STEPS,
                                     FinetuneConfig, check_outputs)
from toolkit.model_sources import load_model
from toolkit.optim import Schedule
from toolkit.sft import ChatObjective, chat_objective
from toolkit.tasks import (Example, TaskModel, add_special_tokens, classification_metrics,
                           encode_records, label_names, over_examples, pad_batch, prediction,
                           read_records, regression_metrics, score)
from toolkit.tokenizers import Tokenizer, load_tokenizer
from toolkit.training import Engine, LoopConfig, Objective, TorchEngine, Trainer

PROBE_L2, PROBE_ITERS = 1e-4, 200  # the head's first fit: L2 penalty, L-BFGS iterations (docs)


# ----- models and predictions -----

def load_body(cfg: FinetuneConfig) -> tuple[GPT, Tokenizer, dict]:
    """The pretrained body (cut to --block-size), the tokenizer it was pretrained with and its
    facts; a body already fine-tuned, or one its tokenizer does not fit, is an error."""
    source = cfg.init_from
    body, facts = load_model(source, dropout=cfg.dropout)
    tokenizer = load_tokenizer(facts)
    if facts.get("special_tokens"):
        exported = os.path.isfile(os.path.join(source, "config.json"))  # an HF folder: no head
        use = (f"talk to it with test.py --ckpt {source} --chat" if can_chat(tokenizer) else
               "its HF export keeps no task head (--predict takes the ckpt.pt)" if exported else
               "use it with --predict")
        raise CLIError(f"{source} is already fine-tuned; {use}, or fine-tune the model it came "
                       "from")
    if tokenizer.vocab_size > body.config.vocab_size:
        raise CLIError(f"{source} has a model of {body.config.vocab_size} tokens but its "
                       f"{tokenizer.name} tokenizer has {tokenizer.vocab_size}: the checkpoint "
                       f"does not fit its tokenizer")
    if cfg.block_size is not None:
        if cfg.block_size > body.config.block_size:
            raise CLIError(f"--block-size {cfg.block_size} is longer than the "
                           f"{body.config.block_size} positions of {source}")
        body.crop_block_size(cfg.block_size)
    return body, tokenizer, facts


def load_finetuned(path: str, device: torch.device) -> tuple[TaskModel, Tokenizer, dict]:
    """(model with its head, tokenizer with special tokens, task facts) of a fine-tuned ckpt.pt."""
    checkpoint = load_checkpoint(path)
    task = checkpoint.get("finetune")
    if isinstance(task, dict) and task.get("task") == "sft":
        raise CLIError(f"{path} is instruction-tuned, not fine-tuned for a task: talk to it with "
                       f"test.py --ckpt {path} --chat")
    if not isinstance(task, dict) or "head" not in checkpoint:
        raise CLIError(f"{path} is not a fine-tuned checkpoint (it has no task head); fine-tune it "
                       f"with --task, --train and --val first")
    body, _ = load_model(path)
    special = checkpoint["tokenizer"]["special_tokens"]
    model = TaskModel(body, task["task"], task["outputs"], 0.0, special)
    shapes = {name: tensor.shape for name, tensor in model.head.state_dict().items()}
    head_fits = {name: tensor.shape for name, tensor in checkpoint["head"].items()} == shapes
    if not (task.get("likelihood") and head_fits):  # written before the head read the likelihood
        raise CLIError(f"{path} was written by an older version of finetune.py, whose head read "
                       f"other inputs; fine-tune again to use it")
    model.head.load_state_dict(checkpoint["head"])
    return model.to(device).eval(), load_tokenizer(checkpoint["tokenizer"]), task


def predict_examples(path: str, task: str, tokenizer, block_size: int) -> list:
    """The unlabelled examples of --predict, encoded as the fine-tuned model reads them."""
    records = read_records(path, task, labelled=False)
    return encode_records(records, path, task, tokenizer, tokenizer.special_tokens, block_size,
                          None, labelled=False)


def write_predictions(cfg: FinetuneConfig, checkpoint_path: str, device: torch.device,
                      dtype: torch.dtype) -> dict:
    """Label cfg.predict with a fine-tuned checkpoint into cfg.out (atomically); what was done."""
    model, tokenizer, task = load_finetuned(checkpoint_path, device)
    if cfg.task not in (None, task["task"]):
        raise CLIError(f"{checkpoint_path} was fine-tuned for --task {task['task']}, not "
                       f"{cfg.task}")
    examples = predict_examples(cfg.predict, task["task"], tokenizer,
                                model.body.config.block_size)
    rows = score(model, examples, cfg.batch_size, device, dtype)
    with atomic_open(cfg.out) as f:
        f.writelines(json.dumps(prediction(row, task), ensure_ascii=False) + "\n" for row in rows)
    truncated = sum(e.truncated for e in examples)
    return {"predictions": len(rows), "out": cfg.out, "truncated": truncated}


# ----- the objective -----

class TaskObjective(Objective):
    """What the loop learns when fine-tuning for a task: the task's loss (cross-entropy, or squared
    error for a regression) plus lm_weight times the LM loss on the same inputs, over one epoch
    order per epoch; evaluated on the val set after each epoch."""

    def __init__(self, cfg: FinetuneConfig, model: TaskModel, facts: dict, names: list | None,
                 train_set: list[Example], val_set: list[Example], device: torch.device,
                 dtype: torch.dtype):
        self.cfg, self.model, self.facts, self.names = cfg, model, facts, names
        self.train_set, self.val_set, self.device, self.dtype = train_set, val_set, device, dtype
        self.regression = cfg.labels == "float"
        self.val_labels = torch.tensor([e.label for e in val_set])
        self.global_batch = cfg.batch_size * cfg.grad_accum
        self.steps_per_epoch = len(epoch_batches(len(train_set), self.global_batch, cfg.grad_accum,
                                                 cfg.seed, 0))
        self.adapters = None  # LoRA's settings when the body trains adapters (setup)

    def micro_batches(self, step: int) -> list[tuple[list[Example], float]]:
        """This rank's micro-batches of the step, each weighted by its share of the global batch."""
        batch, mine = step_batches(step, len(self.train_set), self.cfg, self.steps_per_epoch)
        return [([self.train_set[i] for i in rows], len(rows) / len(batch)) for rows in mine]

    def loss(self, model: torch.nn.Module, examples: list[Example]) -> torch.Tensor:
        idx, extract, targets = pad_batch(examples, self.device)
        labels = torch.tensor([e.label for e in examples], device=self.device)
        lm_targets = targets if self.cfg.lm_weight else None
        logits, lm_loss = model(idx, extract, len(examples[0].sequences), lm_targets)
        loss = self.task_loss(logits, labels)
        return loss if lm_loss is None else loss + self.cfg.lm_weight * lm_loss

    def task_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.regression:
            return F.mse_loss(logits.squeeze(-1), labels.float())
        return F.cross_entropy(logits, labels)

    def fit_head(self) -> None:
        """Start the head as the best linear probe of the pretrained body (LP-FT: Kumar et al. 2022,
        "Fine-Tuning can Distort Pretrained Features and Underperform Out-of-Distribution"): the
        task's loss of the head alone on the frozen body's features, L2-regularised, minimised by
        L-BFGS (convex: one answer whatever the start, the same in every rank). A random head would
        first pull the body towards itself; a fitted one builds on what the body knows."""
        model, answers = self.model, len(self.train_set[0].sequences)
        width = model.head.in_features
        choice = model.task == "choice"  # the head reads each answer, and adds its log-likelihood
        shapes = [(answers, width), (answers,)] if choice else [(width,)]

        def head_inputs(idx: torch.Tensor, extract: torch.Tensor, per_example: int) -> list:
            hidden = model.body.hidden_states(idx)
            inputs, offset = model.head_inputs(hidden, idx, extract, per_example)
            return [inputs] if offset is None else [inputs, offset]

        inputs, *offset = over_examples(model, self.train_set, self.cfg.batch_size, self.device,
                                        self.dtype, shapes, head_inputs)
        offset = offset[0] if choice else None
        labels = torch.tensor([e.label for e in self.train_set], device=self.device)
        optimizer = torch.optim.LBFGS(model.head.parameters(), max_iter=PROBE_ITERS,
                                      line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            penalty = PROBE_L2 * model.head.weight.square().sum()
            loss = self.task_loss(model.scores(inputs, offset), labels) + penalty
            loss.backward()
            return loss

        optimizer.step(closure)

    def throughput(self) -> tuple[int, str, None]:
        return self.global_batch, "examples", None

    def evaluate(self, engine: Engine) -> dict[str, float]:
        logits = score(self.model, self.val_set, self.cfg.batch_size, self.device, self.dtype)
        if self.regression:
            metrics = regression_metrics(logits.squeeze(-1), self.val_labels.float())
        else:
            two_classes = self.names is not None and len(self.names) == 2
            metrics = classification_metrics(logits, self.val_labels, binary=two_classes)
        return {name: round(value, 4) for name, value in metrics.items()}

    def checkpoint_state(self, best: dict | None) -> dict:
        """train.py's format plus the head's weights and the task (no optimizer: the best epoch's
        checkpoint is not resumed)."""
        cfg, body = self.cfg, self.model.body
        task = {"task": cfg.task, "labels": cfg.labels, "label_names": self.names,
                "outputs": self.model.head.out_features, "metrics": best,
                "init_from": cfg.init_from, "likelihood": True}  # (load_finetuned checks it)
        return {**run_state(body, cfg, self.facts), **lora.checkpoint_entries(self.adapters, body),
                "head": self.model.head.state_dict(), "finetune": task}

    def chance(self) -> float:
        """The metric a model that learnt nothing reaches: the commonest val label's share (a
        choice: one over the answers), or no correlation."""
        if self.regression:
            return 0.0
        if self.cfg.task == "choice":
            return 1 / len(self.val_set[0].sequences)
        return torch.bincount(self.val_labels).max().item() / len(self.val_labels)

    def describe_data(self) -> str:
        if self.regression:
            learnt = "scores (regression)"
        elif self.names is None:
            learnt = "answers"
        else:
            learnt = f"labels {', '.join(map(repr, self.names))}"
            if len(self.names) == 2:  # which class val_f1 is the F1 of
                learnt += f" (val_f1: of {self.names[1]!r})"
        return f"{len(self.train_set)} train, {len(self.val_set)} val examples, {learnt}"


def task_objective(cfg: FinetuneConfig, body: GPT, facts: dict, tokenizer: Tokenizer,
                   special: dict[str, int], device: torch.device,
                   dtype: torch.dtype) -> TaskObjective:
    """A GPT-1 task's examples, labels and head."""
    train, val = train_and_val(cfg, lambda path: read_records(path, cfg.task, labelled=True))
    val_file = cfg.val or cfg.train  # where the validation examples' lines are
    has_classes = cfg.labels == "class" and cfg.task != "choice"
    names = label_names(train, cfg.train) if has_classes else None
    block_size = body.config.block_size
    train_set = encode_records(train, cfg.train, cfg.task, tokenizer, special, block_size, names)
    val_set = encode_records(val, val_file, cfg.task, tokenizer, special, block_size, names)
    model = TaskModel(body, cfg.task, len(names) if names else 1, cfg.head_dropout, special)
    for path, examples in ((cfg.train, train_set), (val_file, val_set)):
        cut = sum(e.truncated for e in examples)
        if cut and distributed.rank() == 0:
            print(f"{path}: {cut} of {len(examples)} examples cut to the block size of "
                  f"{block_size} tokens, from the left of the context")
    return TaskObjective(cfg, model, facts, names, train_set, val_set, device, dtype)


# ----- a run -----

def run(cfg: FinetuneConfig, resume: dict | None, backend: str | None, timeout: float) -> None:
    """finetune.py's work, its flags checked: merge a LoRA checkpoint, label --predict with a
    fine-tuned model, or fine-tune (under torchrun, in every process) and then label --predict; the
    last line printed is one JSON object."""
    check_outputs(cfg, resume is not None)
    if distributed.launched_by_torchrun():
        distributed.init_torchrun(cfg.device, backend, timeout)
    master = distributed.rank() == 0
    if cfg.merge_lora:
        if master:
            print(json.dumps(write_merged(cfg)))
        return
    if cfg.train is None:
        if master:
            device, dtype = run_device(cfg.device, cfg.dtype)
            print(json.dumps(write_predictions(cfg, cfg.init_from, device, dtype)))
        return
    trainer = setup(cfg, resume)
    trainer.fit()
    if not master:
        return
    if cfg.predict and not trainer.stopped:
        print(json.dumps(write_predictions(cfg, trainer.engine.path, trainer.device,
                                           trainer.engine.dtype)))
    warning = learning_warning(trainer)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    epochs = trainer.step // trainer.objective.steps_per_epoch
    print(json.dumps({**(trainer.best or {}), "epochs": epochs, "steps": trainer.step}), flush=True)


def write_merged(cfg: FinetuneConfig) -> dict:
    """--merge-lora: the LoRA checkpoint's base with its adapters added in, as OUT_DIR/ckpt.pt."""
    checkpoint = load_checkpoint(cfg.merge_lora)
    if "adapters" not in checkpoint:
        raise CLIError(f"{cfg.merge_lora} holds no LoRA adapters; it is already a full checkpoint")
    merged, _ = load_model(cfg.merge_lora)
    path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
    # the adapters' base is an input too: replaced, it would orphan them
    check_output(path, [checkpoint["lora"]["base"]["path"]], "--out-dir")
    os.makedirs(cfg.out_dir, exist_ok=True)
    save_checkpoint(lora.merged_checkpoint(checkpoint, merged, cfg.merge_lora), path)
    return {"merged": cfg.merge_lora, "out": path}


def setup(cfg: FinetuneConfig, resume: dict | None = None) -> Trainer:
    """Read the body and the examples, add the special tokens and the head (or the adapters), and
    hand the loop an engine; nothing is written before every input has been read and checked.
    resume: an interrupted run's latest state (resumed_config), continued exactly."""
    cfg = settle_run(cfg, data_parallel=distributed.world_size())
    device, dtype = run_device(cfg.device, cfg.dtype, distributed.local_rank())
    body, tokenizer, facts = load_body(cfg)
    base_vocab = body.config.vocab_size
    sft = cfg.task == "sft"
    torch.manual_seed(cfg.seed)  # the new embedding rows and the head, the same in every rank
    special = add_chat_tokens(body, tokenizer) if sft else add_special_tokens(body, tokenizer)
    facts = {**facts, "vocab_size": tokenizer.vocab_size, "special_tokens": special}
    if sft:
        objective = chat_objective(cfg, body, facts, tokenizer, device, dtype)
    else:
        objective = task_objective(cfg, body, facts, tokenizer, special, device, dtype)
    if cfg.predict:  # read now, not found bad once the training is done
        predict_examples(cfg.predict, cfg.task, tokenizer, body.config.block_size)
    model = objective.model.to(device)
    if objective.steps_per_epoch == 0:
        raise CLIError(f"{cfg.train} has {len(objective.train_set)} examples, fewer than the "
                       f"{cfg.grad_accum} micro-batches of a step")
    if cfg.lora_rank:
        objective.adapters = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha,
                              "dropout": cfg.lora_dropout, "targets": cfg.lora_targets,
                              "base_vocab": base_vocab, "base": lora.base_record(cfg.init_from)}
        lora.add_lora(body, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets,
                      base_vocab)
    if resume is not None:  # what the engine does not restore: the adapters and the head
        if "adapters" in resume:
            lora.load_adapters(body, resume["adapters"], LATEST_FILE)
        if not sft:
            load_head(objective.model.head, resume, os.path.join(cfg.out_dir, LATEST_FILE))
    elif not sft:
        objective.fit_head()
    # the last defaults, which depend on the data and the model: the configuration is settled here
    epochs = cfg.epochs or max(EPOCHS, math.ceil(MIN_STEPS / objective.steps_per_epoch))
    lr = cfg.lr or LR_WIDTH / body.config.n_embd * (LORA_LR if cfg.lora_rank else 1)
    objective.cfg = cfg = replace(cfg, epochs=epochs, lr=lr)
    engine = TorchEngine(os.path.join(cfg.out_dir, CHECKPOINT_FILE), save_optimizer=False)
    engine.start(model, cfg, device, dtype, objective.loss, resume, gpt=body)
    if distributed.rank() == 0:  # every input is good: only now is anything written
        # (overwrite: finetune.py refused an existing checkpoint unless --overwrite)
        claim_out_dir(cfg.out_dir, engine.path, resuming=resume is not None, overwrite=True)
        describe_run(cfg, objective, body, device, dtype)
    total = cfg.epochs * objective.steps_per_epoch
    schedule = Schedule(cfg.lr, math.ceil(cfg.warmup * total), total, 0.0, shape="linear")
    metric = "val_loss" if sft else "val_pearson" if cfg.labels == "float" else "val_accuracy"
    loop = LoopConfig(max_iters=total, eval_interval=objective.steps_per_epoch, eval_at_start=sft,
                      metric=metric, maximize=metric != "val_loss", keep_best=True,
                      latest_path=os.path.join(cfg.out_dir, LATEST_FILE))
    if resume is None:
        return Trainer(engine, objective, schedule, loop, cfg, desc="finetune")
    return Trainer(engine, objective, schedule, loop, cfg, resume["iter_num"], resume["history"],
                   resume["finetune"].get("metrics"), desc="finetune")


def load_head(head: torch.nn.Module, resume: dict, path: str) -> None:
    """The interrupted run's task head, when it has the shapes of this task's."""
    shapes = {name: tensor.shape for name, tensor in head.state_dict().items()}
    saved = resume.get("head") or {}
    if {name: getattr(tensor, "shape", None) for name, tensor in saved.items()} != shapes:
        raise CLIError(f"{path} holds no task head of this task's shape; start anew with "
                       "--overwrite")
    head.load_state_dict(saved)


def describe_run(cfg: FinetuneConfig, objective: TaskObjective | ChatObjective, body: GPT,
                 device: torch.device, dtype: torch.dtype) -> None:
    print(f"fine-tuning {cfg.task} from {cfg.init_from}: {objective.describe_data()}")
    adapters = ""
    if cfg.lora_rank:
        trained = sum(p.numel() for p in objective.model.parameters() if p.requires_grad)
        adapters = f", LoRA rank {cfg.lora_rank} on {cfg.lora_targets}: {trained:,} trained"
    print(f"model: {num_params(body.config) / 1e6:.2f}M parameters{adapters}, block "
          f"{body.config.block_size}; {cfg.epochs} epochs x {objective.steps_per_epoch} steps of "
          f"{objective.global_batch} over {distributed.world_size()} process(es), lr {cfg.lr:.3g}; "
          f"device {describe(device)}, dtype {str(dtype).removeprefix('torch.')}", flush=True)


def learning_warning(trainer: Trainer) -> str | None:
    """A warning line when the run's best is no better than chance, or than its first evaluation."""
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
        above_chance = best > chance + 0.02
        improved = len(metrics) < 2 or best > first  # (one evaluation: nothing to compare it with)
        if above_chance and improved:
            return None
        why = "no better than after the first epoch" if above_chance else \
            f"no better than chance ({chance:.3f})"
    return (f"warning: the best {loop.metric.replace('_', ' ')} {best:.4f} is {why}; try a higher "
            f"--lr (now {objective.cfg.lr:g}), more --epochs or more examples")
