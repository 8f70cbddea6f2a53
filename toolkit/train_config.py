"""Pretraining's options (TrainConfig) for train.py, train_ddp.py and train_ds.py, the tables of
their defaults, and the rules that settle them, which toolkit/pretraining.py's `settle` applies
once, in order, into the run's frozen configuration:

    cfg, args = parse_config(argv)                    # the flags; cfg.given: those the user set
    cfg, resume, pretrained = settle(cfg, engine)     # settled and frozen: nothing changes it after

No default depends on anything (the device, a resumed checkpoint, --preset, pretrained weights,
DeepSpeed's config, Megatron's counts) anywhere else; `min_lr` and `lr_decay_iters` left unset
follow `lr` and `max_iters` (schedule), on resume too.
"""
import argparse
import os
from dataclasses import asdict, dataclass, field, replace

import torch

from model import ARCHS, ATTN_KERNELS, GPTConfig
from toolkit import cli, distributed, flags, megatron
from toolkit.checkpoint import usable_config
from toolkit.cli import CLIError
from toolkit.config import RunConfig
from toolkit.data import DEFAULT_CORPUS_DIR
from toolkit.evaluation import file_task_name, refuse_same_names
from toolkit.flags import flag, option, option_fields
from toolkit.model_parallel import estimate_torch_memory
from toolkit.optim import Schedule

MODEL_SHAPE = ("arch", "n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "bias", "qk_norm")
PRESET_SHAPE = ("n_layer", "n_head", "n_embd")  # what --preset sets
# --preset's shapes; the rest of GPT-2's config as well, for benchmarks and tests that build one
PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    # for model parallelism, GPT-3's shapes (16b: 5 blocks per stage of 8, 12 heads per shard of 4)
    "gpt2-2.7b": dict(n_layer=32, n_head=32, n_embd=2560),  # 2.65B
    "gpt2-6.7b": dict(n_layer=32, n_head=32, n_embd=4096),  # 6.65B
    "gpt2-13b": dict(n_layer=40, n_head=40, n_embd=5120),  # 12.85B
    "gpt2-16b": dict(n_layer=40, n_head=48, n_embd=5760),  # 16.22B
}
for _preset in PRESETS.values():
    _preset.update(block_size=1024, vocab_size=50257, bias=True)
LLAMA_DEFAULTS = dict(bias=False, qk_norm=True)  # --arch llama's own defaults
# `python train.py` on a CUDA GPU: nanoGPT's shakespeare_char shape, compiled, a model that uses
# the GPU in about the wall time two CPU cores take for the 4 x 128 default (docs/performance.md)
CUDA_DEFAULTS = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, dropout=0.2,
                     max_iters=2000, eval_interval=250, compile=True)


@dataclass(frozen=True)
class TrainConfig(RunConfig):
    # data
    data_dir: str = option(DEFAULT_CORPUS_DIR, "nanoGPT data dir (train.bin, val.bin, meta.json) "
                                               "or Megatron prefix")
    init_from: str = option("scratch", "scratch, resume (from OUT_DIR/ckpt.pt), or pretrained "
                                       "weights: an HF GPT-2, Llama or Qwen3 folder, a GPT-2 name, "
                                       "a checkpoint")
    # model
    arch: str = option("llama", "the model family from scratch: llama, rotary positions, RMSNorm, "
                                "QK-norm, a gated SiLU MLP, no biases, an untied head (Llama, "
                                "Qwen3, SmolLM: better per minute, docs/performance.md); gpt2, "
                                "GPT-2 exactly (--preset's family). --init-from and resume keep "
                                "the family of the weights", choices=list(ARCHS))
    preset: str | None = option(None, "model size preset (sets n_layer, n_head, "
                                      "n_embd)", choices=sorted(PRESETS))
    n_layer: int = option(4, "transformer blocks (default: 6 on a CUDA GPU)", check="positive")
    n_head: int = option(4, "attention heads (default: 6 on a CUDA GPU)", check="positive")
    n_embd: int = option(128, "embedding width (default: 384 on a CUDA GPU)", check="positive")
    block_size: int = option(64, "context length in tokens (default: 256 on a CUDA GPU)",
                             check="positive")
    dropout: float = option(0.0, "dropout probability, may change on resume (default: 0.2 on a "
                                 "CUDA GPU)", check="probability")
    n_kv_head: int | None = option(None, "key/value heads, --arch llama's grouped-query attention "
                                         "(default: --n-head)", check="positive")
    qk_norm: bool = option(False, "RMSNorm of each head's queries and keys, as Qwen3 (--arch "
                                  "llama: on; --no-qk-norm for Llama's layout)")
    bias: bool = option(True, "biases in Linear and LayerNorm layers, as GPT-2 (--arch llama: off)")
    attn_kernel: str = option("auto", "attention: manual (written out; auto's pick for bfloat16 "
                                      "on CPU up to 512 keys) or an SDPA kernel (may change on "
                                      "resume)", choices=list(ATTN_KERNELS))
    # optimisation
    batch_size: int = option(32, "sequences per micro-batch, in each process (default: 64 on a "
                                 "CUDA GPU)", check="positive")
    grad_accum: int | None = option(None, "micro-batches per optimizer step over ALL processes "
                                          "(default: one per process)", check="positive")
    max_iters: int = option(300, "optimizer steps in total, a resumed run continuing up to this "
                                 "number (default: 2000 on a CUDA GPU)", check="positive")
    optimizer: str = option("auto", "muon: Muon for the blocks' matrices, AdamW for the rest; "
                                    "adamw; auto: muon from scratch, adamw from pretrained weights",
                            choices=["auto", "muon", "adamw"])
    lr: float | None = option(None, "peak learning rate of AdamW (Muon's is --muon-lr); default "
                                    "4e-3, or 4e-3 x 128 / n-embd where AdamW trains the blocks' "
                                    "matrices from scratch", check="positive-number")
    muon_lr: float = option(0.03, "Muon's peak learning rate (it follows --lr's schedule)",
                            check="non-negative-number")
    min_lr: float | None = option(None, "final learning rate of the cosine decay (default lr/10)",
                                  check="non-negative-number")
    warmup_iters: int = option(25, "linear warmup steps", check="non-negative")
    lr_decay_iters: int | None = option(None, "steps of cosine decay (default: all steps)",
                                        check="positive")
    # evaluation and checkpoints
    eval_interval: int = option(100, "evaluate every N steps (default: 250 on a CUDA GPU)",
                                check="positive")
    eval_iters: int = option(20, "batches per evaluation and split", check="positive")
    eval_tasks: str | None = option(None, "multiple-choice files in HellaSwag's format "
                                          "(comma-separated .jsonl) scored at each evaluation: acc "
                                          "and acc_norm, as eval.py scores them")
    save_interval: int = option(0, "also save a checkpoint every N steps (0 = only at the end)",
                                check="non-negative")
    # system
    compile: bool = option(False, "torch.compile the model (default: on a CUDA GPU, where it pays; "
                                  "off on a CPU, where it does not: docs/performance.md)")
    peak_tflops: float | None = option(None, "device peak TFLOP/s for MFU (known GPUs are "
                                             "looked up)", check="non-negative-number")
    # Megatron-LM's own (its --help group; toolkit/megatron.py turns them into the options above)
    load: str | None = option(None, "use this folder as --out-dir and resume from its checkpoint "
                                    "when it holds one (else start from scratch)", megatron=True)
    split: str = option("969,30,1", "train,val,test document split of a Megatron "
                                    "prefix", check="split", megatron=True)
    global_batch_size: int | None = option(None, "sequences per optimizer step over all processes; "
                                                 "sets --grad-accum to it / --batch-size",
                                           check="positive", megatron=True)
    train_samples: int | None = option(None, "train on this many sequences instead; sets "
                                             "--max-iters", check="positive", megatron=True)
    lr_warmup_samples: int | None = option(None, "warm up over this many sequences instead; sets "
                                                 "--warmup-iters",
                                           check="non-negative", megatron=True)
    lr_decay_samples: int | None = option(None, "decay over this many sequences instead; sets "
                                                "--lr-decay-iters", check="positive", megatron=True)
    codecarbon_dir: str | None = option(None, "record energy and CO2 with codecarbon's offline "
                                              "tracker (rank 0) in DIR/emissions.csv, one row per "
                                              "run (needs: pip install codecarbon)", megatron=True)
    codecarbon_country: str = option("USA", "ISO 3166 alpha-3 code of the country whose "
                                            "electricity mix converts the energy to CO2 (offline: "
                                            "nothing is looked up)", megatron=True)
    # the options set on purpose (a flag, a --config file, a resumed checkpoint): no default that
    # settle decides replaces one of them
    given: frozenset[str] = field(default=frozenset(), repr=False)


CONFIG_FIELDS = {f.name for f in option_fields(TrainConfig)}


def parse_config(argv: list[str] | None = None, description: str = "Train a GPT.",
                 extra_arguments=None, overrides: dict[str, dict | None] | None = None
                 ) -> tuple[TrainConfig, argparse.Namespace]:
    """Flags into a TrainConfig as given, its `given` the fields the user set; and all parsed args.
    Precedence: defaults < --config JSON < command-line flags; Megatron's --load DIR is --out-dir
    DIR. extra_arguments(parser) adds a script's own flags; overrides change or leave out some of
    TrainConfig's (flags.add_flags)."""
    parser = cli.argument_parser(description)
    parser.add_argument("--config", help="JSON file of option values; command-line flags win")
    flags.add_flags(parser, TrainConfig, megatron.ALIASES, overrides=overrides)
    if extra_arguments:
        extra_arguments(parser)
    args = parser.parse_args(argv)
    given = flags.given(TrainConfig, argv, megatron.ALIASES, overrides)
    values = flags.values(args, TrainConfig)
    if args.config:
        from_file = flags.read_config_file(args.config, TrainConfig)
        values.update({k: v for k, v in from_file.items() if k not in given})
        given |= set(from_file)
    cfg = TrainConfig(**values, given=frozenset(given))
    check_config(cfg)
    megatron.check_options(cfg)
    if cfg.load is not None:
        cfg = replace(cfg, out_dir=megatron.load_folder(cfg), given=cfg.given | {"out_dir"})
    return cfg, args


def check_config(cfg: TrainConfig) -> None:
    """Every value in range before any data is read or anything is written (CLIError)."""
    flags.check_values(cfg)
    if cfg.n_embd % cfg.n_head:
        raise CLIError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")
    if cfg.min_lr is not None and cfg.lr is not None and cfg.min_lr > cfg.lr:
        raise CLIError(f"--min-lr {cfg.min_lr:g} is above --lr {cfg.lr:g}: the decay would climb")
    if cfg.eval_tasks:
        paths = [path for path in cfg.eval_tasks.split(",") if path]
        refuse_same_names(paths, list(map(file_task_name, paths)), "--eval-tasks")


def family_defaults(cfg: TrainConfig) -> TrainConfig:
    """A llama model from scratch takes LLAMA_DEFAULTS wherever no flag was given (measured:
    docs/performance.md)."""
    if cfg.arch != "llama" or cfg.init_from != "scratch":
        return cfg
    return replace(cfg, **{name: value for name, value in LLAMA_DEFAULTS.items()
                           if name not in cfg.given})


def resuming(cfg: TrainConfig, checkpoint: str, device: torch.device) -> bool:
    """Rule 1: --init-from resume; --load of a folder holding a checkpoint; or a job torchrun
    restarted after a process died, with a checkpoint that every process sees."""
    if cfg.init_from == "resume":
        return True
    if cfg.load is not None:
        return cfg.init_from == "scratch" and os.path.exists(checkpoint)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    seen = distributed.all_reduce_sum([float(os.path.exists(checkpoint))], device)[0]
    if 0 < seen < distributed.world_size():
        raise CLIError(f"{checkpoint} is visible to only some processes; --out-dir must be on a "
                       "filesystem shared by all nodes to resume")
    return seen > 0


def merge_resumed_config(cfg: TrainConfig, saved: dict, source: str) -> TrainConfig:
    """The checkpoint's settings, but flags given now win; a different model shape is an error."""
    given = cfg.given
    # checkpoints from before the optimizer option were trained with AdamW
    known = {"optimizer": "adamw"}
    known.update((k, v) for k, v in saved["train_config"].items() if k in CONFIG_FIELDS)
    flags.check_types(known, TrainConfig, f"{source}'s train_config")
    values = {**asdict(TrainConfig()), **known, **{k: getattr(cfg, k) for k in given},
              "init_from": "resume", "out_dir": cfg.out_dir, "given": given}
    if values["optimizer"] not in ("auto", known["optimizer"]):
        raise CLIError(f"{source} was trained with --optimizer {known['optimizer']}; its optimizer "
                       f"state cannot continue under --optimizer {values['optimizer']}")
    values["optimizer"] = known["optimizer"]
    # checked before its values enter the options; older checkpoints lack fields: GPT-2's
    model_config = asdict(usable_config(saved["model_config"], source))
    for name in MODEL_SHAPE:
        if name in given and shape_value(values, name) != shape_value(model_config, name):
            raise CLIError(f"checkpoint {source} has {name}={model_config[name]} but "
                           f"{given_flag(name, values[name])} was given; drop the flag or use "
                           "another --out-dir")
        values[name] = model_config[name]
    if "preset" in given and values["preset"]:
        raise CLIError("--preset cannot be combined with --init-from resume; the checkpoint fixes "
                       "the shape")
    megatron.forget_replaced_counts(values, given)
    return TrainConfig(**values)


def shape_value(values: dict, name: str):
    """A shape field as the model reads it: no --n-kv-head is as many as --n-head."""
    if name == "n_kv_head":
        return values["n_kv_head"] or values["n_head"]
    return values[name]


def given_flag(name: str, value) -> str:
    """A shape field as the flag that sets it: --n-layer 2, --qk-norm, --no-bias."""
    if isinstance(value, bool):
        return flag(name) if value else "--no-" + flag(name)[2:]
    return f"{flag(name)} {value}"


def check_pretrained_shape(cfg: TrainConfig, model: GPTConfig) -> None:
    """Pretrained weights (--init-from a checkpoint, an HF folder or a GPT-2 name) fix the model's
    shape: a shape flag that says otherwise is an error; --block-size may shorten it."""
    values, loaded = asdict(cfg), asdict(model)
    for name in sorted(cfg.given & set(MODEL_SHAPE) - {"block_size"}, key=MODEL_SHAPE.index):
        if shape_value(values, name) != shape_value(loaded, name):
            raise CLIError(f"{cfg.init_from} has {name}={loaded[name]} but "
                           f"{given_flag(name, values[name])} was given; --init-from fixes the "
                           "model's shape (--block-size may shorten it): drop the flag")


def device_defaults(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Rule 2: on a CUDA GPU, CUDA_DEFAULTS wherever no flag was given (a --preset keeps its
    shape); the run header names those taken."""
    if device.type != "cuda":
        return cfg
    kept = cfg.given | (set(PRESET_SHAPE) if cfg.preset else set())
    taken = {name: value for name, value in CUDA_DEFAULTS.items() if name not in kept}
    if taken and distributed.rank() == 0:
        shown = ", ".join(flag(name) if value is True else f"{flag(name)} {value}"
                          for name, value in taken.items())
        print(f"defaults for a CUDA GPU, where no flag set them: {shown} (a model that uses the "
              f"GPU; the CPU's: 4 x 128, block 64, batch 32, 300 steps)", flush=True)
    return replace(cfg, **taken)


def shape_of(cfg: TrainConfig) -> GPTConfig:
    """The model the flags describe, with GPT-2's vocabulary: what a layout is checked against and
    the memory estimate counts."""
    gpt2 = cfg.arch == "gpt2"
    return GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, bias=cfg.bias and gpt2, arch=cfg.arch,
                     n_kv_head=cfg.n_kv_head, qk_norm=cfg.qk_norm, tie_embeddings=gpt2)


def torch_memory_estimate(cfg: TrainConfig, processes: int, fsdp: bool) -> str:
    """train_ddp.py --estimate-memory (train.py's on one process): the model the flags describe,
    DDP or FSDP2 over `processes`, --dtype (auto: bfloat16, as a GPU that computes it runs), as
    lines of text (toolkit/model_parallel.py's estimate_torch_memory)."""
    cfg = settle_optimizer(family_defaults(apply_preset(cfg)))
    dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    e = estimate_torch_memory(shape_of(cfg), processes, fsdp, dtype, cfg.optimizer == "muon",
                              cfg.batch_size, cfg.activation_checkpointing)
    gib, total = 2**30, e.weights + e.gradients + e.optimizer + e.activations
    return "\n".join([
        f"model: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, block "
        f"{cfg.block_size}, GPT-2 vocabulary: {e.params:,} parameters ({e.params / 1e9:.2f}B)",
        f"layout: {processes} processes, {'FSDP2' if fsdp else 'DDP'}, {dtype} autocast, "
        f"{cfg.optimizer}, micro-batch {cfg.batch_size}",
        f"per process: weights {e.weights / gib:.2f} GiB, gradients {e.gradients / gib:.2f}, "
        f"optimizer {e.optimizer / gib:.2f}, activations {e.activations / gib:.2f}"
        f"{' (recomputed)' if cfg.activation_checkpointing else ''} = {total / gib:.2f} GiB"])


def apply_preset(cfg: TrainConfig) -> TrainConfig:
    """--preset sets the shape of GPT-2 (or GPT-3) and, unless --arch is given, GPT-2's family; a
    shape flag given with it that says otherwise is an error."""
    if not cfg.preset:
        return cfg
    shape = {name: PRESETS[cfg.preset][name] for name in PRESET_SHAPE}
    if "arch" not in cfg.given:
        shape["arch"] = "gpt2"
    for name, value in shape.items():
        if name in cfg.given and getattr(cfg, name) != value:
            raise CLIError(f"--preset {cfg.preset} has {name.replace('_', '-')} {value} but "
                           f"{flag(name)} {getattr(cfg, name)} was given; drop one of them")
    return replace(cfg, **shape)


def settle_optimizer(cfg: TrainConfig) -> TrainConfig:
    """--optimizer auto: Muon from scratch (measured), AdamW for pretrained weights. Then AdamW's
    default --lr: 4e-3, measured at the quick start's width of 128; where AdamW trains the blocks'
    matrices from scratch it falls as 1/width, as GPT-3's rates do (a 124M body at 4e-3 stays near
    letter statistics: docs/performance.md). Muon scales its own updates, and what it leaves to
    AdamW keeps 4e-3 (as muP does)."""
    optimizer = cfg.optimizer
    if optimizer == "auto":
        optimizer = "muon" if cfg.init_from == "scratch" else "adamw"
    adamw_from_scratch = optimizer == "adamw" and cfg.init_from == "scratch"
    lr = cfg.lr
    if lr is None:
        lr = 4e-3 * 128 / cfg.n_embd if adamw_from_scratch else 4e-3
    return replace(cfg, optimizer=optimizer, lr=lr)


def schedule(cfg: TrainConfig) -> Schedule:
    """Warmup, then cosine decay to min_lr by lr_decay_iters: unset, they follow lr (lr/10) and
    max_iters, so a resumed run given another --lr or --max-iters decays to its own."""
    return Schedule(cfg.lr, cfg.warmup_iters, cfg.lr_decay_iters or cfg.max_iters,
                    cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr)
