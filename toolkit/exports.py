"""The exports test.py and test_ds.py write: an HF folder of the model's family (toolkit/hf.py,
toolkit/hf_llama.py) and a GGUF file (toolkit/gguf_export.py), each with the chat template the model
carries, and a plain ckpt.pt (e.g. of FSDP's sharded or DeepSpeed's folder), checked before any
model is read.

    save_hf(model, "out-dir", facts)  # GPT2LMHeadModel, LlamaForCausalLM or Qwen3ForCausalLM
"""
import argparse
import os
from dataclasses import asdict

from model import GPT
from toolkit import gguf_export, hf, hf_llama
from toolkit.chat import export_template
from toolkit.checkpoint import save_checkpoint
from toolkit.cli import CLIError
from toolkit.files import check_output, refuse_special, replace_folder


def save_hf(model: GPT, out_dir: str, facts: dict) -> str:
    """An HF folder of the model's family that transformers loads alone, in place of any folder
    there (whole: nothing of an old model stays mixed in); a line saying what it wrote."""
    writer = hf.save_gpt2 if model.config.arch == "gpt2" else hf_llama.save_llama
    template = export_template(facts)
    written = replace_folder(out_dir, lambda tmp: writer(model, tmp, facts, template))
    return f"wrote {written} to {out_dir}"


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--export-hf", metavar="DIR",
                        help="write the model as an HF folder of its family (weights, config, "
                             "tokenizer files) and exit")
    parser.add_argument("--export-gguf", metavar="FILE",
                        help="write the model and its tokenizer as one GGUF file for llama.cpp, "
                             "ollama or LM Studio, and exit")
    parser.add_argument("--export-ckpt", metavar="FILE",
                        help="write the model as one plain ckpt.pt (weights, configs, tokenizer; "
                             "no optimizer state) for test.py, eval.py and finetune.py, and exit")
    parser.add_argument("--outtype", choices=gguf_export.WEIGHT_TYPES, default="f16",
                        help="the GGUF's weight type, as llama.cpp's converter names it (default: "
                             "f16; vectors stay f32)")


def check_exports(outputs: dict[str, str | None], inputs: list[str],
                  args: argparse.Namespace) -> None:
    """Refuse (CLIError), before any model is read, an export (flag -> path) onto an input, onto a
    folder that is not a model's (an HF export replaces its folder whole), or onto an existing file
    or a folder with files in it unless --overwrite; and the flags it would leave unused (an export
    samples nothing; --outtype is --export-gguf's)."""
    unused = [flag for flag in ("--genfile", "--prompt", "--chat", "--interactive")
              if getattr(args, flag[2:])]
    if any(outputs.values()) and unused:
        raise CLIError(f"an export writes no samples: drop {unused[0]}, or sample in another run")
    if args.outtype != "f16" and not args.export_gguf:
        raise CLIError(f"--outtype {args.outtype} is the weight type of --export-gguf FILE, which "
                       "was not given")
    overwrite = args.overwrite
    given = {flag: os.path.realpath(path) for flag, path in outputs.items() if path}
    for flag, path in outputs.items():
        if path:
            check_output(path, inputs, flag)
            twin = next(other for other in given if given[other] == given[flag])
            if twin != flag:
                raise CLIError(f"{twin} and {flag} both name {path}; give each its own path")
            if flag != "--export-hf":  # a file
                refuse_special(path, flag)
            elif flag == "--export-hf" and os.path.exists(path) and not os.path.isdir(path):
                raise CLIError(f"{flag} {path} is a file; an HF model is a folder: choose one")
            holds_files = os.path.isdir(path) and bool(os.listdir(path))
            if flag == "--export-hf" and holds_files and \
                    not os.path.isfile(os.path.join(path, "config.json")):
                raise CLIError(f"{flag} {path} holds files and is no HF model folder (it has no "
                               "config.json), so they are not replaced; choose a new folder")
            if (holds_files or os.path.isfile(path)) and not overwrite:
                raise CLIError(f"{flag} {path} already holds "
                               f"{'files' if holds_files else 'a file'}; use "
                               "--overwrite to replace it whole")


def export(model: GPT, facts: dict, args: argparse.Namespace, state: dict | None = None) -> None:
    """The exports args ask for (--export-hf, --export-gguf, --export-ckpt), each announced on
    stdout; state: a run's (toolkit/checkpoint.py's STATE_KEYS) for the ckpt.pt to keep."""
    if args.export_ckpt:
        state = state or {"model_config": asdict(model.config), "tokenizer": facts}
        save_checkpoint({**state, "model": model.state_dict(), "optimizer": None, "scaler": None,
                         "rng": {}}, args.export_ckpt)
        print(f"wrote {args.export_ckpt}; sample it with `python test.py --ckpt "
              f"{args.export_ckpt}`", flush=True)
    if args.export_hf:
        print(save_hf(model, args.export_hf, facts), flush=True)
    if args.export_gguf:
        print(gguf_export.save_gguf(model, args.export_gguf, facts, args.outtype), flush=True)
