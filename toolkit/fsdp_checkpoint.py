"""The sharded checkpoint of `train_ddp.py --fsdp`: each rank writes its own shard of the weights
and of the optimizer's state with `torch.distributed.checkpoint` (DCP), so no process ever holds
the whole model. A folder, `dcp/` in --out-dir beside where ckpt.pt would be (DeepSpeed's is `ds/`):

    latest            the newest complete tag, e.g. `iter_0000300`; written last, atomically
    iter_0000300/     DCP's files: one `__R_0.distcp` per rank and `.metadata` (tensors only);
                      a second save of the same step goes to `iter_0000300_1/`
        state.pt      ckpt.pt's other keys (configs, tokenizer, iter_num, history, RNG, scaler,
                      the optimizer's param_groups), written by rank 0

A kill during a save leaves `latest` naming the previous tag, which loads; the next save removes
the unfinished one. DCP reshards on load, so a run resumes on any number of ranks, and
`read_sharded` gathers the whole checkpoint in one process as a ckpt.pt dict (what test.py,
eval.py, finetune.py, embed.py and the exports read; test.py --export-ckpt writes it as a file).
Where an --out-dir holds both (a run that went on under train.py), the later step is the run's.
DCP unpickles `.metadata` and non-tensor items: here only DCP's own metadata classes are let
through the unpickler, and a checkpoint holds no non-tensor item.
"""
import io
import os
import pickle
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from toolkit import distributed
from toolkit.checkpoint import (POINTER_FILE, STATE_KEYS, TAG, check_state, clean_state_dict,
                                load_plain, read_pointer)
from toolkit.cli import CLIError, first_line
from toolkit.files import atomic_write, make_folder

STATE_FILE = "state.pt"
# what DCP's .metadata pickles: its own classes, torch's sizes, dtypes and layouts, a path
DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                    ("collections", "OrderedDict")}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch's sizes and dtypes; any other global is refused."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not (module in DCP_MODULES or (module, name) in METADATA_GLOBALS or dtype):
            raise pickle.UnpicklingError(f"{module}.{name} is not DCP metadata")
        return super().find_class(module, name)


class CheckedReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = MetadataUnpickler(f).load()
            except Exception as e:  # a damaged or foreign file fails anywhere in the unpickler
                raise CLIError(f"{self.path}: its DCP metadata is not one this toolkit reads "
                               f"({e})") from None
        if getattr(metadata, "storage_meta", None) is None:  # (as DCP's own reader does)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, refusing a pickled (non-tensor) item rather than running it."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CLIError(f"{read_item.dest_index.fqn}: a sharded checkpoint of this toolkit holds "
                       "tensors only")


def tensors_of(weights: dict, optimizer: dict | None) -> dict:
    """What DCP writes: the weights and each parameter's optimizer state, keyed by string."""
    tensors = {"model": clean_state_dict(weights)}
    if optimizer is not None:
        tensors["optimizer"] = {str(i): values for i, values in optimizer["state"].items()}
    return tensors


def save_sharded(folder: str, state: dict, weights: dict, optimizer: dict | None,
                 scaler: dict | None, rng: dict) -> None:
    """Every rank calls it (a collective): its shards into a new tag, rank 0 the rest, then rank 0
    points `latest` at the tag and removes the others."""
    tag = f"iter_{state['iter_num']:07d}"
    if read_pointer(folder) == tag:  # saved before (or by a run this one --overwrites): beside it
        tag += "_1"
    path = os.path.join(folder, tag)
    if distributed.rank() == 0:
        make_folder(folder)
        shutil.rmtree(path, ignore_errors=True)  # a save cut short before
    distributed.barrier()
    dcp.save(tensors_of(weights, optimizer), storage_writer=FileSystemWriter(path))
    if distributed.rank() == 0:
        rest = {**state, "scaler": scaler, "rng": rng,
                "optimizer": None if optimizer is None else
                {"param_groups": optimizer["param_groups"]}}
        atomic_write(os.path.join(path, STATE_FILE), lambda tmp: torch.save(rest, tmp))
        atomic_write(os.path.join(folder, POINTER_FILE), lambda tmp: write_text(tmp, tag))
        for old in os.listdir(folder):
            if TAG.fullmatch(old) and old != tag:
                shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
    distributed.barrier()


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read_state(folder: str) -> tuple[str, dict]:
    """(the newest tag's path, its state.pt), checked as a resume's state is."""
    tag = read_pointer(folder)
    if tag is None:
        raise CLIError(f"{folder}: its `{POINTER_FILE}` names no checkpoint")
    path = os.path.join(folder, tag)
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise CLIError(f"{folder}: its `{POINTER_FILE}` names {tag}, of which {path}/{STATE_FILE} "
                       "is not there")
    state = load_plain(os.path.join(path, STATE_FILE))
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        raise CLIError(f"{path}/{STATE_FILE} is not the state of a sharded checkpoint")
    check_state(state, path, ("iter_num", "train_config"))
    return path, state


def load_sharded(folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                 ) -> dict:
    """Load the newest tag into a sharded model (and optimizer) of any number of ranks: DCP reads
    each rank's part of every tensor. Returns state.pt (every rank calls it: a collective)."""
    path, state = read_state(folder)
    tensors = {"model": clean_state_dict(model.state_dict())}
    if optimizer is not None and state["optimizer"] is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        tensors["optimizer"] = {}
        for (index, name), (shape, dtype) in optimizer_keys(stored_tensors(path), path).items():
            if index >= len(params):
                raise CLIError(f"{path}: its optimizer state does not fit this optimizer (it has "
                               f"state for parameter {index}, of {len(params)})")
            p = params[index]
            # a state tensor shaped as its parameter is sharded as it is; others (steps) whole
            like = torch.zeros_like(p) if tuple(shape) == tuple(p.shape) else \
                torch.zeros(shape, dtype=dtype)
            tensors["optimizer"].setdefault(str(index), {})[name] = like
    load_tensors(tensors, path)
    if "optimizer" in tensors:
        state["optimizer"] = {"param_groups": state["optimizer"]["param_groups"],
                              "state": {int(i): v for i, v in tensors["optimizer"].items()}}
    state["model"] = tensors["model"]
    return state


def load_tensors(tensors: dict, path: str, **kwargs) -> None:
    """dcp.load of a tag into tensors, in place; a damaged tag is a CLIError."""
    try:
        dcp.load(tensors, storage_reader=CheckedReader(path), planner=TensorsOnlyPlanner(),
                 **kwargs)
    except CLIError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps each rank's failure, ours too
        failures = [error for error, _ in e.failures.values()] \
            if isinstance(e, CheckpointException) else [e]
        ours = next((f for f in failures if isinstance(f, CLIError)), None)
        if ours is not None:
            raise ours from None
        raise CLIError(f"{path}: its shards are truncated, corrupt or not of this model "
                       f"({first_line(failures[0])[:200]})") from None


def stored_tensors(path: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{key: (shape, dtype)} of every item a tag holds, from its metadata: tensors only."""
    stored = {}
    for key, meta in CheckedReader(path).read_metadata().state_dict_metadata.items():
        if not hasattr(meta, "properties"):
            raise CLIError(f"{path}: {key} is not a tensor; a sharded checkpoint of this toolkit "
                           "holds tensors only")
        stored[key] = (meta.size, meta.properties.dtype)
    return stored


def optimizer_keys(stored: dict, path: str) -> dict[tuple[int, str], tuple]:
    """{(parameter index, state name): (shape, dtype)} of the optimizer's items among stored."""
    found = {}
    for key, value in stored.items():
        if key.startswith("optimizer."):
            index, _, name = key.removeprefix("optimizer.").partition(".")
            if not index.isdigit() or not name:
                raise CLIError(f"{path}: {key} is no optimizer state this toolkit writes")
            found[int(index), name] = value
    return found


def read_sharded(folder: str) -> dict:
    """The newest tag gathered whole in this process (no process group needed): a ckpt.pt dict."""
    path, state = read_state(folder)
    stored = stored_tensors(path)
    tensors = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in stored.items()}
    with warnings.catch_warnings():  # (that no process group is there: none is needed)
        warnings.simplefilter("ignore")
        load_tensors(tensors, path, no_dist=True)
    weights = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    if state["optimizer"] is not None:
        per_param = {}
        for index, name in optimizer_keys(stored, path):
            per_param.setdefault(index, {})[name] = tensors[f"optimizer.{index}.{name}"]
        state["optimizer"] = {**state["optimizer"], "state": per_param}
    return {**state, "model": weights}

