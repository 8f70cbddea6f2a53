"""The one training loop and its declared parts: every trainer (train.py, train_ddp.py, train_ds.py,
finetune.py, embed.py tune) runs Trainer.fit over an Engine and an Objective, as torchtitan composes
its trainer.

    trainer = Trainer(engine, objective, schedule, loop, cfg)
    trainer.fit()

Follow one step (docs/design.md): Trainer.fit asks the objective for the step's micro-batches, the
engine's train_step runs each through objective.loss and steps the optimizer; for pretraining that
loss is LanguageModeling.loss (toolkit/pretraining.py), `model(x, y)` of model.py (its chunked loss
on a CPU).

Each micro-batch carries its share of the global batch's loss (the weights of all micro-batches of
all data-parallel processes sum to 1), so uneven splits train exactly as one process would. A
non-finite step never reaches disk.
"""
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed._composable import checkpoint
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from toolkit import distributed
from toolkit.checkpoint import (SHARDED_DIR, capture_rng, is_sharded, load_resume, load_weights,
                                make_checkpoint, newest_checkpoint, restore_rng, save_checkpoint)
from toolkit.cli import CLIError
from toolkit.config import RunConfig
from toolkit.device import autocast, peak_flops
from toolkit.files import refuse_special
from toolkit.optim import Schedule, make_optimizer
from toolkit.runlog import RunLog
from toolkit.signals import StopRequest

Batch = Any  # what an objective's micro-batch holds: (x, y) windows, examples, conversations, pairs


def diverged(what: str, hint: str) -> CLIError:
    """The one wording of a run that went non-finite."""
    return CLIError(f"{what}; stopped without saving (the checkpoint written before, if any, is "
                    f"kept). Try {hint}")


class Engine(Protocol):
    """How a step runs and a checkpoint is written: TorchEngine below (one process or DDP),
    DeepSpeedEngine (toolkit/deepspeed_engine.py). Made before the model, so that setup can read
    what it resumes from; started with the model."""
    path: str  # where its checkpoint lives
    resumed_from: str  # what read_resume read
    device: torch.device
    dtype: torch.dtype

    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) among replicas splitting the data (a replica's pipeline stages share it)."""

    def read_resume(self) -> dict:
        """The saved state a resumed run continues from."""

    def settle_config(self, cfg: RunConfig, resumed: set[str]) -> RunConfig:
        """The options its own configuration also sets, reconciled with the flags (cfg.given; those
        of resumed came from the checkpoint)."""

    def start(self, model: torch.nn.Module, cfg: RunConfig, device: torch.device,
              dtype: torch.dtype, loss: Callable, resume: dict | None) -> None:
        """Take the model (and the saved state of a resumed run); build the optimizer."""

    def train_step(self, batches: list[tuple[Batch, float]], lr: float) -> float:
        """One optimizer step over this process's weighted micro-batches; its share of the loss."""

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The language-model loss of a batch, without gradients."""

    def logits_at(self, idx: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The logits at some positions of a batch (toolkit/evaluation.py's scoring)."""

    def weights_finite(self) -> bool:
        """No NaN or inf in the weights of any process."""

    def save(self, state: dict, path: str | None = None, resumable: bool | None = None) -> None:
        """A checkpoint of the weights and `state` at path (default: self.path)."""


class Objective(Protocol):
    """What is learnt: LanguageModeling (toolkit/pretraining.py), TaskObjective
    (toolkit/finetuning.py), ChatObjective (toolkit/sft.py), Contrastive (toolkit/embedding.py);
    each declares it as its base."""

    def micro_batches(self, step: int) -> list[tuple[Batch, float]]:
        """This rank's micro-batches of a step, each with its share of the global batch's loss."""

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss of one micro-batch."""

    def throughput(self) -> tuple[int, str, float | None]:
        """(items per step, their unit, FLOPs per step or None) for the log line and MFU."""

    def evaluate(self, engine: Engine) -> dict[str, float]:
        """The metrics of an evaluation (val_loss among them, unless there is none)."""

    def good_weights(self, engine: Engine) -> bool:
        """Weights fit to save: finite (and with a finite loss, where the objective checks one)."""
        return engine.weights_finite()

    def checkpoint_state(self, best: dict | None) -> dict:
        """What a checkpoint keeps besides the weights and the loop's state."""


@dataclass
class LoopConfig:
    max_iters: int
    eval_interval: int = 0  # 0: evaluate only at the end
    save_interval: int = 0  # 0: save only at the end (and on a signal)
    eval_at_start: bool = True  # nanoGPT evaluates before the first step; fine-tuning after epochs
    metric: str = "val_loss"  # the metric "best" refers to
    maximize: bool = False
    keep_best: bool = False  # save at each evaluation that beats the best, not the latest state
    latest_path: str | None = None  # with keep_best: the latest state (exact resume) until the end
    peak_tflops: float | None = None  # the device's peak, for MFU (known GPUs are looked up)
    hint: str = "a lower --lr or --dtype bfloat16"  # what to try when the run goes non-finite


def checkpoint_activations(blocks: torch.nn.ModuleList) -> None:
    """Each block keeps its input only and runs again in the backward pass (PyTorch's composable
    activation checkpointing: hooks, so the weights keep their names and FSDP2 composes)."""
    for block in blocks:
        checkpoint(block)


class TorchEngine:
    """Steps in torch: Muon or AdamW (a param group's `lr_scale` moves it along the schedule), a
    GradScaler for float16, torch.compile, DDP in a process group, or FSDP2 with fsdp
    (toolkit/fsdp.py). Its checkpoint is the ckpt.pt it is given, written by rank 0: the weights of
    `gpt`, the objective's state and, unless save_optimizer is off, what exact resume needs; under
    FSDP2 the sharded folder beside it (toolkit/fsdp_checkpoint.py), each rank writing its shards.
    `path` is the one it writes; it resumes from whichever of the two holds the later step."""

    def __init__(self, path: str, save_optimizer: bool = True, fsdp: bool = False):
        refuse_special(path, "--out-dir's")  # a folder in its place: found now, not after training
        self.file, self.save_optimizer, self.fsdp = path, save_optimizer, fsdp
        self.path = os.path.join(os.path.dirname(path), SHARDED_DIR) if fsdp else path
        self.resumed_from, self.sharded_source = self.file, None  # (a sharded folder)

    def data_parallel(self) -> tuple[int, int]:
        return distributed.rank(), distributed.world_size()

    def read_resume(self) -> dict:
        source = self.resumed_from = newest_checkpoint(self.file)
        if not is_sharded(source):
            return load_resume(self.file)
        from toolkit.fsdp_checkpoint import read_sharded, read_state  # (0.8 s: see start())
        if not self.fsdp:
            return read_sharded(source)  # gathered whole in each process
        self.sharded_source = source  # each rank reads its shards in start()
        return read_state(source)[1]

    def settle_config(self, cfg: RunConfig, resumed: set[str]) -> RunConfig:
        return cfg  # the flags are the whole configuration

    def start(self, model: torch.nn.Module, cfg: RunConfig, device: torch.device,
              dtype: torch.dtype, loss: Callable, resume: dict | None = None,
              gpt: torch.nn.Module | None = None) -> None:
        """gpt: the network whose weights a checkpoint keeps, when model wraps it (a task head)."""
        self.model, self.gpt, self.device, self.dtype = model, gpt or model, device, dtype
        self.loss, self.grad_clip = loss, cfg.grad_clip
        # (a LoRA checkpoint holds adapters instead: toolkit/lora.py)
        if resume is not None and "model" in resume:
            load_weights(self.gpt, resume["model"], self.resumed_from)
        if cfg.activation_checkpointing:
            checkpoint_activations(self.gpt.transformer.h)
        if self.fsdp:  # every rank read the whole weights: now each keeps its shard
            # FSDP2 and DCP take 0.8 s to import (DTensor's ops): only FSDP runs pay it
            from toolkit.fsdp import shard_model, shard_optimizer_state
            from toolkit.fsdp_checkpoint import load_sharded
            shard_model(model, self.gpt.transformer.h, dtype)
        self.optimizer = make_optimizer(model, cfg.optimizer, cfg.lr, cfg.weight_decay,
                                        (cfg.beta1, cfg.beta2), cfg.muon_lr, device.type, dtype)
        # as built from the flags: a resumed optimizer's saved groups do not override them
        self.lr_scales = [group.get("lr_scale", 1.0) for group in self.optimizer.param_groups]
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        if self.sharded_source is not None:
            resume = load_sharded(self.sharded_source, model,
                                  self.optimizer if resume.get("optimizer") else None)
        if resume is not None:
            if not resume.get("optimizer"):  # e.g. finetune.py's, which keeps no optimizer
                raise CLIError(f"{self.resumed_from} holds no optimizer state to resume; to go on "
                               f"from its weights with a fresh optimizer: --init-from "
                               f"{self.resumed_from}")
            saved = resume["optimizer"]
            try:
                whole = self.fsdp and self.sharded_source is None  # a ckpt.pt's, cut up here
                self.optimizer.load_state_dict(shard_optimizer_state(self.optimizer, saved)
                                               if whole else saved)
            except ValueError as e:  # groups laid out otherwise, e.g. by an earlier version
                source = self.resumed_from
                raise CLIError(f"{source}: its optimizer state does not fit this optimizer ({e}); "
                               f"to go on from its weights with a fresh optimizer: --init-from "
                               f"{source} --optimizer {cfg.optimizer}") from None
            if resume.get("scaler"):
                self.scaler.load_state_dict(resume["scaler"])
            restore_rng(resume.get("rng") or {}, device)
        self.forward_model = self.train_model = torch.compile(model) if cfg.compile else model
        if distributed.world_size() > 1 and not self.fsdp:
            ids = [device.index] if device.type == "cuda" else None
            self.train_model = DistributedDataParallel(self.forward_model, device_ids=ids)

    def train_step(self, batches: list[tuple[Batch, float]], lr: float) -> float:
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr"] = lr * scale
        total = torch.zeros((), device=self.device)
        for i, (batch, weight) in enumerate(batches):
            wrapped = self.train_model is not self.forward_model
            last = i == len(batches) - 1
            if self.fsdp:  # gradients are reduced once a step, after its last micro-batch
                self.model.set_requires_gradient_sync(last)
            with self.train_model.no_sync() if wrapped and not last else nullcontext():
                with autocast(self.device, self.dtype):
                    loss = self.loss(self.train_model, batch)
                # DDP and FSDP average the gradients over the processes: scale up to the global
                # batch's sum
                self.scaler.scale(loss * (weight * distributed.world_size())).backward()
            total += loss.detach().float() * weight
        if self.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not float16's scaled
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)  # (float16: skipped when a gradient overflowed)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)  # None: the memory is free until the backward
        return total.item()

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.dtype):
            return self.loss(self.forward_model, (x, y))

    def logits_at(self, idx: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.dtype):
            if self.fsdp:  # FSDP gathers the weights in forward(): all the logits, then those
                return self.forward_model(idx)[0][rows, cols].float()
            return self.gpt.lm_head(self.gpt.hidden_states(idx)[rows, cols]).float()

    def weights_finite(self) -> bool:
        if not self.fsdp:
            return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())
        from toolkit.fsdp import local  # (see start())
        finite = all(bool(torch.isfinite(local(p)).all()) for p in self.model.parameters())
        return distributed.all_reduce_sum([float(not finite)], self.device) == [0.0]  # all shards

    def save(self, state: dict, path: str | None = None, resumable: bool | None = None) -> None:
        """resumable (default: save_optimizer): with the optimizer, scaler and RNG states."""
        keep = self.save_optimizer if resumable is None else resumable
        weights, optimizer = self.gpt.state_dict(), self.optimizer.state_dict() if keep else None
        scaler = self.scaler.state_dict() if keep and self.scaler.is_enabled() else None
        rng = capture_rng(self.device) if keep else {}
        if self.fsdp:  # each rank writes its shards
            from toolkit.fsdp_checkpoint import save_sharded  # (see start())
            save_sharded(self.path, state, weights, optimizer, scaler, rng)
        elif distributed.rank() == 0:
            save_checkpoint(make_checkpoint(state, weights, optimizer, scaler, rng),
                            path or self.path)


class Trainer:
    """The loop: an evaluation every eval_interval steps, a step, the loss averaged over all
    processes and checked, a log line every log_interval steps, SIGINT or SIGTERM finishing the
    step and saving, checkpoints at save_interval; at the end a last evaluation and the checkpoint.
    With keep_best (fine-tuning) the checkpoint is written at each evaluation that beats the best
    so far, and the latest state (for exact resume) at latest_path until the run ends."""

    def __init__(self, engine: Engine, objective: Objective, schedule: Schedule, loop: LoopConfig,
                 cfg: RunConfig, step: int = 0, history: dict | None = None,
                 best: dict | None = None, desc: str = "train"):
        self.engine, self.objective, self.schedule, self.loop = engine, objective, schedule, loop
        self.cfg, self.step, self.best, self.desc = cfg, step, best, desc
        self.master = distributed.rank() == 0
        self.log = RunLog(cfg, history, self.master)
        self.history = self.log.history
        self.device = engine.device
        # processes that hold the same share of the data (model parallel) report one replica's loss
        self.replicas = distributed.world_size() // engine.data_parallel()[1]
        self.skipped_steps = 0
        self.stopped = False

    def fit(self) -> None:
        loop = self.loop
        throughput = self.objective.throughput()
        peak = peak_flops(self.device, loop.peak_tflops)
        bar = tqdm(total=loop.max_iters, initial=self.step, desc=self.desc, dynamic_ncols=True,
                   disable=not self.master or None)
        first_step = self.step + 1
        if self.cfg.compile and self.master:
            bar.write("the first step compiles the model (torch.compile): it takes a while")
        with StopRequest() as stop_request:
            while self.step < loop.max_iters:
                due = loop.eval_interval and self.step % loop.eval_interval == 0
                done = self.step in self.history["eval_iter"]  # a resumed run evaluated its step
                if due and (self.step or loop.eval_at_start) and not done:
                    self.evaluate()
                lr = self.schedule(self.step)
                t0 = time.perf_counter()
                loss = self.engine.train_step(self.objective.micro_batches(self.step), lr)
                loss, stop = distributed.all_reduce_sum(
                    [loss / self.replicas, float(stop_request.requested)], self.device)
                dt = time.perf_counter() - t0
                self.check_finite(loss)
                self.step += 1
                bar.update(1)
                if self.step == first_step and self.cfg.compile and self.master:
                    bar.write(f"first step {dt:.1f} s, compilation included")
                if self.step % self.cfg.log_interval == 0 or self.step == loop.max_iters or stop:
                    mfu = throughput[2] / dt / peak if throughput[2] and peak else None
                    self.log.step(self.step, loss, lr, dt, throughput, mfu, bar)
                if stop:
                    self.stopped = True
                    break
                periodic = loop.save_interval and self.step % loop.save_interval == 0
                if periodic and self.step < loop.max_iters and not loop.keep_best:
                    self.save()
            bar.close()
            self.finish()
        self.log.close()
        if self.master:
            print(self.outcome(), flush=True)

    def finish(self) -> None:
        """After the last step: a stopped run saves its latest state, a finished one evaluates and
        saves (with keep_best the best is on disk already, and the latest state goes)."""
        loop = self.loop
        if not self.stopped:
            self.evaluate()
        if not loop.keep_best:
            self.save()
        elif not loop.latest_path:  # no resumable state kept (embed.py tune): the best is it
            return
        elif self.stopped:
            self.save(latest=True)
        elif self.master and os.path.exists(loop.latest_path):
            os.remove(loop.latest_path)

    def outcome(self) -> str:
        """The run's last line: how it ended, the best metric and where the checkpoint is."""
        loop, path = self.loop, self.engine.path
        saved = f"saved {path}"
        if loop.keep_best:
            saved = f"the best checkpoint is {path}" if self.best else "nothing evaluated yet"
        if self.stopped:
            resume = f"; continue it with --init-from resume ({loop.latest_path})"
            resume = resume if loop.latest_path else ""
            return f"stopped by signal at iteration {self.step}; {saved}{resume}"
        metric = loop.metric.replace("_", " ")
        best = f", best {metric} {self.best[loop.metric]:.4f}" if self.best else ""
        # what the run's tensors held at most on a GPU, as nanochat reports it
        peak = (f", peak memory {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"
                if self.device.type == "cuda" else "")
        return f"done: {self.step} iterations{best}{peak}, {saved}"

    def check_finite(self, loss: float) -> None:
        """Stop on a NaN/inf loss, keeping the checkpoint written before; float16 overflow steps are
        skipped by the loss scaler, so there only a run of ten is fatal."""
        if math.isfinite(loss):
            self.skipped_steps = 0
            return
        self.skipped_steps += 1
        if self.engine.dtype != torch.float16 or self.skipped_steps >= 10:
            raise diverged(f"loss is {loss} at iteration {self.step}", self.loop.hint)

    def evaluate(self) -> None:
        """The objective's metrics: checked, logged, kept; with keep_best, a checkpoint when they
        beat the best so far."""
        metrics = self.objective.evaluate(self.engine)
        if not metrics:
            return
        if not all(math.isfinite(v) for v in metrics.values()):
            shown = ", ".join(f"{name} {value}" for name, value in metrics.items())
            raise diverged(f"the evaluation at iteration {self.step} gives {shown}", self.loop.hint)
        metric, sign = self.loop.metric, 1 if self.loop.maximize else -1
        improved = self.best is None or sign * (metrics[metric] - self.best[metric]) > 0
        self.best = metrics if improved else self.best
        saved = improved and self.loop.keep_best
        self.log.evaluation(self.step, metrics, self.engine.path if saved else None)
        if saved:
            self.save()
        if self.loop.keep_best and self.loop.latest_path and self.step < self.loop.max_iters:
            self.save(latest=True)

    def save(self, latest: bool = False) -> None:
        """A checkpoint through the engine (latest: keep_best's latest state, resumable, at
        latest_path), unless the weights went bad: a non-finite step never reaches disk (the loss
        check_finite saw was computed before the last update)."""
        if not self.objective.good_weights(self.engine):
            raise diverged(f"the weights after iteration {self.step} are not finite or give a "
                           "non-finite loss", self.loop.hint)
        path, resumable = (self.loop.latest_path, True) if latest else (None, None)
        self.engine.save(self.state(), path, resumable)
        self.log.flush()
        distributed.barrier()

    def state(self) -> dict:
        """What every checkpoint keeps besides the weights and optimizer (checkpoint.STATE_KEYS)."""
        best_val_loss = (self.best or {}).get("val_loss", float("inf"))
        return {**self.objective.checkpoint_state(self.best), "iter_num": self.step,
                "best_val_loss": best_val_loss, "history": self.history}
