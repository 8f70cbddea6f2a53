"""Train a GPT with DeepSpeed (ZeRO-3 with CPU offload by default), launched by the `deepspeed` launcher.

Same flags as train.py, plus DeepSpeed's --deepspeed --deepspeed_config (default: ds_config.json next to
this script) and the --local_rank the launcher appends. One machine, two processes (hostfile.txt holds
`localhost slots=2`; no ssh server is needed with --no_ssh_check):

    deepspeed --hostfile=hostfile.txt --no_ssh_check --master_addr=127.0.0.1 \\
        train_ds.py --deepspeed --deepspeed_config ds_config.json [train.py flags]

Several machines: list them in the hostfile (`HOST slots=N`) and run the same command on the first one
(passwordless ssh + pdsh), or without ssh run on every node R = 0..M-1:
`deepspeed --hostfile=hostfile.txt --no_ssh --node_rank R --master_addr A --master_port P train_ds.py ...`.

Each value has one source of truth and a contradiction is an error: the flags own the batch per process
(--batch-size = train_micro_batch_size_per_gpu), the accumulation (--grad-accum micro-batches over ALL
processes = gradient_accumulation_steps x processes), the learning rate and its schedule, AdamW's betas and
weight decay; ds_config.json owns the ZeRO stage, offload, gradient clipping and precision (bf16/fp16
sections). A value may be given in either place; given in both and different, it is an error.

Checkpoints: OUT_DIR/ds/global_stepN/ (DeepSpeed's layout, plus train_state.json with the model config,
training config and tokenizer), `latest` and zero_to_fp32.py; `--init-from resume` continues exactly with
the same number of processes. test_ds.py samples from them.
"""
import copy
import datetime
import json
import math
import os
import shutil
import signal
import socket
import time
from dataclasses import asdict

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

import cli
from checkpoint import clean_state_dict
from cli import CLIError
from data import get_batch
from model import GPT, GPTConfig
from training import TrainConfig, Trainer, parse_config, read_json_object, resolve_device, resolve_dtype

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DS_CONFIG = os.path.join(HERE, "ds_config.json")
STATE_FILE = "train_state.json"  # next to DeepSpeed's files in each global_stepN/: what resume and test_ds.py read
SIGNAL_GRACE_S = 5.0  # further SIGINT/SIGTERM within this time of the first one do not abort the save
DUMP_ENV = "TRAIN_DS_DUMP_WEIGHTS"  # tests: rank 0 writes the engine's gathered fp32 weights there at the end


def extra_arguments(parser) -> None:
    deepspeed.add_config_arguments(parser)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by the deepspeed launcher (LOCAL_RANK in the environment wins)")
    parser.add_argument("--keep-checkpoints", type=int, default=1,
                        help="global_stepN folders kept in OUT_DIR/ds; older ones are deleted after a save "
                             "(0 = keep all; default: 1)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a process waits for the others in a collective (default: 300)")


# ----- ds_config.json versus the flags -----
def config_precision(ds: dict) -> str | None:
    """float32 / bfloat16 / float16 as the config's bf16 and fp16 sections set it; None when it has neither."""
    bf16 = ds.get("bf16", ds.get("bfloat16"))
    fp16 = ds.get("fp16")
    if bf16 is None and fp16 is None:
        return None
    if (bf16 or {}).get("enabled") and (fp16 or {}).get("enabled"):
        raise CLIError("the DeepSpeed config enables both bf16 and fp16; enable at most one")
    return "bfloat16" if (bf16 or {}).get("enabled") else "float16" if (fp16 or {}).get("enabled") else "float32"


def reconcile(cfg: TrainConfig, given: set[str], ds: dict, path: str, world_size: int,
              device: torch.device, resumed: frozenset[str] = frozenset()) -> tuple[TrainConfig, dict]:
    """Settle every value that both the flags and the DeepSpeed config can set.

    `given` names the flags set on purpose (command line, --config file, or a resumed checkpoint). A value set
    in only one place is used and copied to the other; set in both and different it is a CLIError. Returns the
    updated TrainConfig and the complete DeepSpeed config to pass to deepspeed.initialize."""
    cfg, ds = copy.deepcopy(cfg), copy.deepcopy(ds)
    name = os.path.basename(path)

    def settle(flag: str, key: str, ds_value, flag_value, shown=None) -> bool:
        """True when the config's value is to be used."""
        if ds_value is None:
            return False
        if flag in given and ds_value != flag_value and flag in resumed:
            raise CLIError(f"{name} sets {key} {ds_value} but the checkpoint was trained with "
                           f"--{flag.replace('_', '-')} {shown if shown is not None else flag_value}; "
                           f"give the flag to change it, or change the config")
        if flag in given and ds_value != flag_value:
            raise CLIError(f"{name} sets {key} {ds_value} but --{flag.replace('_', '-')} "
                           f"{shown if shown is not None else flag_value} was given; they must agree: "
                           f"change one of them or drop the flag")
        return True

    if ds.get("scheduler"):
        raise CLIError(f"{name} has a scheduler section; the learning-rate schedule comes from the flags "
                       f"(--lr, --min-lr, --warmup-iters, --lr-decay-iters): remove it")
    if settle("batch_size", "train_micro_batch_size_per_gpu", ds.get("train_micro_batch_size_per_gpu"),
              cfg.batch_size):
        cfg.batch_size = int(ds["train_micro_batch_size_per_gpu"])
    gas = ds.get("gradient_accumulation_steps")
    if gas is not None and settle("grad_accum", "gradient_accumulation_steps", gas, cfg.grad_accum // world_size
                                  if cfg.grad_accum % world_size == 0 else None,
                                  shown=f"{cfg.grad_accum} (micro-batches over all {world_size} processes)"):
        cfg.grad_accum = int(gas) * world_size
    elif "grad_accum" not in given and cfg.grad_accum % world_size:  # the default 1: one micro-batch per process
        cfg.grad_accum = world_size * math.ceil(cfg.grad_accum / world_size)
    if cfg.grad_accum % world_size:
        raise CLIError(f"--grad-accum {cfg.grad_accum} cannot be split across {world_size} processes; "
                       f"use a multiple of {world_size}")
    if ds.get("train_batch_size") is not None and ds["train_batch_size"] != cfg.batch_size * cfg.grad_accum:
        raise CLIError(f"{name} sets train_batch_size {ds['train_batch_size']} but the global batch is "
                       f"{cfg.batch_size} x {cfg.grad_accum} = {cfg.batch_size * cfg.grad_accum}; "
                       f"remove train_batch_size (it is derived)")
    if settle("grad_clip", "gradient_clipping", ds.get("gradient_clipping"), cfg.grad_clip):
        cfg.grad_clip = float(ds["gradient_clipping"])

    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = optimizer.setdefault("params", {})
    if settle("lr", "optimizer.params.lr", params.get("lr"), cfg.lr):
        cfg.lr = float(params["lr"])
    if settle("weight_decay", "optimizer.params.weight_decay", params.get("weight_decay"), cfg.weight_decay):
        cfg.weight_decay = float(params["weight_decay"])
    if params.get("betas") is not None:
        betas = [float(b) for b in params["betas"]]
        flag = "beta1" if "beta1" in given and betas[0] != cfg.beta1 else "beta2"
        settle(flag, "optimizer.params.betas", betas, [cfg.beta1, cfg.beta2], shown=getattr(cfg, flag))
        cfg.beta1, cfg.beta2 = betas

    ds_dtype = config_precision(ds)
    flag_dtype = None if cfg.dtype == "auto" else cfg.dtype
    if ds_dtype is not None and flag_dtype is not None and "dtype" in given and ds_dtype != flag_dtype:
        raise CLIError(f"{name} sets precision {ds_dtype} (its bf16/fp16 sections) but --dtype {flag_dtype} "
                       f"was given; they must agree: change one of them or drop the flag")
    dtype = ds_dtype or str(resolve_dtype(cfg.dtype, device)).removeprefix("torch.")
    if dtype == "float16" and device.type == "cpu":
        resolve_dtype(dtype, device)  # a clear error where the CPU has no fp16
    cfg.dtype = dtype

    # the flags' values, written into the config DeepSpeed gets
    ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
    ds["gradient_accumulation_steps"] = cfg.grad_accum // world_size
    ds["gradient_clipping"] = cfg.grad_clip
    params.update(lr=cfg.lr, betas=[cfg.beta1, cfg.beta2], weight_decay=cfg.weight_decay)
    ds["bf16"] = {**(ds.pop("bfloat16", None) or ds.get("bf16") or {}), "enabled": dtype == "bfloat16"}
    ds["fp16"] = {**ds.get("fp16", {}), "enabled": dtype == "float16"}
    ds.setdefault("steps_per_print", 10 ** 9)  # the trainer logs; keep DeepSpeed quiet
    return cfg, ds


def zero_stage(ds: dict) -> int:
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


# ----- the trainer -----
class DeepSpeedTrainer(Trainer):
    """The shared training loop with a DeepSpeed engine doing forward, backward and the optimizer step."""

    def __init__(self, cfg: TrainConfig, explicit: set[str], ds: dict, ds_path: str, keep_checkpoints: int = 1):
        self.ds_input, self.ds_path, self.keep_checkpoints = ds, ds_path, keep_checkpoints
        self.ds_dir = os.path.join(cfg.out_dir, "ds")
        world_size = dist.get_world_size()
        self.accel_device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
        if cfg.init_from != "resume":
            cfg, self.ds_config = reconcile(cfg, explicit, ds, ds_path, world_size, self.accel_device)
        super().__init__(cfg, explicit)
        self.ckpt_path = self.ds_dir

    # ----- resume: read our JSON before the engine exists, load DeepSpeed's state after -----
    def load_resume_checkpoint(self, cfg: TrainConfig) -> dict:
        self.ckpt_path = self.ds_dir
        state = read_train_state(self.ds_dir)
        if state["world_size"] != self.world_size:
            raise CLIError(f"{self.ds_dir} was written by {state['world_size']} processes but this run has "
                           f"{self.world_size}; a DeepSpeed ZeRO checkpoint resumes only with the same number "
                           f"of processes (launch {state['world_size']})")
        if state.get("zero_stage") != zero_stage(self.ds_input):
            raise CLIError(f"{self.ds_dir} was written with ZeRO stage {state.get('zero_stage')} but "
                           f"{os.path.basename(self.ds_path)} has stage {zero_stage(self.ds_input)}; "
                           f"resume with the same stage")
        return state

    def merge_resumed_config(self, cfg: TrainConfig, explicit: set[str], checkpoint: dict) -> TrainConfig:
        merged = super().merge_resumed_config(cfg, explicit, checkpoint)
        resumed = frozenset(checkpoint.get("train_config", {})) - set(explicit) - {"init_from", "out_dir"}
        given = set(explicit) | resumed
        if "dtype" not in explicit:  # the checkpoint's precision stands unless the config says otherwise
            given.discard("dtype")
            if config_precision(self.ds_input) is None:
                merged.dtype = checkpoint["train_config"].get("dtype", merged.dtype)
        merged, self.ds_config = reconcile(merged, given, self.ds_input, self.ds_path, self.world_size,
                                           self.accel_device, resumed)
        return merged

    def build_model(self, resume: dict | None) -> GPT:
        if resume is None:
            return super().build_model(resume)
        config = {**resume["model_config"], "dropout": self.cfg.dropout, "attn_kernel": self.cfg.attn_kernel}
        return GPT(GPTConfig(**config))  # the weights come from engine.load_checkpoint

    def setup_engine(self, resume: dict | None) -> None:
        cfg, model = self.cfg, self.raw_model
        sizes = (model.num_params(non_embedding=True), model.num_params(non_embedding=False))
        # ZeRO-3 partitions the parameters, so count them now (the log line and MFU use this)
        model.num_params = lambda non_embedding=True: sizes[0] if non_embedding else sizes[1]
        groups = [  # the same parameter groups as train.py: decay only matrices and embeddings
            {"params": [p for p in model.parameters() if p.requires_grad and p.dim() >= 2],
             "weight_decay": cfg.weight_decay},
            {"params": [p for p in model.parameters() if p.requires_grad and p.dim() < 2], "weight_decay": 0.0},
        ]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                                                 config=self.ds_config)
        if cfg.compile:
            self.engine.compile()
        self.model = self.train_model = self.engine
        self.scaler = None
        if self.master:
            zero = self.ds_config.get("zero_optimization") or {}
            offload = ", ".join(f"{what} offload to {(zero.get(key) or {}).get('device')}"
                                for what, key in (("optimizer", "offload_optimizer"), ("param", "offload_param"))
                                if (zero.get(key) or {}).get("device") not in (None, "none"))
            print(f"deepspeed {deepspeed.__version__}: ZeRO stage {zero_stage(self.ds_config)}"
                  f"{', ' + offload if offload else ''}, optimizer "
                  f"{type(getattr(self.engine, 'basic_optimizer', None) or self.optimizer).__name__}, "
                  f"config {self.ds_path}", flush=True)
        if resume is not None:
            self.load_engine_checkpoint(resume)

    def load_engine_checkpoint(self, resume: dict) -> None:
        from deepspeed.runtime.zero.utils import ZeRORuntimeException
        try:
            path, client_state = self.engine.load_checkpoint(self.ds_dir, tag=resume["tag"])
        except ZeRORuntimeException as e:
            raise CLIError(f"cannot resume from {self.ds_dir}: {str(e).strip().splitlines()[0]}") from None
        if path is None:
            raise CLIError(f"cannot resume: no DeepSpeed checkpoint {resume['tag']} in {self.ds_dir}")
        resume["rng"] = (client_state or {}).get("rng") or {}

    # ----- one step through the engine -----
    def train_step(self, lr: float) -> float:
        for group in self.engine.optimizer.param_groups:  # the core's schedule (training.learning_rate)
            group["lr"] = lr
        batches = self.micro_batches(self.iter_num)
        total = torch.zeros((), device=self.device)
        for i, offsets in enumerate(batches):
            x, y = get_batch(self.corpus.train, offsets, self.cfg.block_size, self.device)
            _, loss = self.engine(x, y)
            self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            if self.engine.is_gradient_accumulation_boundary() != (i == len(batches) - 1):
                raise RuntimeError("DeepSpeed's accumulation boundary is out of step with the micro-batches")
            self.engine.step()  # the optimizer steps (and zeroes the gradients) only at the boundary
            total += loss.detach().float() / len(batches)
        return total.item()

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine(x, y)[1]  # no autocast: DeepSpeed's config owns the precision

    def install_signal_handlers(self) -> None:
        """As the core's (finish the step, save, exit), but a repeat within a few seconds is the same request:
        on Ctrl-C the terminal signals every rank and the launcher then sends each of them SIGTERM too."""
        def request_stop(signum, frame):
            now = time.monotonic()
            if self.stop_requested and now - self.first_signal > SIGNAL_GRACE_S:
                raise KeyboardInterrupt
            if not self.stop_requested:
                self.stop_requested, self.first_signal = True, now
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    # ----- checkpoints -----
    def checkpoint_state(self) -> dict:
        """The client state: everything but the weights and optimizer (DeepSpeed saves those), JSON-able."""
        return {
            "model_config": asdict(self.raw_model.config),
            "train_config": asdict(self.cfg),
            "tokenizer": self.corpus.meta,
            "iter_num": self.iter_num,
            "best_val_loss": self.best_val_loss if math.isfinite(self.best_val_loss) else None,
            "history": self.history,
            "world_size": self.world_size,
            "zero_stage": zero_stage(self.ds_config),
            "deepspeed_version": deepspeed.__version__,
        }

    def save(self) -> None:
        tag = f"global_step{self.iter_num}"
        state = self.checkpoint_state()
        state["tag"] = tag
        if self.master:  # before DeepSpeed writes `latest`, so `latest` never names a folder without it
            write_json(os.path.join(self.ds_dir, tag, STATE_FILE), state)
        self.barrier()
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        self.engine.save_checkpoint(self.ds_dir, tag=tag, client_state={**state, "rng": rng})
        self.barrier()
        if self.master:
            self.prune_checkpoints(tag)
            if self.writer is not None:
                self.writer.flush()
        if os.environ.get(DUMP_ENV) and self.iter_num == self.max_iters:
            self.dump_weights(os.environ[DUMP_ENV])
        self.barrier()

    def prune_checkpoints(self, keep_tag: str) -> None:
        if self.keep_checkpoints <= 0:
            return
        tags = sorted((d for d in os.listdir(self.ds_dir) if d.startswith("global_step") and d != keep_tag
                       and d.removeprefix("global_step").isdigit()), key=lambda d: int(d.removeprefix("global_step")))
        for old in tags[:max(0, len(tags) - (self.keep_checkpoints - 1))]:
            shutil.rmtree(os.path.join(self.ds_dir, old), ignore_errors=True)

    def dump_weights(self, path: str) -> None:
        """The engine's full fp32 weights (gathered from every rank under ZeRO-3), written by rank 0."""
        params = list(self.raw_model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if self.master:
                state = {k: v.detach().float().clone().cpu() for k, v in
                         clean_state_dict(self.raw_model.state_dict()).items()}
                torch.save(state, path)


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_train_state(ds_dir: str, tag: str | None = None) -> dict:
    """train_state.json of the checkpoint named by `latest` (or tag) in a DeepSpeed checkpoint folder."""
    if not os.path.isdir(ds_dir):
        raise CLIError(f"DeepSpeed checkpoint folder not found: {ds_dir}")
    if tag is None:
        latest = os.path.join(ds_dir, "latest")
        if not os.path.isfile(latest):
            raise CLIError(f"{ds_dir} is not a DeepSpeed checkpoint folder of train_ds.py (no 'latest' file)")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(ds_dir, tag, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise CLIError(f"{path} not found: {ds_dir} is not a checkpoint of train_ds.py") from None
    except json.JSONDecodeError as e:
        raise CLIError(f"{path} is corrupt ({e})") from None
    if not isinstance(state, dict) or "model_config" not in state or "world_size" not in state:
        raise CLIError(f"{path} is not a train_ds.py training state")
    state["tag"] = tag
    if state.get("best_val_loss") is None:
        state["best_val_loss"] = float("inf")
    return state


# ----- processes -----
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: TrainConfig, args) -> torch.device:
    """Join the process group the launcher describes (a single process when started with plain python)."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if "LOCAL_RANK" not in os.environ and args.local_rank is not None:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accelerator = get_accelerator().device_name()  # "cpu" or "cuda": DeepSpeed chose it at import
    device = resolve_device(accelerator if cfg.device == "auto" else cfg.device, local_rank)
    if device.type != accelerator:
        raise CLIError(f"--device {cfg.device} but DeepSpeed runs on its {accelerator} accelerator; "
                       f"set DS_ACCELERATOR={device.type} in the environment or drop --device")
    cfg.device = device.type
    if device.type == "cuda":
        get_accelerator().set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # the launcher does not set it; N ranks x all cores thrash
        torch.set_num_threads(1)
    if args.timeout <= 0:
        raise CLIError("--timeout must be positive")
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=args.timeout))  # nccl on CUDA, gloo on CPU
    release_shm_buffer()
    return device


def release_shm_buffer() -> None:
    """On CPU, DeepSpeed's shared-memory all-reduce creates /dev/shm/deepspeed_allreduce_buffer_* (~66 MB per rank)
    and never removes it: every run would leak that much RAM until reboot. Once every rank has mapped every
    buffer (done inside init_distributed), the names can go; the memory is freed when the processes exit."""
    dist.barrier()
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{dist.get_rank()}")
    try:
        os.unlink(name)
    except FileNotFoundError:  # not on CPU, or ranks on several machines: no shared-memory buffer
        pass


def main() -> None:
    cfg, explicit, args = parse_config(description=__doc__, extra_arguments=extra_arguments)
    ds_path = args.deepspeed_config or args.deepscale_config or DEFAULT_DS_CONFIG
    ds = read_json_object(ds_path, "DeepSpeed config")
    init_distributed(cfg, args)
    trainer = DeepSpeedTrainer(cfg, explicit, ds, ds_path, args.keep_checkpoints)
    if trainer.master and cfg.init_from == "resume":
        print(f"resumed from {trainer.ds_dir} at iteration {trainer.iter_num}", flush=True)
    trainer.fit()
    if trainer.master:
        print(f"DeepSpeed checkpoint: {trainer.ds_dir}; sample with `python test_ds.py --ckpt {trainer.ds_dir}` "
              f"or convert with `cd {trainer.ds_dir} && python zero_to_fp32.py . ckpt_ds.pt`", flush=True)
    dist.barrier()  # leave together: a rank whose peer (the store's host) already exited can abort in teardown


if __name__ == "__main__":
    cli.run_distributed(main)
