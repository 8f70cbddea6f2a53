"""Instruction tuning, LoRA and chat, measured: three parts, each printing a table (the CPU kind in
its header).

  decode  test.py --chat's decode (toolkit/sampling.py's Sampler.reply: KV cache, streaming) against
          transformers' generate on the same weights (the folder test.py --export-hf writes): the
          124M shape with random weights and the chat tokens, float32, batch 1, greedy, a 64-token
          history; interleaved rounds; the greedy tokens must agree.
  lora    one fine-tuning step of the 124M preset, float32, batch 4 x 256 tokens (AdamW, the chunked
          loss): every weight against LoRA (rank 8 on all linears); each mode in a process of its
          own, interleaved, for its peak RSS and its ms/step.
  recipe  docs/finetune.md's worked recipe: train.py on the embedded corpus (block 128), the pydoc
          conversations (examples/pydoc_chat.py), finetune.py --task sft with and without
          --lora-rank 8, then greedy answers to every conversation's question: the exact-match rate
          on the training and the held-out ones.

    python benchmarks/bench_sft.py decode --rounds 3
    python benchmarks/bench_sft.py lora --rounds 2
    python benchmarks/bench_sft.py recipe
"""
import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from model import GPT, PRESETS, GPTConfig
from toolkit import cli, lora
from toolkit.chat import add_chat_tokens, chat_prompt
from toolkit.device import cpu_kind
from toolkit.finetune_config import FinetuneConfig
from toolkit.gpt2_vocab import GPT2_FACTS
from toolkit.hf import save_gpt2
from toolkit.model_sources import load_model
from toolkit.sampling import Sampler, add_sampling_arguments
from toolkit.tokenizers import load_tokenizer
from toolkit.training import TorchEngine


def chat_args(max_new_tokens: int) -> argparse.Namespace:
    """test.py --chat's options: greedy, float32 on the CPU, streamed, every other one its
    default."""
    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--dtype", "float32", "--stream", "--temperature",
                              "0", "--max-new-tokens", str(max_new_tokens)])


def header() -> str:
    return f"CPU {cpu_kind()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


# ----- decode -----

def decode(args) -> None:
    import transformers
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS["gpt2"])).eval()
    tok = load_tokenizer(dict(GPT2_FACTS))
    add_chat_tokens(model, tok)
    folder = tempfile.mkdtemp(prefix="bench_sft_")
    save_gpt2(model, folder, tok.facts())
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()
    history = [{"role": "user", "content": "word " * 60}]
    ids = chat_prompt(history, tok)
    sampler = Sampler(model, tok, chat_args(args.tokens), None)
    print(f"{header()}; gpt2 (124M) + chat tokens, float32, batch 1, greedy, "
          f"{len(ids)}-token history, {args.tokens} new tokens")
    times = {"test.py --chat (Sampler.reply)": [], "transformers generate": []}
    for round_ in range(args.rounds):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            reply = sampler.reply(history)
        times["test.py --chat (Sampler.reply)"].append(time.perf_counter() - start)
        ours = tok.encode(reply)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=args.tokens,
                              min_new_tokens=args.tokens, pad_token_id=0)
        times["transformers generate"].append(time.perf_counter() - start)
        theirs = out[0, len(ids):].tolist()
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()) +
              f"; same greedy tokens: {ours == theirs[:len(ours)]}", flush=True)
    print("| decoder | median s | tokens/s |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | "
              f"{args.tokens / statistics.median(values):.1f} |")


# ----- lora: one step, one mode per process -----

def lora_step(mode: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**PRESETS["gpt2"], "block_size": 256}))
    if mode == "lora":
        lora.add_lora(model, 8, 16.0, 0.05, "all", model.config.vocab_size)
    engine = TorchEngine("unused")  # finetune.py's AdamW and gradient clipping, at lr 1e-4
    engine.start(model, FinetuneConfig(lr=1e-4), torch.device("cpu"), torch.float32,
                 lambda m, batch: m(*batch, chunked_loss=True)[1])
    idx = torch.randint(0, model.config.vocab_size, (4, 257))
    batch = [((idx[:, :-1], idx[:, 1:]), 1.0)]
    times = []
    for step in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        engine.train_step(batch, 1e-4)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return {"mode": mode, "ms_per_step": 1000 * statistics.median(times),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def lora_table(args) -> None:
    print(f"{header()}; gpt2 (124M), float32, batch 4 x 256 tokens, AdamW, {args.steps} steps "
          "after 2 warm-up")
    results = {"full": [], "lora": []}
    for round_ in range(args.rounds):
        for mode in results:
            out = subprocess.run([sys.executable, __file__, "lora-step", "--mode", mode, "--steps",
                                  str(args.steps)], capture_output=True, text=True, check=True)
            results[mode].append(json.loads(out.stdout.splitlines()[-1]))
            print(f"round {round_ + 1}: {results[mode][-1]}", flush=True)
    print("| fine-tuning | trained parameters | peak RSS GB | ms/step |\n|---|---|---|---|")
    for mode, runs in results.items():
        print(f"| {'every weight' if mode == 'full' else 'LoRA rank 8, all linears'} | "
              f"{runs[0]['trainable']:,} | "
              f"{statistics.median(r['peak_rss_gb'] for r in runs):.2f} | "
              f"{statistics.median(r['ms_per_step'] for r in runs):,.0f} |")


# ----- recipe -----

def run(*command: str) -> str:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{result.stderr[-2000:]}")
    print(f"  {time.perf_counter() - start:6.1f} s  python {' '.join(command)}", flush=True)
    return result.stdout


@torch.no_grad()
def exact_matches(checkpoint: str, path: str) -> tuple[int, int]:
    """Greedy answers to each conversation's question, compared with its assistant turn."""
    model, facts = load_model(checkpoint)
    tok = load_tokenizer(facts)
    sampler = Sampler(model.eval(), tok, chat_args(80), None)
    hits = total = 0
    for line in open(path):
        messages = json.loads(line)["messages"]
        with contextlib.redirect_stdout(io.StringIO()):
            answer = sampler.reply(messages[:-1])
        hits += answer == messages[-1]["content"]
        total += 1
    return hits, total


def recipe(args) -> None:
    work = args.work or tempfile.mkdtemp(prefix="bench_sft_recipe_")
    print(f"{header()}; work folder {work}")
    base = os.path.join(work, "pretrained")
    run("train.py", "--block-size", "128", "--max-iters", str(args.pretrain_iters), "--out-dir",
        base, "--overwrite")
    run("examples/pydoc_chat.py", "--out-dir", os.path.join(work, "chats"))
    train, val = (os.path.join(work, "chats", f"{name}.jsonl") for name in ("train", "val"))
    rows = []
    for name, extra in (("every weight", []), ("LoRA rank 8", ["--lora-rank", "8"])):
        out = os.path.join(work, "sft-lora" if extra else "sft")
        start = time.perf_counter()
        best = json.loads(run("finetune.py", "--task", "sft", "--train", train, "--val", val,
                              "--init-from", os.path.join(base, "ckpt.pt"), "--out-dir", out,
                              "--overwrite", *extra)
                          .splitlines()[-1])
        seconds = time.perf_counter() - start
        on_train, on_val = (exact_matches(os.path.join(out, "ckpt.pt"), path)
                            for path in (train, val))
        rows.append((name, best, seconds, on_train, on_val))
    print("| sft | best val loss | epochs | s | exact match, train | exact match, held out |\n"
          "|---|---|---|---|---|---|")
    for name, best, seconds, (a, n), (b, m) in rows:
        print(f"| {name} | {best['val_loss']:.4f} | {best['epochs']} | {seconds:.0f} | "
              f"{a}/{n} = {a / n:.2f} | {b}/{m} = {b / m:.2f} |")


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parts = parser.add_subparsers(dest="part", required=True)
    p = parts.add_parser("decode", help="test.py --chat's decode against transformers' generate")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p = parts.add_parser("lora", help="LoRA against every weight: peak RSS and ms/step")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p = parts.add_parser("lora-step", help="(one mode, run by lora)")
    p.add_argument("--mode", choices=["full", "lora"], required=True)
    p.add_argument("--steps", type=int, default=5)
    p = parts.add_parser("recipe", help="docs/finetune.md's recipe and its exact-match rates")
    p.add_argument("--pretrain-iters", type=int, default=1000)
    p.add_argument("--work", help="folder for the runs (default: a new temporary one)")
    args = parser.parse_args()
    if args.part == "lora-step":
        print(json.dumps(lora_step(args.mode, args.steps)))
    else:
        {"decode": decode, "lora": lora_table, "recipe": recipe}[args.part](args)


if __name__ == "__main__":
    cli.run(main)
