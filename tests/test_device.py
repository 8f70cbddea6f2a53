"""toolkit/device.py: the CPU kind decides --dtype auto, and a run restricted to AVX2 is treated as AVX2."""
import platform
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from toolkit import device

PROBE = ("import torch; from toolkit import device; "
         "print(device.cpu_kind(), device.resolve_dtype('auto', torch.device('cpu')))")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (an oracle independent of torch's detection)."""
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
    expected = "AMX" if "amx_tile" in flags else "AVX512-BF16" if {"avx512_bf16", "avx512bw"} <= flags else \
        "AVX512" if "avx512bw" in flags else "AVX2" if "avx2" in flags else "DEFAULT"
    assert device.cpu_kind() == expected


def test_avx2_restriction_is_reported_and_picks_float32():
    """ATEN_CPU_CAPABILITY=avx2 on any x86 CPU: the run header says AVX2 and bfloat16 is not assumed fast."""
    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("an x86 CPU with AVX2 is needed to restrict a run to it")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"ATEN_CPU_CAPABILITY": "avx2", "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == ["AVX2", "torch.float32"]
