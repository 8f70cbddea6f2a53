"""
tokenizer.py's wall time, MB/s of text and peak RSS for each kind of input, at one size of text.

    python benchmarks/bench_prepare.py                        # 2 GB of text in each kind
    python benchmarks/bench_prepare.py --mb 100 400 --kinds parquet txt --tokenizer gpt2

Each kind holds the same documents (1,000 characters of pydoc prose each, a third of them Chinese
by characters): JSON lines, JSON lines compressed with zstd, one JSON array, parquet in row groups
of 1,000 rows, parquet as one row group, four parquet files in a folder, a folder that HF datasets
saved (arrow stream files), a folder of 1,000 text files and one text file. Each run is a process of
its own (`--workers` given, default 1) and its peak RSS is that of the whole process tree, sampled
every 20 ms. Inputs are written once under --work-dir and reused. Target: peak RSS at most 1 GiB
and flat (within 100 MiB from 100 MB to 2 GB of text) for every kind.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pydoc_data.topics import topics

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from toolkit.device import cpu_kind  # noqa: E402

KINDS = ("jsonl", "jsonl.zst", "json", "parquet", "parquet-1-group", "parquet-4-files", "datasets",
         "txt-files", "txt")
DOCUMENT_CHARS = 1000
CHINESE = ("数据准备在平坦的内存中进行无论输入有多大模型都能从原始文本训练出来"
           "我们的工具读中文英文和代码每个文件是一篇文档每行是一条记录")


def documents(mb: float, seed: int = 0):
    """Documents of DOCUMENT_CHARS characters until mb MB of UTF-8 text: slices of pydoc's text,
    every third one of random Chinese characters in clauses instead."""
    english = " ".join(" ".join(topics[key] for key in sorted(topics)).split())
    rng = np.random.default_rng(seed)
    # (a clause of about 12 characters, then a comma or a full stop, as Chinese prose has)
    chinese = "".join(np.where(rng.random(1 << 20) < 1 / 12, rng.choice(list("，。"), 1 << 20),
                               rng.choice(list(CHINESE), 1 << 20)))
    total, n = 0, 0
    while total < mb * 1e6:
        pool = chinese if n % 3 == 2 else english
        start = int(rng.integers(0, len(pool) - DOCUMENT_CHARS))
        text = pool[start:start + DOCUMENT_CHARS]
        total += len(text.encode())
        n += 1
        yield text


def write_table_batches(mb: float, rows: int):
    batch = []
    for text in documents(mb):
        batch.append(text)
        if len(batch) == rows:
            yield pa.record_batch([pa.array(batch, pa.large_string())], names=["text"])
            batch = []
    if batch:
        yield pa.record_batch([pa.array(batch, pa.large_string())], names=["text"])


def write_input(kind: str, mb: float, path: str) -> None:
    """One kind of input of mb MB of text at path (a file or a folder)."""
    schema = pa.schema([("text", pa.large_string())])
    if kind in ("jsonl", "jsonl.zst"):
        opener = (lambda p: zstandard.open(p, "wt", encoding="utf-8")) if kind.endswith("zst") \
            else (lambda p: open(p, "w", encoding="utf-8"))
        with opener(path) as f:
            for text in documents(mb):
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    elif kind == "json":
        with open(path, "w", encoding="utf-8") as f:
            for i, text in enumerate(documents(mb)):
                f.write(",\n" if i else "[\n")
                f.write(json.dumps({"text": text}, ensure_ascii=False))
            f.write("\n]\n")
    elif kind == "parquet":
        with pq.ParquetWriter(path, schema) as writer:
            for batch in write_table_batches(mb, 1000):
                writer.write_batch(batch, row_group_size=1000)
    elif kind == "parquet-1-group":  # (each write is a group of its own: one write of all rows)
        table = pa.Table.from_batches(list(write_table_batches(mb, 1000)), schema)
        pq.write_table(table, path, row_group_size=len(table))
    elif kind == "parquet-4-files":
        os.makedirs(path)
        for i in range(4):
            with pq.ParquetWriter(os.path.join(path, f"part-{i}.parquet"), schema) as writer:
                for batch in write_table_batches(mb / 4, 1000):
                    writer.write_batch(batch, row_group_size=1000)
    elif kind == "datasets":
        os.makedirs(path)
        name = "data-00000-of-00001.arrow"
        with pa.ipc.new_stream(os.path.join(path, name), schema) as writer:
            for batch in write_table_batches(mb, 1000):
                writer.write_batch(batch)
        with open(os.path.join(path, "state.json"), "w") as f:
            json.dump({"_data_files": [{"filename": name}]}, f)
    elif kind == "txt-files":
        os.makedirs(path)
        texts = documents(mb)
        for i in range(1000):  # a thousand files, each about mb/1000 MB
            with open(os.path.join(path, f"{i:04d}.txt"), "w", encoding="utf-8") as f:
                for text in texts:
                    f.write(text + "\n")
                    if f.tell() >= mb * 1e6 / 1000:
                        break
    else:
        with open(path, "w", encoding="utf-8") as f:
            for text in documents(mb):
                f.write(text + "\n")


def input_path(work_dir: str, kind: str, mb: float) -> str:
    """The input of that kind and size, written on first use (to a temporary name, then renamed)."""
    suffix = {"parquet-1-group": ".parquet", "parquet-4-files": "", "datasets": "",
              "txt-files": ""}.get(kind, "." + kind)
    path = os.path.join(work_dir, f"{kind}-{mb:g}mb{suffix}")
    if not os.path.exists(path):
        tmp = os.path.join(work_dir, f"tmp-{os.getpid()}{suffix}")
        subprocess.run(["rm", "-rf", tmp], check=True)
        write_input(kind, mb, tmp)
        os.rename(tmp, path)
    return path


def peak_rss(cmd: list[str]) -> tuple[float, float, str]:
    """(seconds, peak RSS in MiB of the process and all its children, output) of a command."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [root, *root.children(True)]))
        except psutil.Error:  # a worker ended while it was read
            pass
        time.sleep(0.02)
    output = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output}")
    return time.perf_counter() - start, peak / 2**20, output


def measure(kind: str, mb: float, work_dir: str, tokenizer: str, fmt: str,
            workers: int) -> dict:
    """One run of tokenizer.py on the input of that kind and size."""
    path = input_path(work_dir, kind, mb)
    out = os.path.join(work_dir, "out")
    glob = ["--glob", "*.parquet"] if kind == "parquet-4-files" else []
    output = ["--output-prefix", os.path.join(out, "data")] if fmt == "megatron" else \
        ["--output-dir", out]
    cmd = [sys.executable, os.path.join(ROOT, "tokenizer.py"), "--input", path, *glob,
           "--tokenizer", tokenizer, "--format", fmt, *output, "--workers", str(workers),
           "--overwrite", "--quiet"]
    seconds, rss, _ = peak_rss(cmd)
    subprocess.run(["rm", "-rf", out], check=True)
    return {"kind": kind, "mb": mb, "seconds": seconds, "mb_s": mb / seconds, "rss": rss}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, nargs="+", default=[2000],
                   help="MB of text of each input (default: %(default)s)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--tokenizer", default="byte", choices=["gpt2", "bpe", "char", "byte"],
                   help="(default: %(default)s: tokenizing costs least, reading shows)")
    p.add_argument("--format", default="nanogpt", choices=["nanogpt", "megatron", "llmc"])
    p.add_argument("--workers", type=int, default=1, help="(default: %(default)s, tokenizer.py's)")
    p.add_argument("--work-dir", default="/tmp/bench_prepare")
    args = p.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    print(f"CPU: {cpu_kind()}, {os.cpu_count()} CPUs; --tokenizer {args.tokenizer} --format "
          f"{args.format} --workers {args.workers}", flush=True)
    print("| input | MB of text | s | MB/s | peak RSS (MiB) |\n|---|---|---|---|---|", flush=True)
    results = []
    for kind in args.kinds:
        for mb in args.mb:
            r = measure(kind, mb, args.work_dir, args.tokenizer, args.format, args.workers)
            results.append(r)
            print(f"| {kind} | {mb:g} | {r['seconds']:.1f} | {r['mb_s']:.1f} | {r['rss']:,.0f} |",
                  flush=True)
    return results


if __name__ == "__main__":
    main()
