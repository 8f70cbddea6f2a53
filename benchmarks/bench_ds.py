"""DeepSpeed on this machine: step time of ZeRO-3 offload vs ZeRO-2 vs DDP, and peak memory per
model size.

    python benchmarks/bench_ds.py steps                  # same model, 2 processes each, ms per step
    python benchmarks/bench_ds.py memory --sizes 12x768,24x1024 --modes zero3_offload,ddp

Every mode trains the same model on the embedded corpus (prepared into a temporary folder) with the
same global batch, launched as a user would (the deepspeed launcher, torchrun). `steps` reports the
median step time after the first few steps; `memory` reports the peak resident memory of all
processes together (sampled every 0.1 s) while the first training steps run, then kills the job (no
checkpoint is written).
Modes: single (train.py, 1 process), ddp (torchrun train_ddp.py), zero2 (ds_config_zero2.json:
optimizer offloaded), zero3_offload (ds_config.json), zero3 (ds_config.json without offload,
torch's AdamW).
On a CPU-only machine "offload" moves the state from one part of the same RAM to another: what ZeRO
saves here is the replication of parameters, gradients and optimizer state across processes.
"""
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from toolkit import cli
from toolkit.distributed import free_port
from toolkit.files import read_json, write_json

STEP_LINE = re.compile(r"^iter (\d+): loss ([\d.naninf]+), lr \S+, ([\d.]+) ms", re.M)
MODES = ("single", "ddp", "zero2", "zero3_offload", "zero3")


def prepare(tmp: str) -> tuple[str, dict]:
    subprocess.run([sys.executable, os.path.join(ROOT, "tokenizer.py")], cwd=tmp, check=True,
                   capture_output=True)
    zero3 = read_json(os.path.join(ROOT, "ds_config.json"))
    zero3["zero_optimization"].pop("offload_optimizer")
    zero3["zero_optimization"].pop("offload_param")
    zero3["optimizer"]["params"]["torch_adam"] = True  # no fused_adam build on CPU
    configs = {"zero2": os.path.join(ROOT, "ds_config_zero2.json"),
               "zero3_offload": os.path.join(ROOT, "ds_config.json"),
               "zero3": os.path.join(tmp, "ds_config_zero3_no_offload.json")}
    write_json(configs["zero3"], zero3)
    with open(os.path.join(tmp, "hostfile"), "w") as f:
        f.write("localhost slots=2\n")
    return os.path.join(tmp, "data", "pydoc_char"), configs


def command(mode: str, tmp: str, configs: dict, flags: list[str]) -> list[str]:
    if mode == "single":
        return [sys.executable, os.path.join(ROOT, "train.py"), *flags]
    if mode == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                os.path.join(ROOT, "train_ddp.py"), *flags]
    return [sys.executable, "-m", "deepspeed.launcher.runner",
            "--hostfile", os.path.join(tmp, "hostfile"), "--no_ssh_check",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            os.path.join(ROOT, "train_ds.py"), "--deepspeed", "--deepspeed_config", configs[mode],
            *flags]


def run(cmd: list[str], cwd: str, stop_after: int | None, timeout: float,
        rss_limit_gib: float | None = None) -> tuple[str, float, float]:
    """Run a job in its own session; returns (output, peak RSS of the whole tree in GiB, seconds).
    With stop_after, the job is killed once that many steps were logged; with rss_limit_gib, once
    its processes together hold more than that (so a too-large model never pushes a shared machine
    into OOM)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    log = tempfile.TemporaryFile(mode="w+")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    root, peak = psutil.Process(proc.pid), 0
    try:
        while proc.poll() is None and time.time() - t0 < timeout:
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            if rss_limit_gib is not None and peak > rss_limit_gib * 2 ** 30:
                break
            if stop_after is not None:
                log.seek(0)
                if len(STEP_LINE.findall(log.read())) >= stop_after:
                    break
            time.sleep(0.1)
    finally:
        kill_tree(root)
        proc.wait()
    log.seek(0)
    return log.read(), peak / 2 ** 30, time.time() - t0


def kill_tree(root: psutil.Process) -> None:
    """SIGKILL a job and every process it started (torchrun puts its workers in sessions of their
    own, so killing the job's process group is not enough)."""
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)


def model_flags(shape: str) -> list[str]:
    n_layer, n_embd = (int(v) for v in shape.split("x"))
    n_head = max(1, n_embd // 64)
    return ["--n-layer", str(n_layer), "--n-head", str(n_head), "--n-embd", str(n_embd)]


def steps(args, tmp, data, configs) -> None:
    flags = ["--data-dir", data, *model_flags(args.shape), "--block-size", str(args.block_size),
             "--batch-size", str(args.batch_size), "--grad-accum", "2", "--device", "cpu",
             "--dtype", "float32", "--max-iters", str(args.iters), "--eval-interval", "100000",
             "--eval-iters", "1", "--log-interval", "1"]
    print(f"model {args.shape} (layers x width), block {args.block_size}, micro-batch "
          f"{args.batch_size}, global batch {2 * args.batch_size}, {args.iters} steps, float32; "
          f"median ms/step after {args.skip} steps")
    results = {m: [] for m in args.modes}
    for repeat in range(args.repeats):  # interleaved: a busy neighbour slows every mode alike
        for mode in args.modes:
            out_dir = os.path.join(tmp, f"out_{mode}_{repeat}")
            cmd = command(mode, tmp, configs, [*flags, "--out-dir", out_dir])
            out, peak, seconds = run(cmd, tmp, None, args.timeout)
            times = [float(ms) for _, _, ms in STEP_LINE.findall(out)][args.skip:]
            losses = [float(loss) for _, loss, _ in STEP_LINE.findall(out)]
            if not times:
                print(f"{mode}: failed\n{out[-2000:]}")
                continue
            results[mode].append(statistics.median(times))
            print(f"{mode:14s} run {repeat}: {statistics.median(times):8.1f} ms/step, final loss "
                  f"{losses[-1]:.4f}, peak RSS {peak:.2f} GiB, wall {seconds:.0f} s", flush=True)
    print("summary (best median of the repeats):")
    for mode, values in results.items():
        if values:
            print(f"  {mode:14s} {min(values):8.1f} ms/step")


def memory(args, tmp, data, configs) -> None:
    print(f"peak RSS of all processes during the first {args.steps} steps; block "
          f"{args.block_size}, micro-batch 1, 2 processes (train.py: 1); bytes/param = peak / "
          f"parameters. The largest model for R GiB is about R / (bytes/param), the fixed overhead "
          f"aside: try sizes upwards until a run is over the limit")
    from model import GPTConfig  # (torch's import: only this mode needs it)
    from toolkit.device import num_params
    for shape in args.sizes.split(","):
        n_layer, n_embd = (int(v) for v in shape.split("x"))
        n_params = num_params(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64),
                                        vocab_size=103, block_size=args.block_size),
                              non_embedding=False)
        for mode in args.modes:
            flags = ["--data-dir", data, *model_flags(shape), "--block-size", str(args.block_size),
                     "--batch-size", "1", "--grad-accum", "1" if mode == "single" else "2",
                     "--device", "cpu", "--dtype", "float32", "--max-iters", "1000",
                     "--eval-interval", "100000", "--eval-iters", "1", "--log-interval", "1",
                     "--warmup-iters", "1", "--out-dir", os.path.join(tmp, f"mem_{mode}_{shape}")]
            limit = args.limit_gib or 0.8 * psutil.virtual_memory().available / 2 ** 30
            out, peak, seconds = run(command(mode, tmp, configs, flags), tmp, args.steps,
                                     args.timeout, limit)
            ok = len(STEP_LINE.findall(out)) >= args.steps
            status = "ok" if ok else f"over the {limit:.1f} GiB limit" if peak > limit else "FAILED"
            print(f"{shape:10s} {n_params / 1e6:7.1f}M params {mode:14s} peak {peak:6.2f} GiB "
                  f"({peak * 2 ** 30 / n_params:5.1f} bytes/param) {status} "
                  f"in {seconds:.0f} s", flush=True)
            if status == "FAILED":
                print(out[-1500:])


def main() -> None:
    parser = cli.argument_parser(__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("steps", allow_abbrev=False)
    s.add_argument("--modes", default="single,ddp,zero2,zero3_offload")
    s.add_argument("--shape", default="4x256", help="LAYERSxWIDTH (default: 4x256, ~3.2M params)")
    s.add_argument("--block-size", type=int, default=256)
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--iters", type=int, default=20)
    s.add_argument("--skip", type=int, default=5)
    s.add_argument("--repeats", type=int, default=1)
    s.add_argument("--timeout", type=float, default=900)
    m = sub.add_parser("memory", allow_abbrev=False)
    m.add_argument("--modes", default="ddp,zero3_offload")
    m.add_argument("--sizes", default="12x768",
                   help="comma-separated LAYERSxWIDTH (12x768 = GPT-2 small's trunk)")
    m.add_argument("--block-size", type=int, default=64)
    m.add_argument("--steps", type=int, default=2)
    m.add_argument("--timeout", type=float, default=1800)
    m.add_argument("--limit-gib", type=float, default=None,
                   help="kill a run whose processes hold more than this (default: 80%% of the "
                        "available memory)")
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="bench_ds_") as tmp:
        data, configs = prepare(tmp)
        (steps if args.what == "steps" else memory)(args, tmp, data, configs)


if __name__ == "__main__":
    main()
