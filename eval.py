"""Score a model on the field's standard evaluations: multiple-choice files in HellaSwag's format,
and lm-evaluation-harness tasks by name or from a task YAML.

    python eval.py --ckpt ckpt/ckpt.pt --tasks my_hellaswag.jsonl            # a local file: no extra package
    python eval.py --ckpt gpt2 --tasks hellaswag,lambada_openai --limit 500   # the harness (pip install lm_eval)
    python eval.py --ckpt ckpt/ckpt.pt --tasks my_task.yaml --output results.json

--ckpt is anything the toolkit reads: a ckpt.pt, a DeepSpeed checkpoint folder or its zero_to_fp32
output, an HF GPT-2 folder or a cached hub name (GPT-2 itself: --ckpt gpt2). The text is tokenized
with the model's own tokenizer. A .jsonl of {ctx, endings, label} lines (or HellaSwag's own
activity_label, ctx_a, ctx_b) is scored exactly as the harness's `hellaswag` task scores its data,
so both give the same acc and acc_norm (toolkit/evaluation.py); the harness's own tasks go through
its API (toolkit/harness.py). The last line printed is one JSON object {task: {metric: value}};
--output writes the full results. Formats and metrics: docs/eval.md.
"""
import json
import os
import sys

from toolkit import cli
from toolkit.cli import CLIError
from toolkit.device import resolve_device, resolve_dtype
from toolkit.evaluation import ChoiceTask, gpt_logits_at
from toolkit.files import check_output, refuse_existing, write_json
from toolkit.load import load_model
from toolkit.tokenizers import load_tokenizer


def parse_args(argv: list[str] | None):
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default="ckpt/ckpt.pt", help="the model (default: ckpt/ckpt.pt)")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated: local .jsonl files (HellaSwag's format), task .yaml "
                             "files, or lm-evaluation-harness task names (hellaswag, "
                             "lambada_openai, arc_easy, piqa, ...)")
    parser.add_argument("--limit", type=int, help="score only the first N items of each task")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="sequences per forward pass, in each process (default: 16)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: "
                                                         "auto)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="autocast dtype; auto = bfloat16 where the hardware computes it "
                             "natively, else float32 (default: auto)")
    parser.add_argument("--output", help="write the full results as JSON (with each item's scores)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = parser.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        raise CLIError("--tasks names no task")
    for name in ("limit", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, got "
                           f"{getattr(args, name)}")
    for task in args.tasks:
        if task.endswith((".jsonl", ".yaml", ".yml")) and not os.path.isfile(task):
            raise CLIError(f"task file not found: {task}")
    if args.output:
        check_output(args.output, [args.ckpt, *args.tasks], "--output")
        refuse_existing([args.output], args.overwrite)
    return args


def harness_results(specs: list[str], model, tok, args, device, dtype) -> dict:
    """The harness's results for its tasks: {task: {metric: value}} (its filters' ",none" and the
    stderrs left out), and its full output."""
    try:
        from toolkit import harness
    except ImportError:
        raise CLIError(f"--tasks {','.join(specs)} needs lm-evaluation-harness: pip install lm_eval (a local .jsonl "
                       f"in HellaSwag's format needs nothing)") from None
    out = harness.run(specs, harness.GPTHarness(model, tok, args.batch_size, device, dtype), args.limit)
    metrics = {task: {key.split(",")[0]: value for key, value in values.items()
                      if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
               for task, values in out["results"].items()}
    return metrics, out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, facts = load_model(args.ckpt)
    model.to(device).eval()
    tok = load_tokenizer(facts)
    results, full = {}, {}
    local = [task for task in args.tasks if task.endswith(".jsonl")]
    for path in local:
        task = ChoiceTask(path, tok, args.limit)
        if task.name in results:
            raise CLIError(f"two --tasks files are named {task.name}; rename one")
        results[task.name] = task.score(gpt_logits_at(model, device, dtype), model.config.block_size,
                                        args.batch_size, device)
        full[task.name] = {"path": os.path.abspath(path), "items": len(task.items), **results[task.name]}
    others = [task for task in args.tasks if task not in local]
    if others:
        metrics, out = harness_results(others, model, tok, args, device, dtype)
        results.update(metrics)
        full["harness"] = out
    for task, metrics in results.items():
        print(f"{task}: " + ", ".join(f"{name} {value:.4f}" for name, value in metrics.items()), file=sys.stderr)
    if args.output:
        write_json(args.output, json.loads(json.dumps({"ckpt": args.ckpt, "results": results, "tasks": full},
                                                      default=str)))
    print(json.dumps(results))


if __name__ == "__main__":
    cli.run(main)
