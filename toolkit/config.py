"""A run's configuration: the options every trainer shares (RunConfig, which TrainConfig,
FinetuneConfig and TuneConfig extend), frozen once settled, and what every run settles alike: its
name and the accumulation over the data-parallel processes.

    @dataclass(frozen=True)
    class TrainConfig(RunConfig):            # also FinetuneConfig, embedding.TuneConfig
        n_layer: int = option(4, "transformer blocks", check="positive")

    cfg = settle_run(cfg, data_parallel=2)   # a new config: the run's name, --grad-accum's default
"""
import itertools
import os
import time
from dataclasses import dataclass, replace
from typing import ClassVar

from toolkit import distributed
from toolkit.cli import CLIError
from toolkit.device import DTYPES
from toolkit.flags import option


@dataclass(frozen=True)
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
    seed: int = option(1337, "seed of the new weights, of dropout and of the data order",
                       check="seed")
    activation_checkpointing: bool = option(False, "keep each block's input only and recompute "
                                                   "its activations in the backward pass: less "
                                                   "memory for about a third more compute")

    # what TorchEngine.start builds for a config without these options (TrainConfig makes them
    # options)
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


def settle_run(cfg: RunConfig, data_parallel: int | None = None) -> RunConfig:
    """cfg with a run name unless one is given; with data_parallel (the replicas that split the
    data), --grad-accum defaulting to one micro-batch per replica, checked to split evenly."""
    cfg = replace(cfg, run_name=cfg.run_name or run_name())
    if data_parallel is None:
        return cfg
    cfg = replace(cfg, grad_accum=cfg.grad_accum or data_parallel)
    if cfg.grad_accum % data_parallel:
        raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across "
                       f"{replicas(data_parallel)}; use a multiple of {data_parallel}")
    return cfg


def replicas(data_parallel: int) -> str:
    """The data-parallel width: "2 processes", or "1 replica of 2 processes" if model-parallel."""
    world = distributed.world_size()
    if data_parallel == world:
        return f"{world} process{'es' * (world > 1)}"
    return (f"{data_parallel} replica{'s' * (data_parallel > 1)} of {world // data_parallel} "
            "processes")
