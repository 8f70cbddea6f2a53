"""Checkpoint files: written atomically, read without unpickling code, checked before use.

A checkpoint is a plain dict saved with torch.save. The weights live under "model" as a plain state
dict (nanoGPT's layout, so other tools can read it); the rest is what sampling and exact resume need:
"model_config", "tokenizer" (facts for tokenizer.load_tokenizer), "train_config", "optimizer",
"scaler", "iter_num", "best_val_loss", "rng" and "history" (the loss curve).
"""
import os
import pickle
import warnings
import zipfile

import torch

from cli import CLIError
from model import GPT, GPTConfig

COMPILED_PREFIX = "_orig_mod."  # added to every key by torch.compile's wrapper module


def clean_state_dict(state_dict: dict) -> dict:
    """Strip torch.compile's prefix so compiled and plain models share one checkpoint layout."""
    return {k.removeprefix(COMPILED_PREFIX): v for k, v in state_dict.items()}


def save_checkpoint(checkpoint: dict, path: str) -> None:
    """Write to a temporary file in the same folder, then rename: a crash never leaves half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint of this toolkit; anything else is a CLIError, and no pickled code ever runs."""
    if not os.path.isfile(path):
        raise CLIError(f"checkpoint not found: {path}")
    try:
        with warnings.catch_warnings():  # e.g. about the pickle protocol of files torch.save did not write
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CLIError(f"{path} is not a checkpoint: it holds Python objects other than tensors and plain "
                       f"data, which are never unpickled") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as e:
        raise CLIError(f"{path} is truncated or corrupt ({type(e).__name__})") from None
    required = ("model", "model_config")
    if not isinstance(checkpoint, dict) or any(k not in checkpoint for k in required):
        raise CLIError(f"{path} is not a checkpoint of this toolkit (needs keys {', '.join(required)})")
    return checkpoint


def model_from_checkpoint(checkpoint: dict, **overrides) -> GPT:
    """Build a GPT from a checkpoint's config and weights; overrides change e.g. attn_kernel or dropout."""
    try:
        config = GPTConfig(**{**checkpoint["model_config"], **overrides})
    except TypeError as e:
        raise CLIError(f"checkpoint has an unknown model config: {e}") from None
    model = GPT(config)
    state_dict = clean_state_dict(checkpoint["model"])
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        raise CLIError(f"checkpoint weights do not fit its model config: {str(e).splitlines()[0]}") from None
    return model
