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

Model parallel (toolkit/parallel.py): --pipeline-stages P (deepspeed.pipe, ZeRO 0/1) or --tp-size T
(AutoTP, ZeRO 0-3); the ranks of one model replica read the same data. `mpirun -np N python
train_ds.py ...` finds its ranks through DeepSpeed's MPI discovery (mpi4py). --estimate-memory
prints what a model and layout need, without a launcher.

Checkpoints: OUT_DIR/ds/ in DeepSpeed's layout plus train_state.json (toolkit/ds_checkpoint.py);
--init-from resume continues exactly with the same number of processes, and on another number
through DeepSpeed's universal checkpoint. test_ds.py samples from any layout or exports it
(--export-ckpt, --export-hf).
"""
import argparse
import os

import deepspeed
import torch.distributed as dist

from model import GPTConfig
from toolkit import cli, distributed, flags
from toolkit.cli import CLIError
from toolkit.deepspeed_engine import DeepSpeedEngine, config_precision, init_distributed, zero_stage
from toolkit.files import read_json
from toolkit.megatron import grad_accum_for, tracking_emissions
from toolkit.parallel import Layout, check_layout, estimate_memory
from toolkit.pretraining import TrainConfig, apply_preset, parse_config, setup

DEFAULT_DS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")
# DeepSpeed trains with the optimizer its config names (AdamW here): Muon's options are train.py's
FLAG_OVERRIDES = {"muon_lr": None, "lr": {"help": "peak learning rate"},
                  "optimizer": {"choices": ["auto", "adamw"],
                                "help": "adamw: the DeepSpeed config's AdamW (auto = adamw)"}}


def extra_arguments(parser) -> None:
    deepspeed.add_config_arguments(parser)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher (LOCAL_RANK in the environment wins)")
    parser.add_argument("--pipeline-stages", type=int, default=1,
                        help="pipeline-parallel stages (deepspeed.pipe; ZeRO stage 0 or 1) "
                             "(default: 1)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel shards (DeepSpeed AutoTP; ZeRO stage 0-3) (default: "
                             "1)")
    megatron = flags.megatron_group(parser)
    megatron.add_argument("--pipeline-model-parallel-size", dest="pipeline_stages", type=int,
                          default=argparse.SUPPRESS, help="= --pipeline-stages")
    megatron.add_argument("--tensor-model-parallel-size", dest="tp_size", type=int, default=argparse.SUPPRESS,
                          help="= --tp-size")
    parser.add_argument("--estimate-memory", action="store_true",
                        help="print the parameters, FLOPs per token and memory per device of this "
                             "model and layout (ZeRO stage and offload from the config) on "
                             "--num-nodes x --num-gpus, and exit; nothing is allocated and no "
                             "process group is needed")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines, for --estimate-memory (default: 1)")
    parser.add_argument("--num-gpus", type=int, default=1,
                        help="devices per machine, for --estimate-memory (default: 1)")
    parser.add_argument("--keep-checkpoints", type=int, default=1,
                        help="global_stepN folders kept in OUT_DIR/ds; older ones are deleted after a save "
                             "(0 = keep all; default: 1)")
    distributed.add_distributed_flags(parser, backend=False)


def print_memory_estimate(cfg: TrainConfig, given: set[str], args, ds: dict) -> None:
    """--estimate-memory: the model on the meta device, this layout, the config's ZeRO stage and
    offload, the precision of --dtype or else the config's (float32 when neither sets one), and
    DeepSpeed's own estimators for ZeRO 2 and 3."""
    apply_preset(cfg, given)
    stage, zero = zero_stage(ds), ds.get("zero_optimization") or {}
    config = GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                       bias=cfg.bias)  # GPT-2's vocabulary
    try:
        layout = Layout(args.num_nodes * args.num_gpus, args.pipeline_stages, args.tp_size)
        check_layout(layout, config, stage, training=False)
    except ValueError as e:
        raise CLIError(str(e)) from None
    dtype = cfg.dtype if cfg.dtype != "auto" else config_precision(ds) or "float32"
    grad_accum = grad_accum_for(cfg, given) if cfg.global_batch_size else cfg.grad_accum
    micro_steps = max(1, (grad_accum or layout.data_parallel) // layout.data_parallel)
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device") not in (None, "none")
    offload_param = (zero.get("offload_param") or {}).get("device") not in (None, "none")
    e = estimate_memory(config, layout, stage, dtype, offload_optimizer, offload_param, cfg.batch_size, micro_steps)
    gib = 2 ** 30
    param_offload = offload_param and stage == 3  # ZeRO offloads parameters only at stage 3
    device = e.weights + e.gradients + e.optimizer + e.activations
    print(f"model: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, block "
          f"{cfg.block_size}, GPT-2 vocabulary: {e.params:,} parameters ({e.params / 1e9:.2f}B)")
    print(f"training FLOPs per token: {e.flops_per_token / 1e9:,.1f} GFLOP (6 x parameters + "
          "attention)")
    print(f"layout: {layout.world_size} devices ({args.num_nodes} nodes x {args.num_gpus}) = "
          f"{layout.describe()}; ZeRO stage {stage}, {dtype}, micro-batch {cfg.batch_size} x "
          f"{micro_steps} per step" + (", optimizer offload to cpu" if offload_optimizer else "")
          + (", param offload to cpu" if param_offload else ""))
    print(f"per device (the busiest stage: {e.device_params:,} parameters): weights {e.weights / gib:.2f} GiB, "
          f"gradients {e.gradients / gib:.2f}, optimizer {e.optimizer / gib:.2f}, activations {e.activations / gib:.2f}"
          f" = {device / gib:.2f} GiB" + (f"; CPU memory per process {e.cpu / gib:.2f} GiB" if e.cpu else ""))
    if stage in (2, 3):  # DeepSpeed's estimators assume 16-bit weights and a 1.5x CPU buffer
        if stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
            cpu, gpu = estimate_zero2_model_states_mem_needs(e.device_params, 1, layout.data_parallel,
                                                             offload_optimizer)
        else:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(e.device_params, e.largest_layer, 1,
                                                                layout.data_parallel, offload_optimizer, offload_param)
        print(f"DeepSpeed's ZeRO-{stage} estimator (16-bit weights, without activations): "
              f"{gpu / gib:.2f} GiB per device, {cpu / gib:.2f} GiB CPU memory per process")


def main(argv: list[str] | None = None) -> None:
    cfg, given, args = parse_config(argv, description=__doc__, extra_arguments=extra_arguments,
                                    overrides=FLAG_OVERRIDES)
    ds_path = args.deepspeed_config or args.deepscale_config or DEFAULT_DS_CONFIG
    ds = read_json(ds_path, "DeepSpeed config")
    if args.estimate_memory:
        print_memory_estimate(cfg, given, args, ds)
        return
    init_distributed(cfg, args)
    engine = DeepSpeedEngine(ds, ds_path, cfg.out_dir, args.keep_checkpoints, args.pipeline_stages, args.tp_size)
    trainer = setup(cfg, given, engine)
    with tracking_emissions(trainer.cfg, master=dist.get_rank() == 0):
        trainer.fit()
    if dist.get_rank() == 0:
        print(f"DeepSpeed checkpoint: {engine.path}; sample with `python test_ds.py --ckpt "
              f"{engine.path}` or convert with `python test_ds.py --ckpt {engine.path} "
              "--export-ckpt ckpt.pt`", flush=True)
    dist.barrier()  # leave together: a rank whose peer (the store's host) already exited can abort in teardown


if __name__ == "__main__":
    cli.run_distributed(main)
