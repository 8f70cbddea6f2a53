"""Process groups: joining the one torchrun starts, this process's place in it, and the all-reduce
the loop uses.

Everything here also works in a single process (rank 0 of 1), so callers need no special case.
"""
import argparse
import datetime
import math
import os
import socket

import torch
import torch.distributed as dist

from toolkit.cli import CLIError, first_line
from toolkit.device import resolve_device, set_job_threads

MAX_TIMEOUT = 365 * 24 * 3600
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """The sums over all processes of each value (float64; on the GPU for NCCL, else on the CPU)."""
    if world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now (for a launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_distributed_flags(parser: argparse.ArgumentParser, backend: bool = True) -> None:
    """--backend (torchrun's scripts) and --timeout (every multi-process script)."""
    if backend:
        parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                            help="process group backend (default: nccl on CUDA, gloo otherwise)")
    parser.add_argument("--timeout", type=timeout_seconds, default=300,
                        help="seconds a process waits for the others at start-up or in any "
                             "collective (e.g. while rank 0 saves) before failing (default: 300)")


def timeout_seconds(text: str) -> float:
    """--timeout: whole seconds to a year (gloo counts milliseconds in a C int64; under a second the
    store's own connection times out)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 1 <= seconds <= MAX_TIMEOUT:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds from 1 to "
                                         f"{MAX_TIMEOUT:,}")
    return seconds


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def check_torchrun_vars() -> None:
    """torchrun's variables, when set by hand, make sense: a rank outside the world would wait for
    its peers until --timeout."""
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        value = os.environ[name]
        if not value.isdecimal():
            raise CLIError(f"{name}={value!r} is not a non-negative integer; torchrun sets it")
        numbers[name] = int(value)
    if not numbers["RANK"] < numbers["WORLD_SIZE"]:
        raise CLIError(f"RANK={numbers['RANK']} is outside WORLD_SIZE={numbers['WORLD_SIZE']} "
                       "(ranks are 0 to WORLD_SIZE - 1); torchrun sets both")
    if not 0 < numbers["MASTER_PORT"] < 65536:
        raise CLIError(f"MASTER_PORT={numbers['MASTER_PORT']} is not a port (1 to 65535)")


def init_torchrun(device_name: str, backend: str | None, timeout: float) -> torch.device:
    """Check the environment torchrun provides, pick this process's device and the backend, join the
    process group; returns the device."""
    missing = [name for name in TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise CLIError(f"{' '.join(missing)} not set: launch with torchrun --nproc_per_node N ... "
                       f"(or use one process without torchrun)")
    check_torchrun_vars()
    device = resolve_device(device_name, local_rank())
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise CLIError(f"--backend nccl needs CUDA devices, but the device is {device}; use "
                       "--backend gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_job_threads()
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    wait = datetime.timedelta(seconds=timeout)
    try:
        store, rank_, size = next(dist.rendezvous("env://", timeout=wait))
        # torchrun keeps one key-value store for all restarts: without a per-restart prefix,
        # restarted workers may read their dead predecessors' addresses and fail to connect
        # (pytorch/pytorch#135712)
        store = dist.PrefixStore("toolkit/restart_"
                                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank_, world_size=size, timeout=wait,
                                device_id=device if device.type == "cuda" else None)
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError on a missing peer
        raise CLIError(f"rendezvous at {where} failed ({os.environ['WORLD_SIZE']} processes "
                       f"expected): {first_line(e)}") from None
    return device
