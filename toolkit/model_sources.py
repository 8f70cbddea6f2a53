"""Every model a script can start from, read by one function: a ckpt.pt (pretrained or fine-tuned,
or the --out-dir that holds it), a DeepSpeed checkpoint folder (OUT_DIR, OUT_DIR/ds, a global_stepN
folder, or the zero_to_fp32 output inside it), an HF folder of GPT-2, Llama or Qwen3, or a GPT-2 hub
name found in the local Hugging Face cache; a LoRA checkpoint is read as its base with the adapters
merged in. And the exports the scripts share: an HF folder, for either family, and a GGUF file
(toolkit/gguf_export.py).

    model, facts = load_model("ckpt/ckpt.pt")  # the GPT and its tokenizer facts (load_tokenizer)
    save_hf(model, "out-dir", facts)  # GPT2LMHeadModel, LlamaForCausalLM or Qwen3ForCausalLM
"""
import argparse
import os

import torch

from model import GPT
from toolkit import gguf_export, hf, hf_llama, lora
from toolkit.checkpoint import load_checkpoint, model_from_checkpoint, run_file, usable_config
from toolkit.cli import CLIError
from toolkit.files import check_output, refuse_special, replace_folder
from toolkit.ds_checkpoint import is_deepspeed_folder, load_deepspeed_model
from toolkit.gpt2_vocab import GPT2_FACTS


def is_deepspeed_source(path: str) -> bool:
    """A DeepSpeed checkpoint folder, the run folder above one, or a file or tag folder in one."""
    parent = os.path.dirname(os.path.abspath(path.rstrip("/\\")))
    return any(map(is_deepspeed_folder, (path, os.path.join(path, "ds"), parent)))


def is_hf_source(path: str) -> bool:
    """An HF folder, or a name that is no file here (looked up in the local Hugging Face cache)."""
    return os.path.isdir(path) or not os.path.exists(path) and not path.endswith(".pt")


def load_model(path: str, **overrides) -> tuple[GPT, dict]:
    """(model, tokenizer facts) from any source above; overrides set e.g. attn_kernel or dropout,
    which is off (this is for inference) unless they set it. An HF folder is read with GPT-2's
    tokenizer unless it holds this toolkit's tokenizer facts. Weights that are not all finite are
    refused: such a model samples nothing and scores nan."""
    model, facts = read_model(path, **{"dropout": 0.0, **overrides})
    for name, weight in model.named_parameters():
        if not torch.isfinite(weight).all():
            raise CLIError(f"{path}: its weight {name} holds nan or inf values")
    return model, facts


def read_model(path: str, **overrides) -> tuple[GPT, dict]:
    if is_deepspeed_source(path):
        model, state, _ = load_deepspeed_model(path, **overrides)
        return model, state["tokenizer"]
    path = run_file(path)
    if is_hf_source(path) and hf_llama.is_llama_folder(path):
        return hf_llama.load_llama(path, **overrides)
    if is_hf_source(path):
        model = hf.load_gpt2(path, **overrides)
        return model, hf.read_tokenizer(hf.find_model_dir(path), model.config.vocab_size)
    checkpoint = load_checkpoint(path)
    if "adapters" in checkpoint:
        return load_adapted(checkpoint, path, **overrides), checkpoint["tokenizer"]
    model = model_from_checkpoint(checkpoint, path, **overrides)
    # a checkpoint that names no tokenizer is read with GPT-2's (its vocabulary padded or not)
    if "tokenizer" not in checkpoint and model.config.vocab_size < GPT2_FACTS["vocab_size"]:
        raise CLIError(f"{path} names no tokenizer, and its vocabulary of "
                       f"{model.config.vocab_size:,} tokens is not GPT-2's, which a checkpoint "
                       "without one is read with")
    return model, checkpoint.get("tokenizer", GPT2_FACTS)


def save_hf(model: GPT, out_dir: str, facts: dict) -> str:
    """An HF folder of the model's family that transformers loads alone, in place of any folder
    there (whole: nothing of an old model stays mixed in); a line saying what it wrote."""
    writer = hf.save_gpt2 if model.config.arch == "gpt2" else hf_llama.save_llama
    return f"wrote {replace_folder(out_dir, lambda tmp: writer(model, tmp, facts))} to {out_dir}"


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--export-hf", metavar="DIR",
                        help="write the model as an HF folder of its family (weights, config, "
                             "tokenizer files) and exit")
    parser.add_argument("--export-gguf", metavar="FILE",
                        help="write the model and its tokenizer as one GGUF file for llama.cpp, "
                             "ollama or LM Studio, and exit")
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


def export(model: GPT, facts: dict, args: argparse.Namespace) -> None:
    """The exports args ask for (--export-hf, --export-gguf), each announced on stdout."""
    if args.export_hf:
        print(save_hf(model, args.export_hf, facts), flush=True)
    if args.export_gguf:
        print(gguf_export.save_gguf(model, args.export_gguf, facts, args.outtype), flush=True)


def load_adapted(checkpoint: dict, path: str, **overrides) -> GPT:
    """A LoRA checkpoint's base (found and unchanged: toolkit/lora.py) shaped as the fine-tuning
    shaped it, with the adapters merged in: a plain GPT."""
    settings, config = checkpoint["lora"], checkpoint["model_config"]
    new_rows = checkpoint["adapters"].get(lora.NEW_ROWS)
    added = 0 if new_rows is None else len(new_rows)
    if usable_config(config, path).vocab_size != settings["base_vocab"] + added:
        raise CLIError(f"{path}: its model config says vocab_size {config['vocab_size']}, but its "
                       f"base has {settings['base_vocab']} tokens and its adapters add {added}")
    model, _ = load_model(lora.check_base(settings, path), **overrides)
    if config["block_size"] < model.config.block_size:
        model.crop_block_size(config["block_size"])
    model.resize_token_embeddings(config["vocab_size"])
    lora.add_lora(model, settings["rank"], settings["alpha"], 0.0, settings["targets"],
                  settings["base_vocab"])
    lora.load_adapters(model, checkpoint["adapters"], path)
    return lora.merge(model).eval()
