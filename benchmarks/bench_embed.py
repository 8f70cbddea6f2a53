"""
Embeddings: encode throughput, exact search latency and memory, and what `embed.py tune` does to
recall.

    python benchmarks/bench_embed.py                                 # all three parts
    python benchmarks/bench_embed.py --parts search --rows 100000 --dims 128

encode: random-weight models of two shapes, the quick start's (4 layers, 128 wide, char vocabulary)
and GPT-2 124M's (its vocabulary too), 200 texts of 80-120 random tokens, batch 16, through
embedding.encode (what embed.py runs), in float32 and bfloat16; the median and the best of
--repeats rounds after a warm-up batch.
search: synthetic unit vectors written block by block to a .npy file and memory-mapped, as an
index's are; one query and a batch of 10; the first call (the mapping's pages fault in) and the
median of the next 5.
RSS is the process's resident memory during the search minus before the file was mapped.
recall: the retrieval set of tests/test_embed.py, with embed.py index / eval / tune run as a user
runs them.
documents: issue 47's held-out set from the embedded corpus, tune --input (no labels) on a
pretrained encoder.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import GPT, PRESETS, GPTConfig
from toolkit import cli
from toolkit.embedding import encode, top_k

MODELS = {"4 x 128, char vocab": dict(n_layer=4, n_head=4, n_embd=128, block_size=256,
                                      vocab_size=103),
          "GPT-2 124M shape": PRESETS["gpt2"]}


def bench_encode(repeats: int, texts: int, batch_size: int) -> None:
    print(f"\nencode: {texts} texts of 80-120 tokens, batch {batch_size}, "
          f"{torch.get_num_threads()} threads, median of {repeats}")
    print("| model | dtype | texts/s | tokens/s | best round, texts/s |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, shape in MODELS.items():
        model = GPT(GPTConfig(**shape)).eval()
        token_lists = [torch.randint(shape["vocab_size"], (int(n),), generator=g).tolist()
                       for n in torch.randint(80, 121, (texts,), generator=g)]
        tokens = sum(map(len, token_lists))
        for dtype in (torch.float32, torch.bfloat16):
            encode(model, token_lists[:batch_size], "weighted-mean", batch_size, dtype)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                encode(model, token_lists, "weighted-mean", batch_size, dtype)
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times)
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {texts / dt:,.1f} | "
                  f"{tokens / dt:,.0f} | {texts / min(times):,.1f} |", flush=True)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def write_unit_vectors(path: str, rows: int, dim: int) -> None:
    """rows x dim float32 unit vectors, written block by block (never all in memory)."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    g = torch.Generator().manual_seed(0)
    for start in range(0, rows, 65536):
        block = torch.randn(min(65536, rows - start), dim, generator=g)
        out[start:start + len(block)] = torch.nn.functional.normalize(block, dim=1).numpy()
    out.flush()
    del out


def bench_search(all_rows: list[int], dims: list[int], tmp_dir: str) -> None:
    print(f"\nsearch: exact top-10, {torch.get_num_threads()} threads; first call / median of the "
          "next 5 (ms)")
    print("| vectors | dim | file | 1 query: first | 1 query | 10 queries: first | 10 queries | "
          "RSS during search |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in all_rows:
        for dim in dims:
            path = os.path.join(tmp_dir, f"vectors_{rows}_{dim}.npy")
            write_unit_vectors(path, rows, dim)
            with open(path, "rb") as f:  # best effort: the first search reads the file from disk
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            before = rss_mb()
            vectors = np.load(path, mmap_mode="r")
            cells = []
            for q in (1, 10):
                queries = torch.nn.functional.normalize(torch.randn(q, dim), dim=1)
                times = []
                for _ in range(6):
                    t0 = time.perf_counter()
                    top_k(vectors, queries, 10)
                    times.append((time.perf_counter() - t0) * 1000)
                cells += [f"{times[0]:,.0f}", f"{statistics.median(times[1:]):,.1f}"]
            rss = rss_mb() - before
            del vectors
            os.remove(path)
            print(f"| {rows:,} | {dim} | {rows * dim * 4 / 2**20:,.0f} MiB | {' | '.join(cells)} | "
                  f"{rss:,.0f} MiB |", flush=True)


def embed_py(*args) -> str:
    result = subprocess.run([sys.executable, os.path.join(ROOT, "embed.py"), *map(str, args)],
                            capture_output=True, text=True)
    if result.returncode:
        raise cli.CLIError(f"embed.py {args[0]} failed: {result.stderr.strip()}")
    return result.stdout


def held_out_metrics(folder: Path, ckpt: Path, index: str, device: list[str]) -> dict:
    embed_py("index", "--ckpt", ckpt, "--input", folder / "docs.jsonl", "--out", folder / index,
             *device)
    return json.loads(embed_py("eval", "--index", folder / index,
                               "--pairs", folder / "heldout.jsonl", *device).splitlines()[-1])


def bench_recall(tmp_dir: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_embed import DEVICE, write_retrieval_set
    folder = Path(tempfile.mkdtemp(dir=tmp_dir))
    write_retrieval_set(folder)
    before = held_out_metrics(folder, folder / "ckpt.pt", "index", DEVICE)
    t0 = time.perf_counter()
    embed_py("tune", "--ckpt", folder / "ckpt.pt", "--pairs", folder / "train.jsonl",
             "--out-dir", folder / "tuned", *DEVICE)
    seconds = time.perf_counter() - t0
    after = held_out_metrics(folder, folder / "tuned" / "ckpt.pt", "tuned_index", DEVICE)
    shutil.rmtree(folder)
    print(f"\nrecall: the {after['queries']} held-out queries of tests/test_embed.py's retrieval "
          f"set (100 documents); tune took {seconds:.0f} s with its defaults")
    print("| encoder | recall@1 | recall@10 | MRR@10 |\n|---|---|---|---|")
    for name, m in (("untuned", before), ("after tune", after)):
        print(f"| {name} | {m['recall@1']:.2f} | {m['recall@10']:.2f} | {m['mrr@10']:.2f} |")


def bench_documents(tmp_dir: str, pretrain_iters: int) -> None:
    """Issue 47's set: tune from the documents alone with the defaults, evaluated on queries it
    never saw."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_embed import write_pydoc_retrieval_set
    folder = Path(tempfile.mkdtemp(dir=tmp_dir))
    write_pydoc_retrieval_set(folder)
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                    "--max-iters", str(pretrain_iters), "--out-dir", str(folder / "encoder")],
                   cwd=folder, check=True, capture_output=True)  # the embedded corpus
    before = held_out_metrics(folder, folder / "encoder" / "ckpt.pt", "index", [])
    t0 = time.perf_counter()
    embed_py("tune", "--ckpt", folder / "encoder" / "ckpt.pt", "--input", folder / "docs.jsonl",
             "--out-dir", folder / "tuned")
    seconds = time.perf_counter() - t0
    after = held_out_metrics(folder, folder / "tuned" / "ckpt.pt", "tuned_index", [])
    shutil.rmtree(folder)
    print(f"\ndocuments: the quick start's encoder pretrained {pretrain_iters} steps; tune --input "
          f"on the 79 documents with its defaults took {seconds:.0f} s; the {after['queries']} "
          "held-out queries (tests/test_embed.py's write_pydoc_retrieval_set)")
    print("| encoder | recall@1 | recall@5 | recall@10 | MRR@10 |\n|---|---|---|---|---|")
    for name, m in (("untuned", before), ("after tune --input", after)):
        print(f"| {name} | {m['recall@1']:.3f} | {m['recall@5']:.3f} | {m['recall@10']:.3f} | "
              f"{m['mrr@10']:.3f} |")


def main() -> None:
    p = cli.argument_parser(__doc__)
    p.add_argument("--parts", default="encode,search,recall,documents",
                   help="comma-separated: encode, search, recall, documents")
    p.add_argument("--pretrain-iters", type=int, default=600,
                   help="the documents part's encoder (default: 600)")
    p.add_argument("--repeats", type=int, default=3,
                   help="encode rounds per model and dtype (default: 3)")
    p.add_argument("--texts", type=int, default=200, help="texts to encode (default: 200)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="texts per forward pass (default: 16)")
    p.add_argument("--rows", default="100000,1000000", help="vectors to search, comma-separated")
    p.add_argument("--dims", default="128,768", help="vector dimensions, comma-separated")
    p.add_argument("--tmp-dir", default=tempfile.gettempdir(),
                   help="where the vector files are written")
    args = p.parse_args()
    parts = args.parts.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}")
    if "encode" in parts:
        bench_encode(args.repeats, args.texts, args.batch_size)
    if "search" in parts:
        bench_search([int(n) for n in args.rows.split(",")], [int(d) for d in args.dims.split(",")],
                     args.tmp_dir)
    if "recall" in parts:
        bench_recall(args.tmp_dir)
    if "documents" in parts:
        bench_documents(args.tmp_dir, args.pretrain_iters)


if __name__ == "__main__":
    cli.run(main)
