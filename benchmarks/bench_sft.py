"""Instruction tuning, LoRA and chat, measured: four parts, each printing its figures (the CPU kind
in its header).

  decode  test.py --chat's decode (toolkit/sampling.py's Sampler.reply: KV cache, streaming) against
          transformers' generate on the same weights (the folder test.py --export-hf writes): the
          124M shape with random weights and the chat tokens, float32, batch 1, greedy, a 64-token
          history; interleaved rounds; the greedy tokens must agree.
  lora    one fine-tuning step of the 124M preset, float32, batch 4 x 256 tokens (AdamW, the chunked
          loss): every weight against LoRA (rank 8 on all linears); each mode in a process of its
          own, interleaved, for its peak RSS and its ms/step.
  data    finetune.py --task sft's memory on an alpaca .json array of --mb MB and of a tenth of it:
          the growth of its peak RSS against that of the data's token arrays.
  recipe  docs/finetune.md's worked recipe: train.py on the embedded corpus (block 128), the pydoc
          conversations (examples/pydoc_chat.py), finetune.py --task sft with and without
          --lora-rank 8, then greedy answers to every conversation's question: the exact-match rate
          on the training and the held-out ones.

    python benchmarks/bench_sft.py decode --rounds 3
    python benchmarks/bench_sft.py lora --rounds 2
    python benchmarks/bench_sft.py data --mb 200
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
import threading
import time
from pydoc_data.topics import topics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import psutil
import torch

from model import GPT, GPTConfig
from toolkit.train_config import PRESETS
from toolkit import cli, lora
from toolkit.chat import add_chat_tokens, chat_prompt, encode_conversation, messages_of
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


# ----- data -----

def peak_rss_until(command: list[str], line_start: str) -> float:
    """The peak RSS (MiB) of a command's process, sampled every 20 ms until it prints a line that
    starts with line_start; then it is stopped."""
    proc = subprocess.Popen([sys.executable, *command], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    watched, peak, output = psutil.Process(proc.pid), 0, []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None and not any(line.startswith(line_start) for line in output):
        peak = max(peak, watched.memory_info().rss)
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    if not any(line.startswith(line_start) for line in output):
        raise SystemExit(f"error: {' '.join(command)} ended before {line_start!r}:\n"
                         f"{''.join(output)[-2000:]}")
    return peak / 2**20


def data(args) -> None:
    """finetune.py --task sft on an alpaca .json array (one JSON array, its records of 300
    characters) of --mb MB and of a tenth of it: the growth of peak RSS against that of the data's
    token arrays (4 bytes an id, 1 a loss-mask flag, 21 a sequence's start, cut and record). The
    model is char-level: a record's tokens are its characters and the template's."""
    work = args.work or tempfile.mkdtemp(prefix="bench_sft_data_")
    print(f"{header()}; work folder {work}")
    run("train.py", "--max-iters", "1", "--eval-interval", "1", "--eval-iters", "1", "--n-layer",
        "1", "--n-head", "2", "--n-embd", "32", "--block-size", "512", "--out-dir",
        os.path.join(work, "base"), "--overwrite")
    words = " ".join(" ".join(topics.values()).split())
    model, facts = load_model(os.path.join(work, "base", "ckpt.pt"))
    tok = load_tokenizer(facts)
    add_chat_tokens(model, tok)
    template = len(encode_conversation(messages_of({"instruction": "a", "output": "b"}), tok,
                                       512)[0].ids) - 2  # the tokens a record adds to its own
    sizes = {}
    for mb in (args.mb / 10, args.mb):
        path, records, tokens = os.path.join(work, f"alpaca-{mb:g}mb.json"), 0, 0
        with open(path, "w") as f:
            f.write("[")
            while f.tell() < mb * 1e6:
                start = (records * 7919) % (len(words) - 300)
                record = {"instruction": words[start:start + 100], "input": "",
                          "output": words[start + 100:start + 300]}
                f.write(("," if records else "") + json.dumps(record) + "\n")
                records += 1
                tokens += 300 + template
            f.write("]")
        # (through the first evaluation and 10 steps)
        rss = peak_rss_until(["finetune.py", "--task", "sft", "--train", path, "--init-from",
                              os.path.join(work, "base", "ckpt.pt"), "--out-dir",
                              os.path.join(work, "sft"), "--overwrite", "--device", "cpu"],
                             "iter 10:")
        sizes[mb] = (records, tokens * 5 + records * 21, rss)
        print(f"  {mb:g} MB: {records:,} records, token arrays {sizes[mb][1] / 2**20:,.0f} MiB, "
              f"peak RSS {rss:,.0f} MiB", flush=True)
    (small, small_arrays, small_rss), (big, big_arrays, big_rss) = sizes.values()
    grown = big_arrays - small_arrays
    print(f"peak RSS grew {big_rss - small_rss:,.0f} MiB for {grown / 2**20:,.0f} MiB more token "
          f"arrays: {(big_rss - small_rss) * 2**20 / grown:.2f}x")


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
    p = parts.add_parser("data", help="the memory of SFT data against its token arrays")
    p.add_argument("--mb", type=float, default=200, help="MB of the larger file")
    p.add_argument("--work", help="folder for the runs (default: a new temporary one)")
    p = parts.add_parser("recipe", help="docs/finetune.md's recipe and its exact-match rates")
    p.add_argument("--pretrain-iters", type=int, default=1000)
    p.add_argument("--work", help="folder for the runs (default: a new temporary one)")
    args = parser.parse_args()
    if args.part == "lora-step":
        print(json.dumps(lora_step(args.mode, args.steps)))
    else:
        {"decode": decode, "lora": lora_table, "data": data, "recipe": recipe}[args.part](args)


if __name__ == "__main__":
    cli.run(main)
