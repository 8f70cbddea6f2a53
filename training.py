"""The training core shared by train.py, train_ddp.py and train_ds.py.

It holds the training config and its flags, the learning-rate schedule, the loop (batches, evaluation,
logging to stdout, TensorBoard and a loss-curve PNG), the SIGINT/SIGTERM and NaN handling, and
TorchEngine: the model, AdamW, GradScaler, torch.compile and DDP. A trainer's engine does the steps and
writes the checkpoints; train_ds.py brings its own (a DeepSpeed engine) with the same methods:

    path                                        where its checkpoint lives (OUT_DIR/ckpt.pt, OUT_DIR/ds)
    data_parallel() -> (rank, size)             this rank's data-parallel index and width (ranks of one model
                                                replica, e.g. pipeline stages, take the same windows)
    read_resume() -> dict            the saved training state (checkpoint.STATE_KEYS, and what else it keeps)
    settle_config(cfg, given, resumed) -> cfg   settle values the engine also configures (DeepSpeed's JSON)
    start(model, cfg, device, dtype, resume)    optimizer (and weights, RNG) ready to train
    train_step([(x, y), ...], lr) -> float      one optimizer step over this rank's micro-batches
    eval_loss(x, y) -> Tensor
    weights_finite() -> bool
    save(state)                                 called in every rank

Data order is a pure function of (seed, iteration): every optimizer step draws one global set of
windows and each rank / micro-step takes its slice, so the iteration number is the data position,
N ranks train exactly like one process with the same global batch, and resume is exact.
"""
import argparse
import math
import os
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import cli
from checkpoint import CHECKPOINT_FILE, capture_rng, load_checkpoint, load_weights, make_checkpoint, restore_rng, \
    save_checkpoint
from cli import CLIError
from data import get_batch, load_corpus, window_offsets
from device import autocast, describe, keep_freed_memory_in_heap, peak_flops, resolve_device, resolve_dtype
from files import atomic_write, lock_folder, read_json, remove_temporaries
from model import ATTN_KERNELS, GPT, GPTConfig, PRESETS
from tokenizer import DEFAULT_CORPUS_DIR, ensure_default_corpus

TRAIN_STREAM, EVAL_TRAIN_STREAM, EVAL_VAL_STREAM = 0, 1, 2  # independent random streams of windows
MODEL_SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "bias")
SIGNAL_GRACE_S = 5.0  # more SIGINT/SIGTERM within this time of the first are the same request


def option(default, help: str, **kwargs):
    """A config field with its --help text (and argparse choices): one flag per field (add_field_arguments)."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = option(DEFAULT_CORPUS_DIR, "nanoGPT data dir (train.bin, val.bin, meta.json) or Megatron prefix")
    split: str = option("969,30,1", "train,val,test document split of a Megatron prefix (as Megatron's --split)")
    out_dir: str = option("ckpt", "where ckpt.pt, the loss curve and TensorBoard logs go")
    overwrite: bool = option(False, "replace a checkpoint in --out-dir that this run does not resume from")
    init_from: str = option("scratch", "scratch, resume (from OUT_DIR/ckpt.pt), or an HF GPT-2 dir or name")
    load: str | None = option(None, "Megatron's --load: use this folder as --out-dir and resume from its checkpoint "
                                    "when it holds one (else start from scratch)")
    # model
    preset: str | None = option(None, "model size preset (sets n_layer, n_head, n_embd)", choices=sorted(PRESETS))
    n_layer: int = option(4, "transformer blocks")
    n_head: int = option(4, "attention heads")
    n_embd: int = option(128, "embedding width")
    block_size: int = option(64, "context length in tokens")
    dropout: float = option(0.0, "dropout probability (may change on resume)")
    bias: bool = option(True, "biases in Linear and LayerNorm layers, as GPT-2")
    attn_kernel: str = option("auto", "attention: manual (written out; auto's pick for bfloat16 on CPU up to 512 "
                            "keys) or an SDPA kernel (may change on resume)", choices=ATTN_KERNELS)
    # optimisation
    batch_size: int = option(32, "micro-batch size per process")
    grad_accum: int | None = option(None, "micro-batches per optimizer step over ALL processes (default: one per "
                                        "process)")
    global_batch_size: int | None = option(None, "sequences per optimizer step (Megatron); sets --grad-accum to "
                                                 "it / --batch-size")
    max_iters: int = option(300, "optimizer steps in total (a resumed run continues up to this number)")
    train_samples: int | None = option(None, "train on this many samples instead (Megatron); sets max_iters")
    lr: float = option(4e-3, "peak learning rate (AdamW's; Muon's is --muon-lr)")
    min_lr: float | None = option(None, "final learning rate of the cosine decay (default lr/10)")
    warmup_iters: int = option(25, "linear warmup steps")
    lr_decay_iters: int | None = option(None, "steps of cosine decay (default: all steps)")
    lr_warmup_samples: int | None = option(None, "warmup over this many samples instead (Megatron); sets "
                                                 "--warmup-iters")
    lr_decay_samples: int | None = option(None, "decay over this many samples instead (Megatron); sets "
                                                "--lr-decay-iters")
    optimizer: str = option("auto", "muon: Muon for the blocks' matrices, AdamW for the rest; adamw; auto: muon from "
                                    "scratch, adamw from pretrained weights", choices=["auto", "muon", "adamw"])
    muon_lr: float = option(0.05, "Muon's peak learning rate (it follows --lr's schedule)")
    weight_decay: float = option(0.1, "AdamW weight decay (2-D weights only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip gradients at this global norm (0 = off)")
    # evaluation, logging, checkpoints
    eval_interval: int = option(100, "evaluate every N steps")
    eval_iters: int = option(20, "batches per evaluation and split")
    log_interval: int = option(10, "print the training loss every N steps")
    save_interval: int = option(0, "also save a checkpoint every N steps (0 = only at the end)")
    tensorboard_dir: str | None = option(None, "TensorBoard log dir (default OUT_DIR/tensorboard); each run logs to a "
                                             "subfolder named by --run-name")
    run_name: str | None = option(None, "TensorBoard run name (default: the start time; a resumed run keeps its own)")
    # system
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "autocast dtype; auto = bfloat16 where the hardware has it, else float32",
                      choices=["auto", "float32", "bfloat16", "float16"])
    compile: bool = option(False, "torch.compile the model")
    peak_tflops: float | None = option(None, "device peak TFLOP/s for MFU (known GPUs are looked up)")
    codecarbon_dir: str | None = option(None, "record energy and CO2 with codecarbon's offline tracker (rank 0) in "
                                              "DIR/emissions.csv, one row per run (needs: pip install codecarbon)")
    codecarbon_country: str = option("USA", "ISO 3166 alpha-3 code of the country whose electricity mix converts "
                                            "the energy to CO2 (offline: nothing is looked up)")
    seed: int = option(1337, "seed of the initial weights and of the data order")


CONFIG_FIELDS = {f.name: f for f in fields(TrainConfig)}
# Megatron-LM's names for the same values (its samples flags have fields of their own: they need the global batch)
ALIASES = {"lr": ["--learning-rate"], "n_layer": ["--num-layers"], "n_embd": ["--hidden-size"],
           "n_head": ["--num-attention-heads"], "block_size": ["--seq-length"], "batch_size": ["--micro-batch-size"],
           "data_dir": ["--data-path"], "out_dir": ["--save"], "max_iters": ["--train-iters"],
           "warmup_iters": ["--lr-warmup-iters"], "grad_clip": ["--clip-grad"], "beta1": ["--adam-beta1"],
           "beta2": ["--adam-beta2"]}
# sample counts (Megatron) -> the step counts they set, through the global batch
SAMPLE_FLAGS = {"train_samples": "max_iters", "lr_warmup_samples": "warmup_iters", "lr_decay_samples": "lr_decay_iters"}


def _base_type(annotation) -> type:
    """int | None -> int."""
    args = getattr(annotation, "__args__", None)
    return args[0] if args else annotation


def add_config_arguments(parser: argparse.ArgumentParser, argument_default=None) -> None:
    """One kebab-case flag per TrainConfig field, plus --config and Megatron's aliases."""
    parser.add_argument("--config", help="JSON file of option values; command-line flags win",
                        **({} if argument_default is None else {"default": argument_default}))
    add_field_arguments(parser, TrainConfig, argument_default)


def add_field_arguments(parser: argparse.ArgumentParser, config_class: type, argument_default=None) -> None:
    """One kebab-case flag per field of a config dataclass (help and choices from its metadata), with ALIASES."""
    for f in fields(config_class):
        kwargs = {"dest": f.name, "help": f.metadata["help"]}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _base_type(f.type)
        if argument_default is not None:
            kwargs["default"] = argument_default
        else:
            kwargs["default"] = f.default
            if f.default is not None:
                kwargs["help"] += f" (default: {f.default})"
        parser.add_argument("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, []), **kwargs)


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """What train_ddp.py and train_ds.py add to train.py's flags."""
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a process waits for the others at start-up or in any collective "
                             "(e.g. while rank 0 saves) before failing (default: 300)")


def parse_config(argv: list[str] | None = None, description: str = "Train a GPT.",
                 extra_arguments=None) -> tuple[TrainConfig, set[str], argparse.Namespace]:
    """Parse flags into a TrainConfig. Returns (config, names the user set explicitly, all args).

    Precedence: defaults < --config JSON < command-line flags. `extra_arguments(parser)` lets a
    front-end add its own flags (train_ds.py adds DeepSpeed's)."""
    parser = cli.argument_parser(description)
    add_config_arguments(parser)
    if extra_arguments:
        extra_arguments(parser)
    args = parser.parse_args(argv)
    explicit_parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_config_arguments(explicit_parser, argument_default=argparse.SUPPRESS)
    explicit = set(vars(explicit_parser.parse_known_args(argv)[0])) - {"config"}

    values = {name: getattr(args, name) for name in CONFIG_FIELDS}
    if args.config:
        from_file = read_json_config(args.config)
        values.update({k: v for k, v in from_file.items() if k not in explicit})
        explicit |= set(from_file)
    cfg = TrainConfig(**values)
    check_config(cfg)
    for samples, steps in SAMPLE_FLAGS.items():
        if {samples, steps} <= explicit:
            raise CLIError(f"--{samples.replace('_', '-')} and --{steps.replace('_', '-')} set the same value; "
                           f"give one of them")
    if cfg.load is not None:
        apply_load(cfg, explicit)
    return cfg, explicit, args


def apply_load(cfg: TrainConfig, explicit: set[str]) -> None:
    """Megatron's --load DIR: DIR is the run's folder (checkpoints are read from and written to one place here), and
    the Trainer resumes from it when it holds a checkpoint."""
    if "out_dir" in explicit and os.path.abspath(cfg.out_dir) != os.path.abspath(cfg.load):
        raise CLIError(f"--load {cfg.load} and --save/--out-dir {cfg.out_dir} differ; a run resumes and saves in one "
                       f"folder here: give the same folder or only one of them")
    if "init_from" in explicit and cfg.init_from != "resume":
        raise CLIError(f"--load resumes from {cfg.load}; it cannot be combined with --init-from {cfg.init_from}")
    cfg.out_dir = cfg.load
    explicit.add("out_dir")


def read_json_config(path: str) -> dict:
    """Option values from a JSON object; keys are TrainConfig names (snake_case or kebab-case), values typed
    as the flags are."""
    values = {k.replace("-", "_"): v for k, v in read_json(path, "config file").items()}
    unknown = sorted(set(values) - set(CONFIG_FIELDS))
    if unknown:
        raise CLIError(f"{path}: unknown option(s) {', '.join(unknown)}")
    for name, value in values.items():
        f = CONFIG_FIELDS[name]
        kind = _base_type(f.type)
        nullable = f.type is not kind
        ok = (value is None and nullable) or (type(value) is bool if kind is bool else
                                              type(value) is int if kind is int else
                                              type(value) in (int, float) if kind is float else
                                              isinstance(value, str))
        if not ok:
            raise CLIError(f"{path}: {name} must be {'null or ' if nullable else ''}{kind.__name__}, got {value!r}")
        if "choices" in f.metadata and value is not None and value not in f.metadata["choices"]:
            raise CLIError(f"{path}: {name} must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
    return values


def check_config(cfg: TrainConfig) -> None:
    """Every value in range before any data is read or anything is written (CLIError)."""
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    for name in ("batch_size", "block_size", "n_layer", "n_head", "n_embd", "eval_interval", "eval_iters",
                 "log_interval", "grad_accum", "global_batch_size", "train_samples",
                 "lr_decay_samples"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise CLIError(f"{flag(name)} must be at least 1, got {value}")
    for name in ("max_iters", "warmup_iters", "save_interval", "lr_decay_iters", "lr_warmup_samples"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise CLIError(f"{flag(name)} must be at least 0, got {value}")
    for name in ("lr", "min_lr", "muon_lr", "weight_decay", "grad_clip", "peak_tflops", "dropout"):
        value = getattr(cfg, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise CLIError(f"{flag(name)} must be a finite number >= 0, got {value}")
    if cfg.lr == 0:
        raise CLIError("--lr must be positive")
    if not 0 <= cfg.dropout < 1:
        raise CLIError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise CLIError(f"{flag(name)} must be in [0, 1), got {getattr(cfg, name)}")
    if cfg.n_embd % cfg.n_head:
        raise CLIError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if cfg.run_name is not None and (not cfg.run_name or os.sep in cfg.run_name or cfg.run_name in (".", "..")):
        raise CLIError(f"--run-name must be a plain folder name, got {cfg.run_name!r}")
    if cfg.codecarbon_dir:
        try:
            import codecarbon  # noqa: F401  (an optional dependency)
        except ImportError:
            raise CLIError("--codecarbon-dir needs the optional codecarbon package: pip install codecarbon") from None


def apply_preset(cfg: TrainConfig, explicit: set[str]) -> None:
    """--preset sets the shape; a shape flag given with it that says otherwise is an error."""
    if not cfg.preset:
        return
    for name in ("n_layer", "n_head", "n_embd"):
        value = PRESETS[cfg.preset][name]
        if name in explicit and getattr(cfg, name) != value:
            raise CLIError(f"--preset {cfg.preset} has {name.replace('_', '-')} {value} but "
                           f"--{name.replace('_', '-')} {getattr(cfg, name)} was given; drop one of them")
        setattr(cfg, name, value)


def learning_rate(it: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr over lr_decay_iters (default: all max_iters steps), then flat."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return min_lr
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def merge_resumed_config(cfg: TrainConfig, explicit: set[str], saved: dict, source: str) -> TrainConfig:
    """Resume with the checkpoint's settings except flags given now; a different model shape is an error."""
    known = {"optimizer": "adamw"}  # checkpoints from before the optimizer option were trained with AdamW
    known.update((k, v) for k, v in saved.get("train_config", {}).items() if k in CONFIG_FIELDS)
    merged = TrainConfig(**{**asdict(TrainConfig()), **known, **{k: getattr(cfg, k) for k in explicit},
                            "init_from": "resume", "out_dir": cfg.out_dir})
    if merged.optimizer not in ("auto", known["optimizer"]):
        raise CLIError(f"{source} was trained with --optimizer {known['optimizer']}; its optimizer state cannot "
                       f"continue under --optimizer {merged.optimizer}")
    merged.optimizer = known["optimizer"]
    model_config = saved["model_config"]
    for name in MODEL_SHAPE:
        if name in explicit and getattr(merged, name) != model_config[name]:
            raise CLIError(f"checkpoint {source} has {name}={model_config[name]} but "
                           f"--{name.replace('_', '-')} {getattr(merged, name)} was given; "
                           f"drop the flag or use another --out-dir")
    if "preset" in explicit and merged.preset:
        raise CLIError("--preset cannot be combined with --init-from resume; the checkpoint fixes the shape")
    for name in MODEL_SHAPE:
        setattr(merged, name, model_config[name])
    for samples, steps in {**SAMPLE_FLAGS, "global_batch_size": "grad_accum"}.items():
        if steps in explicit and samples not in explicit:
            setattr(merged, samples, None)  # a step count given now wins over the saved Megatron count
    return merged


def same_tokenizer(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("tokenizer", "vocab_size", "eot_id", "chars"))


def build_model(cfg: TrainConfig, vocab_size: int) -> GPT:
    """A new GPT of the configured shape (or preset), or GPT-2 weights for --init-from DIR/NAME."""
    if cfg.init_from not in ("scratch", "resume"):
        model = GPT.from_pretrained(cfg.init_from, attn_kernel=cfg.attn_kernel, dropout=cfg.dropout)
        if cfg.block_size > model.config.block_size:
            raise CLIError(f"--block-size {cfg.block_size} is longer than the {model.config.block_size} positions "
                           f"of {cfg.init_from}; use --block-size {model.config.block_size} or less")
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
        return model
    return GPT(GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias, attn_kernel=cfg.attn_kernel))


def evaluation_windows(n_tokens: int, block_size: int, count: int, seed: int, stream: int) -> np.ndarray:
    """Offsets of the windows an evaluation scores: all non-overlapping ones when there are at most `count`,
    else `count` random ones (fixed by the seed, so successive evaluations are comparable)."""
    whole = (n_tokens - 1) // block_size
    if whole <= count:
        return np.arange(whole, dtype=np.int64) * block_size
    return window_offsets(n_tokens, block_size, count, seed, 0, stream)


@contextmanager
def tracking_emissions(cfg: TrainConfig | None):
    """codecarbon's OfflineEmissionsTracker around the block when cfg sets --codecarbon-dir; its row is appended to
    CODECARBON_DIR/emissions.csv when the block ends, by any path."""
    if cfg is None or not cfg.codecarbon_dir:
        yield
        return
    from codecarbon import OfflineEmissionsTracker
    os.makedirs(cfg.codecarbon_dir, exist_ok=True)
    tracker = OfflineEmissionsTracker(country_iso_code=cfg.codecarbon_country, output_dir=cfg.codecarbon_dir,
                                      project_name=cfg.run_name, log_level="error", allow_multiple_runs=True)
    tracker.start()
    try:
        yield
    finally:
        tracker.stop()


class StopRequest:
    """SIGINT/SIGTERM ask the loop to finish its step, save and exit 0 (in every rank). Repeats within a few
    seconds are the same request (on Ctrl-C the terminal signals every process, and a launcher then forwards
    SIGTERM too); a later one stops at once."""

    def __init__(self):
        self.requested, self.first = False, 0.0
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.requested and now - self.first > SIGNAL_GRACE_S:
            raise KeyboardInterrupt
        if not self.requested:
            self.requested, self.first = True, now


def tensorboard_writer(cfg: TrainConfig):
    """A SummaryWriter for this run: TENSORBOARD_DIR (default OUT_DIR/tensorboard) / RUN_NAME (cfg: any config
    with tensorboard_dir, out_dir and run_name, e.g. finetune.py's)."""
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(os.path.join(cfg.tensorboard_dir or os.path.join(cfg.out_dir, "tensorboard"), cfg.run_name))


class TorchEngine:
    """train.py's and train_ddp.py's engine: AdamW (+ GradScaler for float16, torch.compile, DDP in a process
    group); checkpoints are OUT_DIR/ckpt.pt, written by rank 0."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, CHECKPOINT_FILE)
        self.master = not dist.is_initialized() or dist.get_rank() == 0

    def data_parallel(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(), dist.get_world_size()

    def read_resume(self) -> dict:
        return load_checkpoint(self.path)

    def settle_config(self, cfg: TrainConfig, given: set[str], resumed: set[str]) -> TrainConfig:
        return cfg

    def start(self, model: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype,
              resume: dict | None) -> None:
        self.raw_model, self.device, self.dtype, self.grad_clip = model, device, dtype, cfg.grad_clip
        self.muon_scale = cfg.muon_lr / cfg.lr if cfg.optimizer == "muon" else 1.0  # from the flags, also on resume
        self.optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), device.type,
                                                    muon_lr=cfg.muon_lr if cfg.optimizer == "muon" else None)
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        if resume is not None:
            load_weights(model, resume["model"], self.path)
            if resume.get("optimizer"):
                self.optimizer.load_state_dict(resume["optimizer"])
            if resume.get("scaler"):
                self.scaler.load_state_dict(resume["scaler"])
            restore_rng(resume.get("rng") or {}, device)
        self.model = torch.compile(model) if cfg.compile else model
        self.train_model = self.model
        if dist.is_initialized() and dist.get_world_size() > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.train_model = DistributedDataParallel(self.model, device_ids=[device.index]
                                                       if device.type == "cuda" else None)

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * self.muon_scale if group.get("muon") else lr  # Muon's: the schedule at --muon-lr
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            sync = self.train_model.no_sync() if not last and self.train_model is not self.model else nullcontext()
            with sync:
                with autocast(self.device, self.dtype):
                    _, loss = self.train_model(x, y)
                    loss = loss / len(batches)
                self.scaler.scale(loss).backward()
            total += loss.detach()
        if self.grad_clip:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.dtype):
            return self.model(x, y)[1]

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.raw_model.parameters())

    def save(self, state: dict) -> None:
        if self.master:
            scaler = self.scaler.state_dict() if self.scaler.is_enabled() else None
            checkpoint = make_checkpoint(state, self.raw_model, self.optimizer.state_dict(), scaler,
                                         capture_rng(self.device))
            save_checkpoint(checkpoint, self.path)


class Trainer:
    """One training run, in a single process or in every rank of an initialised process group.

    The constructor's steps, in order: settle the config (resumed settings, the engine's config), pick the
    device and dtype, load the data, build the model, check it against the data, start the engine."""

    def __init__(self, cfg: TrainConfig, explicit: set[str], engine):
        self.engine = engine
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.master = self.rank == 0
        # ranks that share one model replica (pipeline stages, tensor-parallel shards) take the same data
        self.dp_rank, self.data_parallel_size = engine.data_parallel()
        if cfg.load is not None and cfg.init_from == "scratch" and os.path.exists(engine.path):
            cfg.init_from = "resume"  # Megatron's --load: resume when the folder holds a checkpoint
        resume = engine.read_resume() if cfg.init_from == "resume" else None
        self.cfg = cfg = self.settle_config(cfg, explicit, resume)
        if self.master:
            self.claim_out_dir(resume)
        self.micro_steps = cfg.grad_accum // self.data_parallel_size
        self.global_batch = cfg.batch_size * cfg.grad_accum
        self.device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()

        if cfg.data_dir == DEFAULT_CORPUS_DIR and self.master:
            ensure_default_corpus(DEFAULT_CORPUS_DIR)
        self.barrier()
        self.corpus = load_corpus(cfg.data_dir, cfg.split)
        for split in ("train", "val"):  # fail now, not at the first evaluation
            tokens = len(getattr(self.corpus, split))
            if tokens < cfg.block_size + 1:
                raise CLIError(f"the {split} split of {cfg.data_dir} has {tokens:,} tokens, fewer than one window "
                               f"of --block-size + 1 = {cfg.block_size + 1}; use a smaller --block-size"
                               + (" or give val more data (tokenizer.py --val-fraction, or --split for a Megatron "
                                  "prefix)" if split == "val" else ""))

        torch.manual_seed(cfg.seed)  # identical initial weights in every rank
        model_cfg = cfg if resume is None else TrainConfig(**{**asdict(cfg), "init_from": "scratch"})
        vocab_size = resume["model_config"]["vocab_size"] if resume else self.corpus.meta["vocab_size"]
        self.model = build_model(model_cfg, vocab_size).to(self.device)
        self.check_vocabulary(resume)
        self.iter_num = resume["iter_num"] if resume else 0
        self.best_val_loss = resume.get("best_val_loss", float("inf")) if resume else float("inf")
        self.history = resume.get("history") if resume else None
        self.history = self.history or {"iter": [], "loss": [], "eval_iter": [], "val": []}
        if self.iter_num >= cfg.max_iters:
            raise CLIError(f"{engine.path} is at iteration {self.iter_num} and --max-iters {cfg.max_iters} is the "
                           f"total, so nothing is left to train; continue with --max-iters N for some N > "
                           f"{self.iter_num}")
        engine.start(self.model, cfg, self.device, self.dtype, resume)
        self.writer = None

    def settle_config(self, cfg: TrainConfig, explicit: set[str], resume: dict | None) -> TrainConfig:
        """The run's final settings: resumed ones, the engine's, one micro-batch per process by default, steps
        from --train-samples; checked before anything is read or written."""
        resumed = set()
        if resume is not None:
            cfg = merge_resumed_config(cfg, explicit, resume, self.engine.path)
            resumed = set(resume.get("train_config", {})) & set(CONFIG_FIELDS) - explicit - {"init_from", "out_dir"}
        else:
            apply_preset(cfg, explicit)
        if cfg.run_name is None:
            cfg.run_name = time.strftime("%Y%m%d-%H%M%S")
        given = explicit | resumed
        if cfg.global_batch_size is not None:
            cfg.grad_accum = self.grad_accum_for(cfg, given)
            given = given | {"grad_accum"}
        if cfg.grad_accum is None:
            cfg.grad_accum = self.data_parallel_size
        cfg = self.engine.settle_config(cfg, given, resumed)
        if cfg.optimizer == "auto":  # Muon is measured from scratch; fine-tuning pretrained weights keeps AdamW
            cfg.optimizer = "muon" if cfg.init_from == "scratch" else "adamw"
        check_config(cfg)
        if cfg.grad_accum % self.data_parallel_size:
            raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across {self.replicas()}; "
                           f"use a multiple of {self.data_parallel_size}")
        for samples, steps in SAMPLE_FLAGS.items():
            if getattr(cfg, samples) is not None:
                setattr(cfg, steps, math.ceil(getattr(cfg, samples) / (cfg.batch_size * cfg.grad_accum)))
        return cfg

    @staticmethod
    def grad_accum_for(cfg: TrainConfig, given: set[str]) -> int:
        """--grad-accum from Megatron's --global-batch-size = --micro-batch-size x accumulation (over all processes)."""
        accum, rest = divmod(cfg.global_batch_size, cfg.batch_size)
        if rest:
            raise CLIError(f"--global-batch-size {cfg.global_batch_size} is not a multiple of --micro-batch-size/"
                           f"--batch-size {cfg.batch_size}")
        if "grad_accum" in given and cfg.grad_accum not in (None, accum):
            raise CLIError(f"--global-batch-size {cfg.global_batch_size} / --batch-size {cfg.batch_size} = {accum} "
                           f"micro-batches but --grad-accum {cfg.grad_accum} was given; drop one of them")
        return accum

    def claim_out_dir(self, resume: dict | None) -> None:
        """Lock --out-dir for this run (a second run there stops), clear what a killed writer left, and refuse to
        replace a checkpoint this run did not resume from."""
        self.out_dir_lock = lock_folder(self.cfg.out_dir)
        remove_temporaries(self.cfg.out_dir)
        if resume is None and os.path.exists(self.engine.path) and not self.cfg.overwrite:
            raise CLIError(f"{self.engine.path} holds the checkpoint of another run; continue it with --init-from "
                           f"resume, use another --out-dir, or pass --overwrite to replace it")

    def check_vocabulary(self, resume: dict | None) -> None:
        data_facts, model_vocab = self.corpus.meta, self.model.config.vocab_size
        if resume is not None and "tokenizer" in resume and not same_tokenizer(data_facts, resume["tokenizer"]):
            saved = resume["tokenizer"]
            raise CLIError(f"data in {self.cfg.data_dir} uses tokenizer {data_facts.get('tokenizer')} "
                           f"(vocab {data_facts.get('vocab_size')}) but the checkpoint was trained with "
                           f"{saved.get('tokenizer')} (vocab {saved.get('vocab_size')})")
        if self.cfg.init_from not in ("scratch", "resume") and data_facts.get("tokenizer") != "gpt2":
            raise CLIError(f"GPT-2 weights need GPT-2 tokenized data, but {self.cfg.data_dir} uses "
                           f"{data_facts.get('tokenizer')}; prepare it with tokenizer.py --tokenizer gpt2")
        if data_facts["vocab_size"] != model_vocab:
            raise CLIError(f"data vocabulary size {data_facts['vocab_size']} does not match the model's {model_vocab}")

    # ----- distributed helpers (no-ops in one process) -----
    def replicas(self) -> str:
        """The data-parallel width in words: "2 processes", or "1 replica of 2 processes" under model parallelism."""
        if self.data_parallel_size == self.world_size:
            return f"{self.world_size} processes"
        each = self.world_size // self.data_parallel_size
        return f"{self.data_parallel_size} replica{'s' * (self.data_parallel_size > 1)} of {each} processes"

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t)
        return t.tolist()

    # ----- the loop -----
    def fit(self) -> None:
        """Train up to max_iters (or a stop signal); with --codecarbon-dir, rank 0 records the energy and CO2 of the
        whole run however it ends (done, signal, NaN, error)."""
        with tracking_emissions(self.cfg if self.master else None):
            self.train_loop()

    def train_loop(self) -> None:
        cfg = self.cfg
        stop_request = StopRequest()
        tokens_per_iter = self.global_batch * cfg.block_size
        peak = peak_flops(self.device, cfg.peak_tflops)
        if self.master:
            print(f"model: {self.model.num_params() / 1e6:.2f}M parameters, {self.model.config}")
            print(f"global batch: {cfg.batch_size} micro x {self.micro_steps} accumulation x {self.replicas()} "
                  f"= {self.global_batch} sequences = {tokens_per_iter:,} tokens per step; "
                  f"device {describe(self.device)}, dtype {str(self.dtype).removeprefix('torch.')}")
        bar = tqdm(total=cfg.max_iters, initial=self.iter_num, desc="train", disable=not self.master or None,
                   dynamic_ncols=True)
        while self.iter_num < cfg.max_iters:
            if self.iter_num % cfg.eval_interval == 0:
                self.evaluate_and_log()
            lr = learning_rate(self.iter_num, cfg)
            t0 = time.perf_counter()
            loss = self.engine.train_step(self.micro_batches(self.iter_num), lr)
            loss, stop = self.all_reduce_sum([loss, float(stop_request.requested)])
            loss /= self.world_size
            dt = time.perf_counter() - t0
            self.check_finite(loss)
            self.iter_num += 1
            bar.update(1)
            if self.iter_num % cfg.log_interval == 0 or self.iter_num == cfg.max_iters:
                self.log_step(loss, lr, dt, tokens_per_iter, peak, bar)
            if stop:
                self.save()
                if self.master:
                    bar.write(f"stopped by signal at iteration {self.iter_num}; saved {self.engine.path}")
                bar.close()
                return
            if cfg.save_interval and self.iter_num % cfg.save_interval == 0 and self.iter_num < cfg.max_iters:
                self.save()
        bar.close()
        if cfg.max_iters % cfg.eval_interval == 0 or self.iter_num == cfg.max_iters:
            self.evaluate_and_log()
        self.save()
        if self.master:
            self.plot_losses()
            print(f"done: {self.iter_num} iterations, best val loss {self.best_val_loss:.4f}, saved {self.engine.path}")

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (x, y) micro-batches for one optimizer step: its slice of the step's global draw."""
        cfg = self.cfg
        offsets = window_offsets(len(self.corpus.train), cfg.block_size, self.global_batch, cfg.seed, step,
                                 TRAIN_STREAM)
        mine = offsets[self.dp_rank * self.micro_steps * cfg.batch_size:][: self.micro_steps * cfg.batch_size]
        return [get_batch(self.corpus.train, o, cfg.block_size, self.device) for o in np.split(mine, self.micro_steps)]

    def check_finite(self, loss: float) -> None:
        """Stop on a NaN/inf loss, keeping the last good checkpoint; float16 overflow steps are skipped by
        the GradScaler, so there only a run of them is fatal."""
        if math.isfinite(loss):
            self.skipped_steps = 0
            return
        if self.dtype == torch.float16:
            self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
            if self.skipped_steps < 10:
                return
        raise CLIError(f"loss is {loss} at iteration {self.iter_num}; stopped without saving "
                       f"(the last good checkpoint, if any, is kept). Try a lower --lr or --dtype bfloat16")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss per split over fixed windows: the whole split in non-overlapping windows when it holds no more
        than eval_iters batches of them (exact, and cheaper than sampling), else eval_iters batches of random
        windows. Batches are shared out over all ranks and all-reduced. Every rank runs the same number of
        forwards (a rank short of batches repeats one, uncounted), so an engine whose forward is collective
        (ZeRO-3 gathers the parameters) stays in step."""
        cfg = self.cfg
        self.model.eval()
        losses = {}
        for split, stream in (("train", EVAL_TRAIN_STREAM), ("val", EVAL_VAL_STREAM)):
            tokens = getattr(self.corpus, split)
            offsets = evaluation_windows(len(tokens), cfg.block_size, cfg.eval_iters * cfg.batch_size, cfg.seed,
                                         stream)
            batches = math.ceil(len(offsets) / cfg.batch_size)
            total, count = 0.0, 0
            dp = self.data_parallel_size
            for i in range(self.dp_rank, math.ceil(batches / dp) * dp, dp):
                real = i < batches
                rows = offsets[(i if real else 0) * cfg.batch_size:][:cfg.batch_size]
                loss = self.engine.eval_loss(*get_batch(tokens, rows, cfg.block_size, self.device))
                if real:
                    total, count = total + loss.item() * len(rows), count + len(rows)
            total, count = self.all_reduce_sum([total, count])
            losses[split] = total / count
        self.model.train()
        return losses

    def evaluate_and_log(self) -> None:
        losses = self.evaluate()
        if not all(math.isfinite(v) for v in losses.values()):
            raise CLIError(f"the evaluation at iteration {self.iter_num} gives loss {losses['val']} (val), "
                           f"{losses['train']} (train); stopped without saving (the last good checkpoint, if any, "
                           f"is kept). Try a lower --lr or --dtype bfloat16")
        self.best_val_loss = min(self.best_val_loss, losses["val"])
        if not self.master:
            return
        self.history["eval_iter"].append(self.iter_num)
        self.history["val"].append(losses["val"])
        tqdm.write(f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
                   f"val ppl {math.exp(min(losses['val'], 50)):.2f}")
        writer = self.tensorboard()
        writer.add_scalar("loss/train_eval", losses["train"], self.iter_num)
        writer.add_scalar("loss/val", losses["val"], self.iter_num)
        writer.add_scalar("loss/val_ppl", math.exp(min(losses["val"], 50)), self.iter_num)

    def log_step(self, loss: float, lr: float, dt: float, tokens_per_iter: int, peak: float | None, bar) -> None:
        if not self.master:
            return
        self.history["iter"].append(self.iter_num)
        self.history["loss"].append(loss)
        tokens_per_s = tokens_per_iter / dt
        mfu = self.model.estimate_mfu(tokens_per_iter, dt, peak) if peak else None
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        bar.write(f"iter {self.iter_num}: loss {loss:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, "
                  f"{tokens_per_s:,.0f} tokens/s" + (f", mfu {mfu * 100:.1f}%" if mfu is not None else ""))
        writer = self.tensorboard()
        writer.add_scalar("loss/train", loss, self.iter_num)
        writer.add_scalar("lr", lr, self.iter_num)
        writer.add_scalar("perf/tokens_per_s", tokens_per_s, self.iter_num)
        if mfu is not None:
            writer.add_scalar("perf/mfu", mfu, self.iter_num)

    def tensorboard(self):
        if self.writer is None:
            self.writer = tensorboard_writer(self.cfg)
        return self.writer

    # ----- checkpoints and signals -----
    def state(self) -> dict:
        """The training state every checkpoint format keeps (checkpoint.STATE_KEYS)."""
        return {"model_config": asdict(self.model.config), "train_config": asdict(self.cfg),
                 "tokenizer": self.corpus.meta, "iter_num": self.iter_num, "best_val_loss": self.best_val_loss,
                 "history": self.history}

    def save(self) -> None:
        """Write a checkpoint through the engine, unless the weights went bad: a non-finite step never reaches
        disk (the loss that stopped checks saw was computed before the last update)."""
        if not self.weights_are_good():
            raise CLIError(f"the weights after iteration {self.iter_num} are not finite or give a non-finite loss; "
                           f"stopped without saving "
                           f"(the last good checkpoint, if any, is kept). Try a lower --lr or --dtype bfloat16")
        self.engine.save(self.state())
        if self.master and self.writer is not None:
            self.writer.flush()
        self.barrier()

    @torch.no_grad()
    def weights_are_good(self) -> bool:
        """Finite weights that give a finite loss on one fixed validation batch (in eval mode: no RNG is used)."""
        if not self.engine.weights_finite():
            return False
        cfg = self.cfg
        offsets = window_offsets(len(self.corpus.val), cfg.block_size, cfg.batch_size, cfg.seed, 0, EVAL_VAL_STREAM)
        self.model.eval()
        loss = self.engine.eval_loss(*get_batch(self.corpus.val, offsets, cfg.block_size, self.device)).item()
        self.model.train()
        return bool(self.all_reduce_sum([float(math.isfinite(loss))])[0] == self.world_size)

    def plot_losses(self) -> None:
        """OUT_DIR/loss.png: the training loss every log_interval steps and the val loss at each evaluation."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(self.history["iter"], self.history["loss"], label="train loss", linewidth=1)
        ax.plot(self.history["eval_iter"], self.history["val"], "o-", label="val loss")
        ax.set_xlabel("iteration")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        atomic_write(os.path.join(self.cfg.out_dir, "loss.png"), lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
