"""
Tokens/s of DDP training (train_ddp.py under torchrun) against one process, on the same global
batch.

    python benchmarks/bench_ddp.py  # 2 ranks x 1 thread vs 1 process x 2 threads
    python benchmarks/bench_ddp.py --iters 40 --repeats 3 --dtype float32

Model: 4 layers, 4 heads, 128 wide, block 256, character vocabulary of the embedded pydoc corpus,
global batch 16 sequences (one process: micro-batch 16; N ranks: micro-batch 16/N each). Every run
logs each step's time; the first --warmup steps are dropped and the median of the rest is the step
time. Runs of the two set-ups alternate (A B A B ...) so that load from other processes on the
machine hits both alike; the figure reported is the median over repeats. Step times are rank 0's
and include the gradient all-reduce; start-up (imports, rendezvous) and evaluation are excluded.
"""
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toolkit import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"^iter (\d+): .*?, ([\d.]+) ms,", re.MULTILINE)


def prepare_data(workdir: str) -> str:
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tokenizer.py")], cwd=workdir,
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"tokenizer.py failed: {result.stderr.strip()}")
    return os.path.join(workdir, "data", "pydoc_char")


def step_times(cmd: list[str], threads: int, warmup: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    times = [float(ms) for it, ms in STEP.findall(result.stdout) if int(it) > warmup]
    if not times:
        sys.exit(f"no step times in the output of {' '.join(cmd)}")
    return times


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ranks", type=int, default=2,
                        help="DDP processes, 1 thread each (default: 2)")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of the single process (default: 2)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--iters", type=int, default=25, help="steps per run (default: 25)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="first steps of each run not counted (default: 5)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each set-up, interleaved (default: 2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--data-dir",
                        help="prepared char-level data (default: prepare the pydoc corpus in /tmp)")
    args = parser.parse_args()
    if args.global_batch % args.ranks or args.iters <= args.warmup:
        sys.exit("--global-batch must be a multiple of --ranks and --iters larger than --warmup")

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or prepare_data(tmp)
        common = ["--data-dir", data_dir, "--n-layer", "4", "--n-head", "4", "--n-embd", "128",
                  "--block-size", "256", "--device", "cpu", "--dtype", args.dtype, "--max-iters",
                  str(args.iters), "--log-interval", "1", "--eval-interval", str(args.iters * 10),
                  "--eval-iters", "1", "--warmup-iters", "5"]
        single = [sys.executable, os.path.join(ROOT, "train.py"), *common, "--out-dir",
                  os.path.join(tmp, "single"), "--batch-size", str(args.global_batch),
                  "--grad-accum", "1"]
        ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.ranks), os.path.join(ROOT, "train_ddp.py"), *common, "--out-dir",
               os.path.join(tmp, "ddp"), "--batch-size", str(args.global_batch // args.ranks),
               "--grad-accum", str(args.ranks)]
        setups = {f"1 process x {args.threads} threads": (single, args.threads),
                  f"{args.ranks} ranks x 1 thread (gloo)": (ddp, 1)}
        medians = {name: [] for name in setups}
        for repeat in range(args.repeats):
            for name, (cmd, threads) in setups.items():
                times = step_times(cmd, threads, args.warmup)
                medians[name].append(statistics.median(times))
                print(f"run {repeat + 1} {name}: median {medians[name][-1]:.1f} ms/step "
                      f"(min {min(times):.1f}, max {max(times):.1f}, {len(times)} steps)",
                      flush=True)

    tokens = args.global_batch * 256
    print(f"\nglobal batch {args.global_batch} x 256 tokens, dtype {args.dtype}, "
          f"{os.cpu_count()} CPUs")
    for name, values in medians.items():
        ms = statistics.median(values)
        print(f"{name:32s} {ms:8.1f} ms/step  {tokens / ms * 1000:10,.0f} tokens/s")


if __name__ == "__main__":
    main()
