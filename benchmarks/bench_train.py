"""Training throughput and memory of train.py, side by side with nanoGPT's train.py on the same
work.

Both train the same shape (default: 4 layers, 4 heads, 128 wide, block 256, batch 16, no dropout,
lr 1e-3, 400 iterations) on the same pydoc corpus files, interleaved run by run, and we report the
median ms/iter after warm-up, tokens/s, the val loss at the end and the peak RSS of each run.
nanoGPT is not part of this project: pass a checkout of github.com/karpathy/nanoGPT with
--nanogpt-dir (it is run as is, from a scratch folder holding links to the data), or leave it out
to measure this project's variants alone.

    python benchmarks/bench_train.py --nanogpt-dir ../nanoGPT --vocab char --repeats 2
    python benchmarks/bench_train.py --nanogpt-dir ../nanoGPT --vocab gpt2 --iters 30
"""
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from toolkit import cli, prepare
from toolkit.device import cpu_kind

SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=256, batch_size=16)
# Runs a command and reports its peak resident memory (the max over the process and its children).
RSS_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
               "file=sys.stderr); "
               "sys.exit(r.returncode)")


def prepare_data(vocab: str, workdir: str) -> str:
    """The pydoc corpus as nanoGPT files: char level (the default corpus) or GPT-2 BPE."""
    if vocab == "char":
        return os.path.abspath(prepare.ensure_default_corpus(os.path.join(ROOT, "data",
                                                                          "pydoc_char")))
    out = os.path.join(ROOT, "data", "pydoc_gpt2")
    if not os.path.exists(os.path.join(out, "meta.json")):
        docs = os.path.join(workdir, "pydoc_docs")
        os.makedirs(docs, exist_ok=True)
        for i, text in enumerate(prepare.default_corpus_documents()):
            with open(os.path.join(docs, f"{i:03d}.txt"), "w", encoding="utf-8") as f:
                f.write(text)
        subprocess.run([sys.executable, os.path.join(ROOT, "tokenizer.py"), "--input", docs,
                        "--tokenizer", "gpt2", "--append-eod", "--output-dir", out,
                        "--quiet"], check=True)
    return out


def nanogpt_command(nanogpt_dir: str, data_dir: str, vocab: str, iters: int, eval_iters: int,
                    workdir: str) -> tuple[list[str], str]:
    """nanoGPT reads data/<dataset>/ and configurator.py from its working directory: build one."""
    run_dir = tempfile.mkdtemp(dir=workdir, prefix="nanogpt_")
    dataset_dir = os.path.join(run_dir, "data", "bench")
    os.makedirs(dataset_dir)
    for name in ("train.bin", "val.bin"):
        os.symlink(os.path.join(data_dir, name), os.path.join(dataset_dir, name))
    if vocab == "char":  # without meta.pkl nanoGPT uses the padded GPT-2 vocabulary, 50304
        import json
        with open(os.path.join(data_dir, "meta.json")) as f:
            with open(os.path.join(dataset_dir, "meta.pkl"), "wb") as out:
                pickle.dump({"vocab_size": json.load(f)["vocab_size"]}, out)
    os.symlink(os.path.join(nanogpt_dir, "configurator.py"),
               os.path.join(run_dir, "configurator.py"))
    args = [f"--{k}={v}" for k, v in SHAPE.items()] + [
        "--dataset=bench", "--device=cpu", "--compile=False", "--dtype=float32", "--dropout=0.0",
        "--learning_rate=1e-3", f"--max_iters={iters}", f"--eval_interval={iters}",
        f"--eval_iters={eval_iters}", "--log_interval=1", "--always_save_checkpoint=False",
        "--out_dir=out", "--gradient_accumulation_steps=1"]
    config = os.path.join(nanogpt_dir, "config", "train_shakespeare_char.py")
    return [sys.executable, os.path.join(nanogpt_dir, "train.py"), config, *args], run_dir


def our_command(data_dir: str, variant: str, iters: int, eval_iters: int,
                workdir: str) -> tuple[list[str], str]:
    """train.py with nanoGPT's shakespeare_char optimizer settings (AdamW), so only the
    implementation differs. variant is a dtype, optionally with "+compile", "+muon" (the default
    optimizer from scratch, for its cost) and/or "+<attention kernel>", e.g.
    bfloat16+compile+manual."""
    dtype, *options = variant.split("+")
    out_dir = tempfile.mkdtemp(dir=workdir, prefix=f"ours_{dtype}_")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()] + [
        f"--data-dir={data_dir}", f"--out-dir={out_dir}", "--overwrite", "--device=cpu",
        f"--dtype={dtype}", "--dropout=0.0", "--no-bias", "--lr=1e-3", "--min-lr=1e-4",
        "--warmup-iters=100", "--lr-decay-iters=5000", "--beta2=0.99", "--optimizer=adamw",
        f"--max-iters={iters}", f"--eval-interval={iters}", f"--eval-iters={eval_iters}",
        "--log-interval=1"]
    named = {"compile": "--compile", "muon": "--optimizer=muon"}
    args += [named.get(option, f"--attn-kernel={option}") for option in options]
    return [sys.executable, os.path.join(ROOT, "train.py"), *args], out_dir


def run(cmd: list[str], cwd: str, env: dict) -> dict:
    """Run one training; parse per-iteration times, the last val loss and the peak RSS."""
    result = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *cmd], cwd=cwd, env=env, text=True,
                            capture_output=True)
    if result.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{result.stderr[-2000:]}")
    out = result.stdout + result.stderr
    times = [float(ms) for ms in re.findall(r"^iter \d+: loss [\d.]+,.*?([\d.]+) ?ms", out, re.M)]
    vals = re.findall(r"val loss ([\d.]+)", out)
    rss_kb = int(re.search(r"PEAK_RSS_KB (\d+)", out).group(1))
    return {"ms": statistics.median(times[10:] or times), "val": float(vals[-1]),
            "rss_gb": rss_kb / 2**20}


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--nanogpt-dir", help="a checkout of karpathy/nanoGPT to compare against")
    parser.add_argument("--vocab", choices=["char", "gpt2"], default="char")
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--eval-iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of all variants")
    parser.add_argument("--ours", default="float32,bfloat16,bfloat16+compile",
                        help="this project's runs: dtypes, each optionally +compile, +muon and "
                             "+<attention kernel> (default: %(default)s)")
    parser.add_argument("--malloc-tuned", action="store_true",
                        help="also run nanoGPT with MALLOC_MMAP_MAX_=0 "
                             "MALLOC_TRIM_THRESHOLD_=17179869184")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="bench_train_")
    data_dir = prepare_data(args.vocab, workdir)
    variants = {f"ours {v}": our_command(data_dir, v, args.iters, args.eval_iters, workdir)
                for v in args.ours.split(",")}
    env = dict(os.environ)
    if args.nanogpt_dir:
        nano_dir = os.path.abspath(args.nanogpt_dir)
        variants["nanoGPT float32"] = nanogpt_command(nano_dir, data_dir, args.vocab, args.iters,
                                                      args.eval_iters, workdir)
        if args.malloc_tuned:
            variants["nanoGPT float32 malloc-tuned"] = nanogpt_command(nano_dir, data_dir,
                                                                       args.vocab, args.iters,
                                                                       args.eval_iters, workdir)
    results = {name: [] for name in variants}
    for round_ in range(args.repeats):
        for name, (cmd, cwd) in variants.items():
            run_env = env
            if name.endswith("malloc-tuned"):
                run_env = {**env, "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "17179869184"}
            results[name].append(run(cmd, cwd if name.startswith("nanoGPT") else ROOT, run_env))
            r = results[name][-1]
            print(f"round {round_ + 1} {name:30s} {r['ms']:8.1f} ms/iter  val {r['val']:.4f}  "
                  f"peak RSS {r['rss_gb']:.2f} GB", flush=True)

    tokens = SHAPE["batch_size"] * SHAPE["block_size"]
    base = statistics.median(r["ms"] for r in results.get("nanoGPT float32", [])) \
        if args.nanogpt_dir else None
    print(f"\n{args.vocab} vocabulary, {args.iters} iterations, {tokens} tokens/iter, median over "
          f"{args.repeats} round(s), CPU {cpu_kind()} (ATEN_CPU_CAPABILITY="
          f"{os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}), {os.cpu_count()} cores:")
    print(f"{'variant':32s} {'ms/iter':>8s} {'tokens/s':>9s} {'vs nanoGPT':>10s} {'val loss':>9s} "
          f"{'peak RSS':>9s}")
    for name, rs in results.items():
        ms = statistics.median(r["ms"] for r in rs)
        ratio = f"{base / ms:.2f}x" if base else "-"
        print(f"{name:32s} {ms:8.1f} {tokens / ms * 1000:9,.0f} {ratio:>10s} "
              f"{statistics.median(r['val'] for r in rs):9.4f} "
              f"{max(r['rss_gb'] for r in rs):8.2f}G")


if __name__ == "__main__":
    main()
