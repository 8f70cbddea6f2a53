"""The loss paths side by side: one micro-batch's forward and backward with the chunked loss, with
full logits over the padded vocabulary (model.py's forward), and with full logits over the true
vocabulary (the head as a plain matmul, what the model did before padding), interleaved, eager or
compiled. The figures behind toolkit/device.py's full_logits_fit and model.py's
VOCAB_MULTIPLE (docs/performance.md).

    python benchmarks/bench_loss.py --device cpu --vocab-size 103 --n-embd 128 --batch-size 16
    python benchmarks/bench_loss.py --device cuda --dtype bfloat16 --preset gpt2 \\
        --block-size 1024 --compile
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import GPT, GPTConfig
from toolkit.train_config import PRESETS
from toolkit import cli
from toolkit.device import DTYPES, autocast, describe, full_logits_fit, keep_freed_memory_in_heap


def unpadded_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(model.hidden_states(x))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)


PATHS = {
    "chunked": lambda m, x, y: m(x, y, chunked_loss=True)[1],
    "full-padded": lambda m, x, y: m(x, y)[1],
    "full-unpadded": unpadded_loss,
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="the shape of a preset (else the flags)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="torch.compile each path")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per path, interleaved")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="which paths (default: %(default)s)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        keep_freed_memory_in_heap()  # as training does
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                 vocab_size=args.vocab_size)
    shape.update({k: v for k, v in PRESETS.get(args.preset, {}).items() if k in shape})
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.block_size, **shape)).to(device)
    x, y = (torch.randint(0, shape["vocab_size"], (args.batch_size, args.block_size), device=device)
            for _ in range(2))
    paths = {name: torch.compile(PATHS[name]) if args.compile else PATHS[name]
             for name in args.paths.split(",")}

    def step(name: str) -> float:
        sync(device)
        t0 = time.perf_counter()
        with autocast(device, dtype):
            loss = paths[name](model, x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    first = {name: step(name) for name in paths}  # warm-up (and compilation)
    times = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name in paths:
            times[name].append(step(name))
    fits = full_logits_fit(device, args.batch_size * args.block_size, shape["vocab_size"])
    print(f"{describe(device)}, torch {torch.__version__}, {args.dtype}, "
          f"{'compiled' if args.compile else 'eager'}; "
          f"{shape}, batch {args.batch_size} x {args.block_size}; full_logits_fit: {fits}")
    print(f"{'path':16s} {'ms (median)':>11s} {'min':>8s} {'first':>9s}")
    for name, ts in times.items():
        print(f"{name:16s} {statistics.median(ts) * 1e3:11.1f} {min(ts) * 1e3:8.1f} "
              f"{first[name] * 1e3:9.1f}")


if __name__ == "__main__":
    cli.run(main)
