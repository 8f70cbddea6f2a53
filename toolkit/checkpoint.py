"""The ckpt.pt format and weight files: written atomically, read without running code, checked
before use.

`ckpt.pt` (train.py, train_ddp.py) is a plain dict saved with torch.save:
    model          the weights: a plain state dict without torch.compile's `_orig_mod.` prefix
                   (nanoGPT's layout)
    model_config   GPTConfig fields
    tokenizer      tokenizer facts (toolkit.tokenizers.load_tokenizer rebuilds it: sampling needs
                   no data folder)
    train_config   the run's options (toolkit.pretraining.TrainConfig, or the fine-tuning's)
    iter_num       optimizer steps done; also the data position (windows depend only on seed and
                   iteration)
    best_val_loss, history (the loss curve)
    optimizer, scaler, rng   what exact resume needs (scaler is None unless float16)

Fine-tuned checkpoints add `head` (the task head's weights) and `finetune` (the task's facts). A
LoRA checkpoint has `lora` and `adapters` in place of `model` (toolkit/lora.py: the weights are its
base's plus the adapters). Weight files are what HF folders and DeepSpeed's zero_to_fp32 write:
pytorch_model.bin, model.safetensors, sharded folders. DeepSpeed's own folder is
toolkit/ds_checkpoint.py's, FSDP's sharded one (`dcp/` beside ckpt.pt) toolkit/fsdp_checkpoint.py's;
toolkit/model_sources.py reads any of them.
"""
import os
import pickle
import re
import warnings
from dataclasses import asdict

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model import GPT, GPTConfig, check_config
from toolkit.cli import CLIError, first_line
from toolkit.device import check_memory
from toolkit.files import atomic_write, read_json, require_file

CHECKPOINT_FILE = "ckpt.pt"
# train_ddp.py --fsdp's sharded checkpoints (toolkit/fsdp_checkpoint.py): a folder beside ckpt.pt,
# `latest` naming its newest complete tag
SHARDED_DIR = "dcp"
POINTER_FILE = "latest"
TAG = re.compile(r"iter_(\d{7,})(_1)?")  # _1: a second save of the step, beside the first
STATE_KEYS = ("model_config", "train_config", "tokenizer", "iter_num", "best_val_loss", "history")
NONE = type(None)
STATE_TYPES = {"model_config": (dict,), "train_config": (dict,), "tokenizer": (dict, NONE),
               "iter_num": (int,), "best_val_loss": (int, float, NONE), "history": (dict, NONE),
               "optimizer": (dict, NONE), "scaler": (dict, NONE), "rng": (dict, NONE),
               "finetune": (dict,), "head": (dict,)}
# added to every key by torch.compile's and DDP's wrapper modules
WRAPPER_PREFIXES = ("_orig_mod.", "module.")
WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
INDEX_FILES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")


# ----- ckpt.pt -----

def clean_state_dict(state_dict: dict) -> dict:
    """Strip wrapper prefixes so compiled, DDP and plain models share one checkpoint layout."""
    clean = {}
    for key, value in state_dict.items():
        for prefix in WRAPPER_PREFIXES:
            key = key.removeprefix(prefix)
        clean[key] = value
    return clean


def capture_rng(device: torch.device) -> dict:
    rng = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: dict, device: torch.device) -> None:
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def make_checkpoint(state: dict, weights: dict, optimizer: dict | None,
                    scaler: dict | None, rng: dict) -> dict:
    """The ckpt.pt dict: the training state (STATE_KEYS, and what else a trainer keeps, e.g. a task
    head) plus the weights, optimizer, scaler and RNG states."""
    missing = [k for k in STATE_KEYS if k not in state]
    assert not missing, missing
    model = {} if "adapters" in state else {"model": clean_state_dict(weights)}
    return {**state, **model, "optimizer": optimizer, "scaler": scaler, "rng": rng}


def run_state(model: GPT, cfg, tokenizer: dict) -> dict:
    """What every checkpoint holds besides the weights and the loop's state: the model's shape, the
    run's options and the tokenizer facts."""
    options = {k: v for k, v in asdict(cfg).items() if k != "given"}  # (a run's bookkeeping)
    return {"model_config": asdict(model.config), "train_config": options,
            "tokenizer": tokenizer}


def save_checkpoint(checkpoint: dict, path: str) -> None:
    """torch.save through a temporary file: a crash never leaves half a checkpoint."""
    atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))


def load_checkpoint(path: str) -> dict:
    """A ckpt.pt of this toolkit; anything else is a CLIError, and no pickled code ever runs."""
    if not os.path.isfile(path):
        raise CLIError(f"checkpoint not found: {path}")
    checkpoint = load_plain(path)
    weights = isinstance(checkpoint, dict) and \
        isinstance(checkpoint.get("model", checkpoint.get("adapters")), dict)
    if not weights or not isinstance(checkpoint.get("model_config"), dict):
        raise CLIError(f"{path} is not a checkpoint of this toolkit (needs keys model_config and "
                       "model, or adapters, each a dict)")
    return checkpoint


def is_sharded(path: str) -> bool:
    """A sharded checkpoint's folder: one with a `latest` (toolkit/fsdp_checkpoint.py reads it, and
    says what is wrong with one that names no complete tag)."""
    return os.path.isfile(os.path.join(path, POINTER_FILE))


def newest_checkpoint(path: str) -> str:
    """The checkpoint a ckpt.pt path or a run's --out-dir stands for (as nanoGPT samples its
    out_dir): whichever of its ckpt.pt and its sharded folder holds the later step; any other path,
    or one with neither, as it is."""
    if os.path.isdir(path):
        folder, file = path, os.path.join(path, CHECKPOINT_FILE)
    elif os.path.basename(path) == CHECKPOINT_FILE:
        folder, file = os.path.dirname(path), path
    else:
        return path
    sharded = os.path.join(folder, SHARDED_DIR)
    if not os.path.isfile(file):
        return sharded if is_sharded(sharded) else path
    sharded_step = sharded_iter(sharded)
    if sharded_step is None:  # none, or none complete: the file
        return file
    try:  # (memory-mapped: the weights are not read)
        step = torch.load(file, map_location="cpu", mmap=True, weights_only=True)["iter_num"]
    except Exception:  # unreadable: the sharded one is the run's
        return sharded
    return sharded if sharded_step > step else file


def read_pointer(folder: str) -> str | None:
    """The tag `latest` names, if it is one."""
    try:
        with open(os.path.join(folder, POINTER_FILE)) as f:
            tag = f.read().strip()
    except OSError:
        return None
    return tag if TAG.fullmatch(tag) else None


def sharded_iter(folder: str) -> int | None:
    """The step of a sharded folder's newest checkpoint, from its tag (nothing read); None where
    `latest` names no tag that is there."""
    tag = read_pointer(folder)
    return int(TAG.fullmatch(tag).group(1)) if tag and os.path.isdir(os.path.join(folder, tag)) \
        else None


def load_resume(path: str, *extra: str) -> dict:
    """A ckpt.pt to continue training from: load_checkpoint's checks, plus the loop's state
    (STATE_TYPES, and the `extra` keys a trainer adds) present and of its type, so that an edited
    or foreign checkpoint is one line rather than a traceback halfway through the resume."""
    checkpoint = load_checkpoint(path)
    check_state(checkpoint, path, ("iter_num", "train_config", *extra))
    return checkpoint


def check_state(state: dict, path: str, required: tuple = ()) -> None:
    """Each STATE_TYPES key that is present has its type, and `required` ones are present."""
    for key in required:
        if key not in state:
            raise CLIError(f"{path} has no {key}, which every run writes")
    for key, kinds in STATE_TYPES.items():
        value = state.get(key)
        if key in state and not (isinstance(value, kinds) and not isinstance(value, bool)):
            wanted = " or ".join("None" if k is NONE else k.__name__ for k in kinds)
            raise CLIError(f"{path}: its {key} is {type(value).__name__} {value!r:.40}, "
                           f"not the {wanted} a run writes")
    if state.get("iter_num", 0) < 0:
        raise CLIError(f"{path}: its iter_num {state['iter_num']} is negative")
    history = state.get("history") or {}
    if not all(isinstance(v, list) for v in history.values()):
        raise CLIError(f"{path}: its history is not a dict of lists, as a run writes it")
    rng = state.get("rng") or {}
    if not all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in rng.values()):
        raise CLIError(f"{path}: its rng is not a dict of generator states (uint8 tensors)")


def load_plain(path: str, allowed: tuple = ()):
    """torch.load(weights_only=True): tensors, plain data and `allowed` classes, or a CLIError."""
    with open(path, "rb") as f:
        head = f.read(2)
    if head and head != b"PK" and head[:1] != b"\x80":  # neither torch.save's zip nor a pickle
        raise CLIError(f"{path} is not a checkpoint (no file that torch.save writes)")
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(allowed)):
            # e.g. about the pickle protocol of files torch.save did not write
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CLIError(f"{path} holds Python objects other than tensors and plain data, which are "
                       "never unpickled; it is not a checkpoint this toolkit can read "
                       "safely") from None
    except Exception as e:  # a damaged file fails anywhere in the unpickler: KeyError, EOFError...
        raise CLIError(f"{path} is truncated or corrupt ({type(e).__name__})") from None


def load_weights(model: GPT, weights: dict, source: str) -> None:
    """Copy a state dict into model: wrapper prefixes stripped, the tied head under either key."""
    weights = clean_state_dict(weights)
    # a tied LM head is the token embedding; converters may write either key or both
    tied = (("lm_head.weight", "transformer.wte.weight"),
            ("transformer.wte.weight", "lm_head.weight"))
    for a, b in tied if model.config.tie_embeddings else ():
        if a not in weights and b in weights:
            weights[a] = weights[b]
    try:
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    except (RuntimeError, AttributeError) as e:
        # torch's text begins "Error(s) in loading state_dict for GPT:" and lists keys below
        reason = " ".join(str(e).split()).removeprefix("Error(s) in loading state_dict for GPT: ")
        raise CLIError(f"the weights in {source} do not fit its model config: "
                       f"{reason[:300]}") from None


def usable_config(model_config: dict, source: str, weights: dict | None = None,
                  **overrides) -> GPTConfig:
    """The GPTConfig of a checkpoint's model_config, checked before anything is built: its values,
    the memory its weights need, and, given the weights, the shape they actually hold."""
    try:
        config = GPTConfig(**{**model_config, **overrides})
        check_config(config)
        check_memory(config)
    except (TypeError, ValueError) as e:
        raise CLIError(f"{source} has an unusable model config: {e}") from None
    if weights is not None:
        check_shape(config, weights, source)
    return config


def check_shape(config: GPTConfig, weights: dict, source: str) -> None:
    """The config's vocabulary, width, positions and blocks are those of the weights (a CLIError
    naming each that differs): a config that lies is found before it is built."""
    shapes = {key: tuple(value.shape) for key, value in clean_state_dict(weights).items()}
    embedding = shapes.get("transformer.wte.weight") or shapes.get("lm_head.weight")
    # learned by GPT-2 alone
    positions = shapes.get("transformer.wpe.weight", (config.block_size, 0))
    if embedding is None or len(embedding) != 2 or len(positions) != 2:
        raise CLIError(f"{source} holds no GPT weights (its token embedding is missing)")
    blocks = {int(key.split(".")[2]) for key in shapes
              if re.fullmatch(r"transformer\.h\.\d+\..+", key)}
    held = {"vocab_size": embedding[0], "n_embd": embedding[1], "block_size": positions[0],
            "n_layer": len(blocks),
            "arch": "gpt2" if "transformer.wpe.weight" in shapes else "llama"}
    wrong = [f"{name} {getattr(config, name)} (the weights hold {value})"
             for name, value in held.items() if getattr(config, name) != value]
    if wrong:
        raise CLIError(f"{source}: its model config disagrees with its weights: {', '.join(wrong)}")


def model_from_weights(model_config: dict, weights: dict, source: str, **overrides) -> GPT:
    """A GPT of model_config with the weights; overrides change e.g. attn_kernel or dropout."""
    model = GPT(usable_config(model_config, source, weights, **overrides))
    load_weights(model, weights, source)
    return model


def model_from_checkpoint(checkpoint: dict, source: str = "checkpoint", **overrides) -> GPT:
    """Build a GPT from a ckpt.pt dict's config and weights."""
    if "model" not in checkpoint:
        raise CLIError(f"{source} holds LoRA adapters, not full weights; read it with "
                       "toolkit.model_sources.load_model, or merge it first "
                       "(finetune.py --merge-lora)")
    return model_from_weights(checkpoint["model_config"], checkpoint["model"], source, **overrides)


# ----- weight files: pytorch_model.bin, model.safetensors, zero_to_fp32 output -----

def read_weights_file(path: str) -> dict[str, torch.Tensor]:
    """One .bin/.pt (loaded with weights_only) or .safetensors file holding a state dict."""
    if path.endswith(".safetensors"):
        try:
            state = load_file(path)
        except (SafetensorError, OSError) as e:
            raise CLIError(f"{path} is not a readable safetensors file "
                           f"({first_line(e)})") from None
    else:
        state = load_plain(path)
    if isinstance(state, dict) and isinstance(state.get("module"), dict):
        state = state["module"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CLIError(f"{path} does not hold a state dict of tensors")
    return state


def check_tied_head(head: torch.Tensor | None, embedding: torch.Tensor | None, path: str) -> None:
    """A config that ties the head to the token embedding (tie_word_embeddings), in a folder whose
    lm_head.weight differs from it: which of the two a loader keeps depends on the loader, so the
    folder is refused rather than read as one of them."""
    if head is not None and embedding is not None and not (
            head.shape == embedding.shape and torch.equal(head.float(), embedding.float())):
        raise CLIError(f"{path}: its config ties the head to the token embedding "
                       "(tie_word_embeddings true) but its lm_head.weight differs from it; remove "
                       "lm_head.weight, or untie them in config.json (Llama and Qwen3)")


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A weights file, or a folder holding one or indexed shards, as HF and zero_to_fp32 write."""
    if os.path.isfile(path):
        return read_weights_file(path)
    for index_name in INDEX_FILES:
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            weight_map = read_json(index, "weights index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CLIError(f"{index} has no weight_map")
            state = {}
            for shard in sorted(set(weight_map.values())):
                if os.path.basename(shard) != shard:
                    raise CLIError(f"{index} names a shard outside its folder: {shard}")
                # (a named pipe would block the read forever)
                require_file(os.path.join(path, shard), f"weights shard listed in {index}")
                state.update(read_weights_file(os.path.join(path, shard)))
            return state
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return read_weights_file(os.path.join(path, name))
    raise FileNotFoundError(f"{path}: no {', '.join(WEIGHT_FILES)} or sharded index")
