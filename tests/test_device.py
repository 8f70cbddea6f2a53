"""toolkit/device.py: the CPU kind decides --dtype auto, and a run restricted to AVX2 is treated as
AVX2."""
import platform
import types
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from toolkit import device

PROBE = ("import torch; from toolkit import device; "
         "print(device.cpu_kind(), device.resolve_dtype('auto', torch.device('cpu')))")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (an oracle independent of torch's
    detection)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags on this machine")


@pytest.mark.parametrize("kind, dtype", [("AMX", torch.bfloat16), ("AVX512-BF16", torch.bfloat16),
                                         ("AVX512", torch.float32), ("AVX2", torch.float32),
                                         ("DEFAULT", torch.float32)])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch, kind, dtype):
    monkeypatch.setattr(device, "cpu_kind", lambda: kind)
    assert device.resolve_dtype("auto", torch.device("cpu")) == dtype
    assert device.resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_the_cpu_kind_agrees_with_the_kernels_flags():
    flags = cpu_flags()
    expected = "AMX" if "amx_tile" in flags else \
        "AVX512-BF16" if {"avx512_bf16", "avx512bw"} <= flags else \
        "AVX512" if "avx512bw" in flags else "AVX2" if "avx2" in flags else "DEFAULT"
    assert device.cpu_kind() == expected


def test_avx2_restriction_is_reported_and_picks_float32():
    """ATEN_CPU_CAPABILITY=avx2 on any x86 CPU: the run header says AVX2 and bfloat16 is not assumed
    fast."""
    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("an x86 CPU with AVX2 is needed to restrict a run to it")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={"ATEN_CPU_CAPABILITY": "avx2", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["AVX2", "torch.float32"]


def test_the_loss_builds_full_logits_on_a_gpu_where_they_fit_and_is_chunked_on_a_cpu(monkeypatch):
    """toolkit/device.py's choice of loss path (docs/performance.md): a CPU always takes the chunked
    loss; a GPU the full logits while they take at most a third of its memory. No GPU here: its size
    is given."""
    gpt2_batch = 16 * 1024  # tokens of the 124M preset's micro-batch; 50257 -> 50304 padded
    assert not device.full_logits_fit(torch.device("cpu"), 1, 103)
    for gib, fits in ((80, True), (40, True), (24, False)):  # 16 bytes x 16384 x 50304 = 12.3 GiB
        memory = types.SimpleNamespace(total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _, memory=memory: memory)
        assert device.full_logits_fit(torch.device("cuda", 0), gpt2_batch, 50257) == fits, gib
