"""Score a model on the field's standard evaluations: multiple-choice files in HellaSwag's format,
lm-evaluation-harness tasks by name or from a task YAML, and the loss of prepared data's val split.

    python eval.py --ckpt ckpt/ckpt.pt --tasks my_hellaswag.jsonl            # a local file: no extra package
    python eval.py --ckpt gpt2 --tasks hellaswag,lambada_openai --limit 500   # the harness (pip install lm_eval)
    python eval.py --ckpt ckpt/ckpt.pt --tasks my_task.yaml --output results.json
    python eval.py --ckpt ckpt/ckpt.pt --data-dir data/pydoc_char             # val loss, ppl, bits per byte

--ckpt is anything the toolkit reads: a ckpt.pt, a DeepSpeed checkpoint folder or its zero_to_fp32
output, an HF GPT-2 folder or a cached hub name (GPT-2 itself: --ckpt gpt2). The text is tokenized
with the model's own tokenizer. A .jsonl of {ctx, endings, label} lines (or HellaSwag's own
activity_label, ctx_a, ctx_b) is scored exactly as the harness's `hellaswag` task scores its data,
so both give the same acc and acc_norm (toolkit/evaluation.py); the harness's own tasks go through
its API (toolkit/harness.py). --data-dir scores the val split of tokenizer.py's output in windows of
the model's block size: its loss, perplexity and bits per byte (docs/data.md), which compare models
of different tokenizers. The last line printed is one JSON object {task: {metric: value}}; --output
writes the full results. Formats and metrics: docs/eval.md.
"""
import json
import math
import os
import socket
import sys
from urllib.parse import urlparse

import numpy as np
import torch

from model import GPT
from toolkit import cli
from toolkit.cli import CLIError
from toolkit.data import load_corpus
from toolkit.device import autocast, full_logits_fit, resolve_device, resolve_dtype
from toolkit.evaluation import ChoiceTask, gpt_logits_at, window_losses
from toolkit.files import check_output, refuse_existing, write_json
from toolkit.model_sources import load_model
from toolkit.tokenizers import Tokenizer, load_tokenizer, same_vocabulary


def parse_args(argv: list[str] | None):
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default="ckpt/ckpt.pt", help="the model (default: ckpt/ckpt.pt)")
    parser.add_argument("--tasks", default="",
                        help="comma-separated: local .jsonl files (HellaSwag's format), task .yaml "
                             "files, or lm-evaluation-harness task names (hellaswag, "
                             "lambada_openai, arc_easy, piqa, ...)")
    parser.add_argument("--data-dir", help="prepared data (tokenizer.py's output): score its val split's "
                                           "loss, perplexity and bits per byte")
    parser.add_argument("--limit", type=int, help="score only the first N items of each task (the first N "
                                                  "windows of --data-dir's val split)")
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
    if not args.tasks and not args.data_dir:
        raise CLIError("nothing to score: give --tasks, --data-dir or both")
    for name in ("limit", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for task in args.tasks:
        if task.endswith((".jsonl", ".yaml", ".yml")) and not os.path.isfile(task):
            raise CLIError(f"task file not found: {task}")
    if args.output:
        check_output(args.output, [args.ckpt, args.data_dir, *args.tasks], "--output")
        refuse_existing([args.output], args.overwrite)
    return args


def hub_out_of_reach() -> bool:
    """No proxy and no address for the Hugging Face Hub (HF_ENDPOINT's host, e.g. a mirror): the
    harness's libraries cannot reach it, and would print a warning a try for 25 s before failing."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    try:
        socket.getaddrinfo(urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname, 443)
    except OSError:
        return True
    return False


def harness_results(specs: list[str], model, tok, args, device, dtype) -> tuple[dict, dict]:
    """The harness's results for its tasks: {task: {metric: value}} (its filters' ",none" and the
    stderrs left out), and its full output."""
    if hub_out_of_reach():  # the libraries read their caches at once: cached task data still loads
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
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


def val_scores(model: GPT, tokenizer: Tokenizer, facts: dict, args, device: torch.device,
               dtype: torch.dtype) -> dict[str, float]:
    """--data-dir's val split in non-overlapping windows of the model's block size: the loss in nats
    per token, its perplexity, and bits per UTF-8 byte of the text."""
    corpus = load_corpus(args.data_dir)
    if not same_vocabulary(corpus.meta, facts):
        raise CLIError(f"{args.data_dir} uses tokenizer {corpus.meta.get('tokenizer')} (vocab "
                       f"{corpus.meta.get('vocab_size')}) but {args.ckpt} was trained with {facts.get('tokenizer')} "
                       f"(vocab {facts.get('vocab_size')}); score data prepared with the model's own tokenizer")
    block = model.config.block_size
    if len(corpus.val) < block + 1:
        raise CLIError(f"the val split of {args.data_dir} holds {len(corpus.val):,} tokens, fewer than one "
                       f"window of the model's block size + 1 = {block + 1}")
    offsets = np.arange((len(corpus.val) - 1) // block, dtype=np.int64)[:args.limit] * block

    chunked = not full_logits_fit(device, args.batch_size * block, model.config.vocab_size)

    def eval_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(device, dtype):
            return model(x, y, chunked_loss=chunked)[1]

    token_bytes = torch.from_numpy(tokenizer.token_bytes()).to(device)
    loss_sum, count, nbytes = window_losses(eval_loss, corpus.val, offsets, block, args.batch_size, device,
                                            token_bytes)
    return {"loss": loss_sum / count, "ppl": math.exp(min(loss_sum / count, 50)),
            "bpb": loss_sum / math.log(2) / max(nbytes, 1), "tokens": int(count), "bytes": int(nbytes)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, facts = load_model(args.ckpt)
    model.to(device).eval()
    tok = load_tokenizer(facts)
    results, full = {}, {}
    if args.data_dir:
        results["val"] = val_scores(model, tok, facts, args, device, dtype)
        full["val"] = {"data_dir": os.path.abspath(args.data_dir), **results["val"]}
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
        print(f"{task}: " + ", ".join(f"{name} {value:.4f}" if isinstance(value, float) else f"{name} {value:,}"
                                      for name, value in metrics.items()), file=sys.stderr)
    if args.output:
        write_json(args.output, json.loads(json.dumps({"ckpt": args.ckpt, "results": results, "tasks": full},
                                                      default=str)))
    print(json.dumps(results))


if __name__ == "__main__":
    cli.run(main)
