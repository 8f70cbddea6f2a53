"""Train a GPT with data parallelism over several processes (DistributedDataParallel) under
torchrun.

Same flags as train.py, plus --backend and --timeout. Launch it with torchrun, one process per GPU
(or a few per CPU machine):

    torchrun --standalone --nproc_per_node N train_ddp.py [train.py flags]
    python -m torch.distributed.run --standalone --nproc_per_node N train_ddp.py [flags]
    # M machines: run this on each, with R = 0 .. M-1 and A:P reachable from all of them
    torchrun --nnodes M --node_rank R --master_addr A --master_port P --nproc_per_node N train_ddp.py [flags]

--batch-size is the micro-batch of one process and --grad-accum counts micro-batches per optimizer
step over ALL processes (default: one per process), so the same flags train the same model (same
data, same global batch) on any number of processes; --grad-accum must be a multiple of the number
of processes. Each step draws one global set of windows and every rank takes its slice; evaluation
is averaged over all ranks; rank 0 alone prints, writes TensorBoard logs and writes OUT_DIR/ckpt.pt,
in train.py's format (so train.py resumes a DDP run and the reverse, and test.py samples from it).

With `torchrun --max-restarts K`, when a process dies the job restarts and continues from
OUT_DIR/ckpt.pt (use --save-interval to bound the lost work; OUT_DIR must be shared by all nodes).
SIGTERM or Ctrl-C to torchrun makes every rank finish its step, save and exit 0; torchrun itself
then re-raises the signal and exits 1 (a SIGTERM sent to the worker processes alone ends with status
0). torchrun waits 30 s for that (--shutdown-timeout) before killing the workers.

Timeouts: --timeout bounds waits inside the job (a hung peer, rank 0 saving); torchrun's own wait
for the other nodes defaults to 600 s: `--rdzv-conf timeout=60` shortens it. Errors (e.g.
--grad-accum not a multiple of the world size) are one line from rank 0; torchrun adds its own
failure report. On CPU, OMP_NUM_THREADS (torchrun sets 1 when N > 1) is each process's thread count.
Started without torchrun (no RANK/WORLD_SIZE in the environment) it stops with an error: use
train.py for one process.
"""
import os

import torch
import torch.distributed as dist

from toolkit import cli, distributed
from toolkit.checkpoint import CHECKPOINT_FILE
from toolkit.megatron import tracking_emissions
from toolkit.pretraining import TrainConfig, parse_config, setup
from toolkit.training import TorchEngine


def resume_after_restart(cfg: TrainConfig, device: torch.device) -> None:
    """After torchrun restarts the workers (a rank died), resume from OUT_DIR/ckpt.pt if present."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not restarted or cfg.init_from == "resume":
        return
    path = os.path.join(cfg.out_dir, CHECKPOINT_FILE)
    seen = distributed.all_reduce_sum([float(os.path.isfile(path))], device)[0]  # every rank decides the same
    if 0 < seen < dist.get_world_size():
        raise cli.CLIError(f"{path} is visible to only some processes; --out-dir must be on a "
                           "filesystem shared by all nodes to resume")
    if seen:
        cfg.init_from = "resume"


def main(argv: list[str] | None = None) -> None:
    cfg, given, args = parse_config(argv, description=__doc__, extra_arguments=distributed.add_distributed_flags)
    device = distributed.init_torchrun(cfg.device, args.backend, args.timeout)
    resume_after_restart(cfg, device)
    trainer = setup(cfg, given, TorchEngine(os.path.join(cfg.out_dir, CHECKPOINT_FILE)))
    with tracking_emissions(trainer.cfg, master=distributed.rank() == 0):
        trainer.fit()


if __name__ == "__main__":
    cli.run_distributed(main)
