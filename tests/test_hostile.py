"""Bad input and faults, tried as a hostile but realistic user would (issue 16's list, each case kept here).

Every case ends in one line starting with `error:` and a non-zero exit; a good checkpoint's bytes never
change; files that would run code are never unpickled (the marker file never appears).
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY_MODEL, assert_one_line_error, fake_deepspeed_folder, run_main, run_script
from model import GPT, GPTConfig
from toolkit.hf import save_gpt2
from toolkit.writers import write_nanogpt


class Exploit:
    """Unpickling this runs a shell command that creates the marker file PWNED."""
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.fixture(scope="module")
def good_run(char_data, tmp_path_factory):
    """A finished 4-step run of the tiny model: its out dir (copied by each test) and its data."""
    out = tmp_path_factory.mktemp("good")
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", out, *TINY_MODEL, "--max-iters", "4",
                      "--eval-interval", "4")
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def run_dir(good_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(good_run, out)
    return out


def train(char_data, out, *flags, **kwargs):
    return run_main("train.py", "--data-dir", char_data, "--out-dir", out, *TINY_MODEL, *flags, **kwargs)


def assert_unchanged(out, before: bytes) -> None:
    assert (out / "ckpt.pt").read_bytes() == before
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


# 1. DeepSpeed checkpoints never run code

def test_deepspeed_checkpoint_with_code_is_refused_by_test_ds(tmp_path):
    fake_deepspeed_folder(tmp_path / "ds", payload=Exploit())
    result = run_main("test_ds.py", "--ckpt", tmp_path / "ds", cwd=tmp_path, env={"DS_ACCELERATOR": "cpu"})
    assert_one_line_error(result, "never unpickled")
    assert not (tmp_path / "PWNED").exists()


def test_deepspeed_checkpoint_with_code_is_refused_on_resume(ds_ops, char_data, tmp_path):
    facts = json.loads((char_data / "meta.json").read_text())
    shape = dict(block_size=32, vocab_size=facts["vocab_size"], n_layer=1, n_head=2, n_embd=32)
    fake_deepspeed_folder(tmp_path / "ds", payload=Exploit(), model_config=shape, tokenizer=facts)
    result = run_script("train_ds.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                        "--init-from", "resume", "--max-iters", "8", cwd=tmp_path,
                        env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert_one_line_error(result, "never unpickled")
    assert not (tmp_path / "PWNED").exists()


# 2. a non-finite step never reaches disk

@pytest.mark.parametrize("flags", [
    ["--lr", "1e30", "--save-interval", "1"],  # the update breaks the weights after a finite loss
    ["--lr", "1e30"],                          # no extra save: the final evaluation must not pass either
])
def test_diverged_weights_never_replace_the_checkpoint(char_data, run_dir, flags):
    before = (run_dir / "ckpt.pt").read_bytes()
    result = train(char_data, run_dir, "--init-from", "resume", "--max-iters", "8", "--grad-clip", "0",
                   "--warmup-iters", "0", "--eval-interval", "4", *flags)
    assert_one_line_error(result, "stopped without saving")
    assert_unchanged(run_dir, before)


def test_infinite_learning_rate_is_refused_up_front(char_data, run_dir):
    before = (run_dir / "ckpt.pt").read_bytes()
    assert_one_line_error(train(char_data, run_dir, "--init-from", "resume", "--lr", "inf"), "--lr")
    assert_unchanged(run_dir, before)


# 3. outputs never overwrite inputs

@pytest.mark.parametrize("target", ["ckpt.pt", "test.py"])
def test_genfile_never_replaces_the_checkpoint_or_the_code(run_dir, target):
    path = run_dir / target if target == "ckpt.pt" else ROOT / target
    before = path.read_bytes()
    result = run_main("test.py", "--ckpt", run_dir / "ckpt.pt", "--device", "cpu", "--max-new-tokens", "5",
                      "--genfile", path, "--overwrite")
    assert_one_line_error(result, "--genfile", "would overwrite")
    assert path.read_bytes() == before


# 4. sizes of zero or less

@pytest.mark.parametrize("flag", ["--batch-size", "--block-size"])
def test_zero_sizes_are_refused_before_any_write(char_data, run_dir, flag):
    before = (run_dir / "ckpt.pt").read_bytes()
    assert_one_line_error(train(char_data, run_dir, "--init-from", "resume", flag, "0"), flag)
    assert_unchanged(run_dir, before)


# 5. one run per --out-dir

def test_a_second_run_on_the_same_out_dir_stops_naming_the_first(char_data, tmp_path):
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--data-dir", str(char_data), "--out-dir",
                              str(tmp_path), *TINY_MODEL, "--max-iters", "100000", "--eval-interval", "100000"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stdout:
            if line.startswith("iter 2:"):
                break
        second = train(char_data, tmp_path, "--max-iters", "5")
        assert_one_line_error(second, "in use by another run", f"PID {first.pid}")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 0


# 6. sizes are checked before anything is allocated

def test_checkpoint_of_an_enormous_model_is_refused_at_once(tmp_path):
    torch.save({"model": {}, "model_config": dict(block_size=8, vocab_size=16, n_layer=100_000, n_head=16,
                                                  n_embd=1024)}, tmp_path / "ckpt.pt")
    start = time.monotonic()
    result = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--device", "cpu")
    assert_one_line_error(result, "GiB for their float32 weights alone")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("change", [dict(n_layer=10**9), dict(n_embd=10**9, n_head=1), dict(n_positions=10**12)])
def test_hf_config_of_an_enormous_model_is_refused_at_once(tmp_path, change):
    save_gpt2(GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8)), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    start = time.monotonic()
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path, "--device", "cpu"), "config.json")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("vocab_size", [10**12, -1, "many"])
def test_meta_json_with_an_impossible_vocabulary(char_data, tmp_path, vocab_size):
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "vocab_size": vocab_size}))
    assert_one_line_error(train(data, tmp_path / "out"), "vocab_size")
    assert not (tmp_path / "out" / "ckpt.pt").exists()


# 7. a failed write is one line and keeps the old checkpoint

def limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


def test_a_write_that_fails_keeps_the_old_checkpoint(char_data, run_dir):
    before = (run_dir / "ckpt.pt").read_bytes()
    cmd = [sys.executable, str(ROOT / "train.py"), "--data-dir", str(char_data), "--out-dir", str(run_dir),
           *TINY_MODEL, "--init-from", "resume", "--max-iters", "6"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    assert_one_line_error(result, "cannot write", "ckpt.pt", "file size limit")
    assert_unchanged(run_dir, before)


def test_an_out_dir_that_cannot_be_created_fails_at_start(char_data, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    result = train(char_data, tmp_path / "file" / "out", "--max-iters", "2")
    assert_one_line_error(result, "file")
    assert "iter 1:" not in result.stdout


# 8. every value typed and in range before anything is read or written

@pytest.mark.parametrize("flags, fragment", [
    (["--eval-iters", "0"], "--eval-iters"), (["--eval-interval", "0"], "--eval-interval"),
    (["--log-interval", "0"], "--log-interval"), (["--grad-accum", "0"], "--grad-accum"),
    (["--block-size", "-5"], "--block-size"), (["--dropout", "1.5"], "--dropout"), (["--beta2", "1"], "--beta2"),
    (["--warmup-iters", "-1"], "--warmup-iters"), (["--weight-decay", "nan"], "--weight-decay"),
])
def test_out_of_range_flags(char_data, tmp_path, flags, fragment):
    assert_one_line_error(train(char_data, tmp_path / "out", *flags), fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, fragment", [
    ({"n_layer": "two"}, "n_layer must be int"), ({"batch_size": 2.5}, "batch_size must be int"),
    ({"compile": "no"}, "compile must be bool"), ({"dtype": "float64"}, "dtype must be one of"),
    ({"lr": "fast"}, "lr must be null or float"),
])
def test_config_file_values_are_typed_like_their_flags(char_data, tmp_path, config, fragment):
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert_one_line_error(train(char_data, tmp_path / "out", "--config", tmp_path / "run.json"), fragment)
    assert not (tmp_path / "out").exists()


# 9. lesser cases

def test_corrupt_or_malicious_hf_weights(tmp_path):
    save_gpt2(GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8)), str(tmp_path / "hf"))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "hf", "--device", "cpu"), "model.safetensors")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save({"transformer.wte.weight": Exploit()}, tmp_path / "hf" / "pytorch_model.bin")
    result = run_main("test.py", "--ckpt", tmp_path / "hf", "--device", "cpu", cwd=tmp_path)
    assert_one_line_error(result, "never unpickled")
    assert not (tmp_path / "PWNED").exists()


def test_truncated_train_bin_is_found_from_meta_json(char_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    (data / "train.bin").write_bytes((data / "train.bin").read_bytes()[:1000])
    assert_one_line_error(train(data, tmp_path / "out"), "train.bin holds 500 tokens but meta.json records")


def test_tokenizer_chunk_size_must_be_finite(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    result = run_main("tokenizer.py", "--input", tmp_path / "a.txt", "--tokenizer", "byte", "--output-dir",
                      tmp_path / "out", "--chunk-mb", "inf")
    assert_one_line_error(result, "--chunk-mb")


def test_sigterm_to_tokenizer_leaves_no_temporary_files(tmp_path):
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"text": f"document {i} " * 20}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tokenizer.py"), "--input", str(big), "--tokenizer", "byte",
                             "--output-dir", str(out), "--chunk-mb", "0.1"], cwd=ROOT, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out.exists() and any(out.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not out.exists() or list(out.iterdir()) == []


def test_temporary_files_of_a_killed_save_are_removed_by_the_next_run(char_data, run_dir):
    (run_dir / ".ckpt.pt.tmp99999").write_bytes(b"half a checkpoint")
    result = train(char_data, run_dir, "--init-from", "resume", "--max-iters", "5", "--eval-interval", "100")
    assert result.returncode == 0, result.stderr
    assert not (run_dir / ".ckpt.pt.tmp99999").exists()


@pytest.mark.parametrize("flags, fragment", [(["--temperature", "nan"], "temperature"),
                                             (["--top-p", "0"], "top_p"), (["--top-k", "0"], "top_k")])
def test_sampling_values_are_checked_before_sampling(run_dir, flags, fragment):
    result = run_main("test.py", "--ckpt", run_dir / "ckpt.pt", "--device", "cpu", *flags,
                      "--genfile", run_dir / "samples.jsonl")
    assert_one_line_error(result, fragment)
    assert not (run_dir / "samples.jsonl").exists()


def test_resuming_a_finished_run_says_nothing_is_left(char_data, run_dir):
    before = (run_dir / "ckpt.pt").read_bytes()
    result = train(char_data, run_dir, "--init-from", "resume", "--max-iters", "4")
    assert_one_line_error(result, "nothing is left to train", "--max-iters N for some N > 4")
    assert_unchanged(run_dir, before)


def test_data_with_ids_outside_the_vocabulary(tmp_path):
    facts = {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}
    write_nanogpt(str(tmp_path / "data"), np.full(5000, 300, np.uint16), np.zeros(500, np.uint16), facts)
    assert_one_line_error(train(tmp_path / "data", tmp_path / "out"), "outside the vocabulary of 257")
