"""Score a model on the field's standard evaluations: multiple-choice files in HellaSwag's format,
lm-evaluation-harness tasks by name or from a task YAML, and the loss of prepared data's val split.

    python eval.py --ckpt ckpt/ckpt.pt --tasks my_hellaswag.jsonl   # a local file: no extra package
    python eval.py --ckpt gpt2 --tasks hellaswag,lambada_openai --limit 500  # pip install lm_eval
    python eval.py --ckpt ckpt/ckpt.pt --tasks my_task.yaml --output results.json
    python eval.py --ckpt ckpt/ckpt.pt --data-dir data/pydoc_char  # val loss, ppl, bits per byte

--ckpt is anything the toolkit reads: a ckpt.pt, a DeepSpeed checkpoint folder or its zero_to_fp32
output, an HF GPT-2, Llama or Qwen3 folder, or a cached hub name (GPT-2 itself: --ckpt gpt2). The
text is tokenized with the model's own tokenizer. A .jsonl of {ctx, endings, label} lines (or
HellaSwag's own activity_label, ctx_a, ctx_b) is scored exactly as the harness's `hellaswag` task
scores its data, so both give the same acc and acc_norm (toolkit/evaluation.py); the harness's own
tasks go through its API (toolkit/harness.py); toolkit/model_scores.py runs them all. --data-dir
scores the val split of tokenizer.py's output in windows of the model's block size: its loss,
perplexity and bits per byte (docs/data.md), which compare models of different tokenizers. The last
line printed is one JSON object {task: {metric: value}}; --output writes the full results. Formats
and metrics: docs/eval.md.
"""
import json
import os
import sys

from toolkit import cli
from toolkit.chat import template_variables
from toolkit.cli import CLIError
from toolkit.files import check_new_outputs, write_json
from toolkit.evaluation import is_local_task
from toolkit.model_scores import score_model, task_data_files
from toolkit.lora import lora_base
from toolkit.quantize import add_quantize_argument


def parse_args(argv: list[str] | None):
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default="ckpt/ckpt.pt", help="the model (default: ckpt/ckpt.pt)")
    parser.add_argument("--tasks", default="",
                        help="comma-separated: local .jsonl or .json files (HellaSwag's "
                             "format), task .yaml files, or lm-evaluation-harness task names "
                             "(hellaswag, lambada_openai, arc_easy, piqa, ...)")
    parser.add_argument("--data-dir",
                        help="prepared data (tokenizer.py's output): score its val split's loss, "
                             "perplexity and bits per byte")
    parser.add_argument("--limit", type=int,
                        help="score only the first N items of each task (the first N windows of "
                             "--data-dir's val split)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per forward pass, in each process (default: 16)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: "
                                                         "auto)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="autocast dtype; auto = bfloat16 where the hardware computes it "
                             "natively, else float32 (default: auto)")
    add_quantize_argument(parser)
    parser.add_argument("--output", help="write the full results as JSON (for lm-eval tasks, the "
                        "harness's whole output)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    harness = parser.add_argument_group("lm-evaluation-harness's options",
                                        "for its tasks (names and task YAMLs)")
    harness.add_argument("--apply-chat-template", action="store_true",
                         help="lay out each prompt in the model's chat template (an "
                              "instruction-tuned model's, or an HF folder's own), few-shot "
                              "examples as turns")
    harness.add_argument("--system-instruction", help="a system turn before each prompt (its text)")
    harness.add_argument("--chat-template-kwargs", metavar="JSON",
                         help="further variables for an HF folder's own chat template (lm-eval's "
                              "hf model: chat_template_args), e.g. '{\"enable_thinking\": false}'")
    harness.add_argument("--think-end-token", metavar="TEXT",
                         help="where a reasoning model's thinking ends: generation tasks score the "
                              "reply after its last occurrence (lm-eval's hf model: "
                              "think_end_token), e.g. '</think>'; digits are a token id")
    harness.add_argument("--compile", action="store_true",
                         help="torch.compile the one-token decoding step of generation tasks, as "
                              "test.py's --compile (in bfloat16 or float16 the weights are cast to "
                              "it first)")
    args = parser.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks and not args.data_dir:
        raise CLIError("nothing to score: give --tasks, --data-dir or both")
    for name in ("limit", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for task in args.tasks:
        if task.endswith((".jsonl", ".json", ".yaml", ".yml")) and not os.path.isfile(task):
            raise CLIError(f"task file not found: {task}")
    harness_tasks = [task for task in args.tasks if not is_local_task(task)]
    if args.chat_template_kwargs is not None and not args.apply_chat_template:
        raise CLIError("--chat-template-kwargs sets variables of the chat template: add "
                       "--apply-chat-template")
    template_variables(args.chat_template_kwargs)
    if args.think_end_token == "":
        raise CLIError("--think-end-token is empty")
    for name in ("apply_chat_template", "system_instruction", "think_end_token", "compile"):
        if getattr(args, name) and not harness_tasks:
            raise CLIError(f"--{name.replace('_', '-')} is for lm-evaluation-harness's tasks: "
                           "give one of them (a name or a task YAML) in --tasks")
    if args.output:
        inputs = [args.ckpt, *lora_base(args.ckpt), args.data_dir, *args.tasks,
                  *task_data_files(args.tasks)]
        check_new_outputs([args.output], inputs, args.overwrite, "--output")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results, full = score_model(args)
    for task, metrics in results.items():
        print(f"{task}: " + ", ".join(f"{name} {value:.4f}" if isinstance(value, float)
                                      else f"{name} {value:,}"
                                      for name, value in metrics.items()), file=sys.stderr)
    if args.output:
        write_json(args.output, json.loads(json.dumps({"ckpt": args.ckpt, "results": results,
                                                       "tasks": full}, default=str)))
    print(json.dumps(results))


if __name__ == "__main__":
    cli.run(main)
