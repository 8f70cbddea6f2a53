"""Fine-tuning's options (FinetuneConfig), as finetune.py parses them: GPT-1's recipe as defaults
(its epochs, AdamW, a rate that follows the width), the task and its files, LoRA's settings; their
checks, the options of an interrupted run resumed, and the outputs a run may write.

    cfg = FinetuneConfig(task="classify", train="t.jsonl", val="v.jsonl", init_from="ckpt/ckpt.pt")
    check_config(cfg)
"""
import os
from dataclasses import dataclass

from toolkit import flags, lora
from toolkit.checkpoint import CHECKPOINT_FILE, load_resume
from toolkit.cli import CLIError
from toolkit.config import RunConfig
from toolkit.files import check_output
from toolkit.flags import option
from toolkit.tasks import TASKS

EPOCHS, MIN_STEPS = 3, 200  # GPT-1's epochs; a set too small for them gets more (docs/finetune.md)
LR_WIDTH = 0.128  # lr = LR_WIDTH / n_embd: a larger model takes smaller steps (docs/finetune.md)
LORA_LR = 10  # adapters start at zero and move a rank-r slice: larger steps (docs/finetune.md)
ALL_TASKS = (*TASKS, "sft")
ADAPTER_SHAPE = ("lora_rank", "lora_alpha", "lora_targets")  # fixed once a run has trained
LATEST_FILE = "last.pt"  # OUT_DIR/last.pt: the latest state of a run, for --init-from resume


@dataclass(frozen=True)
class FinetuneConfig(RunConfig):
    # the shared options whose default differs: GPT-1's AdamW, a rate that follows the width
    out_dir: str = option("ckpt/finetune", "where the checkpoint, the loss curve and the "
                                           "TensorBoard logs go")
    overwrite: bool = option(False, "replace an existing OUT_DIR/ckpt.pt or --out")
    lr: float | None = option(None, f"peak learning rate (default: {LR_WIDTH:g} / the model's "
                                    f"width: 1e-3 at the quick start's 128, 1.7e-4 at GPT-2's 768; "
                                    f"{LORA_LR}x that with LoRA)", check="positive-number")
    weight_decay: float = option(0.01, "AdamW weight decay (2-D weights only)",
                                 check="non-negative-number")
    beta2: float = option(0.999, "AdamW beta2", check="probability")
    # task and files
    task: str | None = option(None, f"{', '.join(TASKS)}, or sft for instruction tuning on "
                                    f"conversations (--predict alone: the checkpoint's own)")
    train: str | None = option(None, "training examples or conversations, JSON lines (schemas: "
                                     "docs/finetune.md)")
    val: str | None = option(None, "validation examples or conversations, JSON lines, scored after "
                                   "every epoch (default: --val-fraction of --train held out)")
    val_fraction: float = option(0.1, "the share of --train held out for validation when no --val "
                                      "is given", check="probability")
    labels: str = option("class", "class: labels are classes; float: similarity scores, learnt by "
                                  "regression", choices=["class", "float"])
    init_from: str = option("ckpt/ckpt.pt", "pretrained model: a ckpt.pt, a DeepSpeed folder or "
                                            "its zero_to_fp32 output, an HF GPT-2, Llama or Qwen3 "
                                            "folder; resume: continue the interrupted fine-tuning "
                                            "in OUT_DIR; with --predict alone, a fine-tuned "
                                            "ckpt.pt")
    predict: str | None = option(None, "examples to label with the fine-tuned model (JSON lines, "
                                       "labels not needed)")
    out: str | None = option(None, "where --predict writes one JSON line per example")
    merge_lora: str | None = option(None, "a LoRA checkpoint to merge into its base: writes "
                                          "OUT_DIR/ckpt.pt, a full checkpoint every script reads")
    # LoRA: low-rank adapters, the base frozen (toolkit/lora.py)
    lora_rank: int = option(0, "train LoRA adapters of this rank instead of every weight (0 = "
                               "every weight)", check="non-negative")
    lora_alpha: float = option(16.0, "LoRA's alpha: the update is scaled by alpha / rank",
                               check="positive-number")
    lora_dropout: float = option(0.05, "dropout on the adapters' input", check="probability")
    lora_targets: str = option("all", "the linears that get adapters: attn (c_attn, c_proj), mlp "
                                      "(c_fc, c_proj) or all", choices=list(lora.TARGETS))
    # optimisation: GPT-1's recipe, with enough steps for small sets
    epochs: int | None = option(None, f"passes over the training examples (default: {EPOCHS}, or "
                                      f"more when that is fewer than {MIN_STEPS} steps)",
                                check="positive")
    grad_accum: int | None = option(None, "micro-batches per optimizer step over ALL processes "
                                          "(default: one per process)", check="positive")
    warmup: float = option(0.1, "share of the steps with linear warmup, followed by linear decay "
                                "to 0", check="share")
    lm_weight: float = option(0.5, "weight of the language-model loss on the same inputs (0 = off)",
                              check="non-negative-number")
    dropout: float = option(0.0, "dropout probability (may change on resume)", check="probability")
    head_dropout: float = option(0.1, "dropout before the head", check="probability")
    block_size: int | None = option(None, "longest sequence in tokens (default: the model's); "
                                          "longer ones lose tokens from the left of the context")


def resumed_config(cfg: FinetuneConfig, given: set[str]) -> tuple[FinetuneConfig, dict]:
    """--init-from resume: the interrupted run's options (those given now win), its latest state."""
    path = os.path.join(cfg.out_dir, LATEST_FILE)
    if not os.path.isfile(path):
        raise CLIError(f"nothing to resume in {cfg.out_dir}: {path} exists only while a "
                       f"fine-tuning runs or after one was interrupted")
    checkpoint = load_resume(path, "finetune")
    saved = {k: v for k, v in checkpoint["train_config"].items()
             if k in FinetuneConfig.__dataclass_fields__}
    flags.check_types(saved, FinetuneConfig, f"{path}'s train_config")
    now = {k: getattr(cfg, k) for k in given | {"out_dir", "overwrite"} if k != "init_from"}
    resumed = FinetuneConfig(**{**saved, **now})
    before = FinetuneConfig(**saved)
    for name in ADAPTER_SHAPE:  # the trained weights are of these settings
        was, now = getattr(before, name), getattr(resumed, name)
        if now != was:
            raise CLIError(f"{path} was fine-tuned with {flags.flag(name)} {was}, not {now}; "
                           "resume with the same LoRA settings, or start a new run in another "
                           "--out-dir")
    return resumed, checkpoint


def check_config(cfg: FinetuneConfig) -> None:
    """Every value in range and the flags consistent, before anything is read or written."""
    flags.check_values(cfg)
    training, predicting = cfg.train is not None, cfg.predict is not None
    merging = cfg.merge_lora is not None
    if cfg.task not in (None, *ALL_TASKS):
        raise CLIError(f"unknown task {cfg.task!r}; choose from {', '.join(ALL_TASKS)}")
    if merging and (training or predicting):
        raise CLIError("--merge-lora goes alone (with --out-dir): merge first, then fine-tune or "
                       "predict")
    if cfg.val is not None and not training:
        raise CLIError("--val is scored while fine-tuning on --train; give --train too")
    if not (training or predicting or merging):
        raise CLIError("nothing to do: give --task and --train to fine-tune, --predict and --out, "
                       "or --merge-lora")
    if training and cfg.val is None and cfg.val_fraction == 0:
        raise CLIError("--val-fraction 0 holds nothing out of --train to validate on: give --val")
    if (cfg.predict is None) != (cfg.out is None):
        raise CLIError("--predict and --out go together")
    if training and cfg.task is None:
        raise CLIError(f"--task is required to fine-tune; choose from {', '.join(ALL_TASKS)}")
    if cfg.task == "sft" and predicting:
        raise CLIError("--predict labels examples of a GPT-1 task; an sft model answers with "
                       "test.py --chat or --prompt")
    if cfg.labels == "float" and cfg.task not in (None, "similarity"):
        raise CLIError("--labels float is for --task similarity (regression on a score)")
    if cfg.block_size is not None and cfg.block_size < 4:
        raise CLIError(f"--block-size must be at least 4 (three special tokens and one more), got "
                       f"{cfg.block_size}")


def check_outputs(cfg: FinetuneConfig, resuming: bool) -> None:
    """Outputs that replace no input, and no earlier result unless --overwrite."""
    inputs = [cfg.init_from, *lora.lora_base(cfg.init_from or ""), cfg.train, cfg.val, cfg.predict,
              cfg.merge_lora]
    outputs = []
    if cfg.train or cfg.merge_lora:
        outputs.append(("--out-dir", os.path.join(cfg.out_dir, CHECKPOINT_FILE)))
    if cfg.out:
        outputs.append(("--out", cfg.out))
    for flag, path in outputs:
        check_output(path, inputs, flag)
        continued = flag == "--out-dir" and resuming  # a resumed run replaces its own checkpoint
        if os.path.exists(path) and not (cfg.overwrite or continued):
            raise CLIError(f"{path} exists; choose another {flag} or pass --overwrite to "
                           f"replace it")
        inputs.append(path)
    latest = os.path.join(cfg.out_dir, LATEST_FILE)
    if cfg.train and os.path.exists(latest) and not (resuming or cfg.overwrite):
        raise CLIError(f"{latest} holds an interrupted fine-tuning; continue it with --init-from "
                       "resume, or pass --overwrite to start anew in its place")
