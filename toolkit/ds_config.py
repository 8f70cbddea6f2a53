"""The DeepSpeed config (ds_config.json) against the flags: its values checked for their kind
before start-up, each value both can set settled from one source, and the precision it asks for.

    check_ds_config(ds, path)                        # a wrong kind of value: one line, at once
    cfg, full = reconcile(cfg, ds, path, world_size, device)
"""
import copy
import os
from dataclasses import replace

import torch

from toolkit.cli import CLIError
from toolkit.device import resolve_dtype
from toolkit.train_config import TrainConfig

# Values that both the flags and the DeepSpeed config can set: (flags, config key, the config value
# the flags give for W processes, the flag values a config value gives). --grad-accum counts
# micro-batches over all processes, DeepSpeed's gradient_accumulation_steps those of one process.
SHARED_SETTINGS = [
    (("batch_size",), "train_micro_batch_size_per_gpu",
     lambda c, w: c.batch_size, lambda v, w: {"batch_size": int(v)}),
    (("grad_accum",), "gradient_accumulation_steps",  # unset: one micro-batch per process
     lambda c, w: (c.grad_accum or w) / w, lambda v, w: {"grad_accum": int(v) * w}),
    (("grad_clip",), "gradient_clipping",
     lambda c, w: c.grad_clip, lambda v, w: {"grad_clip": float(v)}),
    (("lr",), "optimizer.params.lr",
     lambda c, w: c.lr, lambda v, w: {"lr": float(v)}),
    (("weight_decay",), "optimizer.params.weight_decay",
     lambda c, w: c.weight_decay, lambda v, w: {"weight_decay": float(v)}),
    (("beta1", "beta2"), "optimizer.params.betas",
     lambda c, w: [c.beta1, c.beta2], lambda v, w: {"beta1": float(v[0]), "beta2": float(v[1])}),
]


def number(v) -> bool:
    return type(v) in (int, float)


# what the config's values that this toolkit reads must be (DeepSpeed would fail on the others
# halfway through start-up, with a traceback, or take them silently)
CONFIG_VALUES = {
    "train_micro_batch_size_per_gpu": (lambda v: type(v) is int and v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": (lambda v: type(v) is int and v >= 1, "an integer >= 1"),
    "train_batch_size": (lambda v: type(v) is int and v >= 1, "an integer >= 1"),
    "gradient_clipping": (lambda v: number(v) and v >= 0, "a number >= 0"),
    "optimizer.type": (lambda v: isinstance(v, str) and v.lower() in ("adam", "adamw"),
                       '"AdamW" (train_ds.py trains with AdamW)'),
    "optimizer.params.lr": (lambda v: number(v) and 0 < v <= 1e30, "a number > 0, at most 1e30"),
    "optimizer.params.weight_decay": (lambda v: number(v) and v >= 0, "a number >= 0"),
    "optimizer.params.betas": (lambda v: isinstance(v, list) and len(v) == 2 and
                               all(number(b) and 0 <= b < 1 for b in v),
                               "[beta1, beta2], each in [0, 1)"),
    "optimizer.params.eps": (lambda v: number(v) and 0 < v < 1, "a number in (0, 1)"),
    "zero_optimization.stage": (lambda v: v in (0, 1, 2, 3) and type(v) is int, "0, 1, 2 or 3"),
    **{f"{section}.enabled": (lambda v: type(v) is bool, "true or false")
       for section in ("bf16", "bfloat16", "fp16")},
}
CONFIG_SECTIONS = ("optimizer", "optimizer.params", "zero_optimization", "bf16", "bfloat16", "fp16",
                   "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
                   "tensor_parallel", "checkpoint")


def check_ds_config(ds: dict, path: str) -> None:
    """The sections and values of a DeepSpeed config that this toolkit reads, each of its kind."""
    for section in CONFIG_SECTIONS:
        value = get_key(ds, section)
        if value is not None and not isinstance(value, dict):
            raise CLIError(f"{path}: {section} must be an object, got {value!r:.60}")
    for key, (test, wanted) in CONFIG_VALUES.items():
        parent, _, name = key.rpartition(".")
        section = get_key(ds, parent) if parent else ds
        if isinstance(section, dict) and name in section and not test(section[name]):
            raise CLIError(f"{path}: {key} must be {wanted}, got {section[name]!r:.60}")


def get_key(ds: dict, key: str):
    for part in key.split("."):
        ds = ds.get(part) if isinstance(ds, dict) else None
    return ds


def set_key(ds: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        ds = ds.setdefault(part, {})
    ds[last] = value


def config_precision(ds: dict) -> str | None:
    """float32/bfloat16/float16 per the config's bf16 and fp16 sections; None if it has neither."""
    bf16 = ds.get("bf16", ds.get("bfloat16"))
    fp16 = ds.get("fp16")
    if bf16 is None and fp16 is None:
        return None
    bf16_on, fp16_on = bool((bf16 or {}).get("enabled")), bool((fp16 or {}).get("enabled"))
    if bf16_on and fp16_on:
        raise CLIError("the DeepSpeed config enables both bf16 and fp16; enable at most one")
    return "bfloat16" if bf16_on else "float16" if fp16_on else "float32"


def reconcile(cfg: TrainConfig, ds: dict, path: str, world_size: int, device: torch.device,
              resumed: set[str] = frozenset()) -> tuple[TrainConfig, dict]:
    """Settle every value that both the flags and the DeepSpeed config can set.

    cfg.given names the flags set on purpose (command line, --config file, a resumed checkpoint).
    A value set in only one place is used and copied to the other; set in both and different it is
    a CLIError. Returns the updated TrainConfig and the complete DeepSpeed config to pass to
    deepspeed.initialize."""
    ds = copy.deepcopy(ds)
    name = os.path.basename(path)
    if ds.get("scheduler"):
        raise CLIError(f"{name} has a scheduler section; the learning-rate schedule comes from the "
                       "flags (--lr, --min-lr, --warmup-iters, --lr-decay-iters): remove it")
    ds.setdefault("optimizer", {"type": "AdamW"})
    for flags, key, to_config, from_config in SHARED_SETTINGS:
        value = get_key(ds, key)
        if value is None:
            continue
        mine = [f for f in flags if f in cfg.given]
        if mine and to_config(cfg, world_size) != value:
            shown = " ".join(f"--{f.replace('_', '-')} {getattr(cfg, f)}" for f in mine)
            if "grad_accum" in mine:
                shown += f" (micro-batches over all {world_size} processes)"
            if set(mine) <= resumed:
                raise CLIError(f"{name} sets {key} {value} but the checkpoint was trained with "
                               f"{shown}; give the flag to change it, or change the config")
            raise CLIError(f"{name} sets {key} {value} but {shown} was given; they must agree: "
                           "change one of them or drop the flag")
        cfg = replace(cfg, **from_config(value, world_size))
    if cfg.grad_accum is not None and cfg.grad_accum % world_size:
        raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across {world_size} "
                       f"processes; use a multiple of {world_size}")
    global_batch = cfg.batch_size * (cfg.grad_accum or world_size)
    if ds.get("train_batch_size") is not None and ds["train_batch_size"] != global_batch:
        raise CLIError(f"{name} sets train_batch_size {ds['train_batch_size']} but the global "
                       f"batch is {cfg.batch_size} x {cfg.grad_accum or world_size} = "
                       f"{global_batch}; remove train_batch_size (it is derived)")
    # the flags' values, written into the config DeepSpeed gets
    for _, key, to_config, _ in SHARED_SETTINGS:
        value = to_config(cfg, world_size)
        set_key(ds, key, int(value) if key == "gradient_accumulation_steps" else value)

    ds_dtype = config_precision(ds)
    if ds_dtype is not None and "dtype" in cfg.given and cfg.dtype not in ("auto", ds_dtype):
        raise CLIError(f"{name} sets precision {ds_dtype} (its bf16/fp16 sections) but --dtype "
                       f"{cfg.dtype} was given; they must agree: change one of them or drop the "
                       "flag")
    cfg = replace(cfg,
                  dtype=ds_dtype or str(resolve_dtype(cfg.dtype, device)).removeprefix("torch."))
    resolve_dtype(cfg.dtype, device)  # a clear error where the CPU has no float16
    ds["bf16"] = {**(ds.pop("bfloat16", None) or ds.get("bf16") or {}),
                  "enabled": cfg.dtype == "bfloat16"}
    ds["fp16"] = {**ds.get("fp16", {}), "enabled": cfg.dtype == "float16"}
    ds.setdefault("steps_per_print", 10 ** 9)  # the trainer logs; keep DeepSpeed quiet
    return cfg, ds


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))
