"""The checkpoint formats: written atomically, read without running code, checked before use.

`ckpt.pt` (train.py, train_ddp.py) is a plain dict saved with torch.save:
    model          the weights: a plain state dict without torch.compile's `_orig_mod.` prefix (nanoGPT's layout)
    model_config   GPTConfig fields
    tokenizer      tokenizer facts (tokenizer.load_tokenizer rebuilds it, so sampling needs no data folder)
    train_config   TrainConfig fields
    iter_num       optimizer steps done; also the data position (windows depend only on seed and iteration)
    best_val_loss, history (the loss curve)
    optimizer, scaler, rng   what exact resume needs (scaler is None unless float16)

A DeepSpeed checkpoint folder (train_ds.py, OUT_DIR/ds) is DeepSpeed's own layout (`latest`,
`global_stepN/` with one model-state and one optimizer-state file per process, `zero_to_fp32.py`), plus
`global_stepN/train_state.json`: the same facts as ckpt.pt without the weights, optimizer and rng
(DeepSpeed saves those), plus world_size, zero_stage, deepspeed_version and tag. DeepSpeed unpickles its
files without restrictions, so every file in a tag folder is checked to hold only tensors, plain data and
DeepSpeed's own plain types before DeepSpeed is given the folder.
"""
import contextlib
import os
import pickle
import re
import shutil
import sys
import warnings
import zipfile

import torch

from cli import CLIError
from files import atomic_write, read_json, write_json
from gpt2_vocab import GPT2_FACTS
from model import GPT, GPTConfig

CHECKPOINT_FILE = "ckpt.pt"
STATE_FILE = "train_state.json"  # in each global_stepN/ of a DeepSpeed folder
STATE_KEYS = ("model_config", "train_config", "tokenizer", "iter_num", "best_val_loss", "history")
WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # added to every key by torch.compile's and DDP's wrapper modules
WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
INDEX_FILES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")
TAG = re.compile(r"global_step(\d+)")


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


def make_checkpoint(state: dict, model: torch.nn.Module, optimizer: dict, scaler: dict | None,
                    rng: dict) -> dict:
    """The ckpt.pt dict: the training state (STATE_KEYS) plus weights, optimizer, scaler and RNG states."""
    return {**{k: state[k] for k in STATE_KEYS}, "model": clean_state_dict(model.state_dict()),
            "optimizer": optimizer, "scaler": scaler, "rng": rng}


def save_checkpoint(checkpoint: dict, path: str) -> None:
    """torch.save through a temporary file: a crash never leaves half a checkpoint."""
    atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict:
    """A ckpt.pt of this toolkit; anything else is a CLIError, and no pickled code ever runs."""
    if not os.path.isfile(path):
        raise CLIError(f"checkpoint not found: {path}")
    checkpoint = _load_plain(path, map_location)
    required = ("model", "model_config")
    if not isinstance(checkpoint, dict) or any(k not in checkpoint for k in required):
        raise CLIError(f"{path} is not a checkpoint of this toolkit (needs keys {', '.join(required)})")
    return checkpoint


def _load_plain(path: str, map_location="cpu", allowed: tuple = ()):
    """torch.load(weights_only=True): tensors and plain data (plus the `allowed` classes), or a CLIError."""
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(allowed)):
            warnings.simplefilter("ignore")  # e.g. about the pickle protocol of files torch.save did not write
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CLIError(f"{path} holds Python objects other than tensors and plain data, which are never "
                       f"unpickled; it is not a checkpoint this toolkit can read safely") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise CLIError(f"{path} is truncated or corrupt ({type(e).__name__})") from None


def load_weights(model: GPT, weights: dict, source: str) -> None:
    """Copy a state dict into model: wrapper prefixes stripped, the tied head under either key."""
    weights = clean_state_dict(weights)
    # the LM head is tied to the token embedding; converters may write either key or both
    for a, b in (("lm_head.weight", "transformer.wte.weight"), ("transformer.wte.weight", "lm_head.weight")):
        if a not in weights and b in weights:
            weights[a] = weights[b]
    try:
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    except (RuntimeError, AttributeError) as e:
        raise CLIError(f"the weights in {source} do not fit its model config: {str(e).splitlines()[0]}") from None


def model_from_weights(model_config: dict, weights: dict, source: str, **overrides) -> GPT:
    """A GPT of model_config with the given weights; overrides change e.g. attn_kernel or dropout."""
    try:
        model = GPT(GPTConfig(**{**model_config, **overrides}))
    except (TypeError, ValueError) as e:
        raise CLIError(f"{source} has an unusable model config: {e}") from None
    load_weights(model, weights, source)
    return model


def model_from_checkpoint(checkpoint: dict, source: str = "checkpoint", **overrides) -> GPT:
    """Build a GPT from a ckpt.pt dict's config and weights."""
    return model_from_weights(checkpoint["model_config"], checkpoint["model"], source, **overrides)


def load_model(path: str, **overrides) -> tuple[GPT, dict]:
    """(model, tokenizer facts) from a ckpt.pt, or an HF GPT-2 folder / cached hub name (GPT-2's tokenizer);
    overrides set e.g. attn_kernel. Dropout is off (this is for inference) unless overrides set it."""
    overrides = {"dropout": 0.0, **overrides}
    if os.path.isdir(path) or not os.path.exists(path) and not path.endswith(".pt"):
        import hf
        model = hf.load_gpt2(path, **overrides)
        return model, hf.read_tokenizer(hf.find_model_dir(path), model.config.vocab_size)
    checkpoint = load_checkpoint(path)
    model = model_from_checkpoint(checkpoint, path, **overrides)
    return model, checkpoint.get("tokenizer", GPT2_FACTS)


# ----- weight files: pytorch_model.bin, model.safetensors, zero_to_fp32 output -----

def read_weights_file(path: str) -> dict[str, torch.Tensor]:
    """One .bin/.pt (loaded with weights_only) or .safetensors file holding a state dict."""
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            state = load_file(path)
        except (SafetensorError, OSError) as e:
            raise CLIError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
    else:
        state = _load_plain(path)
    if isinstance(state, dict) and isinstance(state.get("module"), dict):
        state = state["module"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CLIError(f"{path} does not hold a state dict of tensors")
    return state


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A weights file, or a folder holding one (or shards listed in an index), as HF and zero_to_fp32 write."""
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
                state.update(read_weights_file(os.path.join(path, shard)))
            return state
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return read_weights_file(os.path.join(path, name))
    raise FileNotFoundError(f"{path}: no {', '.join(WEIGHT_FILES)} or sharded index")


# ----- DeepSpeed checkpoint folders -----

def is_deepspeed_folder(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "latest")) or bool(deepspeed_tags(path)))


def deepspeed_tags(ds_dir: str) -> list[str]:
    """The global_stepN folders of a DeepSpeed checkpoint folder, oldest first."""
    names = [n for n in os.listdir(ds_dir) if TAG.fullmatch(n) and os.path.isdir(os.path.join(ds_dir, n))]
    return sorted(names, key=lambda n: int(TAG.fullmatch(n).group(1)))


def latest_tag(ds_dir: str) -> str:
    """The tag DeepSpeed's `latest` file names (written last by a save, so it names a complete one)."""
    path = os.path.join(ds_dir, "latest")
    if not os.path.isfile(path):
        raise CLIError(f"{ds_dir} has no 'latest' file: not a complete DeepSpeed checkpoint folder of train_ds.py")
    with open(path) as f:
        return f.read().strip()


def write_train_state(ds_dir: str, tag: str, state: dict) -> None:
    write_json(os.path.join(ds_dir, tag, STATE_FILE), {**state, "tag": tag})


def read_train_state(ds_dir: str, tag: str | None = None) -> dict:
    """train_state.json of the tag `latest` names (or of tag) in a DeepSpeed checkpoint folder."""
    if not os.path.isdir(ds_dir):
        raise CLIError(f"DeepSpeed checkpoint folder not found: {ds_dir}")
    tag = tag or latest_tag(ds_dir)
    if not TAG.fullmatch(tag) or not os.path.isdir(os.path.join(ds_dir, tag)):
        tags = deepspeed_tags(ds_dir)
        raise CLIError(f"{ds_dir} has no checkpoint {tag}; it holds {', '.join(tags) if tags else 'none'}")
    path = os.path.join(ds_dir, tag, STATE_FILE)
    if not os.path.isfile(path):
        raise CLIError(f"{path} not found: {ds_dir}/{tag} was not written by train_ds.py")
    state = read_json(path, "training state")
    if "model_config" not in state or "world_size" not in state:
        raise CLIError(f"{path} is not a train_ds.py training state")
    state["tag"] = tag
    if state.get("best_val_loss") is None:  # JSON has no infinity
        state["best_val_loss"] = float("inf")
    return state


def check_deepspeed_files(ds_dir: str, tag: str) -> None:
    """Refuse (CLIError) a tag folder with any .pt file that holds more than tensors, plain data and
    DeepSpeed's plain types: DeepSpeed loads these files with weights_only=False, so a crafted file would
    otherwise run code. Called before DeepSpeed or zero_to_fp32 is given the folder."""
    if not torch.cuda.is_available():  # reading needs no accelerator; skips DeepSpeed's detection warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    folder = os.path.join(ds_dir, tag)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".pt"):
            _load_plain(os.path.join(folder, name), allowed=(LossScaler, ZeroStageEnum, fragment_address))


def to_universal(ds_dir: str, tag: str, out_root: str) -> str:
    """DeepSpeed's universal checkpoint of ds_dir/tag written to out_root/tag (returned): every parameter whole, in
    float32, with its optimizer state, whatever the ZeRO stage, pipeline stages and tensor-parallel shards were.
    load_universal resumes from it on any number of processes. The tag's files are checked first."""
    check_deepspeed_files(ds_dir, tag)
    import argparse
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    out = os.path.join(out_root, tag)
    args = argparse.Namespace(input_folder=os.path.join(ds_dir, tag), output_folder=out, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines
            ds_to_universal(args)
    except (ValueError, FileNotFoundError, AssertionError, KeyError, RuntimeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(f"DeepSpeed cannot convert {ds_dir}/{tag} to a universal checkpoint: {first}") from None
    return out


def read_universal_weights(universal_dir: str) -> dict[str, torch.Tensor]:
    """{parameter name: float32 tensor} from a universal checkpoint (its zero/NAME/fp32.pt files)."""
    zero = os.path.join(universal_dir, "zero")
    weights = {}
    for name in sorted(os.listdir(zero)):
        path = os.path.join(zero, name, "fp32.pt")
        if os.path.isfile(path):
            tensor = _load_plain(path).get("param")
            if not isinstance(tensor, torch.Tensor):
                raise CLIError(f"{path} holds no parameter tensor")
            weights[name] = tensor
    return weights


def gather_deepspeed_weights(ds_dir: str, tag: str, pipeline_stages: int = 1, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The full float32 weights of a DeepSpeed checkpoint, consolidated in memory: by DeepSpeed's zero_to_fp32 for
    ZeRO data parallel, through its universal checkpoint (to a temporary folder) for pipeline or tensor parallel,
    which zero_to_fp32 cannot read; pipeline layer names become GPT's."""
    if pipeline_stages > 1 or tp_size > 1:
        import tempfile
        from parallel import gpt_state_from_universal
        with tempfile.TemporaryDirectory(prefix="universal-") as tmp:
            weights = read_universal_weights(to_universal(ds_dir, tag, tmp))
        return gpt_state_from_universal(weights) if pipeline_stages > 1 else weights
    check_deepspeed_files(ds_dir, tag)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is for samples
            return get_fp32_state_dict_from_zero_checkpoint(ds_dir, tag=tag)
    except (ValueError, FileNotFoundError, AssertionError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(f"cannot read the ZeRO checkpoint {ds_dir}/{tag}: {first}") from None


def prune_deepspeed_tags(ds_dir: str, keep: int) -> None:
    """Delete all but the newest `keep` global_stepN folders (0 keeps all)."""
    if keep > 0:
        for old in deepspeed_tags(ds_dir)[:-keep]:
            shutil.rmtree(os.path.join(ds_dir, old), ignore_errors=True)


def newest_mtime(path: str) -> float:
    """Modification time of a file, or of the newest file in a folder."""
    if os.path.isfile(path):
        return os.path.getmtime(path)
    return max((os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)), default=0.0)


def converted_from(converted: str, ds_dir: str) -> str | None:
    """The newest tag that was complete before a zero_to_fp32 output was written: the one it was converted
    from (None when it is older than every tag still in the folder)."""
    written = newest_mtime(converted)
    done = [t for t in deepspeed_tags(ds_dir) if newest_mtime(os.path.join(ds_dir, t)) <= written]
    return done[-1] if done else None


def load_deepspeed_model(path: str, ds_dir: str | None = None, tag: str | None = None,
                         **overrides) -> tuple[GPT, dict, str]:
    """(model, training state, what was loaded in words) from a DeepSpeed checkpoint folder (its `latest` tag or
    `tag`, gathered in memory), or from a zero_to_fp32 output whose model config is in ds_dir (default: the
    folder above it). A converted output older than the folder's newest tag is used only when named, and the
    words say so. Dropout is off unless overrides set it."""
    if not os.path.exists(path):
        raise CLIError(f"checkpoint not found: {path}")
    if is_deepspeed_folder(os.path.join(path, "ds")):  # OUT_DIR given instead of OUT_DIR/ds
        path = os.path.join(path, "ds")
    parent = os.path.dirname(os.path.abspath(path.rstrip("/\\")))
    name = os.path.basename(path.rstrip("/\\"))
    if tag is None and TAG.fullmatch(name) and os.path.isdir(path) and is_deepspeed_folder(parent):
        path, tag = parent, name  # one tag folder inside a checkpoint folder
    if is_deepspeed_folder(path):
        state = read_train_state(path, tag)
        weights = gather_deepspeed_weights(path, state["tag"], state.get("pipeline_stages", 1), state.get("tp_size", 1))
        label = f"{path} ({state['tag']}, iteration {state['iter_num']})"
    else:
        ds_dir = ds_dir or parent
        if not is_deepspeed_folder(ds_dir):
            raise CLIError(f"{path} is not a DeepSpeed checkpoint folder, and {ds_dir} (where its model config "
                           f"is looked for) is not one either; pass --ds-dir OUT_DIR/ds")
        newest, source = latest_tag(ds_dir), tag or converted_from(path, ds_dir)
        state = read_train_state(ds_dir, source or newest)
        weights = read_weights(path)
        label = f"{path} (zero_to_fp32 output of {state['tag']}, iteration {state['iter_num']})"
        if source is None:
            label = f"{path} (zero_to_fp32 output older than {newest}, the oldest checkpoint left)"
        elif source != newest and tag is None:
            label += f"; note: {ds_dir} now holds the newer {newest}"
    return model_from_weights(state["model_config"], weights, path, **{"dropout": 0.0, **overrides}), state, label


def default_deepspeed_source(ds_dir: str, converted_name: str) -> str:
    """What to sample by default: the seed's converted file (ds_dir/ckpt_ds.pt) when it is at least as new as
    the newest tag, else the folder itself (its newest tag, gathered in memory)."""
    converted = os.path.join(ds_dir, converted_name)
    if os.path.exists(converted) and is_deepspeed_folder(ds_dir):
        if converted_from(converted, ds_dir) == latest_tag(ds_dir):
            return converted
    return ds_dir
