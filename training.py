"""The training core shared by train.py, train_ddp.py and train_ds.py.

It holds the training config and its flags, the learning-rate schedule, batch fetching, evaluation,
logging (stdout, TensorBoard, a loss-curve PNG), checkpoints, and the SIGINT/SIGTERM and NaN handling.
`Trainer` runs one training: train.py uses it as it is, train_ddp.py runs it in every rank of a
process group, and train_ds.py overrides the few methods where a DeepSpeed engine differs.

Data order is a pure function of (seed, iteration): every optimizer step draws one global set of
windows and each rank / micro-step takes its slice, so the iteration number is the data position,
N ranks train exactly like one process with the same global batch, and resume is exact.
"""
import argparse
import ctypes
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import tokenizer
from checkpoint import clean_state_dict, load_checkpoint, model_from_checkpoint, save_checkpoint
from cli import CLIError
from data import get_batch, load_corpus, window_offsets
from model import ATTN_KERNELS, GPT, GPTConfig, PRESETS

DEFAULT_DATA_DIR = "data/pydoc_char"
TRAIN_STREAM, EVAL_TRAIN_STREAM, EVAL_VAL_STREAM = 0, 1, 2  # independent random streams of windows
MODEL_SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "bias")
PEAK_TFLOPS = {"A100": 312, "H100": 989, "H200": 989, "L4": 121, "A10": 125, "V100": 125, "4090": 165}


def _opt(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = _opt(DEFAULT_DATA_DIR, "nanoGPT data dir (train.bin, val.bin, meta.json) or Megatron prefix")
    split: str = _opt("969,30,1", "train,val,test document split of a Megatron prefix (as Megatron's --split)")
    out_dir: str = _opt("ckpt", "where ckpt.pt, the loss curve and TensorBoard logs go")
    init_from: str = _opt("scratch", "scratch, resume (from OUT_DIR/ckpt.pt), or an HF GPT-2 dir or name")
    # model
    preset: str | None = _opt(None, "model size preset (sets n_layer, n_head, n_embd)", choices=sorted(PRESETS))
    n_layer: int = _opt(4, "transformer blocks")
    n_head: int = _opt(4, "attention heads")
    n_embd: int = _opt(128, "embedding width")
    block_size: int = _opt(256, "context length in tokens")
    dropout: float = _opt(0.0, "dropout probability (may change on resume)")
    bias: bool = _opt(True, "biases in Linear and LayerNorm layers, as GPT-2")
    attn_kernel: str = _opt("auto", "attention: manual (written out; auto's pick for bfloat16 on CPU) or an "
                            "SDPA kernel (may change on resume)", choices=ATTN_KERNELS)
    # optimisation
    batch_size: int = _opt(16, "micro-batch size per process")
    grad_accum: int = _opt(1, "micro-batches per optimizer step over ALL processes (split across ranks)")
    max_iters: int = _opt(1200, "optimizer steps")
    train_samples: int | None = _opt(None, "train on this many samples instead (Megatron); sets max_iters")
    lr: float = _opt(1e-3, "peak learning rate")
    min_lr: float | None = _opt(None, "final learning rate of the cosine decay (default lr/10)")
    warmup_iters: int = _opt(100, "linear warmup steps")
    lr_decay_iters: int | None = _opt(None, "steps of cosine decay (default max_iters)")
    weight_decay: float = _opt(0.1, "AdamW weight decay (2-D weights only)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.99, "AdamW beta2")
    grad_clip: float = _opt(1.0, "clip gradients at this global norm (0 = off)")
    # evaluation, logging, checkpoints
    eval_interval: int = _opt(200, "evaluate every N steps")
    eval_iters: int = _opt(20, "batches per evaluation and split")
    log_interval: int = _opt(10, "print the training loss every N steps")
    save_interval: int = _opt(0, "also save a checkpoint every N steps (0 = only at the end)")
    tensorboard_dir: str | None = _opt(None, "TensorBoard log dir (default OUT_DIR/tensorboard)")
    # system
    device: str = _opt("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = _opt("auto", "autocast dtype; auto = bfloat16 where the hardware has it, else float32",
                      choices=["auto", "float32", "bfloat16", "float16"])
    compile: bool = _opt(False, "torch.compile the model")
    peak_tflops: float | None = _opt(None, "device peak TFLOP/s for MFU (known GPUs are looked up)")
    seed: int = _opt(1337, "seed of the initial weights and of the data order")


def add_config_arguments(parser: argparse.ArgumentParser, argument_default=None) -> None:
    """One kebab-case flag per TrainConfig field, plus --config and Megatron's aliases."""
    parser.add_argument("--config", help="JSON file of option values; command-line flags win",
                        **({} if argument_default is None else {"default": argument_default}))
    for f in fields(TrainConfig):
        names = ["--" + f.name.replace("_", "-")] + (["--learning-rate"] if f.name == "lr" else [])
        kwargs = {"dest": f.name, "help": f.metadata["help"]}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = {int: int, float: float}.get(_base_type(f.type), str)
        if argument_default is not None:
            kwargs["default"] = argument_default
        else:
            kwargs["default"] = f.default
            if f.default is not None:
                kwargs["help"] += f" (default: {f.default})"
        parser.add_argument(*names, **kwargs)


def _base_type(annotation):
    """int | None -> int, for argparse."""
    args = getattr(annotation, "__args__", None)
    return args[0] if args else annotation


def parse_config(argv: list[str] | None = None, description: str = "Train a GPT.",
                 extra_arguments=None) -> tuple[TrainConfig, set[str], argparse.Namespace]:
    """Parse flags into a TrainConfig. Returns (config, names the user set explicitly, all args).

    Precedence: defaults < --config JSON < command-line flags. `extra_arguments(parser)` lets a
    front-end add its own flags (train_ds.py adds DeepSpeed's)."""
    parser = argparse.ArgumentParser(description=description)
    add_config_arguments(parser)
    if extra_arguments:
        extra_arguments(parser)
    args = parser.parse_args(argv)
    explicit_parser = argparse.ArgumentParser(add_help=False)
    add_config_arguments(explicit_parser, argument_default=argparse.SUPPRESS)
    explicit = set(vars(explicit_parser.parse_known_args(argv)[0])) - {"config"}

    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if args.config:
        from_file = read_json_config(args.config)
        values.update({k: v for k, v in from_file.items() if k not in explicit})
        explicit |= set(from_file)
    return TrainConfig(**values), explicit, args


def read_json_object(path: str, what: str = "config file") -> dict:
    """A JSON object from a file, or a one-line CLIError saying what is wrong with it."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise CLIError(f"{what} not found: {path}") from None
    except json.JSONDecodeError as e:
        raise CLIError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CLIError(f"{path} must hold a JSON object")
    return raw


def read_json_config(path: str) -> dict:
    """Option values from a JSON object; keys are TrainConfig names (snake_case or kebab-case)."""
    raw = read_json_object(path)
    known = {f.name for f in fields(TrainConfig)}
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CLIError(f"{path}: unknown option(s) {', '.join(unknown)}")
    return values


def learning_rate(it: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr over lr_decay_iters, then flat."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return min_lr
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto picks cuda, then mps, then cpu; asking for a device that is not there is a CLIError."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {name} requested but CUDA is not available on this machine")
    if name == "mps" and not torch.backends.mps.is_available():
        raise CLIError("--device mps requested but MPS is not available on this machine")
    if not (name == "cpu" or name == "mps" or name.startswith("cuda")):
        raise CLIError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return torch.device(name)


def keep_freed_memory_in_heap() -> None:
    """Make glibc keep big freed blocks for reuse instead of unmapping them.

    By default glibc serves blocks above 32 MB with fresh mmaps that are zero-filled page by page on
    first touch, and gives the heap top back on free; a CPU step that allocates the same big
    temporaries every time (the GPT-2-vocabulary logits chunks) pays those page faults at every step.
    Only called for CPU training; no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from <malloc.h>
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 where the hardware computes it natively (CUDA Ampere+, AVX512-BF16/AMX CPUs)."""
    if name == "auto":
        if device.type == "cuda":
            name = "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
        elif device.type == "cpu":
            name = "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"
        else:
            name = "float32"
    if name == "float16" and device.type == "cpu" and not torch.cpu._is_amx_fp16_supported():
        raise CLIError("--dtype float16 is not supported on this CPU (no AMX-FP16); use bfloat16 or float32")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision context: weights stay float32, matmuls run in dtype."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    """The device's peak FLOP/s for MFU: --peak-tflops, or a known GPU's bf16 dense peak."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        return next((t * 1e12 for key, t in PEAK_TFLOPS.items() if key in gpu), None)
    return None


def same_tokenizer(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("tokenizer", "vocab_size", "eot_id", "chars"))


class Trainer:
    """One training run. Works in a single process or in every rank of an initialised process group."""

    def __init__(self, cfg: TrainConfig, explicit: set[str] = frozenset()):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.master = self.rank == 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
        resume = self.load_resume_checkpoint(cfg) if cfg.init_from == "resume" else None
        if resume is not None:
            cfg = self.merge_resumed_config(cfg, explicit, resume)
        self.cfg = cfg
        if cfg.grad_accum % self.world_size:
            raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across {self.world_size} processes; "
                           f"use a multiple of {self.world_size}")
        self.micro_steps = cfg.grad_accum // self.world_size
        self.global_batch = cfg.batch_size * cfg.grad_accum
        self.max_iters = (math.ceil(cfg.train_samples / self.global_batch) if cfg.train_samples else cfg.max_iters)
        self.device = resolve_device(cfg.device, self.local_rank)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()

        if cfg.data_dir == DEFAULT_DATA_DIR and not os.path.exists(DEFAULT_DATA_DIR) and self.master:
            tokenizer.ensure_default_corpus(DEFAULT_DATA_DIR)
        self.barrier()
        self.corpus = load_corpus(cfg.data_dir, cfg.split)
        for split in ("train", "val"):  # fail now, not at the first evaluation
            window_offsets(len(getattr(self.corpus, split)), cfg.block_size, 1, cfg.seed, 0)

        torch.manual_seed(cfg.seed)  # identical initial weights in every rank
        self.raw_model = self.build_model(resume).to(self.device)
        self.check_vocabulary(resume)
        self.iter_num = resume["iter_num"] if resume else 0
        self.best_val_loss = resume.get("best_val_loss", float("inf")) if resume else float("inf")
        self.history = resume.get("history", {"iter": [], "loss": [], "eval_iter": [], "val": []}) if resume else \
            {"iter": [], "loss": [], "eval_iter": [], "val": []}
        self.setup_engine(resume)
        if resume is not None:
            self.restore_rng(resume)
        self.stop_requested = False
        self.writer = None

    # ----- setup -----
    def load_resume_checkpoint(self, cfg: TrainConfig) -> dict:
        return load_checkpoint(self.ckpt_path)

    def merge_resumed_config(self, cfg: TrainConfig, explicit: set[str], checkpoint: dict) -> TrainConfig:
        """Resume with the checkpoint's settings except flags given now; a different model shape is an error."""
        saved = {**asdict(TrainConfig()), **{k: v for k, v in checkpoint.get("train_config", {}).items()
                                              if k in asdict(TrainConfig())}}
        merged = TrainConfig(**{**saved, **{k: getattr(cfg, k) for k in explicit}, "init_from": "resume",
                                "out_dir": cfg.out_dir})
        model_config = checkpoint["model_config"]
        for name in MODEL_SHAPE_FLAGS:
            if name in explicit and getattr(merged, name) != model_config[name]:
                raise CLIError(f"checkpoint {self.ckpt_path} has {name}={model_config[name]} but "
                               f"--{name.replace('_', '-')} {getattr(merged, name)} was given; "
                               f"drop the flag or use another --out-dir")
        if "preset" in explicit and merged.preset:
            raise CLIError("--preset cannot be combined with --init-from resume; the checkpoint fixes the shape")
        for name in MODEL_SHAPE_FLAGS:
            setattr(merged, name, model_config[name])
        return merged

    def build_model(self, resume: dict | None) -> GPT:
        cfg = self.cfg
        if resume is not None:
            return model_from_checkpoint(resume, dropout=cfg.dropout, attn_kernel=cfg.attn_kernel)
        if cfg.init_from != "scratch":
            model = GPT.from_pretrained(cfg.init_from, attn_kernel=cfg.attn_kernel, dropout=cfg.dropout)
            if cfg.block_size < model.config.block_size:
                model.crop_block_size(cfg.block_size)
            return model
        shape = {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd")}
        if cfg.preset:
            shape = {k: PRESETS[cfg.preset][k] for k in shape}
        return GPT(GPTConfig(block_size=cfg.block_size, vocab_size=self.corpus.meta["vocab_size"], dropout=cfg.dropout,
                             bias=cfg.bias, attn_kernel=cfg.attn_kernel, **shape))

    def check_vocabulary(self, resume: dict | None) -> None:
        data_facts, model_vocab = self.corpus.meta, self.raw_model.config.vocab_size
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

    def setup_engine(self, resume: dict | None) -> None:
        """Optimizer, GradScaler, torch.compile and DDP; train_ds.py replaces this with deepspeed.initialize."""
        cfg = self.cfg
        self.optimizer = self.raw_model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2),
                                                             self.device.type)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        if resume is not None and resume.get("optimizer"):
            self.optimizer.load_state_dict(resume["optimizer"])
            if resume.get("scaler"):
                self.scaler.load_state_dict(resume["scaler"])
        self.model = torch.compile(self.raw_model) if cfg.compile else self.raw_model
        self.train_model = self.model
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_model = DistributedDataParallel(self.model, device_ids=ids)

    def restore_rng(self, checkpoint: dict) -> None:
        rng = checkpoint.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    # ----- distributed helpers (no-ops in one process) -----
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
        cfg = self.cfg
        self.install_signal_handlers()
        tokens_per_iter = self.global_batch * cfg.block_size
        peak = peak_flops(cfg, self.device)
        if self.master:
            print(f"model: {self.raw_model.num_params() / 1e6:.2f}M parameters, {self.raw_model.config}")
            print(f"global batch: {cfg.batch_size} micro x {self.micro_steps} accumulation x {self.world_size} "
                  f"processes = {self.global_batch} sequences = {tokens_per_iter:,} tokens per step; "
                  f"device {self.device}, dtype {str(self.dtype).removeprefix('torch.')}")
        bar = tqdm(total=self.max_iters, initial=self.iter_num, desc="train", disable=not self.master or None,
                   dynamic_ncols=True)
        while self.iter_num < self.max_iters:
            if self.iter_num % cfg.eval_interval == 0:
                self.evaluate_and_log()
            lr = learning_rate(self.iter_num, cfg)
            t0 = time.perf_counter()
            loss = self.train_step(lr)
            loss, stop = self.all_reduce_sum([loss, float(self.stop_requested)])
            loss /= self.world_size
            dt = time.perf_counter() - t0
            self.check_finite(loss)
            self.iter_num += 1
            bar.update(1)
            if self.iter_num % cfg.log_interval == 0 or self.iter_num == self.max_iters:
                self.log_step(loss, lr, dt, tokens_per_iter, peak, bar)
            if stop:
                self.save()
                if self.master:
                    bar.write(f"stopped by signal at iteration {self.iter_num}; saved {self.ckpt_path}")
                bar.close()
                return
            if cfg.save_interval and self.iter_num % cfg.save_interval == 0 and self.iter_num < self.max_iters:
                self.save()
        bar.close()
        if self.max_iters % cfg.eval_interval == 0 or self.iter_num == self.max_iters:
            self.evaluate_and_log()
        self.save()
        if self.master:
            self.plot_losses()
            print(f"done: {self.iter_num} iterations, best val loss {self.best_val_loss:.4f}, saved {self.ckpt_path}")

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's window offsets for one optimizer step, one array per micro-step."""
        cfg = self.cfg
        offsets = window_offsets(len(self.corpus.train), cfg.block_size, self.global_batch, cfg.seed, step,
                                 TRAIN_STREAM)
        mine = offsets[self.rank * self.micro_steps * cfg.batch_size:][: self.micro_steps * cfg.batch_size]
        return np.split(mine, self.micro_steps)

    def train_step(self, lr: float) -> float:
        """Forward/backward over this rank's micro-batches and one optimizer step; returns the mean loss."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        batches = self.micro_batches(self.iter_num)
        for i, offsets in enumerate(batches):
            x, y = get_batch(self.corpus.train, offsets, self.cfg.block_size, self.device)
            last = i == len(batches) - 1
            sync = nullcontext() if last or self.world_size == 1 else self.train_model.no_sync()
            with sync:
                with autocast(self.device, self.dtype):
                    _, loss = self.train_model(x, y)
                    loss = loss / len(batches)
                self.scaler.scale(loss).backward()
            total += loss.detach()
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()

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
        """Mean loss over eval_iters fixed batches per split, shared out over all ranks and all-reduced. Every rank
        runs the same number of forwards (a rank short of batches repeats one, uncounted), so an engine whose
        forward is collective (ZeRO-3 gathers the parameters) stays in step."""
        cfg = self.cfg
        self.model.eval()
        losses = {}
        for split, stream in (("train", EVAL_TRAIN_STREAM), ("val", EVAL_VAL_STREAM)):
            tokens = getattr(self.corpus, split)
            offsets = window_offsets(len(tokens), cfg.block_size, cfg.eval_iters * cfg.batch_size, cfg.seed, 0, stream)
            total, count = 0.0, 0
            for i in range(self.rank, math.ceil(cfg.eval_iters / self.world_size) * self.world_size, self.world_size):
                real = i < cfg.eval_iters
                j = i if real else 0
                x, y = get_batch(tokens, offsets[j * cfg.batch_size:(j + 1) * cfg.batch_size], cfg.block_size,
                                 self.device)
                loss = self.eval_loss(x, y)
                if real:
                    total, count = total + loss.item(), count + 1
            total, count = self.all_reduce_sum([total, count])
            losses[split] = total / count
        self.model.train()
        return losses

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.dtype):
            return self.model(x, y)[1]

    def evaluate_and_log(self) -> None:
        losses = self.evaluate()
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
        mfu = self.raw_model.estimate_mfu(tokens_per_iter, dt, peak) if peak else None
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
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(self.cfg.tensorboard_dir or os.path.join(self.cfg.out_dir, "tensorboard"))
        return self.writer

    # ----- checkpoints and signals -----
    def checkpoint_state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": clean_state_dict(self.raw_model.state_dict()),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "model_config": asdict(self.raw_model.config),
            "train_config": asdict(self.cfg),
            "tokenizer": self.corpus.meta,
            "iter_num": self.iter_num,  # also the data position: windows depend only on (seed, iteration)
            "best_val_loss": self.best_val_loss,
            "rng": rng,
            "history": self.history,
        }

    def save(self) -> None:
        if self.master:
            save_checkpoint(self.checkpoint_state(), self.ckpt_path)
            if self.writer is not None:
                self.writer.flush()
        self.barrier()

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM finish the current step, save a checkpoint and exit 0 (in every rank)."""
        def request_stop(signum, frame):
            if self.stop_requested:  # a second signal means now
                raise KeyboardInterrupt
            self.stop_requested = True
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    def plot_losses(self) -> None:
        """ckpt/loss.png: the training loss every log_interval steps and the val loss at each evaluation."""
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
        path = os.path.join(self.cfg.out_dir, "loss.png")
        fig.savefig(path + ".tmp.png", dpi=100)
        os.replace(path + ".tmp.png", path)
        plt.close(fig)
