"""DeepSpeed checkpoint folders (train_ds.py's OUT_DIR/ds): read safely, gathered into whole weights
in memory.

The layout is DeepSpeed's own (`latest`, `global_stepN/` with one model-state and one
optimizer-state file per process, `zero_to_fp32.py`), plus `global_stepN/train_state.json`: the same
facts as ckpt.pt without the weights, optimizer and rng (DeepSpeed saves those), plus world_size,
zero_stage, pipeline_stages, tp_size, deepspeed_version and tag, written once every process has
saved (so it marks the tag complete), then `latest_complete`, this toolkit's own `latest`, written
atomically; a reader falls back to the newest complete tag. DeepSpeed unpickles its files without
restrictions, so every file in a tag folder is checked to hold only tensors, plain data and
DeepSpeed's own plain types before DeepSpeed is given the folder.
"""
import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile

import torch

from model import GPT
from toolkit.checkpoint import STATE_KEYS, check_state, load_plain, model_from_weights, read_weights
from toolkit.cli import CLIError, first_line
from toolkit.files import read_json, write_json, write_text
from toolkit.model_parallel import gpt_state_from_universal

TAG = re.compile(r"global_step(\d+)")
STATE_FILE = "train_state.json"  # in each global_stepN/, written once DeepSpeed's save is complete
# this toolkit's `latest`: the newest complete tag, written atomically
POINTER_FILE = "latest_complete"


def is_deepspeed_folder(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "latest")) or
                                    bool(deepspeed_tags(path)))


def deepspeed_tags(ds_dir: str) -> list[str]:
    """The global_stepN folders of a DeepSpeed checkpoint folder, oldest first."""
    names = [n for n in os.listdir(ds_dir)
             if TAG.fullmatch(n) and os.path.isdir(os.path.join(ds_dir, n))]
    return sorted(names, key=lambda n: int(TAG.fullmatch(n).group(1)))


def is_complete(ds_dir: str, tag: str) -> bool:
    return bool(TAG.fullmatch(tag)) and os.path.isfile(os.path.join(ds_dir, tag, STATE_FILE))


def latest_tag(ds_dir: str) -> str:
    """The newest complete tag: the one this toolkit's pointer names, else the one DeepSpeed's
    `latest` names, else (says so on stderr) the newest tag folder with its training state.
    DeepSpeed rewrites `latest` in place, so a kill during a save can leave it empty or naming a tag
    whose files are not all written."""
    for name in (POINTER_FILE, "latest"):
        try:
            with open(os.path.join(ds_dir, name)) as f:
                tag = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if is_complete(ds_dir, tag):
            return tag
    complete = [tag for tag in deepspeed_tags(ds_dir) if is_complete(ds_dir, tag)]
    if not complete:
        raise CLIError(f"{ds_dir} holds no complete checkpoint of train_ds.py (no global_stepN "
                       f"folder with its {STATE_FILE})")
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {ds_dir}: `latest` is missing, empty or names an incomplete checkpoint; "
              f"using the newest complete one, {complete[-1]}", file=sys.stderr, flush=True)
    return complete[-1]


def mark_complete(ds_dir: str, tag: str, state: dict) -> None:
    """After DeepSpeed's save of tag has returned in every process: its training state, then this
    toolkit's pointer to it, each written atomically."""
    write_json(os.path.join(ds_dir, tag, STATE_FILE), {**state, "tag": tag})
    write_text(os.path.join(ds_dir, POINTER_FILE), tag + "\n")


def read_train_state(ds_dir: str, tag: str | None = None) -> dict:
    """train_state.json of the tag `latest` names (or of tag) in a DeepSpeed checkpoint folder."""
    if not os.path.isdir(ds_dir):
        raise CLIError(f"DeepSpeed checkpoint folder not found: {ds_dir}")
    tag = tag or latest_tag(ds_dir)
    if not TAG.fullmatch(tag) or not os.path.isdir(os.path.join(ds_dir, tag)):
        tags = deepspeed_tags(ds_dir)
        raise CLIError(f"{ds_dir} has no checkpoint {tag}; it holds "
                       f"{', '.join(tags) if tags else 'none'}")
    path = os.path.join(ds_dir, tag, STATE_FILE)
    if not os.path.isfile(path):
        raise CLIError(f"{path} not found: {ds_dir}/{tag} was not written by train_ds.py")
    state = read_json(path, "training state")
    if "model_config" not in state or "world_size" not in state:
        raise CLIError(f"{path} is not a train_ds.py training state")
    check_state(state, path, STATE_KEYS)
    state["tag"] = tag
    if state.get("best_val_loss") is None:  # JSON has no infinity
        state["best_val_loss"] = float("inf")
    return state


def check_deepspeed_files(ds_dir: str, tag: str) -> None:
    """Refuse (CLIError) a tag folder with any .pt file that holds more than tensors, plain data and
    DeepSpeed's plain types: DeepSpeed loads these files with weights_only=False, so a crafted file
    would otherwise run code. Called before DeepSpeed or zero_to_fp32 is given the folder."""
    # reading needs no accelerator; skips DeepSpeed's detection warning
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # deepspeed takes 1.5 s to import (after DS_ACCELERATOR): only DeepSpeed folders need it
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    folder = os.path.join(ds_dir, tag)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".pt"):
            load_plain(os.path.join(folder, name),
                       allowed=(LossScaler, ZeroStageEnum, fragment_address))


def to_universal(ds_dir: str, tag: str, out_root: str) -> str:
    """DeepSpeed's universal checkpoint of ds_dir/tag written to out_root/tag (returned): every
    parameter whole, in float32, with its optimizer state, whatever the ZeRO stage, pipeline stages
    and tensor-parallel shards were. load_universal resumes from it on any number of processes. The
    tag's files are checked first."""
    check_deepspeed_files(ds_dir, tag)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # 1.5 s: see above
    out = os.path.join(out_root, tag)
    args = argparse.Namespace(input_folder=os.path.join(ds_dir, tag), output_folder=out,
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines
            ds_to_universal(args)
    except (ValueError, FileNotFoundError, AssertionError, KeyError, RuntimeError,
            NotImplementedError) as e:
        raise CLIError(f"DeepSpeed cannot convert {ds_dir}/{tag} to a universal checkpoint: "
                       f"{first_line(e)}") from None
    return out


def read_universal_weights(universal_dir: str) -> dict[str, torch.Tensor]:
    """{parameter name: float32 tensor} of a universal checkpoint (its zero/NAME/fp32.pt files)."""
    zero = os.path.join(universal_dir, "zero")
    weights = {}
    for name in sorted(os.listdir(zero)):
        path = os.path.join(zero, name, "fp32.pt")
        if os.path.isfile(path):
            tensor = load_plain(path).get("param")
            if not isinstance(tensor, torch.Tensor):
                raise CLIError(f"{path} holds no parameter tensor")
            weights[name] = tensor
    return weights


def gather_deepspeed_weights(ds_dir: str, tag: str, pipeline_stages: int = 1,
                             tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The full float32 weights of a DeepSpeed checkpoint, consolidated in memory: by zero_to_fp32
    for ZeRO data parallel, through its universal checkpoint (to a temporary folder) for pipeline or
    tensor parallel, which zero_to_fp32 cannot read; pipeline layer names become GPT's."""
    if pipeline_stages > 1 or tp_size > 1:
        with tempfile.TemporaryDirectory(prefix="universal-") as tmp:
            weights = read_universal_weights(to_universal(ds_dir, tag, tmp))
        return gpt_state_from_universal(weights) if pipeline_stages > 1 else weights
    check_deepspeed_files(ds_dir, tag)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # 1.5 s
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is for samples
            return get_fp32_state_dict_from_zero_checkpoint(ds_dir, tag=tag)
    except (ValueError, FileNotFoundError, AssertionError, KeyError, RuntimeError) as e:
        raise CLIError(f"cannot read the ZeRO checkpoint {ds_dir}/{tag}: {first_line(e)}") from None


def prune_deepspeed_tags(ds_dir: str, keep: int, own: set[str] | None = None) -> None:
    """Delete the global_stepN folders of an earlier run (those not in own, when given: a new run
    in the folder), then all but the newest `keep` (0 keeps all)."""
    if own is not None:
        for old in set(deepspeed_tags(ds_dir)) - own:
            shutil.rmtree(os.path.join(ds_dir, old), ignore_errors=True)
    if keep > 0:
        for old in deepspeed_tags(ds_dir)[:-keep]:
            shutil.rmtree(os.path.join(ds_dir, old), ignore_errors=True)


def newest_mtime(path: str) -> float:
    """Modification time of a file, or of the newest file in a folder."""
    if os.path.isfile(path):
        return os.path.getmtime(path)
    return max((os.path.getmtime(os.path.join(path, n)) for n in os.listdir(path)), default=0.0)


def converted_from(converted: str, ds_dir: str) -> str | None:
    """The newest tag that was complete before a zero_to_fp32 output was written: the one it was
    converted from (None when it is older than every tag still in the folder)."""
    written = newest_mtime(converted)
    done = [t for t in deepspeed_tags(ds_dir) if newest_mtime(os.path.join(ds_dir, t)) <= written]
    return done[-1] if done else None


def load_deepspeed_model(path: str, ds_dir: str | None = None, tag: str | None = None,
                         **overrides) -> tuple[GPT, dict, str]:
    """(model, training state, what was loaded in words) from a DeepSpeed checkpoint folder (its
    `latest` tag or `tag`, gathered in memory), or from a zero_to_fp32 output whose model config is
    in ds_dir (default: the folder above it). A converted output older than the folder's newest tag
    is used only when named, and the words say so. Dropout is off unless overrides set it."""
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
        weights = gather_deepspeed_weights(path, state["tag"], state.get("pipeline_stages", 1),
                                           state.get("tp_size", 1))
        label = f"{path} ({state['tag']}, iteration {state['iter_num']})"
    else:
        ds_dir = ds_dir or parent
        if not is_deepspeed_folder(ds_dir):
            raise CLIError(f"{path} is not a DeepSpeed checkpoint folder, and {ds_dir} (where its "
                           "model config is looked for) is not one either; pass --ds-dir "
                           "OUT_DIR/ds")
        newest, source = latest_tag(ds_dir), tag or converted_from(path, ds_dir)
        state = read_train_state(ds_dir, source or newest)
        weights = read_weights(path)
        label = f"{path} (zero_to_fp32 output of {state['tag']}, iteration {state['iter_num']})"
        if source is None:
            label = f"{path} (zero_to_fp32 output older than {newest}, the oldest checkpoint left)"
        elif source != newest and tag is None:
            label += f"; note: {ds_dir} now holds the newer {newest}"
    return model_from_weights(state["model_config"], weights, path,
                              **{"dropout": 0.0, **overrides}), state, label


def default_deepspeed_source(ds_dir: str, converted_name: str) -> str:
    """What to sample by default: the seed's converted file (ds_dir/ckpt_ds.pt) when it is at least
    as new as the newest tag, else the folder itself (its newest tag, gathered in memory)."""
    converted = os.path.join(ds_dir, converted_name)
    if os.path.exists(converted) and is_deepspeed_folder(ds_dir):
        if converted_from(converted, ds_dir) == latest_tag(ds_dir):
            return converted
    return ds_dir
