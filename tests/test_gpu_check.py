"""benchmarks/gpu_check.sh --dry-run: every GPU check's steps on the CPU at a tiny size, and its
table."""
import json
import subprocess

from conftest import ROOT


def test_gpu_check_dry_run_on_cpu(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split("\t") for line in (tmp_path / "gpu_check.tsv").read_text().splitlines()]
    figures = {(name, unit): value for name, value, unit in rows}
    for name in ("train gpt2 float32", "train gpt2 float32 --compile", "DeepSpeed ZeRO-3 1 GPU",
                 "FSDP2 1 GPU --activation-checkpointing"):
        assert float(figures[(name, "ms/iter")]) > 0, figures
    for name in ("sampling with KV cache", "sampling, compiled step"):
        assert float(figures[(name, "tokens/s")].replace(",", "")) > 0, figures
        assert int(figures[(f"{name} MBU", "%")]) >= 0, figures
    assert figures[("DDP 2 GPUs", "(fewer than 2 GPUs)")] == "skipped"
    assert figures[("decode sweep", "(on a GPU only)")] == "skipped"
    assert "gpu_check results" in result.stdout
    # bench_sdpa.py's records, one per kernel: times and honest peak memory, or why a kernel cannot
    # run here
    records = [json.loads(line) for line in (tmp_path / "sdpa.jsonl").read_text().splitlines()]
    assert {(r["kernel"], r["dtype"]) for r in records} == \
        {(k, "float32") for k in ("math", "flash", "efficient", "cudnn", "manual")}
    for r in records:
        # CUDA-only kernels, on a CPU: unsupported, with the reason
        if r["kernel"] in ("efficient", "cudnn"):
            assert not r["supported"] and "CUDA" in r["reason"]
            assert figures[(f"sdpa {r['kernel']} 1x4x512x32 float32", "")] == "unsupported"
        else:
            assert r["supported"] and r["ms"] > 0 and r["peak_bytes"] > 0 and \
                r["time_vs_math"] > 0, r
    assert "vs math" in (tmp_path / "sdpa.txt").read_text()
