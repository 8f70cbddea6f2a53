"""Where and how the math runs: device, dtype, autocast, CPU kind, threads and allocator, memory,
peak FLOP/s.

Shared by sampling, the trainers and the benchmarks, so every script makes the same choices.
"""
import contextlib
import ctypes
import functools
import os
import sys
import time
import warnings

import torch
from torch.nn import functional as F
from torch.nn.attention import sdpa_kernel

from model import GPT, SDPA_KERNELS, VOCAB_MULTIPLE, GPTConfig
from toolkit.cli import CLIError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# dense bf16 peak TFLOP/s of known GPUs, for MFU
PEAK_TFLOPS = {"A100": 312, "H100": 989, "H200": 989, "L4": 121, "A10": 125, "V100": 125,
               "4090": 165}


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto picks cuda, then mps, then cpu; asking for a device that is not there is a CLIError."""
    if name == "auto":
        name = ("cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available()
                else "cpu")
    if name == "cuda":
        name = f"cuda:{local_rank}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {name} requested but CUDA is not available on this machine")
    if name == "mps" and not torch.backends.mps.is_available():
        raise CLIError("--device mps requested but MPS is not available on this machine")
    if not (name == "cpu" or name == "mps" or name.startswith("cuda")):
        raise CLIError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return torch.device(name)


def cpu_kind() -> str:
    """The CPU's vector extensions as torch uses them: AMX, AVX512-BF16, AVX512, AVX2 or DEFAULT.
    torch honours ATEN_CPU_CAPABILITY, so an AVX512 CPU restricted to AVX2 says AVX2."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and torch.cpu._is_amx_tile_supported():
        return "AMX"
    if capability == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return capability


def describe(device: torch.device) -> str:
    """The device for run headers, e.g. 'cpu (AVX512-BF16, 2 threads)' or 'cuda:0 (NVIDIA H200)'."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({cpu_kind()}, {torch.get_num_threads()} threads)"
    return str(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 where the hardware runs it natively (CUDA Ampere+, AVX512-BF16/AMX CPUs)."""
    if name == "auto":
        native_cpu = device.type == "cpu" and cpu_kind() in ("AMX", "AVX512-BF16")
        native = torch.cuda.is_bf16_supported() if device.type == "cuda" else native_cpu
        name = "bfloat16" if native else "float32"
    if name == "float16" and device.type == "cpu" and not torch.cpu._is_amx_fp16_supported():
        raise CLIError("--dtype float16 is not supported on this CPU (no AMX-FP16); use bfloat16 "
                       "or float32")
    return DTYPES[name]


def run_device(device: str, dtype: str, local_rank: int = 0) -> tuple[torch.device, torch.dtype]:
    """A run's device and autocast dtype from their options; on a CPU, freed memory kept in glibc's
    heap for the next step (keep_freed_memory_in_heap)."""
    resolved = resolve_device(device, local_rank)
    if resolved.type == "cpu":
        keep_freed_memory_in_heap()
    return resolved, resolve_dtype(dtype, resolved)


@functools.cache
def runnable_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, ...]:
    """The attention kernels that run causal attention for these inputs, found by trying each
    once."""
    q = torch.zeros(1, 1, 2, head_dim, device=device, dtype=dtype)
    runnable = ["auto", "manual"]
    for name, backend in SDPA_KERNELS.items():
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")  # torch explains each refusal in a warning
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            runnable.append(name)
        except RuntimeError:
            pass
    return tuple(runnable)


def check_attn_kernel(model: GPT, device: torch.device, dtype: torch.dtype) -> None:
    """The model's --attn-kernel runs on this device and dtype (ValueError naming those that do)."""
    c = model.config
    runnable = runnable_kernels(device, dtype, c.n_embd // c.n_head)
    if c.attn_kernel not in runnable:
        raise ValueError(f"attn_kernel '{c.attn_kernel}' cannot run on {device.type} ({dtype}, "
                         f"head size {c.n_embd // c.n_head}); available: {', '.join(runnable)}")


def full_logits_fit(device: torch.device, rows: int, vocab_size: int) -> bool:
    """Whether the loss of a micro-batch of `rows` tokens builds its full logits (model.py's
    forward) rather than the chunked loss: never on a CPU, where the chunked loss measured faster
    and leaner; on a GPU while the logits and their gradients (16 bytes a logit at most) take at
    most a third of its memory: the 124M preset's 16 x 1024 tokens need 12.3 GiB, full on 40 GB,
    chunked on 24 GB (docs/performance.md)."""
    if device.type == "cpu":
        return False
    padded = vocab_size + -vocab_size % VOCAB_MULTIPLE
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else None)
    return memory is None or 16 * rows * padded <= memory // 3


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision context: weights stay float32, matmuls run in dtype."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def generation_linears(model: GPT, device: torch.device, dtype: torch.dtype) -> GPT:
    """model, which from now on only generates, with its linears on oneDNN's inner product where it
    runs on a CPU in float32: PyTorch's float32 matrix-vector product reads the weights on one core,
    oneDNN's on all of them (decoding 1.5x at batch 1, 2x at batch 4: docs/performance.md); the
    same greedy tokens. In place: the linears' weights become oneDNN buffers."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return model
    from torch.utils import mkldnn  # (7 ms of jit-scripted modules, for this alone)
    return mkldnn.to_mkldnn(model.eval())


def compile_decoding(model: GPT, dtype: torch.dtype) -> None:
    """model's one-token step (GPT.decode_step) compiled, its shapes dynamic, on a GPU captured as
    a CUDA graph; the prefill stays eager. Greedy in float32 it gives eager's tokens; a temperature
    draws from inductor's RNG."""
    import torch._inductor.config as inductor  # 1.3 s to import: --compile alone needs it
    # inductor's own pass turns a (1, K) x (K, N) product on a CPU into a vectorised reduction:
    # 21 GB/s of weights against 13 for MKL's GEMV on 2 cores. By default it stops at K, N of 2048
    # (read when the pass first loads, so before the first compile)
    inductor.post_grad_fusion_options["decompose_mm_pass"] = {
        "cpu_max_other_dimension_decomposition": 1 << 30}
    # every element-wise result stored, not inlined: inlined into such a product, the final norm
    # was computed again for each of the LM head's rows (decoding 1.2x float32, 1.5x int8)
    inductor.realize_cpu_opcount_threshold = 0
    # a run's floats (rope theta, dropout's p, the temperature) as constants: made symbolic, as
    # dynamic=True makes them, dynamo traces the step twice (warm compile 7.4 s -> 3.6 s, 12 x 768)
    torch._dynamo.config.specialize_float = True
    if dtype != torch.float32:  # compiled under autocast, float32 weights are cast at every step
        model.to(dtype)
    # on a GPU the step is replayed as one CUDA graph: one launch instead of hundreds (KVCache
    # keeps the step's shapes fixed; each new batch size or cache length records another graph)
    cuda = next(model.parameters()).is_cuda
    step = torch.compile(model.decode_step, dynamic=True, mode="reduce-overhead" if cuda else None)

    def decode_step(tok: torch.Tensor, caches: list, start: torch.Tensor, **sampling):
        for cache in caches if cuda else ():  # the graph writes them in place, at fixed addresses
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
        return step(tok, caches, start, **sampling)

    model.decode_step = decode_step


def set_job_threads() -> None:
    """CPU threads of one process in a multi-process job: OMP_NUM_THREADS when set, else the cores
    shared out over this machine's processes (torchrun sets OMP_NUM_THREADS=1; the deepspeed
    launcher sets nothing, and N processes each using every core slow each other down many-fold)."""
    if "OMP_NUM_THREADS" in os.environ:
        threads = int(os.environ["OMP_NUM_THREADS"] or 1)
    else:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
                              or 1)
        threads = (os.cpu_count() or 1) // local_processes
    torch.set_num_threads(max(1, threads))


def keep_freed_memory_in_heap() -> None:
    """Make glibc keep big freed blocks for reuse instead of unmapping them.

    By default glibc serves blocks above 32 MB with fresh mmaps that are zero-filled page by page on
    first touch, and gives the heap top back on free; a CPU step that allocates the same big
    temporaries every time (the GPT-2-vocabulary logits chunks) pays those page faults at every
    step. Only called for CPU training; no-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # from <malloc.h>
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def num_params(config: GPTConfig, non_embedding: bool = True) -> int:
    """Parameters of config's shape, counted without building it; non_embedding leaves out the
    input embeddings that cost no FLOPs (GPT-2's positions; an untied model's token embedding)."""
    C, D, b = config.n_embd, config.head_size, int(config.bias)
    attention = C * (config.n_head + 2 * config.kv_heads) * D + config.n_head * D * C
    mlp = (2 if config.arch == "gpt2" else 3) * C * config.mlp_width
    norms = 2 * (1 + b) * C + 2 * D * config.qk_norm
    biases = b * ((config.n_head + 2 * config.kv_heads) * D + C + config.mlp_width + C)
    head = config.vocab_size * C
    n = head + config.n_layer * (attention + mlp + norms + biases) + (1 + b) * C
    inputs = (config.block_size * C if config.arch == "gpt2" else
              0 if config.tie_embeddings else head)
    return n if non_embedding else n + inputs


def flops_per_token(config: GPTConfig) -> int:
    """Training FLOPs per token: 6N for the weights plus attention scores (PaLM, appendix B)."""
    attention = 12 * config.n_layer * config.n_head * config.head_size * config.block_size
    return 6 * num_params(config) + attention


def peak_flops(device: torch.device, peak_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s for MFU: the given TFLOP/s, or a known GPU's bf16 dense peak."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        return next((t * 1e12 for key, t in PEAK_TFLOPS.items() if key in gpu), None)
    return None


def read_bandwidth(device: torch.device) -> float:
    """GB/s of reading a 1 GiB float32 tensor on device (its dot product with itself: one pass over
    every byte, as a decode step's matrix-vector products make), best of 5; MBU's denominator."""
    x = torch.ones(1 << 28, device=device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.dot(x, x).item()  # (.item() waits for a GPU)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def available_memory() -> int | None:
    """Bytes of memory the system can still give (MemAvailable on Linux), or None where unknown."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check_memory(config: GPTConfig) -> None:
    """Refuse (ValueError) a config whose model's float32 weights alone exceed available memory."""
    n, available = num_params(config, non_embedding=False), available_memory()
    if available is not None and 4 * n > available:
        raise ValueError(f"model config: {n:,} parameters need {4 * n / 2**30:,.1f} GiB for their "
                         f"float32 weights alone, more than the {available / 2**30:,.1f} GiB of "
                         "memory available")
