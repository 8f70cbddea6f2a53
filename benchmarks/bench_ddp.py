"""
Tokens/s and peak memory of DDP and of FSDP2 training (train_ddp.py [--fsdp] under torchrun)
against one process, on the same global batch.

    python benchmarks/bench_ddp.py  # 2 ranks x 1 thread (DDP, FSDP2) vs 1 process x 2 threads
    python benchmarks/bench_ddp.py --iters 40 --repeats 3 --dtype float32
    python benchmarks/bench_ddp.py --n-layer 8 --n-embd 512 --iters 8 --warmup 3  # memory

Model: 4 layers (--n-layer), 4 heads, 128 wide (--n-embd), block 256, character vocabulary of the
embedded pydoc corpus,
global batch 16 sequences (one process: micro-batch 16; N ranks: micro-batch 16/N each). Every run
logs each step's time; the first --warmup steps are dropped and the median of the rest is the step
time. Runs of the two set-ups alternate (A B A B ...) so that load from other processes on the
machine hits both alike; the figure reported is the median over repeats. Step times are rank 0's
and include the gradient all-reduce; start-up (imports, rendezvous) and evaluation are excluded.
Peak RSS is the largest process's of a run (GNU time over torchrun: its workers are waited for),
torch's own ~300 MiB included; the training state's bytes per rank are printed beside it.
"""
import json
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


def step_times(cmd: list[str], threads: int, warmup: int) -> tuple[list[float], float]:
    """(the step times in ms after warmup, the peak RSS in MiB of the run's largest process)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(["/usr/bin/time", "-f", "peak %M", *cmd], cwd=ROOT,
                            capture_output=True, text=True, env=env)
    if result.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    times = [float(ms) for it, ms in STEP.findall(result.stdout) if int(it) > warmup]
    if not times:
        sys.exit(f"no step times in the output of {' '.join(cmd)}")
    return times, int(re.findall(r"^peak (\d+)$", result.stderr, re.M)[-1]) / 1024


def state_mib(n_layer: int, n_embd: int, vocab: int, ranks: int) -> tuple[float, float]:
    """MiB per rank of float32 parameters, gradients and Muon's state (a momentum for the blocks'
    matrices, AdamW's two moments for the rest): replicated (DDP), and sharded over ranks."""
    matrices = 12 * n_layer * n_embd**2  # attention 4 d^2, the gated MLP 8 d^2 (mlp_width 8d/3)
    rest = 2 * vocab * n_embd + (2 * n_layer + 1) * n_embd
    total = 4 * (3 * matrices + 4 * rest) / 2**20
    return total, total / ranks


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
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--data-dir",
                        help="prepared char-level data (default: prepare the pydoc corpus in /tmp)")
    args = parser.parse_args()
    if args.global_batch % args.ranks or args.iters <= args.warmup:
        sys.exit("--global-batch must be a multiple of --ranks and --iters larger than --warmup")

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or prepare_data(tmp)
        with open(os.path.join(data_dir, "meta.json")) as f:
            vocab = json.load(f)["vocab_size"]
        common = ["--data-dir", data_dir, "--n-layer", str(args.n_layer), "--n-head", "4",
                  "--n-embd", str(args.n_embd),
                  "--block-size", "256", "--device", "cpu", "--dtype", args.dtype, "--max-iters",
                  str(args.iters), "--log-interval", "1", "--eval-interval", str(args.iters * 10),
                  "--eval-iters", "1", "--warmup-iters", "5", "--overwrite"]
        single = [sys.executable, os.path.join(ROOT, "train.py"), *common, "--out-dir",
                  os.path.join(tmp, "single"), "--batch-size", str(args.global_batch),
                  "--grad-accum", "1"]
        ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.ranks), os.path.join(ROOT, "train_ddp.py"), *common, "--out-dir",
               os.path.join(tmp, "ddp"), "--batch-size", str(args.global_batch // args.ranks),
               "--grad-accum", str(args.ranks)]
        fsdp = [*ddp, "--fsdp"]
        fsdp[fsdp.index(os.path.join(tmp, "ddp"))] = os.path.join(tmp, "fsdp")
        setups = {f"1 process x {args.threads} threads": (single, args.threads),
                  f"{args.ranks} ranks x 1 thread, DDP (gloo)": (ddp, 1),
                  f"{args.ranks} ranks x 1 thread, FSDP2 (gloo)": (fsdp, 1)}
        medians, peaks = {name: [] for name in setups}, {name: [] for name in setups}
        for repeat in range(args.repeats):
            for name, (cmd, threads) in setups.items():
                times, peak = step_times(cmd, threads, args.warmup)
                medians[name].append(statistics.median(times))
                peaks[name].append(peak)
                print(f"run {repeat + 1} {name}: median {medians[name][-1]:.1f} ms/step "
                      f"(min {min(times):.1f}, max {max(times):.1f}, {len(times)} steps), "
                      f"peak RSS {peak:,.0f} MiB", flush=True)

    tokens = args.global_batch * 256
    print(f"\nglobal batch {args.global_batch} x 256 tokens, dtype {args.dtype}, "
          f"{os.cpu_count()} CPUs")
    whole, shard = state_mib(args.n_layer, args.n_embd, vocab, args.ranks)
    print(f"training state (float32 weights, gradients, Muon's): {whole:,.0f} MiB a rank "
          f"replicated, {shard:,.0f} MiB sharded over {args.ranks}")
    for name, values in medians.items():
        ms = statistics.median(values)
        print(f"{name:40s} {ms:8.1f} ms/step  {tokens / ms * 1000:10,.0f} tokens/s  peak RSS "
              f"{max(peaks[name]):8,.0f} MiB")


if __name__ == "__main__":
    main()
