"""Pretraining a GPT on token data, as train.py, train_ddp.py and train_ds.py do: the options
(TrainConfig), resume, the model, and the setup that hands an engine and the language-modelling
objective to the loop.

    cfg, given, args = parse_config(argv)
    trainer = setup(cfg, given, TorchEngine(os.path.join(cfg.out_dir, CHECKPOINT_FILE)))
    trainer.fit()

The loop, the engine and the objective are toolkit/training.py's; Megatron-LM's options
toolkit/megatron.py's.
"""
import argparse
import os
from dataclasses import asdict, dataclass, fields

import torch

from model import ATTN_KERNELS, GPT, PRESETS, GPTConfig
from toolkit import cli, distributed, flags, megatron
from toolkit.checkpoint import usable_config
from toolkit.cli import CLIError
from toolkit.data import load_corpus
from toolkit.device import check_attn_kernel, check_memory, describe
from toolkit.evaluation import ChoiceTask
from toolkit.flags import flag, option
from toolkit.hf import load_gpt2
from toolkit.optim import Schedule
from toolkit.prepare import DEFAULT_CORPUS_DIR, ensure_default_corpus
from toolkit.run import RunConfig, claim_out_dir, prepare_run, replicas
from toolkit.tokenizers import load_tokenizer, same_vocabulary
from toolkit.training import Engine, LanguageModeling, LoopConfig, Trainer

MODEL_SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "bias")


@dataclass
class TrainConfig(RunConfig, megatron.MegatronOptions):
    # data
    data_dir: str = option(DEFAULT_CORPUS_DIR, "nanoGPT data dir (train.bin, val.bin, meta.json) or Megatron "
                                               "prefix")
    init_from: str = option("scratch", "scratch, resume (from OUT_DIR/ckpt.pt), or an HF GPT-2 dir "
                                       "or name")
    # model
    preset: str | None = option(None, "model size preset (sets n_layer, n_head, "
                                      "n_embd)", choices=sorted(PRESETS))
    n_layer: int = option(4, "transformer blocks", check="positive")
    n_head: int = option(4, "attention heads", check="positive")
    n_embd: int = option(128, "embedding width", check="positive")
    block_size: int = option(64, "context length in tokens", check="positive")
    dropout: float = option(0.0, "dropout probability (may change on resume)", check="probability")
    bias: bool = option(True, "biases in Linear and LayerNorm layers, as GPT-2")
    attn_kernel: str = option("auto", "attention: manual (written out; auto's pick for bfloat16 "
                                      "on CPU up to 512 keys) or an SDPA kernel (may change on "
                                      "resume)", choices=list(ATTN_KERNELS))
    # optimisation
    grad_accum: int | None = option(None, "micro-batches per optimizer step over ALL processes "
                                          "(default: one per process)", check="positive")
    max_iters: int = option(300, "optimizer steps in total (a resumed run continues up to this "
                                 "number)", check="non-negative")
    optimizer: str = option("auto", "muon: Muon for the blocks' matrices, AdamW for the rest; "
                                    "adamw; auto: muon from scratch, adamw from pretrained weights",
                            choices=["auto", "muon", "adamw"])
    lr: float | None = option(None, "peak learning rate of AdamW (Muon's is --muon-lr); default "
                                    "4e-3, or 4e-3 x 128 / n-embd where AdamW trains the blocks' "
                                    "matrices from scratch", check="positive-number")
    muon_lr: float = option(0.05, "Muon's peak learning rate (it follows --lr's schedule)",
                            check="non-negative-number")
    min_lr: float | None = option(None, "final learning rate of the cosine decay (default lr/10)",
                                  check="non-negative-number")
    warmup_iters: int = option(25, "linear warmup steps", check="non-negative")
    lr_decay_iters: int | None = option(None, "steps of cosine decay (default: all steps)",
                                        check="non-negative")
    # evaluation and checkpoints
    eval_interval: int = option(100, "evaluate every N steps", check="positive")
    eval_iters: int = option(20, "batches per evaluation and split", check="positive")
    eval_tasks: str | None = option(None, "multiple-choice files in HellaSwag's format "
                                          "(comma-separated .jsonl) scored at each evaluation: acc "
                                          "and acc_norm, as eval.py scores them")
    save_interval: int = option(0, "also save a checkpoint every N steps (0 = only at the end)",
                                check="non-negative")
    # system
    compile: bool = option(False, "torch.compile the model")
    peak_tflops: float | None = option(None, "device peak TFLOP/s for MFU (known GPUs are "
                                             "looked up)", check="non-negative-number")


CONFIG_FIELDS = {f.name for f in fields(TrainConfig)}


def parse_config(argv: list[str] | None = None, description: str = "Train a GPT.", extra_arguments=None,
                 overrides: dict[str, dict | None] | None = None) -> tuple[TrainConfig, set[str], argparse.Namespace]:
    """Flags into a TrainConfig: (config, the fields the user set, all parsed args). Precedence:
    defaults < --config JSON < command-line flags. extra_arguments(parser) adds a script's own
    flags; overrides change or leave out some of TrainConfig's (flags.add_flags)."""
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
    cfg = TrainConfig(**values)
    check_config(cfg)
    megatron.check_options(cfg, given)
    if cfg.load is not None:
        megatron.apply_load(cfg, given)
    return cfg, given, args


def check_config(cfg: TrainConfig) -> None:
    """Every value in range before any data is read or anything is written (CLIError)."""
    flags.check_values(cfg)
    if cfg.n_embd % cfg.n_head:
        raise CLIError(f"--n-embd {cfg.n_embd} must be a multiple of --n-head {cfg.n_head}")


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


def settle_optimizer(cfg: TrainConfig) -> None:
    """--optimizer auto: Muon from scratch (measured), AdamW for pretrained weights. Then AdamW's
    default --lr: 4e-3, measured at the quick start's width of 128; where AdamW trains the blocks'
    matrices from scratch it falls as 1/width, as GPT-3's rates do (a 124M body at 4e-3 stays near
    letter statistics: docs/performance.md). Muon scales its own updates, and what it leaves to
    AdamW keeps 4e-3 (as muP does)."""
    if cfg.optimizer == "auto":
        cfg.optimizer = "muon" if cfg.init_from == "scratch" else "adamw"
    adamw_from_scratch = cfg.optimizer == "adamw" and cfg.init_from == "scratch"
    if cfg.lr is None:
        cfg.lr = 4e-3 * 128 / cfg.n_embd if adamw_from_scratch else 4e-3


def schedule(cfg: TrainConfig) -> Schedule:
    """Warmup, then cosine decay to min_lr (default lr/10) by lr_decay_iters (default max_iters)."""
    return Schedule(cfg.lr, cfg.warmup_iters, cfg.lr_decay_iters or cfg.max_iters,
                    cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr)


def merge_resumed_config(cfg: TrainConfig, given: set[str], saved: dict, source: str) -> TrainConfig:
    """The checkpoint's settings, but flags given now win; a different model shape is an error."""
    known = {"optimizer": "adamw"}  # checkpoints from before the optimizer option were trained with AdamW
    known.update((k, v) for k, v in saved.get("train_config", {}).items() if k in CONFIG_FIELDS)
    merged = TrainConfig(**{**asdict(TrainConfig()), **known, **{k: getattr(cfg, k) for k in given},
                            "init_from": "resume", "out_dir": cfg.out_dir})
    if merged.optimizer not in ("auto", known["optimizer"]):
        raise CLIError(f"{source} was trained with --optimizer {known['optimizer']}; its optimizer "
                       f"state cannot continue under --optimizer {merged.optimizer}")
    merged.optimizer = known["optimizer"]
    model_config = saved["model_config"]
    for name in MODEL_SHAPE:
        if name in given and getattr(merged, name) != model_config[name]:
            raise CLIError(f"checkpoint {source} has {name}={model_config[name]} but {flag(name)} "
                           f"{getattr(merged, name)} was given; drop the flag or use another "
                           "--out-dir")
        setattr(merged, name, model_config[name])
    if "preset" in given and merged.preset:
        raise CLIError("--preset cannot be combined with --init-from resume; the checkpoint fixes "
                       "the shape")
    megatron.forget_replaced_counts(merged, given)
    return merged


def settle_config(cfg: TrainConfig, given: set[str], resume: dict | None, engine: Engine) -> TrainConfig:
    """The run's final settings: resumed ones, the engine's own, --global-batch-size's accumulation,
    the optimizer and its rate; checked before anything is read or written."""
    resumed = set()
    if resume is not None:
        cfg = merge_resumed_config(cfg, given, resume, engine.path)
        resumed = set(resume.get("train_config", {})) & CONFIG_FIELDS - given - {"init_from", "out_dir"}
    else:
        apply_preset(cfg, given)
    given = given | resumed
    if cfg.global_batch_size is not None:
        cfg.grad_accum = megatron.grad_accum_for(cfg, given)
        given = given | {"grad_accum"}
    cfg = engine.settle_config(cfg, given, resumed)
    settle_optimizer(cfg)
    check_config(cfg)
    return cfg


def build_model(cfg: TrainConfig, vocab_size: int) -> GPT:
    """A new GPT of the given shape, or GPT-2 from --init-from DIR/NAME (cut to --block-size)."""
    if cfg.init_from in ("scratch", "resume"):
        config = GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size, n_layer=cfg.n_layer,
                           n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
                           attn_kernel=cfg.attn_kernel)
        check_memory(config)
        return GPT(config)
    model = load_gpt2(cfg.init_from, attn_kernel=cfg.attn_kernel, dropout=cfg.dropout)
    if cfg.block_size > model.config.block_size:
        raise CLIError(f"--block-size {cfg.block_size} is longer than the {model.config.block_size} positions "
                       f"of {cfg.init_from}; use --block-size {model.config.block_size} or less")
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    return model


def check_data(cfg: TrainConfig, corpus, model: GPT, resume: dict | None) -> None:
    """Each split holds a window; the data, model and a resumed checkpoint share one tokenizer."""
    for split in ("train", "val"):  # fail now, not at the first evaluation
        tokens = len(getattr(corpus, split))
        if tokens < cfg.block_size + 1:
            more = " or give val more data (tokenizer.py --val-fraction, or --split for a Megatron prefix)"
            raise CLIError(f"the {split} split of {cfg.data_dir} has {tokens:,} tokens, fewer than "
                           f"one window of --block-size + 1 = {cfg.block_size + 1}; use a smaller "
                           "--block-size"
                           + (more if split == "val" else ""))
    facts = corpus.meta
    saved = (resume or {}).get("tokenizer")
    if saved is not None and not same_vocabulary(facts, saved):
        raise CLIError(f"data in {cfg.data_dir} uses tokenizer {facts.get('tokenizer')} (vocab "
                       f"{facts.get('vocab_size')}) but the checkpoint was trained with "
                       f"{saved.get('tokenizer')} (vocab {saved.get('vocab_size')})")
    if cfg.init_from not in ("scratch", "resume") and facts.get("tokenizer") != "gpt2":
        raise CLIError(f"GPT-2 weights need GPT-2 tokenized data, but {cfg.data_dir} uses "
                       f"{facts.get('tokenizer')}; prepare it with tokenizer.py --tokenizer gpt2")
    if facts["vocab_size"] != model.config.vocab_size:
        raise CLIError(f"data vocabulary size {facts['vocab_size']} does not match the model's "
                       f"{model.config.vocab_size}")


def setup(cfg: TrainConfig, given: set[str], engine: Engine) -> Trainer:
    """The steps before training, in order: read the resumed state (if any), settle the
    configuration, prepare the run, load the data, build the model, check it against the data, start
    the engine. Nothing is written before every check has passed."""
    master = distributed.rank() == 0
    dp_rank, dp_size = engine.data_parallel()
    if cfg.load is not None and cfg.init_from == "scratch" and os.path.exists(engine.path):
        cfg.init_from = "resume"  # Megatron's --load: resume when the folder holds a checkpoint
    resume = engine.read_resume() if cfg.init_from == "resume" else None
    cfg = settle_config(cfg, given, resume, engine)
    device, dtype = prepare_run(cfg, dp_size)
    megatron.steps_from_samples(cfg)
    if master:
        claim_out_dir(cfg.out_dir, engine.path, resume is not None, cfg.overwrite)
    if cfg.data_dir == DEFAULT_CORPUS_DIR and master:
        ensure_default_corpus(DEFAULT_CORPUS_DIR)
    distributed.barrier()
    corpus = load_corpus(cfg.data_dir, cfg.split)

    torch.manual_seed(cfg.seed)  # identical initial weights in every rank
    vocab_size = corpus.meta["vocab_size"]
    if resume is not None:  # the shape its weights hold, checked before anything is built
        vocab_size = usable_config(resume["model_config"], engine.path, resume.get("model")).vocab_size
    model = build_model(cfg, vocab_size).to(device)
    check_attn_kernel(model, device, dtype)
    check_data(cfg, corpus, model, resume)
    step = resume["iter_num"] if resume else 0
    if step >= cfg.max_iters:
        raise CLIError(f"{engine.path} is at iteration {step} and --max-iters {cfg.max_iters} is "
                       "the total, so nothing is left to train; continue with --max-iters N for "
                       f"some N > {step}")
    tokenizer = load_tokenizer(corpus.meta)
    tasks = [ChoiceTask(path, tokenizer) for path in (cfg.eval_tasks or "").split(",") if path]
    objective = LanguageModeling(cfg, corpus, model, device, dp_rank, dp_size, tokenizer.token_bytes(), tasks)
    engine.start(model, cfg, device, dtype, objective.loss, resume)
    if master:
        if resume is not None:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun restarted the job
            print(f"resumed from {engine.path} at iteration {step}"
                  + (f" after restart {restart}" if restart else ""))
        tokens = objective.global_batch * cfg.block_size
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.config}")
        print(f"global batch: {cfg.batch_size} micro x {objective.micro_steps} accumulation x "
              f"{replicas(dp_size)} = {objective.global_batch} sequences = {tokens:,} tokens per "
              f"step; device {describe(device)}, dtype {str(dtype).removeprefix('torch.')}, loss "
              f"{'chunked' if objective.chunked else 'from full logits'}", flush=True)
    best_val_loss = (resume or {}).get("best_val_loss")
    loop = LoopConfig(max_iters=cfg.max_iters, eval_interval=cfg.eval_interval, save_interval=cfg.save_interval,
                      peak_tflops=cfg.peak_tflops)
    return Trainer(engine, objective, schedule(cfg), loop, cfg, step=step, history=(resume or {}).get("history"),
                   best=None if best_val_loss is None else {"val_loss": best_val_loss})
