"""A training run: the options every trainer shares, preparing the run, and what it leaves on disk
besides checkpoints (its folder claimed, TensorBoard logs, the loss curve).

    @dataclass
    class TrainConfig(RunConfig):            # also FinetuneConfig, embedding.TuneConfig
        n_layer: int = option(4, "transformer blocks", check="positive")

    device, dtype = prepare_run(cfg, data_parallel=2)   # device, dtype, heap, run name, accumulation
"""
import itertools
import os
import signal
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from tqdm import tqdm

from toolkit import distributed
from toolkit.cli import CLIError
from toolkit.device import DTYPES, keep_freed_memory_in_heap, resolve_device, resolve_dtype
from toolkit.files import atomic_write, lock_folder, remove_temporaries
from toolkit.flags import option

SIGNAL_GRACE_S = 5.0  # more SIGINT/SIGTERM within this time of the first are the same request


@dataclass
class RunConfig:
    """Options of train.py, finetune.py and embed.py tune; each redeclares a default it changes."""
    out_dir: str = option("ckpt", "where the checkpoint, the loss curve and the TensorBoard logs "
                                  "go")
    overwrite: bool = option(False, "replace a checkpoint in --out-dir that this run does not "
                                    "resume from")
    batch_size: int = option(32, "sequences (examples, pairs) per micro-batch, in each process",
                             check="positive")
    lr: float | None = option(None, "peak learning rate", check="positive-number")
    weight_decay: float = option(0.1, "AdamW weight decay (2-D weights "
                                      "only)", check="non-negative-number")
    beta1: float = option(0.9, "AdamW beta1", check="probability")
    beta2: float = option(0.99, "AdamW beta2", check="probability")
    grad_clip: float = option(1.0, "clip gradients at this global norm (0 = off)",
                              check="non-negative-number")
    log_interval: int = option(10, "print the training loss every N steps", check="positive")
    tensorboard_dir: str | None = option(None, "TensorBoard log dir (default OUT_DIR/tensorboard); "
                                               "each run logs to a subfolder named by --run-name")
    run_name: str | None = option(None, "TensorBoard run name (default: the UTC start time and the "
                                        "process id; a resumed run keeps its "
                                        "own)", check="folder-name")
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "autocast dtype; auto = bfloat16 where the hardware computes it "
                                "natively, else float32", choices=["auto", *DTYPES])
    seed: int = option(1337, "seed of the new weights, of dropout and of the data order")

    # what TorchEngine.start builds for a config without these options (TrainConfig makes them options)
    optimizer: ClassVar[str] = "adamw"
    muon_lr: ClassVar[float | None] = None
    compile: ClassVar[bool] = False


_runs_in_this_process = itertools.count(1)


def run_name() -> str:
    """A name no other run shares: the UTC start time (names sort in time order in any time zone),
    the process id (two runs started in the same second differ) and, after the first, the run's
    number in this process."""
    number = next(_runs_in_this_process)
    name = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}Z-{os.getpid()}"
    return name if number == 1 else f"{name}-{number}"


def prepare_run(cfg: RunConfig, data_parallel: int | None = None) -> tuple[torch.device, torch.dtype]:
    """The run's device and dtype; a run name unless given; on a CPU, freed memory kept in glibc's
    heap. With data_parallel (the replicas that split the data), --grad-accum defaults to one
    micro-batch per replica and must split evenly among them."""
    cfg.run_name = cfg.run_name or run_name()
    if data_parallel is not None:
        cfg.grad_accum = cfg.grad_accum or data_parallel
        if cfg.grad_accum % data_parallel:
            raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across "
                           f"{replicas(data_parallel)}; use a multiple of {data_parallel}")
    device = resolve_device(cfg.device, distributed.local_rank())
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cpu":
        keep_freed_memory_in_heap()
    return device, dtype


def replicas(data_parallel: int) -> str:
    """The data-parallel width: "2 processes", or "1 replica of 2 processes" if model-parallel."""
    world = distributed.world_size()
    if data_parallel == world:
        return f"{world} process{'es' * (world > 1)}"
    return f"{data_parallel} replica{'s' * (data_parallel > 1)} of {world // data_parallel} processes"


def claim_out_dir(out_dir: str, checkpoint: str, resuming: bool, overwrite: bool) -> None:
    """Lock out_dir for this run (a second run there stops), clear what a killed writer left, and
    refuse to replace a checkpoint this run does not resume from."""
    lock_folder(out_dir)
    remove_temporaries(out_dir)
    if not resuming and os.path.exists(checkpoint) and not overwrite:
        raise CLIError(f"{checkpoint} holds the checkpoint of another run; continue it with "
                       "--init-from resume, use another --out-dir, or pass --overwrite to replace "
                       "it")


def diverged(what: str, hint: str) -> CLIError:
    """The one wording of a run that went non-finite."""
    return CLIError(f"{what}; stopped without saving (the checkpoint written before, if any, is "
                    f"kept). Try {hint}")


class StopRequest:
    """SIGINT/SIGTERM ask the loop to finish its step, save and exit 0 (in every rank). Repeats
    within a few seconds are the same request (Ctrl-C signals every process, and a launcher forwards
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


class RunLog:
    """What a run reports besides checkpoints: the log line of a step and of an evaluation, TensorBoard
    scalars (`loss/train`, `lr`, `perf/*`, `eval/<metric>`), the history a checkpoint keeps, and
    OUT_DIR/loss.png at the end. Only rank 0 prints and writes; every rank keeps the evaluations."""

    def __init__(self, cfg: RunConfig, history: dict | None, master: bool):
        self.cfg, self.master, self.writer = cfg, master, None
        self.history = {"iter": [], "loss": [], "eval_iter": [], "val": [], "metrics": [], **(history or {})}

    def step(self, step: int, loss: float, lr: float, dt: float, throughput: tuple, mfu: float | None,
             bar) -> None:
        if not self.master:
            return
        count, unit, _ = throughput
        self.history["iter"].append(step)
        self.history["loss"].append(loss)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.write(f"iter {step}: loss {loss:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, {count / dt:,.0f} {unit}/s"
                  + (f", mfu {mfu * 100:.1f}%" if mfu else ""))
        scalars = {"loss/train": loss, "lr": lr, f"perf/{unit}_per_s": count / dt, "perf/mfu": mfu}
        for tag, value in scalars.items():
            if value is not None:
                self.tensorboard().add_scalar(tag, value, step)

    def evaluation(self, step: int, metrics: dict[str, float], saved: str | None) -> None:
        self.history["eval_iter"].append(step)
        self.history["val"].append(metrics.get("val_loss"))
        self.history["metrics"].append(metrics)
        if not self.master:
            return
        shown = ", ".join(f"{name.replace('_', ' ')} {value:.4f}" for name, value in metrics.items())
        tqdm.write(f"step {step}: {shown}" + (f"; saved {saved}" if saved else ""))
        for name, value in metrics.items():
            self.tensorboard().add_scalar(f"eval/{name}", value, step)

    def tensorboard(self):
        """A SummaryWriter for this run: TENSORBOARD_DIR (default OUT_DIR/tensorboard) / RUN_NAME."""
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            folder = self.cfg.tensorboard_dir or os.path.join(self.cfg.out_dir, "tensorboard")
            self.writer = SummaryWriter(os.path.join(folder, self.cfg.run_name))
        return self.writer

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """The loss curve, and the TensorBoard file closed."""
        if self.master:
            plot_losses(self.history, self.cfg.out_dir)
            if self.writer is not None:
                self.writer.close()


def plot_losses(history: dict, out_dir: str) -> None:
    """OUT_DIR/loss.png: the train loss at each logged step and the val loss at each evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["iter"], history["loss"], label="train loss", linewidth=1)
    evaluated = [(i, v) for i, v in zip(history["eval_iter"], history["val"]) if v is not None]
    if evaluated:
        ax.plot(*zip(*evaluated), "o-", label="val loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(os.path.join(out_dir, "loss.png"), lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
