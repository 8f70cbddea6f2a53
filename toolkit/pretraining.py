"""Pretraining a GPT on token data, as train.py, train_ddp.py and train_ds.py do: the options, resume, the model, the
language-modelling objective, and the setup that hands them to the loop (toolkit/training.py).

    cfg, given, args = parse_config(argv)
    trainer = setup(cfg, given, TorchBackend(cfg.out_dir))    # or DeepSpeedBackend (toolkit/deepspeed_engine.py)
    trainer.fit()

A backend is what differs between the trainers before the first step: `path` (where its checkpoint lives),
data_parallel() -> (rank, size) (the ranks of one model replica, e.g. pipeline stages, share data),
read_resume() -> the saved state, settle_config(cfg, given, resumed) (the values its own config also sets), and
start(model, cfg, device, dtype, resume, loss) -> the engine the loop runs.

Data order is a pure function of (seed, iteration): every optimizer step draws one global set of windows and
each rank / micro-step takes its slice, so the iteration number is the data position, N ranks train exactly like
one process with the same global batch, and resume is exact.
"""
import argparse
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from model import ATTN_KERNELS, GPT, PRESETS, GPTConfig
from toolkit import cli, distributed, flags
from toolkit.checkpoint import CHECKPOINT_FILE, load_checkpoint
from toolkit.cli import CLIError
from toolkit.data import get_batch, load_corpus, window_offsets
from toolkit.evaluation import ChoiceTask
from toolkit.device import check_memory, describe, keep_freed_memory_in_heap, resolve_device, resolve_dtype
from toolkit.flags import flag, option
from toolkit.hf import load_gpt2
from toolkit.optim import make_optimizer
from toolkit.prepare import DEFAULT_CORPUS_DIR, ensure_default_corpus
from toolkit.tokenizers import load_tokenizer
from toolkit.training import LoopConfig, Schedule, TorchEngine, Trainer, claim_out_dir

TRAIN_STREAM, EVAL_TRAIN_STREAM, EVAL_VAL_STREAM = 0, 1, 2  # independent random streams of windows
MODEL_SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "bias")


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = option(DEFAULT_CORPUS_DIR, "nanoGPT data dir (train.bin, val.bin, meta.json) or Megatron prefix")
    out_dir: str = option("ckpt", "where ckpt.pt, the loss curve and TensorBoard logs go")
    overwrite: bool = option(False, "replace a checkpoint in --out-dir that this run does not resume from")
    init_from: str = option("scratch", "scratch, resume (from OUT_DIR/ckpt.pt), or an HF GPT-2 dir or name")
    # model
    preset: str | None = option(None, "model size preset (sets n_layer, n_head, n_embd)", choices=sorted(PRESETS))
    n_layer: int = option(4, "transformer blocks", check="positive")
    n_head: int = option(4, "attention heads", check="positive")
    n_embd: int = option(128, "embedding width", check="positive")
    block_size: int = option(64, "context length in tokens", check="positive")
    dropout: float = option(0.0, "dropout probability (may change on resume)", check="probability")
    bias: bool = option(True, "biases in Linear and LayerNorm layers, as GPT-2")
    attn_kernel: str = option("auto", "attention: manual (written out; auto's pick for bfloat16 on CPU up to 512 "
                                      "keys) or an SDPA kernel (may change on resume)", choices=list(ATTN_KERNELS))
    # optimisation
    batch_size: int = option(32, "sequences per micro-batch, in each process", check="positive")
    grad_accum: int | None = option(None, "micro-batches per optimizer step over ALL processes (default: one per "
                                          "process)", check="positive")
    max_iters: int = option(300, "optimizer steps in total (a resumed run continues up to this number)",
                            check="non-negative")
    lr: float | None = option(None, "peak learning rate of AdamW (Muon's is --muon-lr); default 4e-3, or 4e-3 x 128 / "
                                    "n-embd where AdamW trains the blocks' matrices from scratch", check="positive-number")
    min_lr: float | None = option(None, "final learning rate of the cosine decay (default lr/10)",
                                  check="non-negative-number")
    warmup_iters: int = option(25, "linear warmup steps", check="non-negative")
    lr_decay_iters: int | None = option(None, "steps of cosine decay (default: all steps)", check="non-negative")
    optimizer: str = option("auto", "muon: Muon for the blocks' matrices, AdamW for the rest; adamw; auto: muon from "
                                    "scratch, adamw from pretrained weights", choices=["auto", "muon", "adamw"])
    muon_lr: float = option(0.05, "Muon's peak learning rate (it follows --lr's schedule)",
                            check="non-negative-number")
    weight_decay: float = option(0.1, "AdamW weight decay (2-D weights only)", check="non-negative-number")
    beta1: float = option(0.9, "AdamW beta1", check="probability")
    beta2: float = option(0.99, "AdamW beta2", check="probability")
    grad_clip: float = option(1.0, "clip gradients at this global norm (0 = off)", check="non-negative-number")
    # evaluation, logging, checkpoints
    eval_interval: int = option(100, "evaluate every N steps", check="positive")
    eval_iters: int = option(20, "batches per evaluation and split", check="positive")
    eval_tasks: str | None = option(None, "multiple-choice files in HellaSwag's format (comma-separated .jsonl) "
                                          "scored at each evaluation: acc and acc_norm, as eval.py scores them")
    log_interval: int = option(10, "print the training loss every N steps", check="positive")
    save_interval: int = option(0, "also save a checkpoint every N steps (0 = only at the end)", check="non-negative")
    tensorboard_dir: str | None = option(None, "TensorBoard log dir (default OUT_DIR/tensorboard); each run logs to a "
                                               "subfolder named by --run-name")
    run_name: str | None = option(None, "TensorBoard run name (default: the start time; a resumed run keeps its own)",
                                  check="folder-name")
    # system
    device: str = option("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = option("auto", "autocast dtype; auto = bfloat16 where the hardware computes it natively, else "
                                "float32", choices=["auto", "float32", "bfloat16", "float16"])
    compile: bool = option(False, "torch.compile the model")
    peak_tflops: float | None = option(None, "device peak TFLOP/s for MFU (known GPUs are looked up)",
                                       check="non-negative-number")
    seed: int = option(1337, "seed of the initial weights and of the data order")
    # Megatron-LM's own options (its other names for the options above are ALIASES)
    load: str | None = option(None, "use this folder as --out-dir and resume from its checkpoint when it holds one "
                                    "(else start from scratch)", megatron=True)
    split: str = option("969,30,1", "train,val,test document split of a Megatron prefix", megatron=True)
    global_batch_size: int | None = option(None, "sequences per optimizer step over all processes; sets --grad-accum "
                                                 "to it / --batch-size", check="positive", megatron=True)
    train_samples: int | None = option(None, "train on this many sequences instead; sets --max-iters",
                                       check="positive", megatron=True)
    lr_warmup_samples: int | None = option(None, "warm up over this many sequences instead; sets --warmup-iters",
                                           check="non-negative", megatron=True)
    lr_decay_samples: int | None = option(None, "decay over this many sequences instead; sets --lr-decay-iters",
                                          check="positive", megatron=True)
    codecarbon_dir: str | None = option(None, "record energy and CO2 with codecarbon's offline tracker (rank 0) in "
                                              "DIR/emissions.csv, one row per run (needs: pip install codecarbon)",
                                        megatron=True)
    codecarbon_country: str = option("USA", "ISO 3166 alpha-3 code of the country whose electricity mix converts "
                                            "the energy to CO2 (offline: nothing is looked up)", megatron=True)


CONFIG_FIELDS = {f.name: f for f in fields(TrainConfig)}
# Megatron-LM's names for the same values (its samples flags have fields of their own: they need the global batch)
ALIASES = {"lr": ["--learning-rate"], "n_layer": ["--num-layers"], "n_embd": ["--hidden-size"],
           "n_head": ["--num-attention-heads"], "block_size": ["--seq-length"], "batch_size": ["--micro-batch-size"],
           "data_dir": ["--data-path"], "out_dir": ["--save"], "max_iters": ["--train-iters"],
           "warmup_iters": ["--lr-warmup-iters"], "grad_clip": ["--clip-grad"], "beta1": ["--adam-beta1"],
           "beta2": ["--adam-beta2"]}
# sample counts (Megatron) -> the step counts they set, through the global batch
SAMPLE_FLAGS = {"train_samples": "max_iters", "lr_warmup_samples": "warmup_iters", "lr_decay_samples": "lr_decay_iters"}


def parse_config(argv: list[str] | None = None, description: str = "Train a GPT.", extra_arguments=None,
                 overrides: dict[str, dict | None] | None = None) -> tuple[TrainConfig, set[str], argparse.Namespace]:
    """Flags into a TrainConfig: (config, the fields the user set, all parsed args).

    Precedence: defaults < --config JSON < command-line flags. extra_arguments(parser) adds a script's own flags
    (train_ds.py adds DeepSpeed's); overrides change or leave out some of TrainConfig's (flags.add_flags)."""
    parser = cli.argument_parser(description)
    parser.add_argument("--config", help="JSON file of option values; command-line flags win")
    flags.add_flags(parser, TrainConfig, ALIASES, overrides=overrides)
    if extra_arguments:
        extra_arguments(parser)
    args = parser.parse_args(argv)
    given = flags.given(TrainConfig, argv, ALIASES, overrides)
    values = flags.values(args, TrainConfig)
    if args.config:
        from_file = flags.read_config_file(args.config, TrainConfig)
        values.update({k: v for k, v in from_file.items() if k not in given})
        given |= set(from_file)
    cfg = TrainConfig(**values)
    check_config(cfg)
    for samples, steps in SAMPLE_FLAGS.items():
        if {samples, steps} <= given:
            raise CLIError(f"{flag(samples)} and {flag(steps)} set the same value; give one of them")
    if cfg.load is not None:
        apply_load(cfg, given)
    return cfg, given, args


def check_config(cfg: TrainConfig) -> None:
    """Every value in range before any data is read or anything is written (CLIError)."""
    flags.check_values(cfg)
    if cfg.n_embd % cfg.n_head:
        raise CLIError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if cfg.codecarbon_dir:
        try:
            import codecarbon  # noqa: F401  (an optional dependency)
        except ImportError:
            raise CLIError("--codecarbon-dir needs the optional codecarbon package: pip install codecarbon") from None


def apply_load(cfg: TrainConfig, given: set[str]) -> None:
    """Megatron's --load DIR: DIR is the run's folder (checkpoints are read from and written to one place here), and
    the run resumes from it when it holds a checkpoint."""
    if "out_dir" in given and os.path.abspath(cfg.out_dir) != os.path.abspath(cfg.load):
        raise CLIError(f"--load {cfg.load} and --save/--out-dir {cfg.out_dir} differ; a run resumes and saves in one "
                       f"folder here: give the same folder or only one of them")
    if "init_from" in given and cfg.init_from != "resume":
        raise CLIError(f"--load resumes from {cfg.load}; it cannot be combined with --init-from {cfg.init_from}")
    cfg.out_dir = cfg.load
    given.add("out_dir")


def apply_preset(cfg: TrainConfig, given: set[str]) -> None:
    """--preset sets the shape; a shape flag given with it that says otherwise is an error."""
    if not cfg.preset:
        return
    for name in ("n_layer", "n_head", "n_embd"):
        value = PRESETS[cfg.preset][name]
        if name in given and getattr(cfg, name) != value:
            raise CLIError(f"--preset {cfg.preset} has {name.replace('_', '-')} {value} but "
                           f"{flag(name)} {getattr(cfg, name)} was given; drop one of them")
        setattr(cfg, name, value)


def default_lr(cfg: TrainConfig) -> float:
    """AdamW's peak rate unless --lr is given: 4e-3, measured at the quick start's width of 128. Where AdamW trains
    the blocks' matrices from scratch it falls as 1/width, as GPT-3's rates do (6e-4 at width 768 ... 1e-4 at 5120;
    this gives 6.7e-4 and 1e-4): at 4e-3 a 124M body stays near letter statistics (docs/performance.md). Muon scales
    its own updates, and the embeddings and norms it leaves to AdamW keep 4e-3 at any width (as muP's do)."""
    return 4e-3 * 128 / cfg.n_embd if cfg.optimizer == "adamw" and cfg.init_from == "scratch" else 4e-3


def settle_optimizer(cfg: TrainConfig) -> None:
    """--optimizer auto: Muon is measured from scratch; fine-tuning pretrained weights keeps AdamW. Then --lr."""
    if cfg.optimizer == "auto":
        cfg.optimizer = "muon" if cfg.init_from == "scratch" else "adamw"
    if cfg.lr is None:
        cfg.lr = default_lr(cfg)


def schedule(cfg: TrainConfig) -> Schedule:
    """Warmup, then cosine decay to min_lr (default lr/10) over lr_decay_iters (default: all max_iters steps)."""
    return Schedule(cfg.lr, cfg.warmup_iters, cfg.lr_decay_iters or cfg.max_iters,
                    cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr)


def merge_resumed_config(cfg: TrainConfig, given: set[str], saved: dict, source: str) -> TrainConfig:
    """Resume with the checkpoint's settings except flags given now; a different model shape is an error."""
    known = {"optimizer": "adamw"}  # checkpoints from before the optimizer option were trained with AdamW
    known.update((k, v) for k, v in saved.get("train_config", {}).items() if k in CONFIG_FIELDS)
    merged = TrainConfig(**{**asdict(TrainConfig()), **known, **{k: getattr(cfg, k) for k in given},
                            "init_from": "resume", "out_dir": cfg.out_dir})
    if merged.optimizer not in ("auto", known["optimizer"]):
        raise CLIError(f"{source} was trained with --optimizer {known['optimizer']}; its optimizer state cannot "
                       f"continue under --optimizer {merged.optimizer}")
    merged.optimizer = known["optimizer"]
    model_config = saved["model_config"]
    for name in MODEL_SHAPE:
        if name in given and getattr(merged, name) != model_config[name]:
            raise CLIError(f"checkpoint {source} has {name}={model_config[name]} but {flag(name)} "
                           f"{getattr(merged, name)} was given; drop the flag or use another --out-dir")
    if "preset" in given and merged.preset:
        raise CLIError("--preset cannot be combined with --init-from resume; the checkpoint fixes the shape")
    for name in MODEL_SHAPE:
        setattr(merged, name, model_config[name])
    for samples, steps in {**SAMPLE_FLAGS, "global_batch_size": "grad_accum"}.items():
        if steps in given and samples not in given:
            setattr(merged, samples, None)  # a step count given now wins over the saved Megatron count
    return merged


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


def same_tokenizer(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("tokenizer", "vocab_size", "eot_id", "chars"))


def build_model(cfg: TrainConfig, vocab_size: int) -> GPT:
    """A new GPT of the configured shape, or GPT-2 weights for --init-from DIR/NAME (cut to --block-size)."""
    if cfg.init_from not in ("scratch", "resume"):
        model = load_gpt2(cfg.init_from, attn_kernel=cfg.attn_kernel, dropout=cfg.dropout)
        if cfg.block_size > model.config.block_size:
            raise CLIError(f"--block-size {cfg.block_size} is longer than the {model.config.block_size} positions "
                           f"of {cfg.init_from}; use --block-size {model.config.block_size} or less")
        if cfg.block_size < model.config.block_size:
            model.crop_block_size(cfg.block_size)
        return model
    config = GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias, attn_kernel=cfg.attn_kernel)
    check_memory(config)
    return GPT(config)


def evaluation_windows(n_tokens: int, block_size: int, count: int, seed: int, stream: int) -> np.ndarray:
    """Offsets of the windows an evaluation scores: all non-overlapping ones when there are at most `count`,
    else `count` random ones (fixed by the seed, so successive evaluations are comparable)."""
    whole = (n_tokens - 1) // block_size
    if whole <= count:
        return np.arange(whole, dtype=np.int64) * block_size
    return window_offsets(n_tokens, block_size, count, seed, 0, stream)


class LanguageModeling:
    """The objective of pretraining: next-token cross-entropy on random windows of the corpus.

    Each step's windows come from (seed, step) alone and the data-parallel ranks take slices of them; evaluation
    scores fixed windows of both splits, shared out over the ranks."""

    def __init__(self, cfg: TrainConfig, corpus, model: GPT, device: torch.device, dp_rank: int, dp_size: int,
                 tasks: list[ChoiceTask] = ()):
        self.cfg, self.corpus, self.model, self.device, self.tasks = cfg, corpus, model, device, tasks
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_steps = cfg.grad_accum // dp_size
        self.global_batch = cfg.batch_size * cfg.grad_accum

    def micro_batches(self, step: int) -> list[tuple[tuple[torch.Tensor, torch.Tensor], float]]:
        """This rank's (x, y) micro-batches for one optimizer step: its slice of the step's global draw."""
        cfg = self.cfg
        offsets = window_offsets(len(self.corpus.train), cfg.block_size, self.global_batch, cfg.seed, step,
                                 TRAIN_STREAM)
        mine = offsets[self.dp_rank * self.micro_steps * cfg.batch_size:][: self.micro_steps * cfg.batch_size]
        return [(get_batch(self.corpus.train, o, cfg.block_size, self.device), 1 / cfg.grad_accum)
                for o in np.split(mine, self.micro_steps)]

    @staticmethod
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return model(x, y, chunked_loss=True)[1]

    def throughput(self) -> tuple[int, str, float]:
        tokens = self.global_batch * self.cfg.block_size
        return tokens, "tokens", self.model.flops_per_token() * tokens

    @torch.no_grad()
    def evaluate(self, engine) -> dict[str, float]:
        """Mean loss per split over fixed windows: the whole split in non-overlapping windows when it holds no more
        than eval_iters batches of them (exact, and cheaper than sampling), else eval_iters batches of random
        windows. Batches are shared out over the data-parallel ranks and all-reduced. Every rank runs the same
        number of forwards (a rank short of batches repeats one, uncounted), so an engine whose forward is
        collective (ZeRO-3 gathers the parameters) stays in step."""
        cfg = self.cfg
        self.model.eval()
        losses = {}
        for split, stream in (("train", EVAL_TRAIN_STREAM), ("val", EVAL_VAL_STREAM)):
            tokens = getattr(self.corpus, split)
            offsets = evaluation_windows(len(tokens), cfg.block_size, cfg.eval_iters * cfg.batch_size, cfg.seed,
                                         stream)
            batches = math.ceil(len(offsets) / cfg.batch_size)
            total, count = 0.0, 0
            for i in range(self.dp_rank, math.ceil(batches / self.dp_size) * self.dp_size, self.dp_size):
                real = i < batches
                rows = offsets[(i if real else 0) * cfg.batch_size:][:cfg.batch_size]
                loss = engine.eval_loss(*get_batch(tokens, rows, cfg.block_size, self.device))
                if real:
                    total, count = total + loss.item() * len(rows), count + len(rows)
            total, count = distributed.all_reduce_sum([total, count], self.device)
            losses[split] = total / count
        metrics = {"train_loss": losses["train"], "val_loss": losses["val"],
                   "val_ppl": math.exp(min(losses["val"], 50))}
        for task in self.tasks:
            scores = task.score(engine.logits_at, cfg.block_size, cfg.batch_size, self.device,
                                (self.dp_rank, self.dp_size))
            metrics.update({f"{task.name}_{name}": value for name, value in scores.items()})
        self.model.train()
        return metrics

    @torch.no_grad()
    def good_weights(self, engine) -> bool:
        """Finite weights that give a finite loss on one fixed validation batch (in eval mode: no RNG is used)."""
        if not engine.weights_finite():
            return False
        cfg = self.cfg
        offsets = window_offsets(len(self.corpus.val), cfg.block_size, cfg.batch_size, cfg.seed, 0, EVAL_VAL_STREAM)
        self.model.eval()
        loss = engine.eval_loss(*get_batch(self.corpus.val, offsets, cfg.block_size, self.device)).item()
        self.model.train()
        finite = distributed.all_reduce_sum([float(math.isfinite(loss))], self.device)[0]
        return finite == distributed.world_size()

    def checkpoint_state(self, best: dict | None) -> dict:
        return {"model_config": asdict(self.model.config), "train_config": asdict(self.cfg),
                "tokenizer": self.corpus.meta}


class TorchBackend:
    """train.py's and train_ddp.py's backend: OUT_DIR/ckpt.pt, written by rank 0; Muon or AdamW; DDP in a process
    group."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, CHECKPOINT_FILE)

    def data_parallel(self) -> tuple[int, int]:
        return distributed.rank(), distributed.world_size()

    def read_resume(self) -> dict:
        return load_checkpoint(self.path)

    def settle_config(self, cfg: TrainConfig, given: set[str], resumed: set[str]) -> TrainConfig:
        return cfg

    def start(self, model: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype, resume: dict | None,
              loss) -> TorchEngine:
        optimizer = make_optimizer(model, cfg.optimizer, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                                   cfg.muon_lr, device.type, dtype)
        return TorchEngine(self.path, model, model, optimizer, device, dtype, loss, cfg.grad_clip, cfg.compile,
                           resume=resume)


def settle_config(cfg: TrainConfig, given: set[str], resume: dict | None, backend, dp_size: int) -> TrainConfig:
    """The run's final settings: resumed ones, the backend's, one micro-batch per process by default, steps from
    Megatron's sample counts; checked before anything is read or written."""
    resumed = set()
    if resume is not None:
        cfg = merge_resumed_config(cfg, given, resume, backend.path)
        resumed = set(resume.get("train_config", {})) & set(CONFIG_FIELDS) - given - {"init_from", "out_dir"}
    else:
        apply_preset(cfg, given)
    if cfg.run_name is None:
        cfg.run_name = time.strftime("%Y%m%d-%H%M%S")
    given = given | resumed
    if cfg.global_batch_size is not None:
        cfg.grad_accum = grad_accum_for(cfg, given)
        given = given | {"grad_accum"}
    if cfg.grad_accum is None:
        cfg.grad_accum = dp_size
    cfg = backend.settle_config(cfg, given, resumed)
    settle_optimizer(cfg)
    check_config(cfg)
    if cfg.grad_accum % dp_size:
        raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across {replicas_in_words(dp_size)}; "
                       f"use a multiple of {dp_size}")
    for samples, steps in SAMPLE_FLAGS.items():
        if getattr(cfg, samples) is not None:
            setattr(cfg, steps, math.ceil(getattr(cfg, samples) / (cfg.batch_size * cfg.grad_accum)))
    return cfg


def replicas_in_words(dp_size: int) -> str:
    """The data-parallel width in words: "2 processes", or "1 replica of 2 processes" under model parallelism."""
    world = distributed.world_size()
    if dp_size == world:
        return f"{world} processes"
    return f"{dp_size} replica{'s' * (dp_size > 1)} of {world // dp_size} processes"


def check_data(cfg: TrainConfig, corpus, model: GPT, resume: dict | None) -> None:
    """Both splits hold a window, and the data, the model and a resumed checkpoint share one tokenizer."""
    for split in ("train", "val"):  # fail now, not at the first evaluation
        tokens = len(getattr(corpus, split))
        if tokens < cfg.block_size + 1:
            raise CLIError(f"the {split} split of {cfg.data_dir} has {tokens:,} tokens, fewer than one window of "
                           f"--block-size + 1 = {cfg.block_size + 1}; use a smaller --block-size"
                           + (" or give val more data (tokenizer.py --val-fraction, or --split for a Megatron "
                              "prefix)" if split == "val" else ""))
    facts = corpus.meta
    if resume is not None and "tokenizer" in resume and not same_tokenizer(facts, resume["tokenizer"]):
        saved = resume["tokenizer"]
        raise CLIError(f"data in {cfg.data_dir} uses tokenizer {facts.get('tokenizer')} (vocab "
                       f"{facts.get('vocab_size')}) but the checkpoint was trained with {saved.get('tokenizer')} "
                       f"(vocab {saved.get('vocab_size')})")
    if cfg.init_from not in ("scratch", "resume") and facts.get("tokenizer") != "gpt2":
        raise CLIError(f"GPT-2 weights need GPT-2 tokenized data, but {cfg.data_dir} uses {facts.get('tokenizer')}; "
                       f"prepare it with tokenizer.py --tokenizer gpt2")
    if facts["vocab_size"] != model.config.vocab_size:
        raise CLIError(f"data vocabulary size {facts['vocab_size']} does not match the model's "
                       f"{model.config.vocab_size}")


def setup(cfg: TrainConfig, given: set[str], backend) -> Trainer:
    """The steps before training, in order: read the resumed state (if any), settle the configuration, pick device
    and dtype, load the data, build the model, check it against the data, start the engine. Nothing is written
    before every check has passed."""
    master = distributed.rank() == 0
    dp_rank, dp_size = backend.data_parallel()
    if cfg.load is not None and cfg.init_from == "scratch" and os.path.exists(backend.path):
        cfg.init_from = "resume"  # Megatron's --load: resume when the folder holds a checkpoint
    resume = backend.read_resume() if cfg.init_from == "resume" else None
    cfg = settle_config(cfg, given, resume, backend, dp_size)
    if master:
        claim_out_dir(cfg.out_dir, backend.path, resume is not None, cfg.overwrite)
    device = resolve_device(cfg.device, distributed.local_rank())
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cpu":
        keep_freed_memory_in_heap()
    if cfg.data_dir == DEFAULT_CORPUS_DIR and master:
        ensure_default_corpus(DEFAULT_CORPUS_DIR)
    distributed.barrier()
    corpus = load_corpus(cfg.data_dir, cfg.split)

    torch.manual_seed(cfg.seed)  # identical initial weights in every rank
    if resume is None:
        model = build_model(cfg, corpus.meta["vocab_size"])
    else:
        model = build_model(TrainConfig(**{**asdict(cfg), "init_from": "scratch"}),
                            resume["model_config"]["vocab_size"])
    model = model.to(device)
    check_data(cfg, corpus, model, resume)
    step = resume["iter_num"] if resume else 0
    if step >= cfg.max_iters:
        raise CLIError(f"{backend.path} is at iteration {step} and --max-iters {cfg.max_iters} is the total, so "
                       f"nothing is left to train; continue with --max-iters N for some N > {step}")
    tasks = [ChoiceTask(path, load_tokenizer(corpus.meta)) for path in (cfg.eval_tasks or "").split(",") if path]
    objective = LanguageModeling(cfg, corpus, model, device, dp_rank, dp_size, tasks)
    engine = backend.start(model, cfg, device, dtype, resume, objective.loss)
    if master:
        if resume is not None:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun restarted the job
            print(f"resumed from {backend.path} at iteration {step}" + (f" after restart {restart}" if restart else ""))
        tokens = objective.global_batch * cfg.block_size
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.config}")
        print(f"global batch: {cfg.batch_size} micro x {objective.micro_steps} accumulation x "
              f"{replicas_in_words(dp_size)} = {objective.global_batch} sequences = {tokens:,} tokens per step; "
              f"device {describe(device)}, dtype {str(dtype).removeprefix('torch.')}", flush=True)
    best = {"val_loss": resume["best_val_loss"]} if resume and resume.get("best_val_loss") is not None else None
    loop = LoopConfig(max_iters=cfg.max_iters, log_interval=cfg.log_interval, eval_interval=cfg.eval_interval,
                      save_interval=cfg.save_interval, peak_tflops=cfg.peak_tflops)
    return Trainer(engine, objective, schedule(cfg), loop, cfg.out_dir, cfg.run_name, cfg.tensorboard_dir, step=step,
                   history=(resume or {}).get("history"), best=best)


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


def train(cfg: TrainConfig, given: set[str], backend) -> Trainer:
    """setup() and fit(); with --codecarbon-dir, rank 0 records the energy and CO2 of the training however it ends
    (done, signal, NaN, error)."""
    trainer = setup(cfg, given, backend)
    with tracking_emissions(trainer.objective.cfg if distributed.rank() == 0 else None):
        trainer.fit()
    return trainer
