"""DeepSpeed as the loop's engine (toolkit/training.py's Engine): ds_config.json reconciled with the
flags (toolkit/ds_config.py), the ZeRO / pipeline / AutoTP engine, its checkpoints in OUT_DIR/ds,
and joining the process group of the deepspeed launcher, torchrun or mpirun.

    init_distributed(cfg, args)
    trainer = pretraining.setup(cfg, DeepSpeedEngine(ds, ds_path, cfg.out_dir, keep_checkpoints))
    trainer.fit()

Forward, backward and the ZeRO optimizer step go through DeepSpeed; the learning rate comes from the
loop's schedule.
"""
import datetime
import functools
import math
import os
import shutil
import warnings
from dataclasses import replace

import cpuinfo
import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.comm.comm import mpi_discovery
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from model import GPT
from toolkit import distributed
from toolkit.checkpoint import capture_rng, restore_rng
from toolkit.cli import CLIError, first_line
from toolkit.device import resolve_device, set_job_threads
from toolkit.distributed import free_port
from toolkit.ds_config import config_precision, reconcile, zero_stage
from toolkit.ds_checkpoint import (check_deepspeed_files, mark_complete, prune_deepspeed_tags,
                                   read_train_state, to_universal)
from toolkit.optim import decay_groups
from toolkit.model_parallel import (Layout, autotp_config, check_layout, estimate_memory,
                                    pipeline_module)
from toolkit.megatron import grad_accum_for
from toolkit.train_config import (TrainConfig, apply_preset, family_defaults, settle_optimizer,
                                  shape_of)
from toolkit.training import checkpoint_activations

# DeepSpeed's ZeRO-3 calls collectives that torch renamed; each rank's log would repeat torch's
# notice
warnings.filterwarnings("ignore", r"`torch\.distributed\."
                        r"(all_gather_into_tensor|reduce_scatter_tensor)` is "
                        "deprecated", FutureWarning)

def memory_estimate(cfg: TrainConfig, ds: dict, nodes: int, gpus: int, pipeline_stages: int,
                    tp_size: int) -> str:
    """train_ds.py --estimate-memory: the model on the meta device, this layout over nodes x gpus,
    the config's ZeRO stage and offload, the precision of --dtype or else the config's (float32 when
    neither sets one), and DeepSpeed's own estimators for ZeRO 2 and 3, as lines of text."""
    cfg = family_defaults(apply_preset(cfg))
    stage, zero = zero_stage(ds), ds.get("zero_optimization") or {}
    config = shape_of(cfg)
    try:
        layout = Layout(nodes * gpus, pipeline_stages, tp_size)
        check_layout(layout, config, stage, training=False)
    except ValueError as e:
        raise CLIError(str(e)) from None
    dtype = cfg.dtype if cfg.dtype != "auto" else config_precision(ds) or "float32"
    grad_accum = grad_accum_for(cfg) if cfg.global_batch_size else cfg.grad_accum
    micro_steps = max(1, (grad_accum or layout.data_parallel) // layout.data_parallel)
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device") not in (None, "none")
    offload_param = (zero.get("offload_param") or {}).get("device") not in (None, "none")
    e = estimate_memory(config, layout, stage, dtype, offload_optimizer, offload_param,
                        cfg.batch_size, micro_steps, cfg.activation_checkpointing)
    gib = 2 ** 30
    offloads = [f"{what} offload to cpu" for what, on in (
        ("optimizer", offload_optimizer), ("param", offload_param and stage == 3)) if on]
    device = e.weights + e.gradients + e.optimizer + e.activations
    cpu = f"; CPU memory per process {e.cpu / gib:.2f} GiB" if e.cpu else ""
    lines = [
        f"model: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, block "
        f"{cfg.block_size}, GPT-2 vocabulary: {e.params:,} parameters ({e.params / 1e9:.2f}B)",
        f"training FLOPs per token: {e.flops_per_token / 1e9:,.1f} GFLOP "
        "(6 x parameters + attention)",
        f"layout: {layout.world_size} devices ({nodes} nodes x {gpus}) = {layout.describe()}; "
        f"ZeRO stage {stage}, {dtype}, micro-batch {cfg.batch_size} x {micro_steps} per step"
        # ZeRO offloads parameters only at stage 3
        + "".join(", " + offload for offload in offloads),
        f"per device (the busiest stage: {e.device_params:,} parameters): weights "
        f"{e.weights / gib:.2f} GiB, gradients {e.gradients / gib:.2f}, optimizer "
        f"{e.optimizer / gib:.2f}, activations {e.activations / gib:.2f}"
        f"{' (recomputed)' if cfg.activation_checkpointing else ''} = {device / gib:.2f} GiB{cpu}"]
    if stage in (2, 3):  # DeepSpeed's estimators assume 16-bit weights and a 1.5x CPU buffer
        if stage == 2:
            cpu_bytes, gpu_bytes = estimate_zero2_model_states_mem_needs(
                e.device_params, 1, layout.data_parallel, offload_optimizer)
        else:
            cpu_bytes, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(
                e.device_params, e.largest_layer, 1, layout.data_parallel, offload_optimizer,
                offload_param)
        lines.append(f"DeepSpeed's ZeRO-{stage} estimator (16-bit weights, without activations): "
                     f"{gpu_bytes / gib:.2f} GiB per device, {cpu_bytes / gib:.2f} GiB CPU memory "
                     "per process")
    return "\n".join(lines)


class DeepSpeedEngine:
    """The Engine of train_ds.py, made from the DeepSpeed config and the layout: it reads the resume
    state, settles the options the config also sets, and runs DeepSpeed's engine on the model."""

    def __init__(self, ds: dict, ds_path: str, out_dir: str, keep_checkpoints: int,
                 pipeline_stages: int = 1, tp_size: int = 1, world_size: int | None = None):
        self.ds_input, self.ds_path, self.keep_checkpoints = ds, ds_path, keep_checkpoints
        self.path = os.path.join(out_dir, "ds")
        # that of the process group, unless told
        self.world_size = world_size or distributed.world_size()
        self.master = distributed.rank() == 0
        self.universal = False  # resuming a checkpoint of another number of processes or precision
        self.saved_dtype = None  # the precision of the checkpoint resumed
        try:
            self.layout = Layout(self.world_size, pipeline_stages, tp_size)
        except ValueError as e:
            raise CLIError(str(e)) from None

    def data_parallel(self) -> tuple[int, int]:
        return self.layout.data_parallel_rank(distributed.rank()), self.layout.data_parallel

    def read_resume(self) -> dict:
        """The newest tag's training state. Another number of data-parallel processes (or, as
        settle_config finds, another precision) resumes through DeepSpeed's universal checkpoint
        (self.universal); another pipeline or tensor-parallel layout starts anew from the exported
        weights."""
        self.resumed_from = self.path
        state = read_train_state(self.path)
        saved = (state.get("pipeline_stages", 1), state.get("tp_size", 1))
        if saved != (self.layout.pipeline_stages, self.layout.tp_size):
            raise CLIError(f"{self.path} was trained with --pipeline-stages {saved[0]} --tp-size "
                           f"{saved[1]}; resume with the same layout, or start a new run from its "
                           f"weights: python test_ds.py --ckpt {self.path} --export-hf DIR, then "
                           "--init-from DIR")
        self.universal = state["world_size"] != self.world_size
        self.saved_dtype = state["train_config"].get("dtype")
        if self.universal and (zero_stage(self.ds_input) == 0 or self.layout.model_parallel > 1):
            raise CLIError(f"{self.path} was written by {state['world_size']} processes but this "
                           f"run has {self.world_size}; DeepSpeed's universal checkpoint resumes "
                           f"ZeRO stage 1-3 data parallel only: launch {state['world_size']} "
                           "processes, or start a new run from its weights: python test_ds.py "
                           f"--ckpt {self.path} --export-hf DIR, then --init-from DIR")
        if state.get("zero_stage") != zero_stage(self.ds_input):
            raise CLIError(f"{self.path} was written with ZeRO stage {state.get('zero_stage')} but "
                           f"{os.path.basename(self.ds_path)} has stage "
                           f"{zero_stage(self.ds_input)}; resume with the same stage")
        check_deepspeed_files(self.path, state["tag"])  # before DeepSpeed unpickles them
        return state

    def settle_config(self, cfg: TrainConfig, resumed: set[str]) -> TrainConfig:
        # the DeepSpeed config's AdamW (train_ds.py offers no other) and --lr, which the config may
        # also set; torch.compile only when asked for (it is not measured under ZeRO)
        cfg = settle_optimizer(replace(cfg, optimizer="adamw",
                                       compile=cfg.compile and "compile" in cfg.given))
        if cfg.eval_tasks and self.pipelined:
            raise CLIError("--eval-tasks needs the model's logits, which a pipeline keeps on its "
                           "last stage; score an exported checkpoint with eval.py instead (python "
                           "test_ds.py --export-ckpt PATH)")
        if "dtype" in resumed:  # the checkpoint's precision stands unless the config says otherwise
            cfg = replace(cfg, given=cfg.given - {"dtype"})
        device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
        cfg, self.ds_config = reconcile(cfg, self.ds_input, self.ds_path,
                                        self.layout.data_parallel, device, resumed)
        if self.saved_dtype is not None and cfg.dtype != self.saved_dtype:
            # DeepSpeed names (and shapes) its optimizer files by precision: another precision
            # resumes through the universal checkpoint, which holds everything in float32
            if zero_stage(self.ds_config) == 0 or self.layout.model_parallel > 1:
                raise CLIError(f"{self.path} was trained in {self.saved_dtype} but this run is in "
                               f"{cfg.dtype}; DeepSpeed's universal checkpoint changes precision "
                               "for ZeRO stage 1-3 data parallel only: resume in "
                               f"{self.saved_dtype}, or start a new run from its weights: python "
                               f"test_ds.py --ckpt {self.path} --export-hf DIR, then --init-from "
                               "DIR")
            self.universal = True
        if self.universal:
            self.ds_config["checkpoint"] = {**self.ds_config.get("checkpoint", {}),
                                            "load_universal": True}
        try:
            check_layout(self.layout, shape_of(cfg), zero_stage(self.ds_config))
        except ValueError as e:
            raise CLIError(str(e)) from None
        if self.layout.tp_size > 1:
            given_tp = self.ds_config.get("tensor_parallel", {}).get("autotp_size")
            if given_tp not in (None, self.layout.tp_size):
                raise CLIError(f"{os.path.basename(self.ds_path)} sets tensor_parallel.autotp_size "
                               f"{given_tp} but --tp-size {self.layout.tp_size} was given; they "
                               "must agree")
            self.ds_config["tensor_parallel"] = autotp_config(self.layout.tp_size, shape_of(cfg))
        return cfg

    def start(self, model: GPT, cfg: TrainConfig, device: torch.device, dtype: torch.dtype, loss,
              resume: dict | None) -> None:
        """deepspeed.initialize with the settled config (and the checkpoint's state on resume); as
        DeepSpeed calls the module itself, the loss is the objective's on the engine (a pipeline's
        is its last stage's chunked cross-entropy)."""
        self.device, self.dtype, self.loss = device, dtype, loss
        # a new run's tags: an earlier run's in OUT_DIR/ds (--overwrite) go once it has saved one
        self.own_tags = None if resume is not None else set()
        if cfg.activation_checkpointing:
            checkpoint_activations(model.transformer.h)
        module = pipeline_module(model, self.layout.pipeline_stages) if self.pipelined else model
        # every rank is past its checks: a rank that failed one is found here, within --timeout,
        # not by the groups deepspeed.initialize makes, which wait 30 minutes whatever it says
        dist.barrier()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, model_parameters=decay_groups(module, cfg.weight_decay),
            config=self.ds_config)
        if cfg.compile:
            self.engine.compile()
        if self.master:
            zero = self.ds_config.get("zero_optimization") or {}
            offload = ", ".join(f"{what} offload to {(zero.get(key) or {}).get('device')}"
                                for what, key in (("optimizer", "offload_optimizer"),
                                                  ("param", "offload_param"))
                                if (zero.get(key) or {}).get("device") not in (None, "none"))
            print(
                f"deepspeed {deepspeed.__version__}: {self.layout.describe()}, ZeRO stage "
                f"{zero_stage(self.ds_config)}{', ' + offload if offload else ''}, optimizer "
                f"{type(getattr(self.engine, 'basic_optimizer', None) or self.optimizer).__name__}"
                f", config {self.ds_path}", flush=True)
        if resume is not None:
            self.load(resume["tag"])

    def load(self, tag: str) -> None:
        folder = self.path
        if self.universal:  # rank 0 converts (to OUT_DIR/ds/universal, removed once loaded)
            folder = os.path.join(self.path, "universal")
            if self.master:
                print(f"resuming on {self.world_size} processes in {str(self.dtype)[6:]} through "
                      "DeepSpeed's universal checkpoint", flush=True)
                to_universal(self.path, tag, folder)
            dist.barrier()
        decays = [group.get("weight_decay") for group in self.engine.optimizer.param_groups]
        try:
            path, client_state = self.engine.load_checkpoint(folder, tag=tag)
        except ZeRORuntimeException as e:
            raise CLIError(f"cannot resume from {self.path}: {first_line(e)}") from None
        if path is None:
            raise CLIError(f"cannot resume: no DeepSpeed checkpoint {tag} in {self.path}")
        restore_rng((client_state or {}).get("rng") or {}, self.device)
        # DeepSpeed's universal loader (ZeRO-3) gives every param group the first one's settings,
        # which would decay the biases and LayerNorm gains too: each group keeps its weight decay
        for group, decay in zip(self.engine.optimizer.param_groups, decays):
            group["weight_decay"] = decay
        if self.universal:
            dist.barrier()
            if self.master:
                shutil.rmtree(folder, ignore_errors=True)

    def finish(self) -> None:
        """After the run: where its checkpoint is and how to use it; every rank leaves together (a
        rank whose peer, the store's host, already exited can abort in teardown)."""
        if self.master:
            print(f"DeepSpeed checkpoint: {self.path}; sample with "
                  f"`python test_ds.py --ckpt {self.path}` or convert with "
                  f"`python test_ds.py --ckpt {self.path} --export-ckpt ckpt.pt`", flush=True)
        dist.barrier()

    @property
    def pipelined(self) -> bool:
        return self.layout.pipeline_stages > 1

    def train_step(self, batches: list[tuple[tuple[torch.Tensor, torch.Tensor], float]],
                   lr: float) -> float:
        """One optimizer step over this process's micro-batches (their weights are equal: DeepSpeed
        divides by gradient_accumulation_steps itself and averages over the data-parallel ranks);
        returns this process's share of the step's loss."""
        for group in self.engine.optimizer.param_groups:  # the loop's schedule
            group["lr"] = lr
        share = sum(weight for _, weight in batches)
        skipped = self.engine.skipped_steps
        if self.pipelined:  # forward, backward and step over all micro-batches, stage by stage
            loss = self.engine.train_batch(iter([batch for batch, _ in batches])).item() * share
            return self.checked(loss, skipped)
        total = torch.zeros((), device=self.device)
        for i, ((x, y), weight) in enumerate(batches):
            loss = self.loss(self.engine, (x, y))
            self.engine.backward(loss)
            if self.engine.is_gradient_accumulation_boundary() != (i == len(batches) - 1):
                raise RuntimeError("DeepSpeed's accumulation boundary is out of step with the "
                                   "micro-batches")
            # the optimizer steps (and zeroes the gradients) only at the boundary
            self.engine.step()
            total += loss.detach().float() * weight
        return self.checked(total.item(), skipped)

    def checked(self, loss: float, skipped: int) -> float:
        """The step's loss, or NaN when DeepSpeed skipped the step for non-finite gradients outside
        float16 (whose loss scaler skips steps on purpose): the run stops as on a NaN loss, where
        it would go on with a finite loss and weights that no longer train."""
        if self.engine.skipped_steps > skipped and self.dtype != torch.float16:
            return math.nan
        return loss

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.pipelined:  # every stage takes part; the last one's loss is broadcast to all
            return self.engine.eval_batch(iter([(x, y)]), num_micro_batches=1)
        return self.loss(self.engine, (x, y))  # no autocast: DeepSpeed's config owns the precision

    def logits_at(self, idx: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The logits at some positions of a batch: every rank of a replica takes part (ZeRO-3
        gathers, AutoTP all-reduces)."""
        return self.engine(idx)[0][rows, cols].float()

    def weights_finite(self) -> bool:
        """Every process's share of the weights (its ZeRO-3 partition) holds no NaN or inf."""
        local = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all())
                    for p in self.engine.module.parameters())
        return (distributed.all_reduce_sum([float(local)], self.device)[0]
                == distributed.world_size())

    def save(self, state: dict, path: str | None = None, resumable: bool | None = None) -> None:
        """A tag folder global_stepN in path (default: OUT_DIR/ds); always resumable."""
        folder = path or self.path
        tag = f"global_step{state['iter_num']}"
        state = {**state, "world_size": self.world_size, "zero_stage": zero_stage(self.ds_config),
                 "pipeline_stages": self.layout.pipeline_stages, "tp_size": self.layout.tp_size,
                 "deepspeed_version": deepspeed.__version__}
        if state["best_val_loss"] == float("inf"):
            state["best_val_loss"] = None  # JSON has no infinity
        own = self.own_tags if folder == self.path else None
        if own is not None and tag not in own:  # an earlier run's tag of this step: not mixed in
            if self.master:
                shutil.rmtree(os.path.join(folder, tag), ignore_errors=True)
            dist.barrier()
        self.engine.save_checkpoint(folder, tag=tag,
                                    client_state={**state, "rng": capture_rng(self.device)})
        dist.barrier()  # every process has written its files
        if own is not None:
            own.add(tag)
        if self.master:
            mark_complete(folder, tag, state)
            prune_deepspeed_tags(folder, self.keep_checkpoints, own)


# what mpirun (OpenMPI, MPICH/Hydra, MVAPICH) sets in each process it starts
MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
MPI_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")


def discover_mpi() -> None:
    """Under mpirun: RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR from DeepSpeed's MPI discovery
    (mpi4py), at MASTER_PORT or 29500; LOCAL_WORLD_SIZE from MPI, for each process's CPU threads."""
    try:
        mpi_discovery(distributed_port=int(os.environ.get("MASTER_PORT", 29500)), verbose=False)
    except ImportError:
        raise CLIError("started by mpirun, but mpi4py is not installed (DeepSpeed finds the ranks "
                       "through it): pip install mpi4py") from None
    local = next((os.environ[v] for v in MPI_LOCAL_SIZE_VARS if v in os.environ), None)
    if local is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", local)


def init_distributed(cfg: TrainConfig, args) -> TrainConfig:
    """Join the process group the launcher describes: the deepspeed launcher or torchrun (RANK,
    WORLD_SIZE), mpirun (found through MPI), or else a single process (plain python); cfg with the
    device DeepSpeed's accelerator runs on."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        if any(v in os.environ for v in MPI_VARS):
            discover_mpi()
        else:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
    if "LOCAL_RANK" not in os.environ and args.local_rank is not None:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accelerator = get_accelerator().device_name()  # "cpu" or "cuda": DeepSpeed chose it at import
    device = resolve_device(accelerator if cfg.device == "auto" else cfg.device, local_rank)
    if device.type != accelerator:
        raise CLIError(f"--device {cfg.device} but DeepSpeed runs on its {accelerator} "
                       f"accelerator; set DS_ACCELERATOR={device.type} in the environment or drop "
                       f"--device")
    if device.type == "cuda":
        get_accelerator().set_device(local_rank)
    else:
        set_job_threads()
    # On CPU, DeepSpeed compiles a shared-memory all-reduce (shm_comm) at the first launch, a minute
    # on 2 cores, and leaves a /dev/shm buffer per process after each run. Only inference-mode
    # AutoTP layers call it; training reduces through torch.distributed (gloo), so it stays unbuilt
    # (deepspeed/comm/torch.py builds what __compatible_ops__ marks compatible).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed's CPU ops ask py-cpuinfo 3 times per process (compiler flags, SIMD width, CPUAdam),
    # and each get_cpu_info() starts a Python subprocess of a second or so: the first is kept.
    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    # nccl on CUDA, gloo on CPU
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=args.timeout))
    return replace(cfg, device=device.type)
