"""LoRA: low-rank adapters on the network's linears with the base weights frozen (Hu et al. 2021),
their checkpoint, and the merge into a plain GPT.

A linear W becomes  W x + (alpha / r) B A dropout(x),  A (r x in) Kaiming-uniform and B (out x r)
zeros, so training starts from the base model exactly (the paper's section 4.1, as peft does). The
special tokens a task adds (toolkit/tasks.py, toolkit/chat.py) are new rows of the tied embedding;
they are trained too, as a small (k x n_embd) tensor that a parametrization puts after the frozen
rows, for the input embedding and the LM head alike. Nothing else trains but a task's head.

The adapter checkpoint is a ckpt.pt without `model`: `lora` (rank, alpha, dropout, targets, and the
base's path and sha256), `adapters` (each A, B and the new rows), plus the usual config, tokenizer,
task facts and head. toolkit/model_sources.py reads it by loading its base, checking the sha256, and
merging: merge() writes W + (alpha/r) B A. merged_checkpoint() turns the whole checkpoint into a
full one (finetune.py --merge-lora).
"""
import math
import os

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from model import GPT
from toolkit import hf
from toolkit.cli import CLIError
from toolkit.checkpoint import newest_checkpoint
from toolkit.files import fingerprint

TARGETS = {"attn": ("attn.c_attn", "attn.c_proj"), "mlp": ("mlp.c_fc", "mlp.c_proj")}
TARGETS["all"] = TARGETS["attn"] + TARGETS["mlp"]
NEW_ROWS = "new_rows"  # the LM head's (and a tied embedding's) new rows
NEW_INPUT_ROWS = "new_input_rows"  # an untied embedding's own


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus its low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's init, as in the paper
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.dropout(x) @ self.lora_a.t() @ self.lora_b.t()) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + (self.lora_b @ self.lora_a) * self.scale


class NewRows(nn.Module):
    """The embedding's rows from `first` on become a trainable tensor; earlier rows stay frozen."""

    def __init__(self, weight: torch.Tensor, first: int):
        super().__init__()
        self.first = first
        self.rows = nn.Parameter(weight[first:].detach().clone())

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([weight[: self.first], self.rows])


def add_lora(model: GPT, rank: int, alpha: float, dropout: float, targets: str,
             base_vocab: int) -> None:
    """Freeze every weight of model, wrap the targets' linears in LoRALinear, and let the embedding
    rows from base_vocab on (the special tokens) train."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:
        for name in TARGETS[targets]:
            parent, attr = name.split(".")
            owner = getattr(block, parent)
            setattr(owner, attr, LoRALinear(getattr(owner, attr), rank, alpha, dropout))
    if model.config.vocab_size > base_vocab:
        rows = NewRows(model.lm_head.weight, base_vocab)
        for module in (model.lm_head, model.transformer.wte):  # tied: one matrix, one set of rows
            if not model.config.tie_embeddings:  # untied (the llama family's): each its own rows
                rows = NewRows(module.weight, base_vocab)
            parametrize.register_parametrization(module, "weight", rows)


def adapter_state(model: GPT) -> dict[str, torch.Tensor]:
    """The trained tensors of a LoRA model, by name: each A and B, and the new embedding rows."""
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            state[f"{name}.lora_a"] = module.lora_a.detach().cpu().clone()
            state[f"{name}.lora_b"] = module.lora_b.detach().cpu().clone()
    for key, module in new_rows_of(model).items():
        state[key] = module.parametrizations.weight[0].rows.detach().cpu().clone()
    return state


def new_rows_of(model: GPT) -> dict[str, nn.Module]:
    """The modules whose new rows train, by adapter key: the head (a tied embedding shares them),
    and an untied embedding."""
    owners = {NEW_ROWS: model.lm_head, NEW_INPUT_ROWS: model.transformer.wte}
    if model.config.tie_embeddings:
        del owners[NEW_INPUT_ROWS]
    return {key: module for key, module in owners.items() if parametrize.is_parametrized(module)}


def checkpoint_entries(settings: dict | None, model: GPT) -> dict:
    """What a LoRA checkpoint holds in place of `model`; nothing when every weight trained."""
    return {} if settings is None else {"lora": settings, "adapters": adapter_state(model)}


def load_adapters(model: GPT, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy an adapter state into a model that add_lora prepared with the same settings."""
    expected = adapter_state(model)
    same_shapes = set(state) == set(expected) and all(state[k].shape == expected[k].shape
                                                      for k in expected)
    if not same_shapes:
        raise CLIError(f"the adapters in {source} do not fit its base model and LoRA settings")
    modules, rows = dict(model.named_modules()), new_rows_of(model)
    with torch.no_grad():
        for key, tensor in state.items():
            if key in rows:
                rows[key].parametrizations.weight[0].rows.copy_(tensor)
            else:
                name, part = key.rsplit(".", 1)
                getattr(modules[name], part).copy_(tensor)


def merge(model: GPT) -> GPT:
    """A plain GPT with the adapters added in: the same function, and any script reads it."""
    merged = {}
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, LoRALinear):
            merged[f"{name}.weight"] = module.merged_weight()
            if module.base.bias is not None:
                merged[f"{name}.bias"] = module.base.bias
    merged["lm_head.weight"], merged["transformer.wte.weight"] = model.lm_head.weight, \
        model.transformer.wte.weight
    for name, tensor in model.state_dict().items():
        adapted = any(part in name for part in (".base.", "parametrizations", "lora_"))
        if not adapted:
            merged.setdefault(name, tensor)
    plain = GPT(model.config).to(model.lm_head.weight.device)
    plain.load_state_dict({k: v.detach() for k, v in merged.items()})
    return plain


def merged_checkpoint(checkpoint: dict, merged: GPT, source: str) -> dict:
    """A LoRA checkpoint (read from source) as a full one: its entries, the weights of merged (the
    model it stands for, as toolkit.model_sources.load_model reads it) in place of the adapters, and
    the merge recorded in `finetune`."""
    full = {k: v for k, v in checkpoint.items() if k not in ("lora", "adapters")}
    full["model"] = merged.state_dict()
    full["finetune"] = {**checkpoint.get("finetune", {}), "merged_from": source,
                        "lora": checkpoint["lora"]}
    return full


# ----- the base -----

def lora_base(source: str) -> list[str]:
    """[the path of the base model] when source holds LoRA adapters, else []: an input too, which
    no output may replace (the adapters would be orphaned). Only the checkpoint's index is read
    (memory-mapped); a file that cannot be read is left to the loader to report."""
    path = newest_checkpoint(source)
    if not os.path.isfile(path):
        return []
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return [checkpoint["lora"]["base"]["path"]]
    except Exception:  # not a LoRA checkpoint, or not a zip file torch can map
        return []


def base_record(source: str) -> dict:
    """What an adapter checkpoint records of its base for check_base: where it lies on disk (the
    file or folder given, or an HF name's folder in the local cache), and its sha256."""
    path = os.path.abspath(source) if os.path.exists(source) else hf.find_model_dir(source)
    return {"path": path, "sha256": fingerprint(path)}


def check_base(lora: dict, source: str) -> str:
    """The path of a LoRA checkpoint's base, found and unchanged since the adapters were trained."""
    base = lora["base"]
    path = base["path"]
    if not os.path.exists(path):
        raise CLIError(f"the base model of the LoRA adapters in {source} is missing: {path}; put "
                       f"it back, or merge the adapters where it exists (finetune.py --merge-lora)")
    if fingerprint(path) != base["sha256"]:
        raise CLIError(f"the base model of the LoRA adapters in {source} has changed since they "
                       f"were trained: {path} no longer has sha256 {base['sha256'][:12]}...; use "
                       f"the base they were trained on")
    return path
