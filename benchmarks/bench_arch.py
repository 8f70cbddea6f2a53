"""Time to quality of the two model families side by side: `python train.py` with --arch gpt2 and
--arch llama at the same width, depth, steps and flags otherwise, on the embedded corpus and on a
text file of your choice (char level), runs interleaved. Each run's validation loss in bits per byte
is recorded against the wall seconds since its process started; reported: each family's final val
bpb and wall time, and how much sooner the llama family reaches the GPT-2 family's final val bpb
(interpolated on its curve).

    python benchmarks/bench_arch.py --text input.txt --rounds 2
    python benchmarks/bench_arch.py --flags "--n-layer 6 --n-embd 256 --max-iters 600" --rounds 1
"""
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from toolkit import cli
from toolkit.data import DEFAULT_CORPUS_DIR
from toolkit.device import cpu_kind
from toolkit.prepare import ensure_default_corpus


def timed_run(cmd: list[str], cwd: str) -> tuple[float, list[tuple[float, float]]]:
    """Wall seconds of the whole process, and (seconds since start, val bpb) at each evaluation."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    curve, log = [], []
    for line in proc.stdout:
        log.append(line)
        if line.startswith("step ") and "val bpb" in line:
            curve.append((time.monotonic() - start, float(line.split("val bpb ")[1].split(",")[0])))
    if proc.wait() != 0:
        raise SystemExit(f"run failed: {shlex.join(cmd)}\n{''.join(log[-20:])}")
    return time.monotonic() - start, curve


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The seconds at which the curve first reaches target (linear between evaluations), or None."""
    for (t0, v0), (t1, v1) in zip(curve, curve[1:]):
        if v1 <= target:
            return t0 + (t1 - t0) * (v0 - target) / (v0 - v1) if v0 > target else t0
    return None


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--text", help="a second corpus: a text file, prepared at char level")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--flags", default="--eval-interval 25",
                        help="flags for both families (default: %(default)s, the quick start "
                             "otherwise)")
    args = parser.parse_args()
    corpora = {"pydoc": os.path.abspath(
        ensure_default_corpus(os.path.join(ROOT, DEFAULT_CORPUS_DIR)))}
    scratch = tempfile.mkdtemp(prefix="bench_arch_")
    if args.text:
        corpora[os.path.basename(args.text)] = os.path.join(scratch, "text")
        subprocess.run([sys.executable, os.path.join(ROOT, "tokenizer.py"), "--input", args.text,
                        "--tokenizer", "char", "--val-fraction", "0.1",
                        "--output-dir", corpora[os.path.basename(args.text)], "--quiet"],
                       check=True, stdout=subprocess.DEVNULL)
    print(f"CPU: {cpu_kind()}, {os.cpu_count()} cores; flags: {args.flags}", flush=True)
    runs = {(corpus, arch): [] for corpus in corpora for arch in ("gpt2", "llama")}
    for r in range(args.rounds):
        for (corpus, arch), results in runs.items():
            out = tempfile.mkdtemp(dir=scratch)
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data-dir", corpora[corpus],
                   "--out-dir", out, "--arch", arch, *shlex.split(args.flags)]
            seconds, curve = timed_run(cmd, ROOT)
            results.append({"seconds": seconds, "curve": curve})
            print(f"round {r + 1} {corpus:12s} {arch:6s} {seconds:6.1f} s, val bpb "
                  f"{curve[-1][1]:.4f}", flush=True)
    print(f"\n{'corpus':14s} {'arch':6s} {'wall s':>7s} {'val bpb':>8s} {'to gpt2 final':>14s}")
    for corpus in corpora:
        target = statistics.median(r["curve"][-1][1] for r in runs[(corpus, "gpt2")])
        for arch in ("gpt2", "llama"):
            results = runs[(corpus, arch)]
            reached = [time_to(r["curve"], target) for r in results]
            shown = ("not reached" if None in reached else f"{statistics.median(reached):.1f} s")
            print(f"{corpus:14s} {arch:6s} {statistics.median(r['seconds'] for r in results):7.1f} "
                  f"{statistics.median(r['curve'][-1][1] for r in results):8.4f} {shown:>14s}")
        gpt2 = statistics.median(r["seconds"] for r in runs[(corpus, "gpt2")])
        llama = [time_to(r["curve"], target) for r in runs[(corpus, "llama")]]
        if None not in llama:
            print(f"{corpus}: llama reaches gpt2's final val bpb {target:.4f} "
                  f"{gpt2 / statistics.median(llama):.2f}x sooner than gpt2's whole run")


if __name__ == "__main__":
    cli.run(main)
