"""Time-to-quality of the quick start against nanoGPT's documented CPU or GPU recipe, side by side.

Both train on the same prepared files (character level: the pydoc corpus, or --text such as Tiny
Shakespeare's input.txt, its last tenth the validation split), each as a whole process, timed by the
wall clock; runs are interleaved (nanoGPT, ours, nanoGPT, ours, ...). Each run's validation curve is
recorded against the seconds since its start (from its own evaluation lines), and its final
checkpoint is scored by one evaluator over the whole validation split: non-overlapping windows of
the model's block size, the loss averaged over every predicted character. nanoGPT is not part of
this project: pass a checkout of github.com/karpathy/nanoGPT, which runs as is (its model.py scores
its own checkpoint).

nanoGPT's CPU recipe is its README's "I only have a macbook" command:
config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0; its GPU recipe is config/train_shakespeare_char.py as it is (6
x 384, block 256, batch 64, dropout 0.2, 5000 iterations, compiled; its README: "about 3 minutes on
one A100, best validation loss 1.4697"). Ours is `python train.py` with no flags but the data (or
--ours-flags). Tiny Shakespeare is not shipped here: it is karpathy/char-rnn's
data/tinyshakespeare/input.txt (1,115,394 bytes).

    python benchmarks/speedrun.py --nanogpt-dir ../nanoGPT --rounds 2 --plot docs/speedrun.png
    python benchmarks/speedrun.py --recipe gpu --nanogpt-dir ../nanoGPT --text input.txt --rounds 1
"""
import importlib.util
import json
import os
import pickle
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from toolkit import cli
from toolkit.checkpoint import load_checkpoint, model_from_checkpoint
from toolkit.device import cpu_kind, describe, resolve_device
from toolkit.data import DEFAULT_CORPUS_DIR
from toolkit.prepare import ensure_default_corpus

NANOGPT_RECIPES = {"cpu": ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
                           "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                           "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000",
                           "--dropout=0.0"],
                   "gpu": []}


def timed_run(cmd: list[str], cwd: str, env: dict) -> tuple[float, list[tuple[float, float]]]:
    """Wall seconds of the whole process, and (seconds since start, val loss) at each of its
    evaluations."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    curve, log = [], []
    for line in proc.stdout:
        log.append(line)
        if line.startswith("step ") and "val loss" in line:
            curve.append((time.monotonic() - start,
                          float(line.split("val loss ")[1].split(",")[0])))
    if proc.wait() != 0:
        raise SystemExit(f"run failed: {shlex.join(cmd)}\n{''.join(log[-30:])}")
    return time.monotonic() - start, curve


@torch.no_grad()
def whole_split_loss(model: torch.nn.Module, tokens: np.ndarray, block_size: int,
                     logits_of) -> float:
    """Mean cross-entropy over non-overlapping windows covering the split (the last partial window
    dropped)."""
    n = (len(tokens) - 1) // block_size
    total = 0.0
    for start in range(0, n, 32):
        rows = range(start, min(n, start + 32))
        x = torch.tensor(np.stack([tokens[r * block_size:(r + 1) * block_size]
                                   for r in rows]).astype(np.int64))
        y = torch.tensor(np.stack([tokens[r * block_size + 1:(r + 1) * block_size + 1]
                                   for r in rows]).astype(np.int64))
        total += torch.nn.functional.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten(),
                                                   reduction="sum").item()
    return total / (n * block_size)


def score_ours(out_dir: str, val: np.ndarray, device: str) -> float:
    model = model_from_checkpoint(
        load_checkpoint(os.path.join(out_dir, "ckpt.pt"))).to(device).eval()
    return whole_split_loss(model, val, model.config.block_size,
                            lambda m, x: m(x.to(device))[0].cpu())


def score_nanogpt(nanogpt_dir: str, out_dir: str, val: np.ndarray, device: str) -> float:
    spec = importlib.util.spec_from_file_location("nanogpt_model",
                                                  os.path.join(nanogpt_dir, "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=True)
    model = module.GPT(module.GPTConfig(**ckpt["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
    model.to(device).eval()

    def logits_of(m, x):  # nanoGPT returns all positions' logits only when given targets
        x = x.to(device)
        return m(x, torch.zeros_like(x))[0].cpu()
    return whole_split_loss(model, val, ckpt["model_args"]["block_size"], logits_of)


def nanogpt_workdir(nanogpt_dir: str, data_dir: str, parent: str) -> str:
    """nanoGPT reads data/<dataset>/{train,val}.bin and meta.pkl from its working directory."""
    run_dir = tempfile.mkdtemp(dir=parent, prefix="nanogpt_")
    dataset = os.path.join(run_dir, "data", "bench")
    os.makedirs(dataset)
    for name in ("train.bin", "val.bin"):
        os.symlink(os.path.join(data_dir, name), os.path.join(dataset, name))
    with open(os.path.join(data_dir, "meta.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    with open(os.path.join(dataset, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": vocab_size}, f)
    os.symlink(os.path.join(nanogpt_dir, "configurator.py"),
               os.path.join(run_dir, "configurator.py"))
    return run_dir


def ours_workdir(data_dir: str, parent: str) -> str:
    """A fresh folder holding only the prepared corpus, where the quick start's command runs."""
    run_dir = tempfile.mkdtemp(dir=parent, prefix="ours_")
    os.makedirs(os.path.join(run_dir, "data"))
    os.symlink(data_dir, os.path.join(run_dir, DEFAULT_CORPUS_DIR))
    return run_dir


def plot(curves: dict[str, list[tuple[float, float]]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot([t for t, _ in curve], [v for _, v in curve], "o-", label=name)
    ax.set_xlabel("wall seconds since the process started")
    ax.set_ylabel("val loss (its own evaluation)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--nanogpt-dir", required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--recipe", choices=sorted(NANOGPT_RECIPES), default="cpu",
                        help="nanoGPT's CPU or GPU recipe (default: %(default)s)")
    parser.add_argument("--text", help="a text file to train on, character level "
                                       "(default: the pydoc corpus)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default: 2)")
    parser.add_argument("--ours-flags", default="",
                        help="flags added to `python train.py` (default: none)")
    parser.add_argument("--nanogpt-flags", default="",
                        help="flags added to nanoGPT's recipe (default: none)")
    parser.add_argument("--plot",
                        help="write the validation curves against wall seconds to this PNG")
    parser.add_argument("--json", help="write every run's figures to this file")
    args = parser.parse_args()
    # (each run starts in a scratch folder of its own)
    args.nanogpt_dir = os.path.abspath(args.nanogpt_dir)
    if not os.path.isfile(os.path.join(args.nanogpt_dir, "train.py")):
        raise cli.CLIError(f"--nanogpt-dir {args.nanogpt_dir} holds no train.py: "
                           "give a checkout of karpathy/nanoGPT")
    device = "cuda" if args.recipe == "gpu" else "cpu"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"CPU: {cpu_kind()} "
          f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}), "
          f"{os.cpu_count()} cores, torch {torch.__version__}; {describe(resolve_device(device))}")
    runs = {"nanoGPT recipe": [], "ours": []}
    with tempfile.TemporaryDirectory(prefix="speedrun_") as scratch:
        if args.text:
            data_dir = os.path.join(scratch, "text_char")
            subprocess.run([sys.executable, os.path.join(ROOT, "tokenizer.py"), "--input",
                            args.text, "--tokenizer", "char", "--val-fraction", "0.1",
                            "--output-dir", data_dir, "--quiet"], check=True)
        else:
            data_dir = os.path.abspath(
                ensure_default_corpus(os.path.join(ROOT, DEFAULT_CORPUS_DIR)))
        val = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")
        for r in range(args.rounds):
            cwd = nanogpt_workdir(args.nanogpt_dir, data_dir, scratch)
            cmd = [sys.executable, os.path.join(args.nanogpt_dir, "train.py"),
                   os.path.join(args.nanogpt_dir, "config", "train_shakespeare_char.py"),
                   *NANOGPT_RECIPES[args.recipe], "--dataset=bench", "--out_dir=out",
                   *shlex.split(args.nanogpt_flags)]
            seconds, curve = timed_run(cmd, cwd, env)
            whole_val = score_nanogpt(args.nanogpt_dir, os.path.join(cwd, "out"), val, device)
            runs["nanoGPT recipe"].append({"seconds": seconds, "curve": curve,
                                           "whole_val": whole_val})
            cwd = ours_workdir(data_dir, scratch)
            seconds, curve = timed_run([sys.executable, os.path.join(ROOT, "train.py"),
                                        *shlex.split(args.ours_flags)], cwd, env)
            runs["ours"].append({"seconds": seconds, "curve": curve,
                                 "whole_val": score_ours(os.path.join(cwd, "ckpt"), val, device)})
            for name, results in runs.items():
                print(f"round {r + 1}: {name}: {results[-1]['seconds']:.1f} s, whole-val loss "
                      f"{results[-1]['whole_val']:.4f}", flush=True)
    print(f"\n{'run':16} {'wall s (median)':>16} {'whole-val loss':>15}")
    for name, results in runs.items():
        print(f"{name:16} {statistics.median(r['seconds'] for r in results):16.1f} "
              f"{statistics.median(r['whole_val'] for r in results):15.4f}")
    ratio = statistics.median(r["seconds"] for r in runs["nanoGPT recipe"]) / \
        statistics.median(r["seconds"] for r in runs["ours"])
    print(f"nanoGPT's wall time / ours: {ratio:.2f}x")
    if args.plot:
        plot({name: results[-1]["curve"] for name, results in runs.items()}, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
