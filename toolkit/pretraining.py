"""Pretraining a GPT on token data, as train.py, train_ddp.py and train_ds.py do: the settling of
its options, the language-modelling objective, the model, the checks of data against model, and the
setup that hands the loop an engine and the objective.

    cfg, args = parse_config(argv)                       # toolkit/train_config.py
    trainer = setup(cfg, TorchEngine(os.path.join(cfg.out_dir, CHECKPOINT_FILE)))
    trainer.fit()

setup settles the options first (settle: every rule in order; the options, their tables and
helpers are toolkit/train_config.py's); the loop and the engine are toolkit/training.py's.
"""
import math
import os
from dataclasses import replace

import numpy as np
import torch

from model import GPT, GPTConfig
from toolkit import distributed, megatron
from toolkit.batches import get_batch, window_offsets
from toolkit.checkpoint import run_state, usable_config
from toolkit.cli import CLIError
from toolkit.config import replicas, settle_run
from toolkit.data import DEFAULT_CORPUS_DIR, is_prepared, load_corpus
from toolkit.device import (check_attn_kernel, check_memory, describe, flops_per_token,
                            full_logits_fit, num_params, resolve_device, run_device)
from toolkit.evaluation import ChoiceTask, loss_metrics, window_losses
from toolkit.files import check_output, claim_out_dir
from toolkit.lora import lora_base
from toolkit.model_sources import load_model
from toolkit.tokenizers import load_tokenizer, same_vocabulary
from toolkit.train_config import (CONFIG_FIELDS, TrainConfig, apply_preset, check_config,
                                  check_pretrained_shape, device_defaults, family_defaults,
                                  merge_resumed_config, resuming, schedule, settle_optimizer)
from toolkit.training import Engine, LoopConfig, Objective, Trainer

TRAIN_STREAM, EVAL_TRAIN_STREAM, EVAL_VAL_STREAM = 0, 1, 2  # independent random streams of windows


def evaluation_windows(n_tokens: int, block_size: int, count: int, seed: int,
                       stream: int) -> np.ndarray:
    """Offsets of the windows an evaluation scores: all non-overlapping ones when there are at most
    `count`, else `count` random ones (fixed by the seed, so successive evaluations are comparable).
    """
    whole = (n_tokens - 1) // block_size
    if whole <= count:
        return np.arange(whole, dtype=np.int64) * block_size
    return window_offsets(n_tokens, block_size, count, seed, 0, stream)


class LanguageModeling(Objective):
    """Pretraining's objective: next-token cross-entropy on random windows of the corpus. Each
    step's windows come from (seed, step) alone and the data-parallel ranks take slices of them, so
    N ranks train exactly like one process and the step is the data position; evaluation scores
    fixed windows of both splits."""

    def __init__(self, cfg, corpus, model: torch.nn.Module, device: torch.device, dp_rank: int,
                 dp_size: int, token_bytes: np.ndarray, tasks: list = ()):
        self.cfg, self.corpus, self.model, self.device = cfg, corpus, model, device
        self.token_bytes, self.tasks = torch.from_numpy(token_bytes).to(device), tasks
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_steps = cfg.grad_accum // dp_size
        self.global_batch = cfg.batch_size * cfg.grad_accum
        rows = cfg.batch_size * cfg.block_size
        self.chunked = not full_logits_fit(device, rows, model.config.vocab_size)

    def micro_batches(self, step: int) -> list[tuple[tuple[torch.Tensor, torch.Tensor], float]]:
        cfg, rows = self.cfg, self.micro_steps * self.cfg.batch_size
        offsets = window_offsets(len(self.corpus.train), cfg.block_size, self.global_batch,
                                 cfg.seed, step, TRAIN_STREAM)
        mine = offsets[self.dp_rank * rows:][:rows]
        return [(get_batch(self.corpus.train, o, cfg.block_size, self.device), 1 / cfg.grad_accum)
                for o in np.split(mine, self.micro_steps)]

    def loss(self, model: torch.nn.Module,
             batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return model(x, y, chunked_loss=self.chunked)[1]

    def throughput(self) -> tuple[int, str, float]:
        tokens = self.global_batch * self.cfg.block_size
        return tokens, "tokens", flops_per_token(self.model.config) * tokens

    @torch.no_grad()
    def evaluate(self, engine: Engine) -> dict[str, float]:
        """Mean loss per split over evaluation_windows, in batches shared out over the data-parallel
        ranks (evaluation.window_losses), and the val loss in bits per byte."""
        cfg = self.cfg
        self.model.eval()
        scored = {}  # split -> (summed loss, tokens, bytes)
        for split, stream in (("train", EVAL_TRAIN_STREAM), ("val", EVAL_VAL_STREAM)):
            tokens = getattr(self.corpus, split)
            most = cfg.eval_iters * cfg.batch_size
            offsets = evaluation_windows(len(tokens), cfg.block_size, most, cfg.seed, stream)
            scored[split] = window_losses(engine.eval_loss, tokens, offsets, cfg.block_size,
                                          cfg.batch_size, self.device, self.token_bytes,
                                          (self.dp_rank, self.dp_size))
        train_sum, train_count, _ = scored["train"]
        metrics = {"train_loss": train_sum / train_count,
                   **{f"val_{name}": value for name, value in loss_metrics(*scored["val"]).items()}}
        for task in self.tasks:
            scores = task.score(engine.logits_at, cfg.batch_size, self.device,
                                (self.dp_rank, self.dp_size))
            metrics.update({f"{task.name}_{name}": value for name, value in scores.items()})
        self.model.train()
        return metrics

    @torch.no_grad()
    def good_weights(self, engine: Engine) -> bool:
        """Finite weights giving a finite loss on one fixed val batch (eval mode: no RNG used)."""
        if not engine.weights_finite():
            return False
        cfg = self.cfg
        offsets = window_offsets(len(self.corpus.val), cfg.block_size, cfg.batch_size, cfg.seed, 0,
                                 EVAL_VAL_STREAM)
        self.model.eval()
        batch = get_batch(self.corpus.val, offsets, cfg.block_size, self.device)
        loss = engine.eval_loss(*batch).item()
        self.model.train()
        finite = distributed.all_reduce_sum([float(math.isfinite(loss))], self.device)[0]
        return finite == distributed.world_size()

    def checkpoint_state(self, best: dict | None) -> dict:
        return run_state(self.model, self.cfg, self.corpus.meta)


def settle(cfg: TrainConfig, engine: Engine
           ) -> tuple[TrainConfig, dict | None, tuple[GPT, dict] | None]:
    """The run's configuration, settled once from the flags (cfg.given: those the user set) and
    frozen; the saved state a resumed run continues from, and the pretrained weights of --init-from
    with their tokenizer facts (or None). The rules, in order (their tables and helpers are
    toolkit/train_config.py's):
      1. resume when asked (--init-from resume), when --load names a folder holding a checkpoint, or
         when torchrun restarted the job and a checkpoint is on disk: the checkpoint's options then
         stand wherever no flag was given, and its model shape is fixed;
      2. a new run on a CUDA GPU takes CUDA_DEFAULTS wherever no flag was given; then --preset
         sets the shape, and GPT-2's family unless --arch is given; a llama model from scratch
         takes LLAMA_DEFAULTS (no biases, QK-norm);
      3. --global-batch-size sets --grad-accum;
      4. the engine's own configuration (DeepSpeed's ds_config.json) is reconciled with the flags;
      5. --optimizer auto becomes Muon from scratch, AdamW from pretrained weights; AdamW's --lr;
      6. a run name; --grad-accum defaults to one micro-batch per data-parallel process;
      7. Megatron's sample counts become step counts;
      8. pretrained weights fix the model's shape, and the block is theirs where it is shorter.
    Every value is checked before anything is read or written."""
    resume, resumed = None, set()
    device = resolve_device(cfg.device, distributed.local_rank())
    if resuming(cfg, engine.path, device):
        resume = engine.read_resume()
        cfg = merge_resumed_config(cfg, resume, engine.path)
        resumed = set(resume.get("train_config", {})) & CONFIG_FIELDS - cfg.given - \
            {"init_from", "out_dir"}
    elif cfg.init_from != "scratch" and "preset" in cfg.given and cfg.preset:
        raise CLIError(f"--preset cannot be combined with --init-from {cfg.init_from}; its weights "
                       "fix the shape")
    else:
        cfg = family_defaults(apply_preset(device_defaults(cfg, device)))
    cfg = replace(cfg, given=cfg.given | resumed)
    if cfg.global_batch_size is not None:
        cfg = replace(cfg, grad_accum=megatron.grad_accum_for(cfg),
                      given=cfg.given | {"grad_accum"})
    cfg = settle_optimizer(engine.settle_config(cfg, resumed))
    data_parallel = engine.data_parallel()[1]
    if "grad_accum" in resumed and cfg.grad_accum and cfg.grad_accum % data_parallel:
        raise CLIError(f"{engine.path} was trained with --grad-accum {cfg.grad_accum} (the "
                       f"micro-batches of a step, all processes together), which "
                       f"{replicas(data_parallel)} cannot share: resume on a number of "
                       f"processes that divides it, or give --grad-accum N, a multiple of "
                       f"{data_parallel} (another global batch)")
    cfg = settle_run(cfg, data_parallel)
    cfg = replace(cfg, **megatron.steps_from_samples(cfg))
    check_config(cfg)
    pretrained = None
    if cfg.init_from not in ("scratch", "resume"):
        cfg, pretrained = settle_pretrained(cfg)
    return cfg, resume, pretrained


def settle_pretrained(cfg: TrainConfig) -> tuple[TrainConfig, tuple[GPT, dict]]:
    """Rule 8: the weights of --init-from (an HF folder, a GPT-2 name, a checkpoint) and their
    facts; a shape flag that says otherwise is an error, --block-size may shorten them, and the
    default --block-size, longer than their positions, settles to theirs."""
    model, facts = load_model(cfg.init_from, attn_kernel=cfg.attn_kernel, dropout=cfg.dropout)
    if cfg.block_size > model.config.block_size and "block_size" in cfg.given:
        raise CLIError(f"--block-size {cfg.block_size} is longer than the "
                       f"{model.config.block_size} positions of {cfg.init_from}; use --block-size "
                       f"{model.config.block_size} or less")
    check_pretrained_shape(cfg, model.config)
    return replace(cfg, block_size=min(cfg.block_size, model.config.block_size)), (model, facts)


def build_model(cfg: TrainConfig, vocab_size: int, resumed: GPTConfig | None,
                pretrained: GPT | None) -> GPT:
    """A new GPT of the settled shape, or of a resumed checkpoint's config (all of it: a run from an
    HF folder holds settings no flag gives, such as its rope scaling), or the pretrained one cut
    to the settled block."""
    if resumed is not None:
        return GPT(replace(resumed, attn_kernel=cfg.attn_kernel, dropout=cfg.dropout))
    if pretrained is not None:
        if cfg.block_size < pretrained.config.block_size:
            pretrained.crop_block_size(cfg.block_size)
        return pretrained
    config = GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size, n_layer=cfg.n_layer,
                       n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
                       attn_kernel=cfg.attn_kernel, arch=cfg.arch, n_kv_head=cfg.n_kv_head,
                       qk_norm=cfg.qk_norm, tie_embeddings=cfg.arch == "gpt2")
    check_memory(config)
    return GPT(config)


def vocabulary_of(facts: dict) -> str:
    return f"{facts.get('tokenizer')} vocabulary of {facts.get('vocab_size')} ids"


def same_tokens_hint(source: str, facts: dict) -> str:
    """How to prepare data in the tokens of pretrained weights."""
    kind = facts.get("tokenizer")
    folder_json = os.path.join(source, "tokenizer.json")
    if kind == "gpt2":
        return "prepare it with tokenizer.py --tokenizer gpt2"
    if kind == "bpe" and os.path.isfile(folder_json):
        return f"prepare it with tokenizer.py --tokenizer-file {folder_json}"
    if kind == "bpe":
        return ("prepare it with tokenizer.py --tokenizer-file T, T the tokenizer.json of the "
                f"data it was trained on (or of its export: test.py --ckpt {source} --export-hf "
                "DIR)")
    return ("a char vocabulary is the characters of the data it was built from: prepare the new "
            "text together with that data, or train from scratch")


def check_data(cfg: TrainConfig, corpus, model: GPT, resume: dict | None,
               pretrained: dict | None) -> None:
    """Each split holds a window; the data, model and a resumed checkpoint or pretrained weights
    (their tokenizer facts) share one tokenizer."""
    for split in ("train", "val"):  # fail now, not at the first evaluation
        tokens = len(getattr(corpus, split))
        if tokens < cfg.block_size + 1:
            more = (" or give val more data (tokenizer.py --val-fraction, or --split for a "
                    "Megatron prefix)")
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
    if pretrained is not None and not same_vocabulary(facts, pretrained):
        raise CLIError(f"the weights of {cfg.init_from} need data tokenized with their own "
                       f"{vocabulary_of(pretrained)}, but {cfg.data_dir} has "
                       f"{vocabulary_of(facts)}; {same_tokens_hint(cfg.init_from, pretrained)}")
    # pretrained open models may hold more embedding rows than their tokenizer has ids (Qwen3's)
    unused_rows = pretrained is not None and facts["vocab_size"] < model.config.vocab_size
    if facts["vocab_size"] != model.config.vocab_size and not unused_rows:
        raise CLIError(f"data vocabulary size {facts['vocab_size']} does not match the model's "
                       f"{model.config.vocab_size}")


def claim_outputs(cfg: TrainConfig, checkpoint: str, resuming: bool) -> None:
    """The run's folder is its own (claim_out_dir), and never holds the weights it starts from."""
    if cfg.init_from not in ("scratch", "resume"):
        check_output(checkpoint, [cfg.init_from, *lora_base(cfg.init_from)], "--out-dir")
    claim_out_dir(cfg.out_dir, checkpoint, resuming, cfg.overwrite)


def check_steps_left(step: int, max_iters: int, checkpoint: str) -> None:
    if step >= max_iters:
        raise CLIError(f"{checkpoint} is at iteration {step} and --max-iters {max_iters} is the "
                       "total, so nothing is left to train; continue with --max-iters N for some "
                       f"N > {step}")


def setup(cfg: TrainConfig, engine: Engine) -> Trainer:
    """The steps before training, in order: settle the configuration (and read the resumed state or
    the pretrained weights), load the data, build the model, check it against the data, start the
    engine. Nothing is written before every check has passed."""
    master = distributed.rank() == 0
    dp_rank, dp_size = engine.data_parallel()
    cfg, resume, pretrained = settle(cfg, engine)
    device, dtype = run_device(cfg.device, cfg.dtype, distributed.local_rank())
    if master:
        claim_outputs(cfg, engine.path, resume is not None)
    if cfg.data_dir == DEFAULT_CORPUS_DIR and master and not is_prepared(DEFAULT_CORPUS_DIR):
        # only the first run tokenizes; prepare's import costs pyarrow's 40 ms on every other
        from toolkit.prepare import ensure_default_corpus
        ensure_default_corpus(DEFAULT_CORPUS_DIR)
    distributed.barrier()
    corpus = load_corpus(cfg.data_dir, cfg.split)

    torch.manual_seed(cfg.seed)  # identical initial weights in every rank
    resumed = None
    if resume is not None:  # the shape its weights hold, checked before anything is built
        resumed = usable_config(resume["model_config"], engine.path, resume.get("model"))
    weights, facts = pretrained or (None, None)
    model = build_model(cfg, corpus.meta["vocab_size"], resumed, weights).to(device)
    check_attn_kernel(model, device, dtype)
    check_data(cfg, corpus, model, resume, facts)
    step = resume["iter_num"] if resume else 0
    check_steps_left(step, cfg.max_iters, engine.path)
    tokenizer = load_tokenizer(corpus.meta)
    tasks = [ChoiceTask(path, tokenizer, cfg.block_size)
             for path in (cfg.eval_tasks or "").split(",") if path]
    objective = LanguageModeling(cfg, corpus, model, device, dp_rank, dp_size,
                                 tokenizer.token_bytes(), tasks)
    engine.start(model, cfg, device, dtype, objective.loss, resume)
    if master:
        if resume is not None:
            # torchrun restarted the job
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            print(f"resumed from {engine.resumed_from} at iteration {step}"
                  + (f" after restart {restart}" if restart else ""))
        tokens = objective.global_batch * cfg.block_size
        print(f"model: {num_params(model.config) / 1e6:.2f}M parameters, {model.config}")
        print(f"global batch: {cfg.batch_size} micro x {objective.micro_steps} accumulation x "
              f"{replicas(dp_size)} = {objective.global_batch} sequences = {tokens:,} tokens per "
              f"step; device {describe(device)}, dtype {str(dtype).removeprefix('torch.')}, loss "
              f"{'chunked' if objective.chunked else 'from full logits'}", flush=True)
    best_val_loss = (resume or {}).get("best_val_loss")
    loop = LoopConfig(max_iters=cfg.max_iters, eval_interval=cfg.eval_interval,
                      save_interval=cfg.save_interval, peak_tflops=cfg.peak_tflops)
    return Trainer(engine, objective, schedule(cfg), loop, cfg, step=step,
                   history=(resume or {}).get("history"),
                   best=None if best_val_loss is None else {"val_loss": best_val_loss})
