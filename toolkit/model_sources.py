"""Every model a script can start from, read by one function: a ckpt.pt (pretrained or fine-tuned,
or the --out-dir that holds it), FSDP's sharded folder (OUT_DIR or OUT_DIR/dcp), a DeepSpeed
checkpoint folder (OUT_DIR, OUT_DIR/ds, a global_stepN folder, or the zero_to_fp32 output inside
it), an HF folder of GPT-2, Llama or Qwen3, or a GPT-2 hub name found in the local Hugging Face
cache; a LoRA checkpoint is read as its base with the adapters merged in. The exports are
toolkit/exports.py's.

    model, facts = load_model("ckpt/ckpt.pt")  # the GPT and its tokenizer facts (load_tokenizer)
"""
import os
import sys

import torch

from model import GPT
from toolkit import hf, hf_llama, lora
from toolkit.checkpoint import (CHECKPOINT_FILE, is_sharded, load_checkpoint, model_from_checkpoint,
                                newest_checkpoint, usable_config)
from toolkit.cli import CLIError
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
    given, path = path, newest_checkpoint(path)  # an --out-dir: ckpt.pt or FSDP's sharded folder
    if os.path.basename(given) == CHECKPOINT_FILE and path != given:
        print(f"note: reading {path}, the newer checkpoint of the run in "
              f"{os.path.dirname(given) or '.'}", file=sys.stderr)
    sharded = is_sharded(path)
    if not sharded and is_hf_source(path) and hf_llama.is_llama_folder(path):
        return hf_llama.load_llama(path, **overrides)
    if not sharded and is_hf_source(path):
        model = hf.load_gpt2(path, **overrides)
        return model, hf.read_tokenizer(hf.find_model_dir(path), model.config.vocab_size)
    if sharded:
        from toolkit.fsdp_checkpoint import read_sharded  # DCP: 0.5 s of import, rarely needed
        checkpoint = read_sharded(path)
    else:
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
