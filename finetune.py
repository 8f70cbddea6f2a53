"""Fine-tune a pretrained GPT for classification, entailment, similarity or multiple choice, as
GPT-1 did, or for instruction following (sft); every weight, or LoRA adapters with the base frozen.

    python finetune.py --task classify --train train.jsonl --val val.jsonl --out-dir ckpt/cls
    python finetune.py --init-from ckpt/cls/ckpt.pt --predict new.jsonl --out predictions.jsonl
    python finetune.py --task sft --train c.jsonl --val v.jsonl --lora-rank 8 --out-dir ckpt/sft
    python finetune.py --merge-lora ckpt/sft/ckpt.pt --out-dir ckpt/sft-merged
    torchrun --standalone --nproc_per_node 2 finetune.py [the same flags]

Examples are JSON lines (schemas: docs/finetune.md); toolkit/tasks.py lays each task out in tokens
and holds the head, toolkit/finetuning.py trains it through the loop of toolkit/training.py.
--init-from is anything the toolkit reads: a ckpt.pt, a DeepSpeed checkpoint folder (or the
zero_to_fp32 output inside it), an HF GPT-2 folder or cached name. The loss is the task's plus
--lm-weight times the language-model loss on the same inputs. After every epoch the validation
file is scored, and the best epoch's model is kept as OUT_DIR/ckpt.pt (train.py's format plus the
head and the task; test.py samples from it). --predict labels a file with a fine-tuned checkpoint:
the one given as --init-from, or after training the one just written. The last line printed is one
JSON object: the best epoch's validation metrics (or, for --predict alone, what was written).
--batch-size is per process and --grad-accum counts micro-batches over all processes, as in
train.py, so N processes train like one with the same global batch. sft learns the assistant turns
of conversations through toolkit/chat.py's template (test.py --chat talks to the result);
--lora-rank R trains adapters alone (toolkit/lora.py), and the checkpoint then holds them with the
path and sha256 of their base: every script reads it, and --merge-lora writes it as a full
checkpoint.
"""
import json
import os
import sys

from toolkit import cli, distributed, flags, lora
from toolkit.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from toolkit.cli import CLIError
from toolkit.device import resolve_device, resolve_dtype
from toolkit.files import check_output
from toolkit.finetuning import FinetuneConfig, check_config, learning_warning, resumed_config, setup, write_predictions
from toolkit.model_sources import load_model


def parse_config(argv: list[str] | None = None) -> tuple[FinetuneConfig, object]:
    parser = cli.argument_parser(__doc__)
    flags.add_flags(parser, FinetuneConfig)
    distributed.add_distributed_flags(parser)  # --backend and --timeout, used under torchrun
    args = parser.parse_args(argv)
    cfg = FinetuneConfig(**flags.values(args, FinetuneConfig))
    args.resume = None
    if cfg.init_from == "resume":
        cfg, args.resume = resumed_config(cfg, flags.given(FinetuneConfig, argv))
    check_config(cfg)
    return cfg, args


def check_outputs(cfg: FinetuneConfig, resuming: bool) -> None:
    """Outputs that replace no input, and no earlier result unless --overwrite."""
    inputs = [cfg.init_from, cfg.train, cfg.val, cfg.predict, cfg.merge_lora]
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


def write_merged(cfg: FinetuneConfig) -> dict:
    """--merge-lora: the LoRA checkpoint's base with its adapters added in, as OUT_DIR/ckpt.pt."""
    checkpoint = load_checkpoint(cfg.merge_lora)
    if "adapters" not in checkpoint:
        raise CLIError(f"{cfg.merge_lora} holds no LoRA adapters; it is already a full checkpoint")
    merged, _ = load_model(cfg.merge_lora)
    path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
    os.makedirs(cfg.out_dir, exist_ok=True)
    save_checkpoint(lora.merged_checkpoint(checkpoint, merged, cfg.merge_lora), path)
    return {"merged": cfg.merge_lora, "out": path}


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_config(argv)
    check_outputs(cfg, args.resume is not None)
    if distributed.launched_by_torchrun():
        distributed.init_torchrun(cfg.device, args.backend, args.timeout)
    master = distributed.rank() == 0
    if cfg.merge_lora:
        if master:
            print(json.dumps(write_merged(cfg)))
        return
    if cfg.train is None:
        if master:
            device = resolve_device(cfg.device)
            dtype = resolve_dtype(cfg.dtype, device)
            print(json.dumps(write_predictions(cfg, cfg.init_from, device, dtype)))
        return
    trainer = setup(cfg, args.resume)
    trainer.fit()
    if not master:
        return
    if cfg.predict and not trainer.stopped:
        print(json.dumps(write_predictions(cfg, trainer.engine.path, trainer.device,
                                           trainer.engine.dtype)))
    warning = learning_warning(trainer)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    epochs = trainer.step // trainer.objective.steps_per_epoch
    print(json.dumps({**(trainer.best or {}), "epochs": epochs, "steps": trainer.step}), flush=True)


if __name__ == "__main__":
    (cli.run_distributed if distributed.launched_by_torchrun() else cli.run)(main)
