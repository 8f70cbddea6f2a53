"""
Throughput and memory of tokenizer.py against tiktoken's raw speed.

    python benchmarks/bench_tokenizer.py            # 200 MB synthetic JSON lines, workers 1 and 2
    python benchmarks/bench_tokenizer.py --size-mb 20 --workers 1 2 4

The input (kept in /tmp and reused) is English prose from Python's pydoc topics: random paragraphs
per document, half of them with their words shuffled, so that tokenization speed is like real text
rather than one repeated string. Target: end-to-end MB/s >= 80% of (raw single-process rate x
workers) with the peak RSS of the whole process tree < 1 GiB.
"""
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pydoc_data.topics import topics

import psutil
import tiktoken

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from toolkit import cli, gpt2_vocab
from toolkit.files import atomic_write


def make_document(rng: random.Random, paragraphs: list[str]) -> str:
    chosen = [rng.choice(paragraphs) for _ in range(rng.randint(2, 40))]
    varied = [" ".join(rng.sample(p.split(), len(p.split()))) if rng.random() < 0.5 else p
              for p in chosen]
    return "\n\n".join(varied)


def make_corpus(path: str, size_mb: int, seed: int) -> None:
    """Synthetic JSON lines of about size_mb MB, written to a temporary name first so a partial file
    is never reused."""
    paragraphs = [p for key in sorted(topics) for p in topics[key].split("\n\n") if p.strip()]
    rng = random.Random(seed)

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            while f.tell() < size_mb * 2**20:
                f.write(json.dumps({"text": make_document(rng, paragraphs)}) + "\n")

    atomic_write(path, write)


def read_sample(path: str, sample_mb: float) -> list[str]:
    texts, size = [], 0
    with open(path) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= sample_mb * 2**20:
                return texts
    return texts


def raw_rates(texts: list[str], repeats: int = 3) -> tuple[float, float, float]:
    """tiktoken alone in this process, best of repeats (the machine may be shared), in MB/s:
    encode_ordinary_batch with 1 thread, encode_to_numpy per text, and encode_to_numpy per CPU
    second (not disturbed by other load)."""
    enc = tiktoken.get_encoding("r50k_base")
    mb = sum(len(t.encode()) for t in texts) / 2**20
    batch = numpy = numpy_cpu = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        enc.encode_ordinary_batch(texts, num_threads=1)
        t1, c1 = time.perf_counter(), time.process_time()
        for text in texts:
            enc.encode_to_numpy(text, disallowed_special=())
        t2, c2 = time.perf_counter(), time.process_time()
        batch, numpy, numpy_cpu = max(batch, mb / (t1 - t0)), max(numpy, mb / (t2 - t1)), \
            max(numpy_cpu, mb / (c2 - c1))
    return batch, numpy, numpy_cpu


@dataclass
class Run:
    seconds: float
    cpu_seconds: float  # user + system of the whole process tree
    # sum of RSS over the tree, sampled (counts pages shared after fork once per process)
    peak_tree_mib: float
    peak_process_mib: float  # largest single process (ru_maxrss)
    summary: str


def run_tokenizer(path: str, workers: int, out_prefix: str) -> Run:
    """Run tokenizer.py end to end, as a user would."""
    cmd = [sys.executable, os.path.join(ROOT, "tokenizer.py"), "--input", path, "--tokenizer",
           "gpt2", "--append-eod", "--format", "megatron", "--output-prefix", out_prefix,
           "--workers", str(workers), "--overwrite", "--quiet"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak,
                       sum(p.memory_info().rss for p in [proc] + proc.children(recursive=True)))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"tokenizer.py failed: {err.strip()}")
    # includes the pool workers, reaped by tokenizer.py
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Run(seconds, cpu, peak / 2**20, after.ru_maxrss / 1024, out.strip())


def main() -> None:
    p = cli.argument_parser(__doc__)
    p.add_argument("--size-mb", type=int, default=200,
                   help="size of the synthetic input (default: %(default)s)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                   help="worker counts to run (default: 1 2)")
    p.add_argument("--sample-mb", type=float, default=4,
                   help="text for the raw tiktoken rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not gpt2_vocab.installed():
        sys.exit(f"the GPT-2 vocabulary is not installed; run: {gpt2_vocab.INSTALL_HINT}")

    path = os.path.join(tempfile.gettempdir(),
                        f"bench_tokenizer_{args.size_mb}mb_seed{args.seed}.jsonl")
    if not os.path.exists(path):
        print(f"writing {path} ...", flush=True)
        make_corpus(path, args.size_mb, args.seed)
    size_mb = os.path.getsize(path) / 2**20
    sample = read_sample(path, args.sample_mb)
    print(f"input {path}: {size_mb:.0f} MB, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        # raw rate measured right before each run: the load of a shared machine drifts
        for workers in args.workers:
            batch_rate, numpy_rate, cpu_rate = raw_rates(sample)
            raw = max(batch_rate, numpy_rate)
            load = os.getloadavg()[0]
            r = run_tokenizer(path, workers, os.path.join(tmp, "bench"))
            rate = size_mb / r.seconds
            print(f"workers {workers} (load average {load:.1f} -> {os.getloadavg()[0]:.1f})\n"
                  f"  raw tiktoken, 1 process: {raw:.1f} MB/s "
                  f"(encode_ordinary_batch 1 thread {batch_rate:.1f}, "
                  f"encode_to_numpy {numpy_rate:.1f}; {cpu_rate:.1f} MB per CPU second)\n"
                  f"  tokenizer.py: {r.seconds:.1f} s, {rate:.1f} MB/s = "
                  f"{rate / (raw * workers):.0%} of raw x {workers}; "
                  f"{size_mb / r.cpu_seconds:.1f} MB per CPU second = "
                  f"{size_mb / r.cpu_seconds / cpu_rate:.0%} of raw\n"
                  f"  peak RSS: process tree {r.peak_tree_mib:.0f} MiB, "
                  f"largest process {r.peak_process_mib:.0f} MiB\n"
                  f"  {r.summary}", flush=True)

if __name__ == "__main__":
    main()
