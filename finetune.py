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
zero_to_fp32 output inside it), an HF GPT-2, Llama or Qwen3 folder or a cached name. The loss is the
task's plus --lm-weight times the language-model loss on the same inputs. After every epoch the
validation file is scored, and the best epoch's model is kept as OUT_DIR/ckpt.pt (train.py's format
plus the head and the task; test.py samples from it). --predict labels a file with a fine-tuned
checkpoint: the one given as --init-from, or after training the one just written. The last line
printed is one JSON object: the best epoch's validation metrics (or, for --predict alone, what was
written).
--batch-size is per process and --grad-accum counts micro-batches over all processes, as in
train.py, so N processes train like one with the same global batch. sft learns the assistant turns
of conversations through toolkit/chat.py's template (test.py --chat talks to the result);
--lora-rank R trains adapters alone (toolkit/lora.py), and the checkpoint then holds them with the
path and sha256 of their base: every script reads it, and --merge-lora writes it as a full
checkpoint.
"""
from toolkit import cli, distributed, flags
from toolkit.finetune_config import FinetuneConfig, check_config, resumed_config
from toolkit.finetuning import run


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


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_config(argv)
    run(cfg, args.resume, args.backend, args.timeout)


if __name__ == "__main__":
    (cli.run_distributed if distributed.launched_by_torchrun() else cli.run)(main)
