"""The benchmark scripts run and write well-formed records (their speeds are figures, not test assertions).
bench_sdpa.py runs inside gpu_check.sh's dry run."""
import json
import re
import subprocess
import sys

from conftest import ROOT


def test_gpu_check_dry_run_on_cpu(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split("\t") for line in (tmp_path / "gpu_check.tsv").read_text().splitlines()]
    figures = {(name, unit): value for name, value, unit in rows}
    for name in ("train gpt2 float32", "train gpt2 float32 --compile", "DeepSpeed ZeRO-3 1 GPU"):
        assert float(figures[(name, "ms/iter")]) > 0, figures
    assert float(figures[("sampling with KV cache", "tokens/s")].replace(",", "")) > 0
    assert figures[("DDP 2 GPUs", "(fewer than 2 GPUs)")] == "skipped"
    assert "gpu_check results" in result.stdout
    # bench_sdpa.py's records, one per kernel: times and honest peak memory, or why a kernel cannot run here
    records = [json.loads(line) for line in (tmp_path / "sdpa.jsonl").read_text().splitlines()]
    assert {(r["kernel"], r["dtype"]) for r in records} == {(k, "float32") for k in ("math", "flash", "efficient",
                                                                                    "cudnn", "manual")}
    for r in records:
        if r["kernel"] in ("efficient", "cudnn"):  # CUDA-only kernels, on a CPU: unsupported, with the reason
            assert not r["supported"] and "CUDA" in r["reason"]
            assert figures[(f"sdpa {r['kernel']} 1x4x512x32 float32", "")] == "unsupported"
        else:
            assert r["supported"] and r["ms"] > 0 and r["peak_bytes"] > 0 and r["time_vs_math"] > 0, r
    assert "vs math" in (tmp_path / "sdpa.txt").read_text()


def test_bench_train_rounds_and_table():
    """Two interleaved rounds of this project's variants (no nanoGPT checkout): a row per round, then the table."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--iters", "2",
                             "--eval-iters", "1", "--repeats", "2", "--ours", "float32+muon"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rounds = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("ms/iter" in line for line in rounds), result.stdout
    assert "CPU " in result.stdout and "ours float32+muon" in result.stdout.split("variant")[-1]


def test_bench_floor_sums_the_step_matmuls():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_floor.py"), "--n-layer", "1",
                             "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "2",
                             "--repeats", "2", "--step-ms", "1000"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ms = {name: float(value) for name, value in re.findall(r"^(\S.*?)\s{2,}([\d.]+) ms", result.stdout, re.M)}
    linear, attention = ms["linear matmuls (fwd + 2 bwd)"], ms["causal attention matmuls"]
    assert linear > 0 and attention > 0
    assert abs(ms["floor (everything else free)"] - (linear + attention)) <= 0.015
    speedup = float(result.stdout.split("largest speedup over a 1000.0 ms step: ")[1].split("x")[0])
    assert abs(1000 / speedup - ms["floor (everything else free)"]) <= 0.01  # the floor is printed to 0.01 ms

    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_floor.py"), "--n-embd", "30"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and len(bad.stderr.splitlines()) == 1
