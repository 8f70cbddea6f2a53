"""Sample text from a model trained by train_ds.py (DeepSpeed ZeRO), or export it as an HF GPT-2 folder.

--ckpt is either
  * the DeepSpeed checkpoint folder itself (OUT_DIR/ds): the weights of its `latest` checkpoint (or --tag)
    are gathered in memory with deepspeed.utils.zero_to_fp32, no conversion step needed; or
  * the output of DeepSpeed's converter, as in `cd ckpt/ds && python zero_to_fp32.py . ckpt_ds.pt`
    (a folder holding pytorch_model.bin, shards with an index, or model.safetensors; or one such file).
The default is ckpt/ds/ckpt_ds.pt when it exists, else ckpt/ds. The model config and the tokenizer come
from the checkpoint folder (train_state.json, written by train_ds.py; for a converted output, the folder
above it or --ds-dir), so no training flags need repeating. Sampling options are those of test.py.
"""
import argparse
import contextlib
import json
import os
import sys

import torch

import cli
from cli import CLIError
from model import GPT, GPTConfig
from test import add_sampling_arguments, run_sampling
from tokenizer import Tokenizer, load_tokenizer

DEFAULT_DS_DIR = os.path.join("ckpt", "ds")
DEFAULT_CONVERTED = os.path.join(DEFAULT_DS_DIR, "ckpt_ds.pt")
WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
INDEX_FILES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")


def is_deepspeed_folder(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, "latest")):
        return True
    return any(name.startswith("global_step") and os.path.isdir(os.path.join(path, name)) for name in os.listdir(path))


def read_weights_file(path: str) -> dict[str, torch.Tensor]:
    """One .bin/.pt (torch.save, loaded with weights_only) or .safetensors file of a state dict."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip, safetensors header errors: all mean "not a weights file"
        raise CLIError(f"{path} is not a state dict this tool can read safely ({type(e).__name__})") from None
    if isinstance(state, dict) and isinstance(state.get("module"), dict):
        state = state["module"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CLIError(f"{path} does not hold a state dict of tensors")
    return state


def read_converted(path: str) -> dict[str, torch.Tensor]:
    """The output of zero_to_fp32: a folder (single file, or shards listed in an index) or one file."""
    if os.path.isfile(path):
        return read_weights_file(path)
    for index_name in INDEX_FILES:
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state = {}
            for shard in shards:
                state.update(read_weights_file(os.path.join(path, shard)))
            return state
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return read_weights_file(os.path.join(path, name))
    raise CLIError(f"{path} is neither a DeepSpeed checkpoint folder nor zero_to_fp32 output "
                   f"(no latest, global_stepN/, {', '.join(WEIGHT_FILES)})")


def gather_in_memory(ds_dir: str, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is for the samples
            return get_fp32_state_dict_from_zero_checkpoint(ds_dir, tag=tag)
    except (ValueError, FileNotFoundError, AssertionError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CLIError(f"cannot read the ZeRO checkpoint {ds_dir}/{tag}: {first}") from None


def load_ds_model(path: str, ds_dir: str | None = None, tag: str | None = None,
                  attn_kernel: str = "auto") -> tuple[GPT, Tokenizer, dict]:
    """(model, tokenizer, train_state) from a DeepSpeed checkpoint folder or a zero_to_fp32 output."""
    if not torch.cuda.is_available():  # converting needs no accelerator; skips DeepSpeed's detection warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from train_ds import read_train_state  # imports deepspeed: only when a checkpoint is actually read
    if not os.path.exists(path):
        raise CLIError(f"checkpoint not found: {path}")
    if is_deepspeed_folder(os.path.join(path, "ds")):  # OUT_DIR given instead of OUT_DIR/ds
        path = os.path.join(path, "ds")
    parent = os.path.dirname(os.path.abspath(path.rstrip("/\\")))
    name = os.path.basename(path.rstrip("/\\"))
    if tag is None and name.startswith("global_step") and os.path.isdir(path) and is_deepspeed_folder(parent):
        path, tag = parent, name  # one tag folder inside a checkpoint folder
    if is_deepspeed_folder(path):
        state = read_train_state(path, tag)
        weights = gather_in_memory(path, state["tag"])
    else:
        ds_dir = ds_dir or os.path.dirname(os.path.abspath(path.rstrip("/\\")))
        if not is_deepspeed_folder(ds_dir):
            raise CLIError(f"{path} is not a DeepSpeed checkpoint folder, and {ds_dir} (where its model config "
                           f"is looked for) is not one either; pass --ds-dir OUT_DIR/ds")
        state = read_train_state(ds_dir, tag)
        weights = read_converted(path)
    weights = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in weights.items()}
    # the head is tied to the token embedding: zero_to_fp32 writes both keys sharing one storage; accept either
    if "lm_head.weight" not in weights and "transformer.wte.weight" in weights:
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
    if "transformer.wte.weight" not in weights and "lm_head.weight" in weights:
        weights["transformer.wte.weight"] = weights["lm_head.weight"]
    try:
        model = GPT(GPTConfig(**{**state["model_config"], "dropout": 0.0, "attn_kernel": attn_kernel}))
    except TypeError as e:
        raise CLIError(f"unknown model config in the checkpoint: {e}") from None
    try:
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    except RuntimeError as e:
        raise CLIError(f"the weights in {path} do not fit the model config of {state['tag']}: "
                       f"{str(e).strip().splitlines()[0]}") from None
    return model, load_tokenizer(state["tokenizer"]), state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default=None,
                        help=f"DeepSpeed checkpoint folder or zero_to_fp32 output (default: {DEFAULT_CONVERTED} "
                             f"if it exists, else {DEFAULT_DS_DIR})")
    parser.add_argument("--ds-dir", default=None,
                        help="the DeepSpeed checkpoint folder holding the model config, when --ckpt is converted "
                             "output stored elsewhere (default: the folder above it)")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step2000 (default: latest)")
    parser.add_argument("--export-hf", metavar="DIR", default=None,
                        help="write the model as an HF GPT-2 folder (config.json + model.safetensors) and exit")
    add_sampling_arguments(parser)
    args = parser.parse_args()
    path = args.ckpt or (DEFAULT_CONVERTED if os.path.exists(DEFAULT_CONVERTED) else DEFAULT_DS_DIR)
    model, tok, state = load_ds_model(path, args.ds_dir, args.tag, args.attn_kernel)
    print(f"loaded {path} ({state['tag']}, iteration {state['iter_num']})", file=sys.stderr, flush=True)
    if args.export_hf:
        model.save_pretrained(args.export_hf)
        note = "" if state["tokenizer"].get("tokenizer") == "gpt2" else \
            f" (note: it uses the {state['tokenizer'].get('tokenizer')} tokenizer, not GPT-2's)"
        print(f"wrote an HF GPT-2 folder to {args.export_hf}{note}", flush=True)
        return
    run_sampling(model, tok, args)


if __name__ == "__main__":
    cli.run(main)
