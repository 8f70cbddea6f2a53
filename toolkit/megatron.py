"""Megatron-LM's options and spellings for the trainers, so that a Megatron-DeepSpeed GPT-2 command
runs as written: its names for ours (ALIASES), and its own options (declared with TrainConfig's,
in their own --help group) turned into ours: sample counts into steps of the global batch,
--global-batch-size into the accumulation, --load into the run's folder.

Where Megatron and this toolkit differ (docs/design.md): `--load` and `--save` name one folder here;
`--global-batch-size` sets the accumulation; sample counts become steps, rounded up, and the cosine
decay runs over those steps.
"""
import math
import os

from toolkit.cli import CLIError
from toolkit.flags import flag

# Megatron-LM's names for our options (its sample counts have fields of their own: they need the
# global batch)
ALIASES = {"lr": ["--learning-rate"], "n_layer": ["--num-layers"], "n_embd": ["--hidden-size"],
           "n_head": ["--num-attention-heads"], "block_size": ["--seq-length"],
           "batch_size": ["--micro-batch-size"], "data_dir": ["--data-path"], "out_dir": ["--save"],
           "max_iters": ["--train-iters"], "warmup_iters": ["--lr-warmup-iters"],
           "grad_clip": ["--clip-grad"], "beta1": ["--adam-beta1"], "beta2": ["--adam-beta2"],
           "activation_checkpointing": ["--checkpoint-activations"]}
# sample counts -> the step counts they set, through the global batch
SAMPLE_FLAGS = {"train_samples": "max_iters", "lr_warmup_samples": "warmup_iters",
                "lr_decay_samples": "lr_decay_iters"}


def check_options(cfg) -> None:
    """A sample count and its step count are not both given; codecarbon is there when asked for."""
    for samples, steps in SAMPLE_FLAGS.items():
        if {samples, steps} <= cfg.given:
            raise CLIError(f"{flag(samples)} and {flag(steps)} set the same value; give one of "
                           "them")
    if cfg.codecarbon_dir:
        try:
            import codecarbon  # noqa: F401  (an optional dependency)
        except ImportError:
            raise CLIError("--codecarbon-dir needs the optional codecarbon package: pip install "
                           "codecarbon") from None


def load_folder(cfg) -> str:
    """--load DIR: DIR is the run's folder, --out-dir (here, checkpoints are read and written in one
    place)."""
    if "out_dir" in cfg.given and os.path.abspath(cfg.out_dir) != os.path.abspath(cfg.load):
        raise CLIError(f"--load {cfg.load} and --save/--out-dir {cfg.out_dir} differ; a run "
                       f"resumes and saves in one folder here: give the same folder or only "
                       f"one of them")
    if "init_from" in cfg.given and cfg.init_from != "resume":
        raise CLIError(f"--load resumes from {cfg.load}; it cannot be combined with --init-from "
                       f"{cfg.init_from}")
    return cfg.load


def grad_accum_for(cfg) -> int:
    """--grad-accum from --global-batch-size = --micro-batch-size x accumulation (all processes)."""
    accum, rest = divmod(cfg.global_batch_size, cfg.batch_size)
    if rest:
        raise CLIError(f"--global-batch-size {cfg.global_batch_size} is not a multiple of "
                       f"--micro-batch-size/--batch-size {cfg.batch_size}")
    if "grad_accum" in cfg.given and cfg.grad_accum not in (None, accum):
        raise CLIError(f"--global-batch-size {cfg.global_batch_size} / --batch-size "
                       f"{cfg.batch_size} = {accum} micro-batches but --grad-accum "
                       f"{cfg.grad_accum} was given; drop one of them")
    return accum


def forget_replaced_counts(values: dict, given: set[str]) -> None:
    """On resume, a step count given now replaces the Megatron count the checkpoint saved for it."""
    for samples, steps in {**SAMPLE_FLAGS, "global_batch_size": "grad_accum"}.items():
        if steps in given and samples not in given:
            values[samples] = None


def steps_from_samples(cfg) -> dict[str, int]:
    """The step counts the sample counts set, rounded up to whole global batches."""
    return {steps: math.ceil(getattr(cfg, samples) / (cfg.batch_size * cfg.grad_accum))
            for samples, steps in SAMPLE_FLAGS.items() if getattr(cfg, samples) is not None}
