"""Causal attention kernels side by side: forward+backward time and peak memory, each also relative
to math.

Every SDPA kernel (math, flash, efficient, cudnn) and the written-out attention of model.py (manual)
run causal attention on the same inputs for a grid of (batch, heads, seq, head_dim) and dtypes. Time
is the median of --repeats forward+backward passes after --warmup. Peak memory is what one
forward+backward adds: on CUDA torch.cuda.max_memory_allocated; on CPU the process's peak resident
memory (VmHWM, reset through /proc/self/clear_refs) in a fresh child process whose allocator returns
every block of 64 KiB or more to the system at once (MALLOC_MMAP_THRESHOLD_), so resident memory
follows live memory. A kernel the device cannot run shows "unsupported" and torch's reason.

    python benchmarks/bench_sdpa.py                                   # CPU, float32 and bfloat16
    python benchmarks/bench_sdpa.py --device cuda --dtypes bfloat16 \\
        --shapes 8x12x1024x64,4x12x2048x64
"""
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import manual_attention
from toolkit import cli
from toolkit.device import DTYPES, describe, resolve_device

SDPA = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
KERNELS = (*SDPA, "manual")


def attention(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if kernel == "manual":
        return manual_attention(q, k, v, 0.0)
    with sdpa_kernel([SDPA[kernel]]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def inputs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3)]


def forward_backward(kernel: str, qkv: list[torch.Tensor]) -> None:
    out = attention(kernel, *qkv)
    out.backward(torch.ones_like(out))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(work: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of work() on the device, after warm-up runs."""
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        work()
        sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_cpu_bytes_in_this_process(kernel: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    # one-time costs (code, thread pools)
    forward_backward(kernel, inputs(shape, dtype, torch.device("cpu")))
    qkv = inputs(shape, dtype, torch.device("cpu"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = vm_kib("VmRSS")
    forward_backward(kernel, qkv)
    return (vm_kib("VmHWM") - before) * 1024


def peak_bytes(kernel: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> int | None:
    """Memory one forward+backward adds at its peak (None where it cannot be measured)."""
    if device.type == "cuda":
        qkv = inputs(shape, dtype, device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        forward_backward(kernel, qkv)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu" or not os.path.exists("/proc/self/clear_refs"):
        return None
    child = subprocess.run([sys.executable, __file__, "--child", kernel,
                            "x".join(map(str, shape)), str(dtype)[6:]],
                           capture_output=True, text=True,
                           env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    return int(child.stdout) if child.returncode == 0 else None


def measure(kernel: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            warmup: int, repeats: int) -> dict:
    record = {"kernel": kernel, "shape": list(shape), "dtype": str(dtype)[6:],
              "device": str(device)}
    # on CUDA torch explains each refusal in a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            qkv = inputs(shape, dtype, device)
            ms = time_ms(lambda: forward_backward(kernel, qkv), device, warmup, repeats)
        except RuntimeError as e:
            reasons = ([str(w.message).strip().splitlines()[0] for w in caught]
                       or [str(e).strip().splitlines()[0]])
            if device.type == "cpu" and kernel in ("efficient", "cudnn"):
                reasons = ["torch has no CPU kernel for it (CUDA only)"]
            return {**record, "supported": False, "reason": "; ".join(dict.fromkeys(reasons))}
    return {**record, "supported": True, "ms": ms,
            "peak_bytes": peak_bytes(kernel, shape, dtype, device)}


def with_ratios(records: list[dict]) -> list[dict]:
    """Time and memory of each kernel relative to math's on the same inputs."""
    math = {(tuple(r["shape"]), r["dtype"]): r for r in records
            if r["kernel"] == "math" and r["supported"]}
    for r in records:
        base = math.get((tuple(r["shape"]), r["dtype"]))
        if r["supported"] and base:
            r["time_vs_math"] = r["ms"] / base["ms"]
            if r["peak_bytes"] is not None and base["peak_bytes"]:
                r["memory_vs_math"] = r["peak_bytes"] / base["peak_bytes"]
    return records


def print_table(records: list[dict]) -> None:
    print(f"{'B x H x T x D':>18} {'dtype':>9} {'kernel':>9} {'ms':>9} {'vs math':>8} "
          f"{'peak MiB':>9} {'vs math':>8}")
    for r in records:
        shape = "x".join(map(str, r["shape"]))
        if not r["supported"]:
            print(f"{shape:>18} {r['dtype']:>9} {r['kernel']:>9}  unsupported: {r['reason'][:100]}")
            continue
        peak = f"{r['peak_bytes'] / 2**20:9.1f}" if r["peak_bytes"] is not None else f"{'n/a':>9}"
        print(f"{shape:>18} {r['dtype']:>9} {r['kernel']:>9} {r['ms']:9.2f} "
              f"{r.get('time_vs_math', float('nan')):8.2f}"
              f" {peak} {r.get('memory_vs_math', float('nan')):8.2f}")


def parse_shape(text: str) -> tuple[int, ...]:
    shape = tuple(int(n) for n in text.split("x"))
    if len(shape) != 4 or min(shape) < 1:
        raise cli.CLIError(f"a shape is BATCHxHEADSxSEQxHEAD_DIM, got {text!r}")
    return shape


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # one CPU memory measurement, in a fresh process
        kernel, shape, dtype = sys.argv[2:5]
        print(peak_cpu_bytes_in_this_process(kernel, parse_shape(shape), DTYPES[dtype]))
        return
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated (default: float32,bfloat16)")
    parser.add_argument("--shapes", default="16x4x256x32,8x12x512x64,4x12x1024x64",
                        help="comma-separated BATCHxHEADSxSEQxHEAD_DIM "
                             "(default: the quick start's, GPT-2's at 512 and 1024)")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma-separated from {', '.join(KERNELS)}")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", metavar="FILE", help="also write one JSON record per line")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype_names, kernels = args.dtypes.split(","), args.kernels.split(",")
    if set(kernels) - set(KERNELS) or set(dtype_names) - set(DTYPES):
        raise cli.CLIError(f"kernels must come from {', '.join(KERNELS)}; dtypes from "
                           f"{', '.join(DTYPES)}")
    dtypes = [DTYPES[d] for d in dtype_names]
    print(f"causal attention, forward + backward, on {describe(device)}, torch {torch.__version__}")
    records = with_ratios([measure(k, parse_shape(s), d, device, args.warmup, args.repeats)
                           for s in args.shapes.split(",") for d in dtypes for k in kernels])
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    cli.run(main)
