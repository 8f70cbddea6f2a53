"""
Sampling speed: nanoGPT's loop (full forward of the last block_size tokens per new token) vs
GPT.generate without and with the KV cache, and with its one-token step compiled as test.py
--compile runs it (toolkit/device.py's compile_decoding: a CUDA graph on a GPU), on a random model.
Each cached method's model bandwidth utilisation (MBU): the bytes of the weights a step reads, as
that model stores them, times steps a second, over the device's measured read bandwidth.

    python benchmarks/bench_sampling.py --repeats 3 --new-tokens 500
    python benchmarks/bench_sampling.py --vocab-size 50257
    python benchmarks/bench_sampling.py --preset gpt2 --device cuda --dtype bfloat16 \
        --methods cache,compiled

Runs are interleaved (A B C A B C ...) so that load from other processes hits all three alike;
the median new tokens/s of each is reported.
"""
import copy
import os
import statistics
import sys
import time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import GPT, GPTConfig
from toolkit.train_config import PRESETS
from toolkit import cli
from toolkit.device import (DTYPES, autocast, compile_decoding, read_bandwidth,
                            resolve_device)


@torch.no_grad()
def nanogpt_sample(model: GPT, idx: torch.Tensor, max_new_tokens: int,
                   temperature: float) -> torch.Tensor:
    """nanoGPT's sampling loop: crop to block_size, full forward, last-position logits, sample."""
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -model.config.block_size :]
        # nanoGPT's inference path
        logits = model.lm_head(model.hidden_states(idx_cond)[:, [-1], :])
        probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
    return idx


def weight_bytes(model: GPT) -> int:
    """The bytes of the weights one token's step reads, as stored: all but the embedding tables,
    of which it gathers a row (a table tied to the LM head is read whole)."""
    head = model.lm_head.weight
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if p is head or not name.startswith(("transformer.wte.", "transformer.wpe.")))


def main() -> None:
    p = cli.argument_parser(__doc__)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per method")
    p.add_argument("--new-tokens", type=int, default=500)
    p.add_argument("--vocab-size", type=int, default=103,
                   help="103: a char vocabulary; 50257: GPT-2's")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model shape (default: 4 layers, 4 heads, 128 wide)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="autocast dtype (default: float32)")
    p.add_argument("--methods", default="nanogpt,nocache,cache",
                   help="comma-separated: nanogpt, nocache, cache, compiled")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    shape = {k: PRESETS[args.preset][k] for k in ("n_layer", "n_head", "n_embd")} \
        if args.preset else dict(n_layer=4, n_head=4, n_embd=128)
    device = resolve_device(args.device)
    config = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size, **shape)
    model = GPT(config).to(device).eval()  # random normal init (std 0.02), not zeros
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    chosen = args.methods.split(",")
    compiled = model
    if "compiled" in chosen:  # a copy: compile_decoding replaces its step (and casts its weights)
        compiled = copy.deepcopy(model)
        compile_decoding(compiled, DTYPES[args.dtype])
    every = {
        "nanogpt": ("nanogpt loop", lambda: nanogpt_sample(model, prompt, args.new_tokens, 1.0)),
        "nocache": ("generate(use_cache=False)",
                    lambda: model.generate(prompt, args.new_tokens, use_cache=False)),
        "cache": ("generate(use_cache=True)",
                  lambda: model.generate(prompt, args.new_tokens, use_cache=True)),
        "compiled": ("generate, compiled step", lambda: compiled.generate(prompt, args.new_tokens)),
    }
    methods = dict(every[m] for m in chosen)
    stored = {every["cache"][0]: model, every["compiled"][0]: compiled}
    for run in methods.values():  # warm-up: allocator, kernels
        torch.manual_seed(args.seed)
        with autocast(device, DTYPES[args.dtype]):
            run()

    rates = {name: [] for name in methods}
    for r in range(args.repeats):
        for name, run in methods.items():
            torch.manual_seed(args.seed)
            t0 = time.perf_counter()
            with autocast(device, DTYPES[args.dtype]):
                out = run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            rates[name].append((out.size(1) - prompt.size(1)) / dt)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:,.0f}" for n, v in rates.items()),
              flush=True)

    print(f"\n{device}, {args.dtype}, threads {torch.get_num_threads()}, vocab {args.vocab_size}, "
          f"block {args.block_size}, {args.new_tokens} new tokens, median of {args.repeats}:")
    med = {name: statistics.median(v) for name, v in rates.items()}
    bandwidth = read_bandwidth(device) * 1e9
    for name, v in med.items():
        spread = f"{min(rates[name]):,.0f}-{max(rates[name]):,.0f}"
        mbu = f", MBU {weight_bytes(stored[name]) * v / bandwidth:.0%}" if name in stored else ""
        print(f"  {name:28s} {v:9,.0f} tokens/s  (range {spread}{mbu})")
    print(f"  read bandwidth {bandwidth / 1e9:,.0f} GB/s")
    if {"cache", "nanogpt"} <= set(args.methods.split(",")):
        print(f"  cache / nanogpt loop: "
              f"{med['generate(use_cache=True)'] / med['nanogpt loop']:.1f}x")


if __name__ == "__main__":
    cli.run(main)
