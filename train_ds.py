"""Train a GPT with DeepSpeed (ZeRO-3 with CPU offload by default), launched by the `deepspeed`
launcher.

Same flags as train.py, plus DeepSpeed's --deepspeed --deepspeed_config (default: ds_config.json
next to this script), --timeout, --keep-checkpoints and the --local_rank the launcher appends. One
machine, two processes (hostfile.txt holds `localhost slots=2`; no ssh server is needed with
--no_ssh_check):

    deepspeed --hostfile=hostfile.txt --no_ssh_check --master_addr=127.0.0.1 \\
        train_ds.py --deepspeed --deepspeed_config ds_config.json [train.py flags]

Several machines: list them in the hostfile (`HOST slots=N`) and run the same command on the first
one (passwordless ssh + pdsh), or without ssh run on every node R = 0..M-1: `deepspeed
--hostfile=hostfile.txt --no_ssh --node_rank R --master_addr A --master_port P train_ds.py ...`.

Each value has one source of truth and a contradiction is an error (toolkit/deepspeed_engine.py):
the flags own the batch per process, the accumulation, the learning rate and its schedule, AdamW's
betas and weight decay; ds_config.json owns the ZeRO stage, offload, gradient clipping and
precision. A value may be given in either place; given in both and different, it is an error.

Model parallel (toolkit/model_parallel.py): --pipeline-stages P (deepspeed.pipe, ZeRO 0/1) or
--tp-size T (AutoTP, ZeRO 0-3); the ranks of one model replica read the same data. `mpirun -np N
python train_ds.py ...` finds its ranks through DeepSpeed's MPI discovery (mpi4py).
--estimate-memory prints what a model and layout need, without a launcher.

Checkpoints: OUT_DIR/ds/ in DeepSpeed's layout plus train_state.json (toolkit/ds_checkpoint.py);
--init-from resume continues exactly with the same number of processes, and on another number
through DeepSpeed's universal checkpoint. test_ds.py samples from any layout or exports it
(--export-ckpt, --export-hf).
"""
import argparse
import os

import deepspeed

from toolkit import cli, distributed, flags
from toolkit.deepspeed_engine import DeepSpeedEngine, init_distributed, memory_estimate
from toolkit.ds_config import check_ds_config
from toolkit.emissions import tracking_emissions
from toolkit.files import read_json
from toolkit.pretraining import setup
from toolkit.train_config import parse_config

DEFAULT_DS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")
# DeepSpeed trains with the optimizer its config names (AdamW here): Muon's options are train.py's
FLAG_OVERRIDES = {"muon_lr": None, "lr": {"help": "peak learning rate"},
                  "optimizer": {"choices": ["auto", "adamw"],
                                "help": "adamw: the DeepSpeed config's AdamW (auto = adamw)"}}


def extra_arguments(parser) -> None:
    deepspeed.add_config_arguments(parser)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher (LOCAL_RANK in the environment wins)")
    parser.add_argument("--pipeline-stages", type=flags.at_least(1), default=1,
                        help="pipeline-parallel stages (deepspeed.pipe; ZeRO stage 0 or 1) "
                             "(default: 1)")
    parser.add_argument("--tp-size", type=flags.at_least(1), default=1,
                        help="tensor-parallel shards (DeepSpeed AutoTP; ZeRO stage 0-3) (default: "
                             "1)")
    megatron = flags.megatron_group(parser)
    megatron.add_argument("--pipeline-model-parallel-size", dest="pipeline_stages",
                          type=flags.at_least(1),
                          default=argparse.SUPPRESS, help="= --pipeline-stages")
    megatron.add_argument("--tensor-model-parallel-size", dest="tp_size", type=flags.at_least(1),
                          default=argparse.SUPPRESS, help="= --tp-size")
    flags.add_estimate_flags(parser, "ZeRO stage and offload from the config")
    parser.add_argument("--keep-checkpoints", type=flags.at_least(0), default=1,
                        help="global_stepN folders kept in OUT_DIR/ds; older ones are deleted "
                             "after a save (0 = keep all; default: 1)")
    distributed.add_distributed_flags(parser, backend=False)


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_config(argv, description=__doc__, extra_arguments=extra_arguments,
                             overrides=FLAG_OVERRIDES)
    ds_path = args.deepspeed_config or args.deepscale_config or DEFAULT_DS_CONFIG
    ds = read_json(ds_path, "DeepSpeed config")
    check_ds_config(ds, ds_path)
    if args.estimate_memory:
        print(memory_estimate(cfg, ds, args.num_nodes, args.num_gpus, args.pipeline_stages,
                              args.tp_size))
        return
    cfg = init_distributed(cfg, args)
    engine = DeepSpeedEngine(ds, ds_path, cfg.out_dir, args.keep_checkpoints, args.pipeline_stages,
                             args.tp_size)
    trainer = setup(cfg, engine)
    with tracking_emissions(trainer.cfg, master=distributed.rank() == 0):
        trainer.fit()
    engine.finish()


if __name__ == "__main__":
    cli.run_distributed(main)
