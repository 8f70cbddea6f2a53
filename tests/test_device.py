"""device.py: the CPU kind decides --dtype auto, and a run restricted to AVX2 is treated as AVX2."""
import subprocess
import sys

import torch

from conftest import ROOT
from device import cpu_kind, resolve_dtype

PROBE = "import torch, device; print(device.cpu_kind(), device.resolve_dtype('auto', torch.device('cpu')))"


def test_auto_dtype_follows_the_cpu_kind():
    expected = torch.bfloat16 if cpu_kind() in ("AMX", "AVX512-BF16") else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected


def test_avx2_restriction_is_reported_and_picks_float32():
    """ATEN_CPU_CAPABILITY=avx2 on any x86 CPU: the run header says AVX2 and bfloat16 is not assumed fast."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"ATEN_CPU_CAPABILITY": "avx2", "PATH": "/usr/bin:/bin"})
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert out.stdout.split() == ["AVX2", "torch.float32"]
