"""What eval.py reports for a model: the loss, perplexity and bits per byte of a val split,
multiple-choice files in HellaSwag's format, and lm-evaluation-harness's tasks (its package is
imported only for them, after the Hub's reach is known).

    results, full = score_model(args)      # {task: {metric: value}}, and everything measured
"""
import argparse
import glob
import os
import socket
from urllib.parse import urlparse

import numpy as np
import torch
import yaml

from model import GPT
from toolkit.chat import can_chat, template_variables
from toolkit.cli import CLIError
from toolkit.data import load_corpus
from toolkit.device import (autocast, compile_decoding, full_logits_fit, generation_linears,
                            resolve_device, resolve_dtype)
from toolkit.evaluation import (ChoiceTask, gpt_logits_at, is_local_task, loss_metrics,
                                 refuse_same_names, task_name, window_losses)
from toolkit.model_sources import load_model
from toolkit.quantize import check_quantize, quantize_model
from toolkit.tokenizers import Tokenizer, load_tokenizer, same_vocabulary


def score_model(args: argparse.Namespace) -> tuple[dict, dict]:
    """eval.py's work, its flags checked: --ckpt scored on --data-dir's val split, the local
    HellaSwag-format files and the harness's tasks; ({task: {metric: value}}, the full results)."""
    refuse_same_names(args.tasks, [task_name(spec)[0] for spec in args.tasks], "--tasks")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    check_quantize(args.quantize, device)
    model, facts = load_model(args.ckpt)
    model = quantize_model(model.to(device).eval(), args.quantize)
    tok = load_tokenizer(facts)
    if args.apply_chat_template and not can_chat(tok):
        raise CLIError(f"--apply-chat-template: {args.ckpt} was never instruction-tuned, so it has "
                       "no chat template (finetune.py --task sft gives it one)")
    if args.chat_template_kwargs is not None and not tok.chat_template:
        raise CLIError(f"--chat-template-kwargs: {args.ckpt} has no chat template of its own that "
                       "takes variables")
    results, full = {}, {}
    if args.data_dir:
        results["val"] = val_scores(model, tok, facts, args.data_dir, args.ckpt, args.batch_size,
                                    args.limit, device, dtype)
        full["val"] = {"data_dir": os.path.abspath(args.data_dir), **results["val"]}
    local = [task for task in args.tasks if is_local_task(task)]
    for path in local:
        task = ChoiceTask(path, tok, model.config.block_size, args.limit, progress=True)
        results[task.name] = task.score(gpt_logits_at(model, device, dtype), args.batch_size,
                                        device)
        full[task.name] = {"path": os.path.abspath(path), "items": len(task.items),
                           **results[task.name]}
    others = [task for task in args.tasks if task not in local]
    if others:
        metrics, out = harness_results(others, model, tok, args, device, dtype)
        results.update(metrics)
        full["harness"] = out
    return results, full


def val_scores(model: GPT, tokenizer: Tokenizer, facts: dict, data_dir: str, source: str,
               batch_size: int, limit: int | None, device: torch.device,
               dtype: torch.dtype) -> dict[str, float]:
    """data_dir's val split in non-overlapping windows of the model's block size: the loss in nats
    per token, its perplexity, bits per UTF-8 byte of the text, and the tokens and bytes scored."""
    corpus = load_corpus(data_dir)
    if not same_vocabulary(corpus.meta, facts):
        raise CLIError(f"{data_dir} uses tokenizer {corpus.meta.get('tokenizer')} (vocab "
                       f"{corpus.meta.get('vocab_size')}) but {source} was trained with "
                       f"{facts.get('tokenizer')} (vocab {facts.get('vocab_size')}); score data "
                       "prepared with the model's own tokenizer")
    block = model.config.block_size
    if len(corpus.val) < block + 1:
        raise CLIError(f"the val split of {data_dir} holds {len(corpus.val):,} tokens, fewer than "
                       f"one window of the model's block size + 1 = {block + 1}")
    offsets = np.arange((len(corpus.val) - 1) // block, dtype=np.int64)[:limit] * block
    chunked = not full_logits_fit(device, batch_size * block, model.config.vocab_size)

    def eval_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(device, dtype):
            return model(x, y, chunked_loss=chunked)[1]

    token_bytes = torch.from_numpy(tokenizer.token_bytes()).to(device)
    loss_sum, count, nbytes = window_losses(eval_loss, corpus.val, offsets, block, batch_size,
                                            device, token_bytes)
    return {**loss_metrics(loss_sum, count, nbytes), "tokens": int(count), "bytes": int(nbytes)}


def task_data_files(specs: list[str]) -> list[str]:
    """The local files and folders the task YAMLs among specs read (the values under their
    `data_files`, `data_dir` and `dataset_path` keys that exist, globs expanded), which an output
    must not replace; a YAML that does not parse names none here (the harness run says why)."""
    found = []
    for spec in (s for s in specs if s.endswith((".yaml", ".yml")) and os.path.isfile(s)):
        try:
            with open(spec, encoding="utf-8") as f:
                root = yaml.compose(f)
        except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
            continue
        found += [path for value in data_values(root) for path in glob.glob(value)]
    return found


def data_values(node: yaml.Node | None, inside: bool = False) -> list[str]:
    """The scalar values under the data keys of a composed YAML node."""
    if isinstance(node, yaml.ScalarNode):
        return [node.value] if inside and node.value else []
    if isinstance(node, yaml.SequenceNode):
        return [v for item in node.value for v in data_values(item, inside)]
    if isinstance(node, yaml.MappingNode):
        return [v for key, value in node.value for v in data_values(
            value, inside or key.value in ("data_files", "data_dir", "dataset_path"))]
    return []


def hub_out_of_reach() -> bool:
    """No proxy and no address for the Hugging Face Hub (HF_ENDPOINT's host, e.g. a mirror): the
    harness's libraries cannot reach it, and would print a warning a try for 25 s before failing."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    try:
        socket.getaddrinfo(
            urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname, 443)
    except OSError:
        return True
    return False


def think_end(value: str | None, tok: Tokenizer) -> str | int | None:
    """--think-end-token as lm-eval's hf model reads it: digits are a token id, else text."""
    if value is None or not value.isdigit():
        return value
    if int(value) >= tok.vocab_size:
        raise CLIError(f"--think-end-token {value}: no such token id (the vocabulary has "
                       f"{tok.vocab_size:,})")
    return int(value)


def harness_results(specs: list[str], model: GPT, tok: Tokenizer, args: argparse.Namespace,
                    device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """The harness's results for its tasks, with eval.py's --batch-size, --limit and chat options:
    {task: {metric: value}} (its filters' ",none" and the stderrs left out), and its full output."""
    if hub_out_of_reach():  # the libraries read their caches at once: cached task data still loads
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    try:
        from toolkit import harness  # lm_eval: optional, 0.9 s to import
    except ImportError:
        raise CLIError(f"--tasks {','.join(specs)} needs lm-evaluation-harness: pip install "
                       f"lm_eval (a local .jsonl in HellaSwag's format needs nothing)") from None
    if args.compile:
        compile_decoding(model, dtype)
    elif not args.quantize:  # as test.py's: faster decoding in float32 on a CPU (performance.md)
        model = generation_linears(model, device, dtype)
    lm = harness.GPTHarness(model, tok, args.batch_size, device, dtype,
                            chat=args.apply_chat_template,
                            variables=template_variables(args.chat_template_kwargs),
                            think_end=think_end(args.think_end_token, tok))
    out = harness.run(specs, lm, args.limit, args.system_instruction)
    metrics = {task: {key.split(",")[0]: value for key, value in values.items()
                      if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
               for task, values in out["results"].items()}
    return metrics, out
