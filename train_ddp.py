"""Train a GPT with data parallelism over several processes (DistributedDataParallel)
under torchrun.

    torchrun --standalone --nproc_per_node N train_ddp.py [train.py flags]
    # M machines: run this on each, with R = 0 .. M-1 and A:P reachable from all of them
    torchrun --nnodes M --node_rank R --master_addr A --master_port P --nproc_per_node N \\
        train_ddp.py [flags]

Same flags as train.py, plus --backend, --timeout and --fsdp: PyTorch's FSDP2 shards the
parameters, gradients and optimizer state over the processes instead of replicating them
(toolkit/fsdp.py; the same checkpoint). --estimate-memory --num-gpus N [--fsdp] prints what a
process holds, without torchrun. --batch-size is one process's micro-batch and
--grad-accum counts micro-batches per step over ALL processes (default: one per process), so the
same flags train the same model on any number of processes. Rank 0 writes OUT_DIR/ckpt.pt in
train.py's format; under `torchrun --max-restarts K` a restarted job continues from it. Signals,
timeouts and errors under torchrun: docs/training.md.
"""
import argparse
import os

from toolkit import cli, distributed, flags
from toolkit.checkpoint import CHECKPOINT_FILE
from toolkit.emissions import tracking_emissions
from toolkit.pretraining import setup
from toolkit.train_config import parse_config, torch_memory_estimate
from toolkit.training import TorchEngine


def add_flags(parser: argparse.ArgumentParser) -> None:
    distributed.add_distributed_flags(parser)
    parser.add_argument("--fsdp", action="store_true",
                        help="shard parameters, gradients and optimizer state over the processes "
                             "(PyTorch's FSDP2, fully_shard) instead of replicating them (DDP)")
    flags.add_estimate_flags(parser, "DDP, or FSDP2 with --fsdp")


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_config(argv, description=__doc__, extra_arguments=add_flags)
    if args.estimate_memory:
        print(torch_memory_estimate(cfg, args.num_nodes * args.num_gpus, args.fsdp))
        return
    distributed.init_torchrun(cfg.device, args.backend, args.timeout)
    engine = TorchEngine(os.path.join(cfg.out_dir, CHECKPOINT_FILE), fsdp=args.fsdp)
    trainer = setup(cfg, engine)
    with tracking_emissions(trainer.cfg, master=distributed.rank() == 0):
        trainer.fit()


if __name__ == "__main__":
    cli.run_distributed(main)
