"""
Tokens/s and peak memory of DDP and of FSDP2 training (train_ddp.py [--fsdp] under torchrun)
against one process, on the same global batch.

    python benchmarks/bench_ddp.py  # 2 ranks x 1 thread (DDP, FSDP2) vs 1 process x 2 threads
    python benchmarks/bench_ddp.py --iters 40 --repeats 3 --dtype float32
    python benchmarks/bench_ddp.py --n-layer 8 --n-embd 512 --iters 8 --warmup 3  # memory
    python benchmarks/bench_ddp.py --state-ranks 2 4 --n-layer 8 --n-embd 1024 --iters 2

Model: 4 layers (--n-layer), 4 heads, 128 wide (--n-embd), block 256, character vocabulary of the
embedded pydoc corpus,
global batch 16 sequences (one process: micro-batch 16; N ranks: micro-batch 16/N each). Every run
logs each step's time; the first --warmup steps are dropped and the median of the rest is the step
time. Runs of the two set-ups alternate (A B A B ...) so that load from other processes on the
machine hits both alike; the figure reported is the median over repeats. Step times are rank 0's
and include the gradient all-reduce; start-up (imports, rendezvous) and evaluation are excluded.
Peak RSS is the largest process's of a run (GNU time over torchrun: its workers are waited for),
torch's own ~300 MiB included; the training state's bytes per rank are printed beside it.

--state-ranks N ...: for each N, DDP and FSDP2 in turn (each under torchrun, N ranks x 1 thread,
float32, Muon, a batch of 2 sequences a rank, --iters steps), the bytes each rank holds of
parameters, gradients and optimizer state, counted tensor by tensor (a shard's own bytes) after
the last step's optimizer step, where all three are there; its peak RSS; and its median step time.
The models are built as train_ddp.py builds them (toolkit.fsdp.shard_model, toolkit.optim).
"""
import argparse
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


def state_worker(mode: str, n_layer: int, n_embd: int, vocab: int, iters: int) -> None:
    """One rank under torchrun: train --iters steps with DDP or FSDP2; print its bytes of
    parameters, gradients and optimizer state (a JSON line), its peak RSS and step time."""
    import resource
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from model import GPT, GPTConfig
    from toolkit.fsdp import local, shard_model
    from toolkit.optim import make_optimizer
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=256,
                          vocab_size=vocab))
    if mode == "fsdp":
        shard_model(model, model.transformer.h, torch.float32)
        train = model
    else:
        train = DistributedDataParallel(model)
    optimizer = make_optimizer(model, "muon", 6e-4, 0.1, (0.9, 0.95), 0.02)
    x = torch.randint(0, vocab, (2, 256))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _, loss = train(x, x)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
        if len(times) < iters:
            optimizer.zero_grad(set_to_none=True)
    params = list(model.parameters())
    state = [t for values in optimizer.state.values() for t in values.values()
             if isinstance(t, torch.Tensor)]
    counted = {"weights": sum(local(p).nbytes for p in params),
               "gradients": sum(local(p.grad).nbytes for p in params if p.grad is not None),
               "optimizer": sum(local(t).nbytes for t in state)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rank": dist.get_rank(), **counted, "peak_mib": peak,
                      "step_s": statistics.median(times)}), flush=True)
    dist.destroy_process_group()


def bench_state(ranks: list[int], n_layer: int, n_embd: int, vocab: int, iters: int) -> None:
    """DDP against FSDP2 at each number of ranks: the training state per rank, side by side."""
    print(f"{n_layer} x {n_embd}, vocabulary {vocab}, float32, Muon, 2 x 256 tokens a rank, "
          f"{iters} steps")
    print("| ranks | set-up | weights + gradients + optimizer MiB (largest rank) | x DDP's / ranks "
          "| peak RSS MiB | s/step |\n|---|---|---|---|---|---|")
    for n in ranks:
        figures = {}
        for mode in ("ddp", "fsdp"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(n), os.path.abspath(__file__), "--worker", mode,
                   "--n-layer", str(n_layer), "--n-embd", str(n_embd), "--vocab", str(vocab),
                   "--iters", str(iters)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            if result.returncode:
                sys.exit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
            rows = [json.loads(line) for line in result.stdout.splitlines()
                    if line.startswith("{")]
            state = max(r["weights"] + r["gradients"] + r["optimizer"] for r in rows) / 2**20
            figures[mode] = state
            ratio = f"{state / (figures['ddp'] / n):.3f}" if mode == "fsdp" else ""
            print(f"| {n} | {'FSDP2' if mode == 'fsdp' else 'DDP'} | {state:,.1f} | "
                  f"{ratio} | {max(r['peak_mib'] for r in rows):,.0f} | "
                  f"{statistics.median(r['step_s'] for r in rows):.2f} |", flush=True)


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
    parser.add_argument("--state-ranks", type=int, nargs="+",
                        help="instead: DDP's and FSDP2's training state per rank at each of these "
                             "numbers of ranks")
    parser.add_argument("--vocab", type=int, default=103,
                        help="--state-ranks' vocabulary (default: 103, the pydoc characters)")
    parser.add_argument("--worker", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return state_worker(args.worker, args.n_layer, args.n_embd, args.vocab, args.iters)
    if args.state_ranks:
        return bench_state(args.state_ranks, args.n_layer, args.n_embd, args.vocab, args.iters)
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
