"""Train a GPT with data parallelism over several processes (DistributedDataParallel) under torchrun.

Same flags as train.py, plus --backend and --timeout. Launch it with torchrun, one process per GPU
(or a few per CPU machine):

    torchrun --standalone --nproc_per_node N train_ddp.py [train.py flags]
    python -m torch.distributed.run --standalone --nproc_per_node N train_ddp.py [flags]
    # M machines: run this on each, with R = 0 .. M-1 and A:P reachable from all of them
    torchrun --nnodes M --node_rank R --master_addr A --master_port P --nproc_per_node N train_ddp.py [flags]

--batch-size is the micro-batch of one process and --grad-accum counts micro-batches per optimizer step
over ALL processes (default: one per process), so the same flags train the same model (same data, same
global batch) on any number of processes; --grad-accum must be a multiple of the number of processes. Each step draws one
global set of windows and every rank takes its slice; evaluation is averaged over all ranks; rank 0
alone prints, writes TensorBoard logs and writes OUT_DIR/ckpt.pt, in train.py's format (so train.py
resumes a DDP run and the reverse, and test.py samples from it).

With `torchrun --max-restarts K`, when a process dies the job restarts and continues from
OUT_DIR/ckpt.pt (use --save-interval to bound the lost work; OUT_DIR must be shared by all nodes).
SIGTERM or Ctrl-C to torchrun makes every rank finish its step, save and exit 0; torchrun itself then
re-raises the signal and exits 1 (a SIGTERM sent to the worker processes alone ends with status 0).
torchrun waits 30 s for that (--shutdown-timeout) before killing the workers.

Timeouts: --timeout bounds waits inside the job (a hung peer, rank 0 saving); torchrun's own wait for
the other nodes defaults to 600 s: `--rdzv-conf timeout=60` shortens it. Errors (e.g. --grad-accum not
a multiple of the world size) are one line from rank 0; torchrun adds its own failure report.
On CPU, OMP_NUM_THREADS (torchrun sets 1 when N > 1) is each process's thread count (device.set_job_threads). Started without
torchrun (no RANK/WORLD_SIZE in the environment) it stops with an error: use train.py for one process.
"""
import datetime
import os

import torch
import torch.distributed as dist

import cli
from checkpoint import CHECKPOINT_FILE
from device import resolve_device, set_job_threads
from training import TorchEngine, Trainer, add_distributed_arguments, parse_config

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def extra_arguments(parser) -> None:
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="process group backend (default: nccl on CUDA, gloo otherwise)")
    add_distributed_arguments(parser)


def init_distributed(cfg, args) -> None:
    """Check the environment torchrun provides, pick the device and backend, join the process group."""
    missing = [name for name in TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise cli.CLIError(f"{' '.join(missing)} not set: launch with torchrun --nproc_per_node N train_ddp.py ... "
                           f"(or use train.py for one process)")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = resolve_device(cfg.device, local_rank)
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise cli.CLIError(f"--backend nccl needs CUDA devices, but the device is {device}; use --backend gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_job_threads()
    if args.timeout <= 0:
        raise cli.CLIError("--timeout must be positive")
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    timeout = datetime.timedelta(seconds=args.timeout)
    try:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps one key-value store for all restarts: without a per-restart prefix, restarted workers
        # may read their dead predecessors' addresses and fail to connect (pytorch/pytorch#135712)
        store = dist.PrefixStore(f"train_ddp/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError on a missing peer
        raise cli.CLIError(f"rendezvous at {where} failed ({os.environ['WORLD_SIZE']} processes expected): "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def resume_after_restart(cfg, device_type: str) -> None:
    """After torchrun restarted the workers (a rank died), continue from OUT_DIR/ckpt.pt when it exists."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or cfg.init_from == "resume":
        return
    seen = torch.tensor([float(os.path.isfile(os.path.join(cfg.out_dir, CHECKPOINT_FILE)))],
                        device="cuda" if device_type == "cuda" else "cpu")
    dist.all_reduce(seen)  # every rank must take the same decision
    if 0 < seen.item() < dist.get_world_size():
        raise cli.CLIError(f"{os.path.join(cfg.out_dir, CHECKPOINT_FILE)} is visible to only some processes; "
                           f"--out-dir must be on a filesystem shared by all nodes to resume")
    if seen.item():
        cfg.init_from = "resume"


def main() -> None:
    cfg, explicit, args = parse_config(description=__doc__, extra_arguments=extra_arguments)
    init_distributed(cfg, args)
    resume_after_restart(cfg, resolve_device(cfg.device).type)
    trainer = Trainer(cfg, explicit, TorchEngine(cfg.out_dir))
    if trainer.master and cfg.init_from == "resume":
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        print(f"resumed from {trainer.engine.path} at iteration {trainer.iter_num}"
              + (f" after restart {restart}" if restart else ""), flush=True)
    trainer.fit()


if __name__ == "__main__":
    cli.run_distributed(main)
