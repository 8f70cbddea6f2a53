"""How fast could one training step be? Its matrix products alone, timed as plain matmuls.

A training step of model.py's GPT multiplies matrices in every Linear and in the tied LM head
(forward, then the input and weight gradients), and in attention (q k^T and weights @ v forward,
four products backward; a causal kernel needs only half of that work). This times exactly those
products on the device, at the step's shapes, and prints their sum: the floor under any
implementation of the same step that uses the same matmul library. With --step-ms (a measured step
time, e.g. nanoGPT's from bench_train.py) it also prints the largest speedup over it that the floor
leaves, with causal attention at batched-matmul speed (or, more optimistic still, at the big
matmuls' rate) and everything else (GELU, LayerNorm, softmax, AdamW, the loss) taking no time.

    python benchmarks/bench_floor.py --step-ms 227.3     # bench_train.py's shape, float32
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_sdpa import time_ms
from model import GPT, GPTConfig
from toolkit import cli
from toolkit.device import DTYPES, describe, keep_freed_memory_in_heap, resolve_device


def linear_products(model: GPT, tokens: int, dtype: torch.dtype, device: torch.device):
    """Forward, input-gradient and weight-gradient matmuls of every Linear and the LM head, and
    their FLOPs."""
    # the LM head is tied to wte
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes = [tuple(w.shape) for w in weights]  # (out, in)
    operands = [(torch.randn(tokens, i, dtype=dtype, device=device),
                 torch.randn(o, i, dtype=dtype, device=device),
                 torch.randn(tokens, o, dtype=dtype, device=device)) for o, i in shapes]

    def run():
        for x, w, grad_y in operands:
            x @ w.t(), grad_y @ w, grad_y.t() @ x
    return run, sum(6 * tokens * o * i for o, i in shapes)


def attention_products(cfg: GPTConfig, batch: int, dtype: torch.dtype, device: torch.device):
    """The six (T, T) x (T, head_dim)-sized batched matmuls of attention forward+backward in every
    layer."""
    bh, t, hd = batch * cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head
    q = torch.randn(bh, t, hd, dtype=dtype, device=device)
    weights = torch.randn(bh, t, t, dtype=dtype, device=device)

    def run():
        for _ in range(cfg.n_layer):
            torch.bmm(q, q.transpose(1, 2)), torch.bmm(q, q.transpose(1, 2))  # q k^T, dO v^T
            for _ in range(4):  # weights @ v, weights^T @ dO, dS @ k, dS^T @ q
                torch.bmm(weights, q)
    return run, cfg.n_layer * 6 * 2 * bh * t * t * hd


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=65,
                        help="65: the default character corpus")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10, help="median of this many timings")
    parser.add_argument("--step-ms", type=float,
                        help="a measured step time to compare the floor with")
    args = parser.parse_args()
    if min(args.n_layer, args.n_head, args.n_embd, args.block_size, args.batch_size,
           args.vocab_size, args.repeats) < 1 or args.n_embd % args.n_head:
        raise cli.CLIError("sizes and --repeats must be positive, and --n-embd a multiple of "
                           "--n-head")
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        keep_freed_memory_in_heap()  # as training does: no page faults for the big temporaries
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                    block_size=args.block_size, vocab_size=args.vocab_size, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)  # shapes only
    with torch.no_grad():
        linear, linear_flops = linear_products(model, args.batch_size * args.block_size, dtype,
                                               device)
        attention, attention_flops = attention_products(cfg, args.batch_size, dtype, device)
        linear_ms = time_ms(linear, device, 1, args.repeats)
        # a causal kernel does half the products
        causal_ms = time_ms(attention, device, 1, args.repeats) / 2
    floor = linear_ms + causal_ms
    # attention as fast as the big matmuls
    ideal = linear_ms * (1 + attention_flops / 2 / linear_flops)
    print(f"{describe(device)}, {args.dtype}, {args.n_layer}L x {args.n_embd} "
          f"({args.n_head} heads), block {args.block_size}, batch {args.batch_size}, "
          f"vocab {args.vocab_size}, torch {torch.__version__}")
    print(f"linear matmuls (fwd + 2 bwd)    {linear_ms:8.2f} ms  "
          f"{linear_flops / linear_ms / 1e6:6.0f} GFLOP/s")
    print(f"causal attention matmuls        {causal_ms:8.2f} ms  "
          f"{attention_flops / 2 / causal_ms / 1e6:6.0f} GFLOP/s")
    print(f"floor (everything else free)    {floor:8.2f} ms")
    print(f"  with attention at the linear matmuls' rate {ideal:.2f} ms")
    if args.step_ms:
        print(f"largest speedup over a {args.step_ms:.1f} ms step: {args.step_ms / floor:.2f}x "
              f"({args.step_ms / ideal:.2f}x with attention at the linear rate)")


if __name__ == "__main__":
    cli.run(main)
