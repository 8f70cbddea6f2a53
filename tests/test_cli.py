"""Every script's command line: --help works, abbreviations are refused, sampling stays light."""
import subprocess
import sys

import pytest

from conftest import ROOT, assert_one_line_error, run_main, run_script

SCRIPTS = ["tokenizer.py", "train.py", "train_ddp.py", "train_ds.py", "test.py", "test_ds.py",
           "finetune.py", "embed.py"]
# embed.py's flags belong to its subcommands: one of them, with its required flags
SUBCOMMAND = {"embed.py": ["encode", "--ckpt", "ckpt.pt", "--input", "texts.txt", "--out",
                           "vectors"]}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_and_no_abbreviations(script):
    """argparse's prefix matching is off: Megatron's --save must never be read as
    --save-interval."""
    command = SUBCOMMAND.get(script, [])
    help_text = run_main(script, *command, "--help", env={"DS_ACCELERATOR": "cpu"})
    assert help_text.returncode == 0 and "usage:" in help_text.stdout, help_text.stderr
    flag = "--num-samples" if script.startswith("test") else \
        "--workers" if script == "tokenizer.py" else \
        "--chunk-tokens" if script == "embed.py" else \
        "--lm-weight" if script == "finetune.py" else "--eval-interval"
    assert flag in help_text.stdout
    abbreviated = run_main(script, *command, flag[:-3], "5", env={"DS_ACCELERATOR": "cpu"})
    assert abbreviated.returncode == 2 and \
        f"unrecognized arguments: {flag[:-3]}" in abbreviated.stderr


def test_megatron_save_is_not_taken_for_save_interval():
    """--save is Megatron's name for --out-dir, never a prefix of --save-interval."""
    from toolkit.train_config import parse_config
    cfg, _ = parse_config(["--save", "ckpt_dir"])
    explicit = cfg.given
    assert cfg.out_dir == "ckpt_dir" and cfg.save_interval == 0 and "save_interval" not in explicit


def test_underscore_spellings_are_the_kebab_case_flags():
    """nanoGPT's --max_iters=7 and --compile=False (HF's and torchrun's parsers take both spellings
    of a flag too)."""
    from toolkit import cli
    from toolkit.train_config import parse_config
    cfg, _ = parse_config(["--max_iters=7", "--data_dir", "x", "--compile=False", "--bias=True"])
    explicit = cfg.given
    assert (cfg.max_iters, cfg.data_dir, cfg.compile, cfg.bias) == (7, "x", False, True)
    assert {"max_iters", "data_dir", "compile", "bias"} <= explicit
    parser = cli.argument_parser(None)
    parser.add_argument("--deepspeed_config")  # a library's own underscore flag stays its own
    parser.add_argument("--top-k", type=int)
    parser.add_argument("words", nargs="*")
    args = parser.parse_args(["--deepspeed_config", "ds.json", "--top_k=3", "--", "--top_k"])
    assert (args.deepspeed_config, args.top_k, args.words) == ("ds.json", 3, ["--top_k"])
    misspelt = run_main("train.py", "--max_itrs=3")
    assert misspelt.returncode == 2 and "unrecognized arguments: --max_itrs=3" in misspelt.stderr


@pytest.mark.parametrize("script, unused", [
    ("test.py", ("toolkit.training", "toolkit.pretraining", "deepspeed")),
    # FSDP2 and DCP: 0.8 s of every trainer's start (docs/performance.md), for sharded runs only
    ("train.py", ("torch.distributed.fsdp", "torch.distributed.checkpoint"))])
def test_a_script_imports_nothing_it_does_not_run(script, unused):
    code = (f"import runpy, sys; runpy.run_path({script!r}, run_name='imported'); "
            f"print(sorted(m for m in {unused!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_torch_failing_to_allocate_host_memory_is_one_line(capsys):
    """The CPU allocator's failure (a LoRA rank of 10**9, a batch of 10**8 samples) is out of memory
    on the host, said as such, not a traceback."""
    import torch

    from toolkit import cli
    with pytest.raises(SystemExit) as stop:
        cli.run(lambda: torch.empty(2**50, dtype=torch.uint8))  # a petabyte
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: out of memory (") and "GPU" not in err and "--batch-size" in err


def test_a_one_process_script_under_a_launcher_is_one_line():
    """torchrun --nproc_per_node 2 train.py would start two copies racing for one --out-dir: rank 0
    says what to run instead, the other copies exit quietly."""
    launched = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    assert_one_line_error(run_script("train.py", env=launched),
                          "train.py runs in one process, but a launcher started 2", "train_ddp.py")
    other = run_script("embed.py", "--help", env={**launched, "RANK": "1"})
    assert other.returncode == 1 and other.stdout + other.stderr == ""
