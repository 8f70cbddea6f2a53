"""The benchmark scripts run and write well-formed records (their speeds are figures, not test
assertions). bench_sdpa.py runs inside gpu_check.sh's dry run (tests/test_gpu_check.py)."""
import re
import subprocess
import sys
from dataclasses import asdict

from conftest import ROOT
from model import GPT, GPTConfig
from toolkit.checkpoint import save_checkpoint
from toolkit.tokenizers import Tokenizer


def test_bench_train_rounds_and_table():
    """Two interleaved rounds of this project's variants (no nanoGPT checkout): a row per round,
    then the table."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train.py"),
                             "--iters", "2", "--eval-iters", "1", "--repeats", "2",
                             "--ours", "float32+muon"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rounds = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all("ms/iter" in line for line in rounds), result.stdout
    assert "CPU " in result.stdout and "ours float32+muon" in result.stdout.split("variant")[-1]


def test_bench_floor_sums_the_step_matmuls():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_floor.py"),
                             "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
                             "--block-size", "32", "--batch-size", "2", "--repeats", "2",
                             "--step-ms", "1000"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ms = {name: float(value)
          for name, value in re.findall(r"^(\S.*?)\s{2,}([\d.]+) ms", result.stdout, re.M)}
    linear, attention = ms["linear matmuls (fwd + 2 bwd)"], ms["causal attention matmuls"]
    assert linear > 0 and attention > 0
    assert abs(ms["floor (everything else free)"] - (linear + attention)) <= 0.015
    speedup = float(result.stdout.split("largest speedup over a 1000.0 ms step: ")[1]
                    .split("x")[0])
    # both are printed to 2 decimals (each within 0.005 of its true value): they must fit the same
    # true floor
    floor = ms["floor (everything else free)"]
    assert (1000 / (speedup + 0.005) - 0.005 - 1e-9 <= floor <=
            1000 / (speedup - 0.005) + 0.005 + 1e-9)

    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_floor.py"),
                          "--n-embd", "30"], capture_output=True, text=True, timeout=120)
    assert (bad.returncode == 1 and bad.stderr.startswith("error:") and
            len(bad.stderr.splitlines()) == 1)


def test_bench_bpe_ratios_table(tmp_path):
    """Tokens per character of GPT-2's BPE and of trained ones, on held-out Chinese and English."""
    (tmp_path / "zh.txt").write_text("".join(f"第{i}条：质量不错，价格也便宜，推荐大家购买。\n"
                                             for i in range(300)))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_bpe.py"), "ratios",
                             "--chinese", str(tmp_path / "zh.txt"), "--sizes", "300", "600"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line[:34].strip(): [float(x) for x in line[34:].split()]
            for line in result.stdout.splitlines() if line.startswith(("gpt2", "bpe"))}
    assert set(rows) == {"gpt2 (50,257)", *(f"bpe {n} trained on {lang}" for n in (300, 600)
                                              for lang in ("Chinese", "English"))}, rows
    # trained on Chinese, more entries spend fewer tokens on Chinese, and fewer than GPT-2's
    assert (rows["bpe 600 trained on Chinese"][0] < rows["bpe 300 trained on Chinese"][0] <
            rows["gpt2 (50,257)"][0])
    # the text without its punctuation, trained cut and whole
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_bpe.py"), "runs",
                             "--chinese", str(tmp_path / "zh.txt"), "--run-chars", "3000",
                             "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 3,000 letters without a break: cut every 256 letters" in result.stdout


def test_speedrun_without_a_nanogpt_checkout_is_one_line(tmp_path):
    """(A run needs karpathy/nanoGPT, which is not shipped: only the check of its folder runs here,
    given as a relative path, as gpu_check.sh passes NANOGPT_DIR, and named as the absolute path
    each run starts from.)"""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speedrun.py"),
                             "--nanogpt-dir", tmp_path.name], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path.parent)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: --nanogpt-dir {tmp_path} holds no train.py")


def test_bench_embed_ann_lexical_stream_and_ceiling_tables():
    """The graph against exact search at a small size (the graph finds what exact search finds),
    BM25's two builders, indexing's memory at two sizes, and dense's ceiling on pydoc (LSA of
    every document is the tf-idf cosine; BM25 is its own 1.00x)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_embed.py"),
                             "--parts", "ann,lexical,stream,ceiling", "--rows", "3000",
                             "--dims", "32", "--queries", "10", "--texts", "300"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1]
            for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert float(rows["exact (blocks of the memory-mapped vectors)"][3]) == 1.0
    assert float(rows["graph, efSearch 256"][3]) >= 0.95, result.stdout  # ann.EF_SEARCH
    assert {"toolkit/lexical.py (Postings)", "bm25s.BM25.index"} <= set(rows), result.stdout
    assert int(rows["300"][1].replace(",", "")) > int(rows["75"][1].replace(",", "")) > 0
    assert rows["BM25 (the lexical half)"][3].strip() == "1.00"
    assert rows["LSA 79 (all: tf-idf cosine)"] == rows["tf-idf cosine, every term"], result.stdout
    assert float(rows["tf-idf cosine, every term"][2]) > 0.3, result.stdout


def test_bench_prepare_memory_does_not_grow_with_the_input(tmp_path):
    """tokenizer.py's peak RSS at 40 MB and at 160 MB of text differs by less than 60 MiB for the
    inputs that were once held whole, which then grew by 90-420 MiB (a JSON array, a parquet row
    group, a datasets folder, a text file)."""
    kinds = ["json", "parquet-1-group", "datasets", "txt"]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_prepare.py"),
                             "--mb", "40", "160", "--kinds", *kinds, "--work-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rss = {(kind, float(mb)): float(peak.replace(",", "")) for kind, mb, peak in
           re.findall(r"^\| (\S+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| ([\d,]+) \|$", result.stdout,
                      re.M)}
    assert len(rss) == 2 * len(kinds), result.stdout
    for kind in kinds:
        assert rss[kind, 160] - rss[kind, 40] < 60, (kind, result.stdout)


def test_bench_layout_measures_the_floors_design_md_draws():
    """bench_layout.py's floors of the import graph are the layers docs/design.md lists, module by
    module (the map is redrawn when the code moves)."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_layout.py"),
                             "--floors"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    measured = {int(n): set(names.split(", ")) for n, names in
                re.findall(r"^(\d+)\. (.+)$", result.stdout, re.M)}
    design = (ROOT / "docs" / "design.md").read_text()
    layers = design.split("The imports go one way")[1].split("\n\n")[1]
    drawn = {}
    for n, text in re.findall(r"^(\d+)\. (.+(?:\n   .+)*)", layers, re.M):
        names = re.findall(r"`([\w.]+)`", text)
        drawn[int(n)] = {name.removesuffix(".py") if name.endswith(".py") else
                         name if name in ("model", "toolkit.cli") else f"toolkit.{name}"
                         for name in names}
    assert drawn == measured


def test_bench_decode_table_side_by_side_with_llama_cpp(tmp_path):
    """A tiny checkpoint: llama.cpp's row (its own GGUF export) and ours for each batch size, with
    positive rates and an MBU."""
    model = GPT(GPTConfig(block_size=64, vocab_size=30, n_layer=2, n_head=2, n_embd=32,
                          arch="llama", bias=False))
    facts = Tokenizer("char", chars="abcdefghijklmnopqrstuvwxyz .\n", char_eot=True).facts()
    save_checkpoint({"model": model.state_dict(), "model_config": asdict(model.config),
                     "tokenizer": facts, "iter_num": 0}, str(tmp_path / "ckpt.pt"))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"),
                             "--ckpt", str(tmp_path / "ckpt.pt"), "--batch-sizes", "1", "2",
                             "--rounds", "1", "--prompt", "8", "--short", "2", "--long", "10",
                             "--no-compile"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = re.findall(r"^\| (.+?) \| (\d+) \| (\d+) \| ([\d.]+) \| (\d+)% \|$", result.stdout,
                      re.M)
    ours = ["ours (eager, KV cache)", "ours (oneDNN linears)", "ours (int8 weights)",
            "ours (int4 weights)"]
    assert [(name, batch) for name, batch, *_ in rows] == \
        [("llama.cpp (f32 GGUF)", "1"), *[(name, b) for b in "12" for name in ours]], \
        result.stdout
    assert all(float(rate) > 0 for *_, rate, _ in rows) and "GB/s" in result.stdout
