"""Options as dataclass fields: one kebab-case flag per field, with its help, its range check and
its choices; Megatron-LM's names in a help group of their own; --config JSON files typed like the
flags.

    @dataclass
    class Config:
        lr: float = option(1e-3, "peak learning rate", check="positive")
        split: str = option("969,30,1", "train,val,test split", megatron=True)

    parser = cli.argument_parser(__doc__)
    add_flags(parser, Config, aliases={"lr": ["--learning-rate"]})
    cfg = Config(**values(parser.parse_args(argv), Config))
    check_values(cfg)                 # every range, one wording per kind of check
"""
import argparse
import os
from collections.abc import Callable
from dataclasses import field, fields

from toolkit.cli import ArgumentParser, CLIError
from toolkit.files import read_json

# check name -> (test, what the value must be)
CHECKS = {
    "positive": (lambda v: v >= 1, "at least 1"),
    "non-negative": (lambda v: v >= 0, "at least 0"),
    # (up to 1e30: a rate times a weight stays inside float32's range, 3.4e38)
    "positive-number": (lambda v: 0 < v <= 1e30, "a number > 0 and at most 1e30"),
    "non-negative-number": (lambda v: 0 <= v <= 1e30, "a number >= 0 and at most 1e30"),
    "seed": (lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63 - 1"),
    "probability": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "share": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "folder-name": (lambda v: bool(v) and os.sep not in v and v not in (".", ".."),
                    "a plain folder name"),
    "split": (lambda v: split_weights(v) is not None,
              "up to 3 comma-separated finite weights >= 0 with a positive sum, e.g. 969,30,1"),
}
MEGATRON_GROUP = ("Megatron-LM's names", "Megatron-LM's options and its spellings of the options "
                                         "above; each sets the same value as the option it names.")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (a script's own flags, outside the dataclasses)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
        return value
    return parse


def split_weights(split: str) -> list[float] | None:
    """Megatron's --split "969,30,1" (or "969/30/1") as its 3 weights, or None if it is not one."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        return None
    weights = (weights + [0.0, 0.0])[:3] if len(weights) <= 3 else []
    if not weights or not all(0 <= w <= 1e30 for w in weights) or sum(weights) <= 0:
        return None  # (NaN fails every comparison)
    return weights


def option(default, help: str, *, check: str | None = None, choices: list | None = None,
           megatron: bool = False, required: bool = False):
    """A config field with its --help text, the CHECKS rule its value must pass, its choices,
    whether it is a Megatron-LM option (listed in their group), and whether it is required."""
    assert check is None or check in CHECKS, check
    return field(default=default, metadata={"help": help, "check": check, "choices": choices,
                                            "megatron": megatron, "required": required})


def option_fields(config_class) -> list:
    """The fields that are options (made by option()), not a config's own bookkeeping."""
    return [f for f in fields(config_class) if "help" in f.metadata]


def flag(name: str) -> str:
    """The flag of a field: lr_decay_iters -> --lr-decay-iters."""
    return "--" + name.replace("_", "-")


def base_type(annotation) -> type:
    """int | None -> int."""
    args = getattr(annotation, "__args__", None)
    return args[0] if args else annotation


def add_flags(parser: argparse.ArgumentParser, config_class: type,
              aliases: dict[str, list[str]] | None = None, argument_default=None,
              overrides: dict[str, dict | None] | None = None) -> None:
    """One flag per field of config_class; Megatron's options and the aliases (other spellings of a
    field, e.g. Megatron's) in the Megatron group. argument_default=argparse.SUPPRESS omits flags
    not given. overrides: a script's own help or choices for a field, or None to omit its flag."""
    overrides = overrides or {}
    for f in option_fields(config_class):
        if f.name in overrides and overrides[f.name] is None:
            continue
        kwargs = {"dest": f.name, "help": f.metadata["help"]}
        if f.metadata["choices"]:
            kwargs["choices"] = f.metadata["choices"]
        if f.metadata["required"] and argument_default is None:
            kwargs["required"] = True
        kwargs.update(overrides.get(f.name) or {})
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = base_type(f.type)
        kwargs["default"] = f.default if argument_default is None else argument_default
        if argument_default is None and f.default is not None and f.type is not bool:
            kwargs["help"] += f" (default: {f.default})"
        (megatron_group(parser) if f.metadata["megatron"] else parser).add_argument(flag(f.name),
                                                                                    **kwargs)
        for alias in (aliases or {}).get(f.name, []):
            alias_kwargs = {**kwargs, "default": argparse.SUPPRESS, "help": f"= {flag(f.name)}"}
            megatron_group(parser).add_argument(alias, **alias_kwargs)


def add_estimate_flags(parser: argparse.ArgumentParser, layout: str) -> None:
    """train_ds.py's and train_ddp.py's --estimate-memory, over --num-nodes x --num-gpus."""
    parser.add_argument("--estimate-memory", action="store_true",
                        help="print the parameters and memory per device of this model and layout "
                             f"({layout}) on --num-nodes x --num-gpus, and exit; nothing is "
                             "allocated and no process group is needed")
    parser.add_argument("--num-nodes", type=at_least(1), default=1,
                        help="machines, for --estimate-memory (default: 1)")
    parser.add_argument("--num-gpus", type=at_least(1), default=1,
                        help="devices per machine, for --estimate-memory (default: 1)")


def megatron_group(parser: argparse.ArgumentParser):
    """The parser's help group of Megatron-LM's names (made on first use)."""
    for group in parser._action_groups:
        if group.title == MEGATRON_GROUP[0]:
            return group
    return parser.add_argument_group(*MEGATRON_GROUP)


def given(config_class: type, argv: list[str] | None, aliases: dict[str, list[str]] | None = None,
          overrides: dict[str, dict | None] | None = None) -> set[str]:
    """The fields whose flags (or aliases) appear in argv: the values the user chose, which a
    resumed checkpoint does not override."""
    # the same spellings as the script's
    parser = ArgumentParser(add_help=False, allow_abbrev=False)
    add_flags(parser, config_class, aliases, argument_default=argparse.SUPPRESS,
              overrides=overrides)
    return set(vars(parser.parse_known_args(argv)[0]))


def values(args: argparse.Namespace, config_class: type) -> dict:
    """The parsed values of config_class's fields."""
    return {f.name: getattr(args, f.name, f.default) for f in option_fields(config_class)}


def check_values(cfg) -> None:
    """Each checked field's value passes its check (CLIError naming the flag); None means unset."""
    for f in fields(cfg):
        value, rule = getattr(cfg, f.name), f.metadata.get("check")
        if rule is None or value is None:
            continue
        test, wanted = CHECKS[rule]
        if not test(value):
            raise CLIError(f"{flag(f.name)} must be {wanted}, got {value!r}")


def read_config_file(path: str, config_class: type) -> dict:
    """Option values from a JSON object; keys are field names (snake_case or kebab-case), values
    typed as the flags are, choices as theirs."""
    known = {f.name for f in option_fields(config_class)}
    raw = read_json(path, "config file")
    values = {k.replace("-", "_"): v for k, v in raw.items()}
    if len(values) < len(raw):
        twice = sorted(k for k in raw if k.replace("-", "_") != k and k.replace("-", "_") in raw)
        raise CLIError(f"{path}: {twice[0]} and {twice[0].replace('-', '_')} are one option, "
                       "given twice; keep one")
    unknown = sorted(set(values) - known)
    if unknown:
        raise CLIError(f"{path}: unknown option(s) {', '.join(unknown)}")
    check_types(values, config_class, path)
    return values


def check_types(values: dict, config_class: type, source: str) -> None:
    """Each value of a config_class field has the field's type and is one of its choices (a JSON
    file's or a checkpoint's options; CLIError naming `source`)."""
    known = {f.name: f for f in option_fields(config_class)}
    for name, value in values.items():
        f = known[name]
        kind = base_type(f.type)
        nullable = f.type is not kind
        allowed = {bool: (bool,), int: (int,), float: (int, float)}.get(kind, (str,))
        ok = (value is None and nullable) or type(value) in allowed
        if not ok:
            raise CLIError(f"{source}: {name} must be "
                           f"{'null or ' if nullable else ''}{kind.__name__}, got {value!r}")
        choices = f.metadata["choices"]
        if choices and value is not None and value not in choices:
            raise CLIError(f"{source}: {name} must be one of {', '.join(choices)}, got {value!r}")
