"""The one training loop, run by every trainer: train.py, train_ddp.py, train_ds.py, finetune.py, embed.py tune.

    trainer = Trainer(engine, objective, schedule, loop, out_dir, run_name)
    trainer.fit()

A trainer composes three parts and the loop runs them; each script supplies only what differs:
  engine     how a step runs and a checkpoint is written: TorchEngine (one process or DDP) here,
             DeepSpeedEngine in toolkit/deepspeed_engine.py. It has `path`, train_step(batches, lr) -> float,
             weights_finite() -> bool, save(state), `dtype`, and for evaluations eval_loss(x, y) and
             logits_at(idx, rows, cols).
  objective  what is learnt: micro_batches(step) -> [(batch, weight)], loss(model, batch) -> Tensor,
             evaluate(engine) -> {metric: value}, good_weights(engine) -> bool, checkpoint_state(best) -> dict,
             and throughput(): (count, unit) per step, with the FLOPs of a step (or None) for MFU.
  schedule   the learning rate of each step (Schedule).

The loop: an evaluation every eval_interval steps (metrics printed, logged to TensorBoard and kept in the
history), a step, the loss averaged over all processes and checked, a log line every log_interval steps,
SIGINT/SIGTERM finishing the step and saving, checkpoints at save_interval, and at the end a last evaluation,
the checkpoint and OUT_DIR/loss.png. A non-finite step never reaches disk. With keep_best (fine-tuning), the
checkpoint is instead written at each evaluation that beats the best so far, and the latest state (what exact
resume needs) at latest_path after each evaluation and on a signal, removed when the run ends.

Weights: each micro-batch comes with its share of the global batch's loss (the weights of all micro-batches
of all data-parallel processes sum to 1), so uneven splits train exactly as one process would.
"""
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tqdm import tqdm

from toolkit import distributed
from toolkit.checkpoint import capture_rng, load_weights, make_checkpoint, restore_rng, save_checkpoint
from toolkit.cli import CLIError
from toolkit.device import autocast, peak_flops
from toolkit.files import atomic_write, lock_folder, remove_temporaries

SIGNAL_GRACE_S = 5.0  # more SIGINT/SIGTERM within this time of the first are the same request


@dataclass
class Schedule:
    """Linear warmup over warmup_iters steps, then cosine (or linear) decay to min_lr at step decay_iters, then
    flat: nanoGPT's schedule, and GPT-1's fine-tuning one with shape linear and min_lr 0."""
    lr: float
    warmup_iters: int
    decay_iters: int
    min_lr: float
    shape: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup_iters:
            return self.lr * (step + 1) / (self.warmup_iters + 1)
        if step >= self.decay_iters:
            return self.min_lr
        progress = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        fall = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.shape == "cosine" else 1.0 - progress
        return self.min_lr + fall * (self.lr - self.min_lr)


@dataclass
class LoopConfig:
    max_iters: int
    log_interval: int
    eval_interval: int = 0  # 0: evaluate only at the end
    save_interval: int = 0  # 0: save only at the end (and on a signal)
    eval_at_start: bool = True  # nanoGPT evaluates before the first step; fine-tuning after each epoch
    metric: str = "val_loss"  # the metric "best" refers to
    maximize: bool = False
    keep_best: bool = False  # save at each evaluation that beats the best, instead of the latest state
    latest_path: str | None = None  # keep_best: also the latest state here, for exact resume, until the run ends
    peak_tflops: float | None = None  # the device's peak, for MFU (known GPUs are looked up)
    hint: str = "a lower --lr or --dtype bfloat16"  # what to try when the run goes non-finite


def diverged(what: str, hint: str = "a lower --lr or --dtype bfloat16") -> CLIError:
    """The one wording of a run that went non-finite."""
    return CLIError(f"{what}; stopped without saving (the checkpoint written before, if any, is kept). Try {hint}")


class StopRequest:
    """SIGINT/SIGTERM ask the loop to finish its step, save and exit 0 (in every rank). Repeats within a few
    seconds are the same request (on Ctrl-C the terminal signals every process, and a launcher then forwards
    SIGTERM too); a later one stops at once. The handlers are restored when the block ends."""

    def __enter__(self) -> "StopRequest":
        self.requested, self.first = False, 0.0
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested and now - self.first > SIGNAL_GRACE_S:
            raise KeyboardInterrupt
        if not self.requested:
            self.requested, self.first = True, now


def tensorboard_writer(out_dir: str, tensorboard_dir: str | None, run_name: str):
    """A SummaryWriter for one run: TENSORBOARD_DIR (default OUT_DIR/tensorboard) / RUN_NAME."""
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(os.path.join(tensorboard_dir or os.path.join(out_dir, "tensorboard"), run_name))


def claim_out_dir(out_dir: str, checkpoint: str, resuming: bool, overwrite: bool) -> None:
    """Lock out_dir for this run (a second run there stops), clear what a killed writer left, and refuse to replace
    a checkpoint this run does not resume from."""
    lock_folder(out_dir)
    remove_temporaries(out_dir)
    if not resuming and os.path.exists(checkpoint) and not overwrite:
        raise CLIError(f"{checkpoint} holds the checkpoint of another run; continue it with --init-from resume, "
                       f"use another --out-dir, or pass --overwrite to replace it")


def empty_history() -> dict:
    """The loss curve: training loss at each logged step, and every evaluation's metrics (val_loss also alone)."""
    return {"iter": [], "loss": [], "eval_iter": [], "val": [], "metrics": []}


class TorchEngine:
    """Steps in torch: the optimizer (its param groups may carry an `lr_scale`, e.g. Muon's), a GradScaler for
    float16, torch.compile, DDP in a process group. Checkpoints are a ckpt.pt at `path`, written by rank 0:
    `gpt`'s weights, the objective's state, and unless save_optimizer is off, what exact resume needs."""

    def __init__(self, path: str, model: torch.nn.Module, gpt: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, dtype: torch.dtype, loss, grad_clip: float, compile: bool = False,
                 save_optimizer: bool = True, resume: dict | None = None):
        self.path, self.model, self.gpt, self.optimizer = path, model, gpt, optimizer
        self.device, self.dtype, self.loss, self.grad_clip = device, dtype, loss, grad_clip
        self.save_optimizer = save_optimizer
        # from the optimizer as built from the flags: a resumed optimizer's saved groups do not override them
        self.lr_scales = [group.get("lr_scale", 1.0) for group in optimizer.param_groups]
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        if resume is not None:
            self.resume(resume)
        self.forward_model = torch.compile(model) if compile else model
        self.train_model = self.forward_model
        self.data_parallel_size = distributed.world_size()
        if self.data_parallel_size > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.train_model = DistributedDataParallel(self.forward_model, device_ids=[device.index]
                                                       if device.type == "cuda" else None)

    def data_parallel(self) -> tuple[int, int]:
        return distributed.rank(), self.data_parallel_size

    def resume(self, checkpoint: dict) -> None:
        """Weights (unless the checkpoint holds adapters: toolkit/lora.py), optimizer, scaler and RNG from a
        ckpt.pt dict."""
        if "model" in checkpoint:
            load_weights(self.gpt, checkpoint["model"], self.path)
        if checkpoint.get("optimizer"):
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        if checkpoint.get("scaler"):
            self.scaler.load_state_dict(checkpoint["scaler"])
        restore_rng(checkpoint.get("rng") or {}, self.device)

    def set_lr(self, lr: float) -> None:
        for group, scale in zip(self.optimizer.param_groups, self.lr_scales):
            group["lr"] = lr * scale

    def train_step(self, batches: list[tuple[object, float]], lr: float) -> float:
        """One optimizer step over this process's weighted micro-batches; returns its share of the step's loss."""
        self.set_lr(lr)
        total = torch.zeros((), device=self.device)
        for i, (batch, weight) in enumerate(batches):
            last = i == len(batches) - 1
            sync = self.train_model.no_sync() if not last and self.train_model is not self.forward_model \
                else nullcontext()
            with sync:
                with autocast(self.device, self.dtype):
                    loss = self.loss(self.train_model, batch)
                # DDP averages the gradients over the processes: scale back up to the global batch's sum
                self.scaler.scale(loss * (weight * self.data_parallel_size)).backward()
            total += loss.detach().float() * weight
        if self.grad_clip:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.dtype):
            return self.forward_model(x, y, chunked_loss=True)[1]

    def logits_at(self, idx: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The logits at some positions of a batch (toolkit/evaluation.py's scoring), in eval mode."""
        with autocast(self.device, self.dtype):
            return self.gpt.lm_head(self.gpt.hidden_states(idx)[rows, cols]).float()

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def save(self, state: dict, path: str | None = None, resumable: bool | None = None) -> None:
        """A checkpoint at path (default: self.path), with the optimizer, scaler and RNG states when resumable
        (default: save_optimizer)."""
        if distributed.rank() == 0:
            keep = self.save_optimizer if resumable is None else resumable
            scaler = self.scaler.state_dict() if keep and self.scaler.is_enabled() else None
            checkpoint = make_checkpoint(state, self.gpt, self.optimizer.state_dict() if keep else None, scaler,
                                         capture_rng(self.device) if keep else {})
            save_checkpoint(checkpoint, path or self.path)


class Trainer:
    """The loop (see the module's docstring), from `step` on, with the history and best metrics a resumed run
    brings."""

    def __init__(self, engine, objective, schedule: Schedule, loop: LoopConfig, out_dir: str, run_name: str,
                 tensorboard_dir: str | None = None, step: int = 0, history: dict | None = None,
                 best: dict | None = None, desc: str = "train"):
        self.engine, self.objective, self.schedule, self.loop = engine, objective, schedule, loop
        self.out_dir, self.run_name, self.tensorboard_dir, self.desc = out_dir, run_name, tensorboard_dir, desc
        self.step, self.best = step, best
        self.history = {**empty_history(), **(history or {})}
        self.master = distributed.rank() == 0
        self.device = engine.device
        dp_size = engine.data_parallel()[1]
        self.replicas = distributed.world_size() // dp_size  # processes that hold the same share (model parallel)
        self.writer = None
        self.skipped_steps = 0
        self.stopped = False

    # ----- the loop -----
    def fit(self) -> None:
        loop = self.loop
        count, unit, flops = self.objective.throughput()
        peak = peak_flops(self.device, loop.peak_tflops)
        bar = tqdm(total=loop.max_iters, initial=self.step, desc=self.desc, disable=not self.master or None,
                   dynamic_ncols=True)
        with StopRequest() as stop_request:
            while self.step < loop.max_iters:
                if loop.eval_interval and self.step % loop.eval_interval == 0 and (self.step or loop.eval_at_start) \
                        and self.step not in self.history["eval_iter"][-1:]:  # a resumed run evaluated it already
                    self.evaluate()
                lr = self.schedule(self.step)
                t0 = time.perf_counter()
                loss = self.engine.train_step(self.objective.micro_batches(self.step), lr)
                loss, stop = distributed.all_reduce_sum([loss / self.replicas, float(stop_request.requested)],
                                                        self.device)
                dt = time.perf_counter() - t0
                self.check_finite(loss)
                self.step += 1
                bar.update(1)
                if self.step % loop.log_interval == 0 or self.step == loop.max_iters or stop:
                    self.log_step(loss, lr, dt, count, unit, flops and peak and flops / dt / peak, bar)
                if stop:
                    self.stopped = True
                    break
                if loop.save_interval and self.step % loop.save_interval == 0 and self.step < loop.max_iters \
                        and not loop.keep_best:
                    self.save()
            bar.close()
            if self.stopped and loop.latest_path:
                self.save_latest()
            elif self.stopped and not loop.keep_best:
                self.save()
            else:
                self.evaluate()
                if not loop.keep_best:
                    self.save()
                elif loop.latest_path and self.master and os.path.exists(loop.latest_path):
                    os.remove(loop.latest_path)  # the run is complete: the best checkpoint is what stays
        if self.master:
            self.plot_losses()
            if self.writer is not None:
                self.writer.close()
            print(self.outcome(), flush=True)

    def outcome(self) -> str:
        """The run's last line: how it ended, the best metric and where the checkpoint is."""
        saved = f"the best checkpoint is {self.engine.path}" if self.loop.keep_best and self.best else \
            "nothing evaluated yet" if self.loop.keep_best else f"saved {self.engine.path}"
        if self.stopped:
            latest = f"; continue it with --init-from resume ({self.loop.latest_path})" if self.loop.latest_path else ""
            return f"stopped by signal at iteration {self.step}; {saved}{latest}"
        best = f", best {self.loop.metric.replace('_', ' ')} {self.best[self.loop.metric]:.4f}" if self.best else ""
        return f"done: {self.step} iterations{best}, {saved}"

    def check_finite(self, loss: float) -> None:
        """Stop on a NaN/inf loss, keeping the checkpoint written before; float16 overflow steps are skipped by the
        loss scaler, so there only a run of them is fatal."""
        if math.isfinite(loss):
            self.skipped_steps = 0
            return
        if self.engine.dtype == torch.float16:
            self.skipped_steps += 1
            if self.skipped_steps < 10:
                return
        raise diverged(f"loss is {loss} at iteration {self.step}", self.loop.hint)

    def evaluate(self) -> None:
        """The objective's metrics: checked, printed, logged, kept in the history; with keep_best, a checkpoint
        when they beat the best so far."""
        metrics = self.objective.evaluate(self.engine)
        if not metrics:
            return
        if not all(math.isfinite(v) for v in metrics.values()):
            raise diverged(f"the evaluation at iteration {self.step} gives " +
                           ", ".join(f"{name} {value}" for name, value in metrics.items()), self.loop.hint)
        improved = self.best is None or (metrics[self.loop.metric] > self.best[self.loop.metric]
                                         if self.loop.maximize else
                                         metrics[self.loop.metric] < self.best[self.loop.metric])
        if improved:
            self.best = metrics
        self.history["eval_iter"].append(self.step)
        self.history["val"].append(metrics.get("val_loss"))
        self.history["metrics"].append(metrics)
        if improved and self.loop.keep_best:
            self.save()
        if self.loop.keep_best and self.step < self.loop.max_iters:
            self.save_latest()
        if self.master:
            shown = ", ".join(f"{name.replace('_', ' ')} {value:.4f}" for name, value in metrics.items())
            tqdm.write(f"step {self.step}: {shown}" + (f"; saved {self.engine.path}" if improved and
                                                        self.loop.keep_best else ""))
            for name, value in metrics.items():
                self.tensorboard().add_scalar(f"eval/{name}", value, self.step)

    def log_step(self, loss: float, lr: float, dt: float, count: int, unit: str, mfu: float | None, bar) -> None:
        if not self.master:
            return
        self.history["iter"].append(self.step)
        self.history["loss"].append(loss)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.write(f"iter {self.step}: loss {loss:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, "
                  f"{count / dt:,.0f} {unit}/s" + (f", mfu {mfu * 100:.1f}%" if mfu else ""))
        writer = self.tensorboard()
        writer.add_scalar("loss/train", loss, self.step)
        writer.add_scalar("lr", lr, self.step)
        writer.add_scalar(f"perf/{unit}_per_s", count / dt, self.step)
        if mfu:
            writer.add_scalar("perf/mfu", mfu, self.step)

    def tensorboard(self):
        if self.writer is None:
            self.writer = tensorboard_writer(self.out_dir, self.tensorboard_dir, self.run_name)
        return self.writer

    # ----- checkpoints -----
    def state(self) -> dict:
        """What every checkpoint format keeps besides weights and optimizer (toolkit.checkpoint.STATE_KEYS)."""
        best_val_loss = (self.best or {}).get("val_loss", float("inf"))
        return {**self.objective.checkpoint_state(self.best), "iter_num": self.step, "best_val_loss": best_val_loss,
                "history": self.history}

    def save(self) -> None:
        """Write a checkpoint through the engine, unless the weights went bad: a non-finite step never reaches
        disk (the loss that check_finite saw was computed before the last update)."""
        if not self.objective.good_weights(self.engine):
            raise diverged(f"the weights after iteration {self.step} are not finite or give a non-finite loss",
                           self.loop.hint)
        self.engine.save(self.state())
        if self.master and self.writer is not None:
            self.writer.flush()
        distributed.barrier()

    def save_latest(self) -> None:
        """keep_best: the latest state, with what exact resume needs, at latest_path."""
        if self.loop.latest_path:
            if not self.objective.good_weights(self.engine):
                raise diverged(f"the weights after iteration {self.step} are not finite", self.loop.hint)
            self.engine.save(self.state(), self.loop.latest_path, resumable=True)
            distributed.barrier()

    def plot_losses(self) -> None:
        """OUT_DIR/loss.png: the training loss every log_interval steps and the val loss at each evaluation."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(self.history["iter"], self.history["loss"], label="train loss", linewidth=1)
        evaluated = [(i, v) for i, v in zip(self.history["eval_iter"], self.history["val"]) if v is not None]
        if evaluated:
            ax.plot(*zip(*evaluated), "o-", label="val loss")
        ax.set_xlabel("iteration")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        atomic_write(os.path.join(self.out_dir, "loss.png"), lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
