"""What finetune.py and `embed.py tune` learn with their defaults, on tasks built from the embedded
corpus.

Bodies: pretrained here on the pydoc corpus (char level) by train.py: the quick start
(`python train.py`, Muon), the same with --optimizer adamw, nanoGPT's shakespeare-char shape (6x384:
6 x 384, 10.7M) and the 124M preset (gpt2: 12 x 768) trained briefly, each with either optimizer.
Tasks, each --train-examples (600) train examples from the corpus' train split and 200 val examples
from its val split (text the body never saw):
  classify  a real 64-character span, or the same span with its words shuffled (chance 0.5)
  choice    the true 24-character continuation of a 48-character context among 4: the other three
            are the continuations of other contexts (chance 0.25)
  entail    does the 24-character hypothesis continue the 40-character premise, or come from
            elsewhere (0.5)
  similarity  two 32-character spans: adjacent in one document, or from two documents (0.5)
  tune      embed.py tune on (query: a span, positive: the span after it) pairs; recall@1,
            recall@10, MRR@10 of held-out queries against the val split's spans, before and after
finetune.py runs as a user runs it, with the defaults and any --flags given after `--`; each line of
the table is one run: task, body, accuracy, epochs, steps, wall seconds. The device (CPU kind or
GPU) is in the header.

    python benchmarks/bench_finetune.py                           # quick start bodies, all tasks
    python benchmarks/bench_finetune.py --bodies 6x384            # 18 min of pretraining on 2 cores
    python benchmarks/bench_finetune.py --bodies gpt2,gpt2-adamw \\
        --tasks classify,choice,entail,similarity
    python benchmarks/bench_finetune.py --tasks choice -- --lr 1e-4  # another setting to compare
    python benchmarks/bench_finetune.py --train-examples 2400     # 4 times the data
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from toolkit import cli
from toolkit.device import describe, resolve_device
from toolkit.data import DEFAULT_CORPUS_DIR
from toolkit.prepare import default_corpus_documents, ensure_default_corpus

GPT2_BRIEFLY = ["--preset", "gpt2", "--block-size", "128", "--batch-size", "16", "--max-iters",
                "150", "--eval-interval", "150", "--eval-iters", "5"]
# nanoGPT's shakespeare-char shape, 10.7M parameters
BABY_GPT = ["--n-layer", "6", "--n-head", "6", "--n-embd", "384", "--block-size", "128", "--lr",
            "1e-3", "--max-iters", "600", "--eval-interval", "300"]
BODIES = {
    "quick-start": [],
    "quick-start-adamw": ["--optimizer", "adamw"],
    "6x384": BABY_GPT,
    "6x384-adamw": [*BABY_GPT, "--optimizer", "adamw"],
    "gpt2": GPT2_BRIEFLY,
    # AdamW's steps take a quarter of Muon's time on a CPU (no Newton-Schulz): four times the steps,
    # in about the same wall time, bring its body to Muon's loss at 150 (docs/performance.md)
    "gpt2-adamw": [*GPT2_BRIEFLY, "--optimizer", "adamw", "--max-iters", "600"],
}
TASKS = ("classify", "choice", "entail", "similarity", "tune")
TRAIN_EXAMPLES, VAL_EXAMPLES = 600, 200


def corpus_splits() -> tuple[list[str], list[str]]:
    """The documents' text split as train.py's default corpus is: the first 90% of the characters
    train."""
    text = "\n\n".join(default_corpus_documents()) + "\n"
    cut = int(len(text) * 0.9)
    return [text[:cut]], [text[cut:]]


def span(rng: random.Random, texts: list[str], n: int) -> tuple[str, int, str]:
    text = rng.choice(texts)
    start = rng.randrange(len(text) - n)
    return text[start:start + n], start, text


def shuffle_words(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for _ in range(10):
        rng.shuffle(words)
        if " ".join(words) != text:
            break
    return " ".join(words)


def make_example(task: str, rng: random.Random, texts: list[str], positive: bool) -> dict:
    if task == "classify":
        text, _, _ = span(rng, texts, 64)
        return {"text": text if positive else shuffle_words(rng, text),
                "label": "real" if positive else "shuffled"}
    if task == "choice":
        text, _, _ = span(rng, texts, 72)
        others = [span(rng, texts, 72)[0][48:] for _ in range(3)]
        label = rng.randrange(4)
        return {"context": text[:48], "choices": others[:label] + [text[48:]] + others[label:],
                "label": label}
    if task == "entail":
        text, _, _ = span(rng, texts, 64)
        hypothesis = text[40:] if positive else span(rng, texts, 24)[0]
        return {"premise": text[:40], "hypothesis": hypothesis,
                "label": "yes" if positive else "no"}
    text, _, _ = span(rng, texts, 64)
    return {"text_a": text[:32], "text_b": text[32:] if positive else span(rng, texts, 32)[0],
            "label": int(positive)}


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def task_files(task: str, folder: str, train_examples: int) -> tuple[str, str]:
    train_texts, val_texts = corpus_splits()
    rng = random.Random(0)
    files = []
    for split, texts, n in (("train", train_texts, train_examples),
                            ("val", val_texts, VAL_EXAMPLES)):
        rows = [make_example(task, rng, texts, i % 2 == 0) for i in range(n)]
        files.append(write_jsonl(os.path.join(folder, f"{task}_{split}.jsonl"), rows))
    return files[0], files[1]


def pretrain(body: str, folder: str) -> str:
    out = os.path.join(folder, body)
    if not os.path.exists(os.path.join(out, "ckpt.pt")):
        run([sys.executable, os.path.join(ROOT, "train.py"), "--out-dir", out, *BODIES[body]])
    return os.path.join(out, "ckpt.pt")


def run(cmd: list[str]) -> tuple[str, float]:
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise cli.CLIError(f"{' '.join(cmd[1:3])} failed: "
                           f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result.stdout, time.perf_counter() - start


def finetune(task: str, body_ckpt: str, folder: str, train_examples: int,
             extra: list[str]) -> tuple[dict, float]:
    train, val = task_files(task, folder, train_examples)
    out = tempfile.mkdtemp(dir=folder, prefix=f"{task}_")
    stdout, seconds = run([sys.executable, os.path.join(ROOT, "finetune.py"), "--task", task,
                           "--train", train, "--val", val, "--init-from", body_ckpt, "--out-dir",
                           out, *extra])
    return json.loads(stdout.splitlines()[-1]), seconds


def tune(body_ckpt: str, folder: str, train_examples: int, extra: list[str]) -> tuple[dict, float]:
    """Recall@1 of held-out (span -> next span) queries against an index of the val split's next
    spans."""
    train_texts, val_texts = corpus_splits()
    rng = random.Random(0)
    pairs = [span(rng, train_texts, 96)[0] for _ in range(train_examples)]
    write_jsonl(os.path.join(folder, "pairs.jsonl"),
                [{"query": p[:48], "positive": p[48:]} for p in pairs])
    held = [span(rng, val_texts, 96)[0] for _ in range(VAL_EXAMPLES)]
    write_jsonl(os.path.join(folder, "docs.jsonl"),
                [{"id": str(i), "text": p[48:]} for i, p in enumerate(held)])
    write_jsonl(os.path.join(folder, "queries.jsonl"),
                [{"query": p[:48], "id": str(i)} for i, p in enumerate(held)])
    embed = [sys.executable, os.path.join(ROOT, "embed.py")]

    def recall(ckpt: str, name: str) -> dict:
        index = os.path.join(folder, f"index_{name}")
        run([*embed, "index", "--ckpt", ckpt, "--input", os.path.join(folder, "docs.jsonl"),
             "--out", index, "--overwrite"])
        stdout, _ = run([*embed, "eval", "--index", index, "--pairs",
                         os.path.join(folder, "queries.jsonl")])
        return json.loads(stdout.splitlines()[-1])

    before = recall(body_ckpt, "before")
    out = tempfile.mkdtemp(dir=folder, prefix="tune_")
    _, seconds = run([*embed, "tune", "--ckpt", body_ckpt, "--pairs",
                      os.path.join(folder, "pairs.jsonl"), "--out-dir", out, *extra])
    after = recall(os.path.join(out, "ckpt.pt"), "after")
    return {f"{k} {when}": v[k] for k in ("recall@1", "recall@10", "mrr@10")
            for when, v in (("before", before), ("after", after))}, seconds


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--bodies", default="quick-start,quick-start-adamw",
                        help="of: " + ", ".join(BODIES))
    parser.add_argument("--tasks", default=",".join(TASKS), help="of: " + ", ".join(TASKS))
    parser.add_argument("--train-examples", type=int, default=TRAIN_EXAMPLES,
                        help="per task (default: %(default)s)")
    parser.add_argument("--work", default=os.path.join(ROOT, "data", "bench_finetune"),
                        help="where bodies, tasks and runs go (bodies are reused)")
    parser.add_argument("extra", nargs="*",
                        help="after --: flags for every finetune.py / embed.py tune run")
    args = parser.parse_args()
    bodies, tasks = args.bodies.split(","), args.tasks.split(",")
    for name in bodies + tasks:
        if name not in BODIES and name not in TASKS:
            raise cli.CLIError(f"unknown body or task {name!r}")
    ensure_default_corpus(os.path.join(ROOT, DEFAULT_CORPUS_DIR))
    os.makedirs(args.work, exist_ok=True)
    print(f"{describe(resolve_device('auto'))}; {args.train_examples} training examples a task; "
          f"flags: {' '.join(args.extra) or '(defaults)'}")
    print("| task | body | result | epochs | steps | seconds |\n|---|---|---|---|---|---|")
    for body in bodies:
        ckpt = pretrain(body, args.work)
        for task in tasks:
            if task == "tune":
                result, seconds = tune(ckpt, args.work, args.train_examples, args.extra)
                shown, epochs, steps = ", ".join(f"{k} {v:.3f}" for k, v in result.items()), "", ""
            else:
                result, seconds = finetune(task, ckpt, args.work, args.train_examples, args.extra)
                metric = "val_accuracy"
                shown, epochs, steps = (f"{metric} {result[metric]:.3f}", result["epochs"],
                                        result["steps"])
            print(f"| {task} | {body} | {shown} | {epochs} | {steps} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    cli.run(main)
