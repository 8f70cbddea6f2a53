"""Bad input and faults, tried as a hostile but realistic user would (issue 16's list, each case
kept here).

Every case ends in one line starting with `error:` and a non-zero exit; a good checkpoint's bytes
never change; files that would run code are never unpickled (the marker file never appears).
"""
import fcntl
import json
import os
import pickle
import pty
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (ROOT, TINY_MODEL, assert_one_line_error, fake_deepspeed_folder,
                      llama3_folder, run_main, run_script)
from model import GPT, GPTConfig
from toolkit import chat
from toolkit.cli import CLIError
from toolkit.fsdp_checkpoint import save_sharded
from toolkit.hf import save_gpt2
from toolkit.model_sources import load_model
from toolkit.tokenizers import Tokenizer
from toolkit.writers import write_nanogpt


class Exploit:
    """Unpickling this runs a shell command that creates the marker file PWNED."""
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.fixture(scope="module")
def good_run(char_data, tmp_path_factory):
    """A finished 4-step run of the tiny GPT-2 (whose learned positions make a block-size lie cost
    memory, and whose weights an absurd rate breaks): its out dir (copied by each test) and its
    data."""
    out = tmp_path_factory.mktemp("good")
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", out, *TINY_MODEL,
                      "--max-iters", "4", "--eval-interval", "4", "--arch", "gpt2")
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def run_dir(good_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(good_run, out)
    return out


def train(char_data, out, *flags, **kwargs):
    return run_main("train.py", "--data-dir", char_data, "--out-dir", out, *TINY_MODEL, *flags,
                    **kwargs)


def assert_unchanged(out, before: bytes) -> None:
    assert (out / "ckpt.pt").read_bytes() == before
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]


# 1. DeepSpeed checkpoints never run code

def test_deepspeed_checkpoint_with_code_is_refused_by_test_ds(tmp_path):
    fake_deepspeed_folder(tmp_path / "ds", payload=Exploit())
    result = run_main("test_ds.py", "--ckpt", tmp_path / "ds", cwd=tmp_path,
                      env={"DS_ACCELERATOR": "cpu"})
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


def test_sharded_checkpoint_with_code_in_its_dcp_metadata_is_refused(tmp_path, monkeypatch):
    """DCP unpickles .metadata; FSDP's sharded folder lets only DCP's own classes through."""
    tag = tmp_path / "dcp" / "iter_0000001"
    tag.mkdir(parents=True)
    (tmp_path / "dcp" / "latest").write_text(tag.name)
    torch.save({"model_config": {}, "train_config": {}, "tokenizer": None, "iter_num": 1,
                "best_val_loss": None, "history": {}, "optimizer": None}, tag / "state.pt")
    (tag / ".metadata").write_bytes(pickle.dumps(Exploit()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CLIError, match="its DCP metadata is not one this toolkit reads"):
        load_model(str(tmp_path))  # the --out-dir: its sharded folder is the checkpoint there
    assert not (tmp_path / "PWNED").exists()


def test_a_damaged_sharded_checkpoint_is_one_line(tmp_path):
    """A shard cut short, a `latest` naming a tag that is not there, one naming nothing."""
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16))
    state = {"model_config": vars(model.config), "train_config": {}, "tokenizer": None,
             "iter_num": 3, "best_val_loss": None, "history": {}}
    save_sharded(str(tmp_path / "dcp"), state, model.state_dict(), None, None, {})
    shard = tmp_path / "dcp" / "iter_0000003" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CLIError, match="iter_0000003: its shards are truncated, corrupt"):
        load_model(str(tmp_path))
    (tmp_path / "dcp" / "latest").write_text("iter_0000009")
    with pytest.raises(CLIError, match="names iter_0000009, of which .* is not there"):
        load_model(str(tmp_path))
    (tmp_path / "dcp" / "latest").write_text("")
    with pytest.raises(CLIError, match="its `latest` names no checkpoint"):
        load_model(str(tmp_path))


# 2. a non-finite step never reaches disk

@pytest.mark.parametrize("flags", [
    ["--lr", "1e30", "--save-interval", "1"],  # the update breaks the weights after a finite loss
    # no extra save: the final evaluation must not pass either
    ["--lr", "1e30"],
])
def test_diverged_weights_never_replace_the_checkpoint(char_data, run_dir, flags):
    before = (run_dir / "ckpt.pt").read_bytes()
    result = train(char_data, run_dir, "--init-from", "resume", "--max-iters", "8",
                   "--grad-clip", "0", "--warmup-iters", "0", "--eval-interval", "4", *flags)
    assert_one_line_error(result, "stopped without saving")
    assert_unchanged(run_dir, before)


def test_infinite_learning_rate_is_refused_up_front(char_data, run_dir):
    before = (run_dir / "ckpt.pt").read_bytes()
    assert_one_line_error(train(char_data, run_dir, "--init-from", "resume", "--lr", "inf"), "--lr")
    assert_unchanged(run_dir, before)


# 3. outputs never overwrite inputs

@pytest.mark.parametrize("target", ["ckpt.pt", "test.py", "README.md", "docs/data.md",
                                    "train.bin"])
def test_genfile_never_replaces_the_checkpoint_the_toolkit_or_prepared_data(run_dir, char_data,
                                                                             target):
    path = {"ckpt.pt": run_dir / target, "train.bin": char_data / target}.get(target, ROOT / target)
    before = path.read_bytes()
    result = run_main("test.py", "--ckpt", run_dir / "ckpt.pt", "--device", "cpu",
                      "--max-new-tokens", "5", "--genfile", path, "--overwrite")
    assert_one_line_error(result, "--genfile", "would overwrite")
    assert path.read_bytes() == before


def test_a_run_never_saves_over_the_checkpoint_it_starts_from(char_data, run_dir):
    before = (run_dir / "ckpt.pt").read_bytes()
    result = train(char_data, run_dir, "--init-from", run_dir / "ckpt.pt", "--overwrite")
    assert_one_line_error(result, "--out-dir", "would overwrite the input")
    assert_unchanged(run_dir, before)


# 4. sizes of zero or less

@pytest.mark.parametrize("flag", ["--batch-size", "--block-size"])
def test_zero_sizes_are_refused_before_any_write(char_data, run_dir, flag):
    before = (run_dir / "ckpt.pt").read_bytes()
    assert_one_line_error(train(char_data, run_dir, "--init-from", "resume", flag, "0"), flag)
    assert_unchanged(run_dir, before)


# 5. one run per --out-dir

def test_a_second_run_on_the_same_out_dir_stops_naming_the_first(char_data, tmp_path):
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--data-dir", str(char_data),
                              "--out-dir", str(tmp_path), *TINY_MODEL, "--max-iters", "100000",
                              "--eval-interval", "100000"],
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
    torch.save({"model": {}, "model_config": dict(block_size=8, vocab_size=16, n_layer=1000,
                                                  n_head=16, n_embd=8192)}, tmp_path / "ckpt.pt")
    start = time.monotonic()
    result = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--device", "cpu")
    assert_one_line_error(result, "GiB for their float32 weights alone")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("change", [dict(n_layer=10**9), dict(n_embd=10**9, n_head=1),
                                    dict(n_positions=10**12)])
def test_hf_config_of_an_enormous_model_is_refused_at_once(tmp_path, change):
    save_gpt2(GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8)),
              str(tmp_path))
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
    cmd = [sys.executable, str(ROOT / "train.py"), "--data-dir", str(char_data),
           "--out-dir", str(run_dir), *TINY_MODEL, "--init-from", "resume", "--max-iters", "6"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
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
    (["--block-size", "-5"], "--block-size"), (["--dropout", "1.5"], "--dropout"),
    (["--beta2", "1"], "--beta2"),
    (["--warmup-iters", "-1"], "--warmup-iters"), (["--weight-decay", "nan"], "--weight-decay"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr 0.01 is above --lr 0.001"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**63 - 1"),
    (["--seed", str(10**23)], "--seed must be an integer from 0 to 2**63 - 1"),
    (["--lr", "1e38"], "--lr must be a number > 0 and at most 1e30"),  # AdamW's step overflowed
    (["--max-iters", "0"], "--max-iters must be at least 1"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be at least 1"),  # (not "all steps")
])
def test_out_of_range_flags(char_data, tmp_path, flags, fragment):
    assert_one_line_error(train(char_data, tmp_path / "out", *flags), fragment)
    assert not (tmp_path / "out").exists()


def test_a_batch_no_memory_holds_is_one_line(char_data, tmp_path):
    assert_one_line_error(train(char_data, tmp_path / "out", "--batch-size", "1000000000000",
                                "--max-iters", "2"), "out of memory", "--batch-size")


def test_a_folder_where_the_checkpoint_goes_is_refused_before_training(char_data, tmp_path):
    (tmp_path / "out" / "ckpt.pt").mkdir(parents=True)
    result = train(char_data, tmp_path / "out", "--max-iters", "2", "--overwrite")
    assert_one_line_error(result, "ckpt.pt is not a regular file")
    assert "iter 0" not in result.stdout and "step 0" not in result.stdout


def test_a_checkpoint_without_optimizer_state_is_not_resumed(char_data, run_dir):
    """finetune.py's keep none: resuming one would restart the optimizer silently."""
    checkpoint = torch.load(run_dir / "ckpt.pt", weights_only=True)
    del checkpoint["optimizer"]
    torch.save(checkpoint, run_dir / "ckpt.pt")
    before = (run_dir / "ckpt.pt").read_bytes()
    assert_one_line_error(train(char_data, run_dir, "--init-from", "resume", "--max-iters", "6"),
                          "holds no optimizer state to resume", "--init-from")
    assert_unchanged(run_dir, before)


@pytest.mark.parametrize("config, fragment", [
    ({"n_layer": "two"}, "n_layer must be int"), ({"batch_size": 2.5}, "batch_size must be int"),
    ({"compile": "no"}, "compile must be bool"), ({"dtype": "float64"}, "dtype must be one of"),
    ({"lr": "fast"}, "lr must be null or float"),
])
def test_config_file_values_are_typed_like_their_flags(char_data, tmp_path, config, fragment):
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert_one_line_error(train(char_data, tmp_path / "out", "--config", tmp_path / "run.json"),
                          fragment)
    assert not (tmp_path / "out").exists()


def test_a_config_file_that_never_ends_is_read_no_further_than_any_config(char_data, tmp_path):
    (tmp_path / "run.json").symlink_to("/dev/zero")  # read whole, it would fill the memory
    assert_one_line_error(train(char_data, tmp_path / "out", "--config", tmp_path / "run.json"),
                          "holds more than 256 MiB, more than any config file")


# 9. lesser cases

def test_corrupt_or_malicious_hf_weights(tmp_path):
    save_gpt2(GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8)),
              str(tmp_path / "hf"))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00"
                                                        b"{not a header")
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "hf", "--device", "cpu"),
                          "model.safetensors")
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save({"transformer.wte.weight": Exploit()}, tmp_path / "hf" / "pytorch_model.bin")
    result = run_main("test.py", "--ckpt", tmp_path / "hf", "--device", "cpu", cwd=tmp_path)
    assert_one_line_error(result, "never unpickled")
    assert not (tmp_path / "PWNED").exists()


def test_truncated_train_bin_is_found_from_meta_json(char_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    (data / "train.bin").write_bytes((data / "train.bin").read_bytes()[:1000])
    assert_one_line_error(train(data, tmp_path / "out"),
                          "train.bin holds 500 tokens but meta.json records")


def test_tokenizer_chunk_size_must_be_finite(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    result = run_main("tokenizer.py", "--input", tmp_path / "a.txt", "--tokenizer", "byte",
                      "--output-dir", tmp_path / "out", "--chunk-mb", "inf")
    assert_one_line_error(result, "--chunk-mb")


def test_sigterm_to_tokenizer_leaves_no_temporary_files(tmp_path):
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"text": f"document {i} " * 20}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tokenizer.py"), "--input", str(big),
                             "--tokenizer", "byte", "--output-dir", str(out), "--chunk-mb", "0.1"],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out.exists() and any(out.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not out.exists() or list(out.iterdir()) == []


def test_temporary_files_of_a_killed_save_are_removed_by_the_next_run(char_data, run_dir):
    (run_dir / ".ckpt.pt.tmp99999").write_bytes(b"half a checkpoint")
    result = train(char_data, run_dir, "--init-from", "resume", "--max-iters", "5",
                   "--eval-interval", "100")
    assert result.returncode == 0, result.stderr
    assert not (run_dir / ".ckpt.pt.tmp99999").exists()


@pytest.mark.parametrize("flags, fragment", [(["--temperature", "nan"], "--temperature"),
                                             (["--top-p", "0"], "--top-p"),
                                             (["--top-k", "0"], "--top-k")])
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
    write_nanogpt(str(tmp_path / "data"), np.full(5000, 300, np.uint16), np.zeros(500, np.uint16),
                  facts)
    assert_one_line_error(train(tmp_path / "data", tmp_path / "out"),
                          "outside the vocabulary of 257")


# ----- round three (issue 39) -----
# 1. nesting too deep to read is invalid JSON (or YAML) in every reader, not a RecursionError

DEEP = "[" * 10_000 + "]" * 10_000


def deep_inputs(folder, ckpt) -> dict[str, list]:
    """The command of each JSON and YAML reader, its input nested 10,000 levels deep."""
    def write(name: str, text: str):
        (folder / name).write_text(text)
        return folder / name

    lines = write("deep.jsonl", json.dumps(dict.fromkeys(["messages", "text", "query", "ctx"], 0))
                  .replace("0", DEEP) + "\n")
    hf = folder / "hf"
    save_gpt2(GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8)), str(hf))
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_layer": ' + DEEP + "}")
    return {
        "finetune sft": ["finetune.py", "--task", "sft", "--train", lines, "--val", lines,
                         "--init-from", ckpt, "--out-dir", folder / "sft"],
        "finetune classify": ["finetune.py", "--task", "classify", "--train", lines, "--val", lines,
                              "--init-from", ckpt, "--out-dir", folder / "cls"],
        "tokenizer": ["tokenizer.py", "--input", lines, "--output-dir", folder / "data"],
        "eval": ["eval.py", "--ckpt", ckpt, "--tasks", lines],
        "eval yaml": ["eval.py", "--ckpt", ckpt, "--tasks",
                      write("deep.yaml", "task: x\nd: " + DEEP + "\n")],
        "embed index": ["embed.py", "index", "--ckpt", ckpt, "--input", lines, "--out",
                        folder / "index"],
        "embed tune": ["embed.py", "tune", "--ckpt", ckpt, "--pairs", lines, "--out-dir",
                       folder / "tuned"],
        "train config": ["train.py", "--config", write("deep.json", '{"lr": ' + DEEP + "}")],
        "test hf config": ["test.py", "--ckpt", hf],
    }


def test_json_and_yaml_nested_too_deep_is_one_line_in_every_reader(run_dir, tmp_path):
    for script, *args in deep_inputs(tmp_path, run_dir / "ckpt.pt").values():
        device = [] if script == "tokenizer.py" else ["--device", "cpu"]
        result = run_main(script, *args, *device)
        assert_one_line_error(result, "nested too deeply to read")


# 2. a config that claims another shape than its weights hold is refused before anything is built

@pytest.mark.parametrize("lie, fragment", [
    (dict(n_layer=100_000), "n_layer 100000 is more than 1024"),
    (dict(n_layer=3), "n_layer 3 (the weights hold 1)"),
    (dict(n_embd=10**9, n_head=1), "GiB for their float32 weights alone"),
    (dict(block_size=10**12), "GiB for their float32 weights alone"),
    (dict(vocab_size=7), "vocab_size 7 (the weights hold"),
])
def test_a_checkpoint_that_claims_another_shape_is_refused_at_once(
        char_data, run_dir, tmp_path, lie, fragment):
    checkpoint = torch.load(run_dir / "ckpt.pt", weights_only=True)
    checkpoint["model_config"].update(lie)
    torch.save(checkpoint, run_dir / "ckpt.pt")
    hf = tmp_path / "hf"  # an HF folder whose config.json says the same
    save_gpt2(GPT(GPTConfig(block_size=32, vocab_size=16, n_layer=1, n_head=2, n_embd=32)), str(hf))
    config = json.loads((hf / "config.json").read_text())
    renamed = {"block_size": "n_positions"}
    (hf / "config.json").write_text(
        json.dumps({**config, **{renamed.get(k, k): v for k, v in lie.items()}}))
    # a DeepSpeed folder whose training state says the same, and its converted weights
    ds = tmp_path / "ds"
    fake_deepspeed_folder(ds, model_config=dict(block_size=8, vocab_size=16, n_layer=1, n_head=1,
                                                n_embd=8))
    module = torch.load(ds / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        weights_only=True)
    torch.save(module["module"], ds / "ckpt_ds.pt")
    state = json.loads((ds / "global_step4" / "train_state.json").read_text())
    state["model_config"].update({"n_head": 1, **lie})
    (ds / "global_step4" / "train_state.json").write_text(json.dumps(state))
    commands = [["test.py", "--ckpt", run_dir / "ckpt.pt"],
                ["eval.py", "--ckpt", run_dir / "ckpt.pt", "--tasks", "hellaswag"],
                ["test.py", "--ckpt", hf], ["test_ds.py", "--ckpt", ds / "ckpt_ds.pt"],
                ["train.py", "--data-dir", char_data, "--out-dir", run_dir, "--init-from", "resume",
                 "--max-iters", "9"]]
    for script, *args in commands:
        start = time.monotonic()
        result = run_main(script, *args, "--device", "cpu", env={"DS_ACCELERATOR": "cpu"})
        assert_one_line_error(result, fragment)
        assert time.monotonic() - start < 5, script  # no model of the claimed shape is built


# 3. a kill during DeepSpeed's save: `latest` empty or naming an incomplete tag falls back to a
# complete one

def test_deepspeed_killed_while_saving_resumes_from_the_newest_complete_tag(
        ds_ops, char_data, tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    train = [sys.executable, str(ROOT / "train_ds.py"), "--deepspeed_config",
             str(ROOT / "ds_config_zero1.json"), "--data-dir", str(char_data), "--out-dir",
             str(tmp_path), *TINY_MODEL, "--optimizer", "adamw", "--keep-checkpoints", "2"]
    proc = subprocess.Popen([*train, "--save-interval", "1", "--max-iters", "100000"], cwd=tmp_path,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in proc.stdout:
        # a save after every step: the kill lands in one, or between two
        if line.startswith("iter 5:"):
            break
    proc.kill()  # kill -9: no handler runs
    proc.communicate(timeout=60)
    ds = tmp_path / "ds"
    tags = sorted((p for p in ds.glob("global_step*")),
                  key=lambda p: int(p.name.removeprefix("global_step")))
    assert len(tags) >= 2, list(ds.iterdir())
    (ds / "latest").write_text("")  # what a kill while DeepSpeed rewrites it leaves
    (ds / "latest_complete").unlink(missing_ok=True)
    (tags[-1] / "train_state.json").unlink(missing_ok=True)  # the newest tag: not all written
    complete = tags[-2].name
    sampled = run_main("test_ds.py", "--ckpt", ds, "--max-new-tokens", "3", "--num-samples", "1",
                       "--device", "cpu", env={"DS_ACCELERATOR": "cpu"})
    assert sampled.returncode == 0, sampled.stderr
    notes = [line for line in sampled.stderr.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {ds}: `latest` is missing, empty or names an incomplete checkpoint; "
                     f"using the newest complete one, {complete}"], sampled.stderr
    step = int(complete.removeprefix("global_step"))
    resumed = subprocess.run([*train, "--init-from", "resume", "--max-iters", str(step + 2)],
                             cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resumed from {ds} at iteration {step}" in resumed.stdout
    assert (ds / "latest_complete").read_text().strip() == f"global_step{step + 2}"


# 4. runs started in the same second never share a TensorBoard folder; names sort in time in any
# time zone

def test_runs_started_together_log_to_folders_of_their_own(char_data, tmp_path):
    board = tmp_path / "board"
    flags = ["--data-dir", char_data, *TINY_MODEL, "--max-iters", "1", "--tensorboard-dir", board]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *map(str, flags),
                               "--out-dir", str(tmp_path / name)], cwd=tmp_path,
                              env={**os.environ, "TZ": zone}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for name, zone in (("a", "Asia/Shanghai"), ("b", "America/Los_Angeles"))]
    started = time.gmtime()
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.communicate()[1]
    names = sorted(p.name for p in board.iterdir())
    assert (len(names) == 2 and
            {name.rsplit("-", 1)[1] for name in names} == {str(p.pid) for p in procs}), names
    assert all(name.startswith(time.strftime("%Y%m%d-", started)) and "Z-" in name
               for name in names), names
    again = [train(char_data, tmp_path / f"c{i}", "--max-iters", "1", "--tensorboard-dir", board)
             for i in (1, 2)]
    assert all(result.returncode == 0 for result in again)
    # two runs of one process in the same second: still two folders
    assert len(list(board.iterdir())) == 4


# 5. tokenizer facts are checked when read

@pytest.mark.parametrize("lie, fragment", [
    ({"chars": [104, 105]}, "chars [104, 105]; it must be a string of distinct characters"),
    ({"chars": "aab"}, "chars 'aab'"), ({"eot_id": "x"}, "eot_id 'x'"),
    ({"vocab_size": -5}, "vocab_size -5"), ({"special_tokens": {"start": "x"}}, "special_tokens"),
    ({"tokenizer": "sentencepiece"}, "unknown tokenizer"),
])
def test_tokenizer_facts_that_lie_are_one_line(run_dir, lie, fragment):
    checkpoint = torch.load(run_dir / "ckpt.pt", weights_only=True)
    checkpoint["tokenizer"].update(lie)
    torch.save(checkpoint, run_dir / "ckpt.pt")
    assert_one_line_error(run_main("test.py", "--ckpt", run_dir / "ckpt.pt", "--device", "cpu"),
                          fragment)


def test_a_char_model_whose_data_had_no_newline_samples_unconditionally(tmp_path):
    facts = {"tokenizer": "char", "vocab_size": 3, "eot_id": None, "chars": "abc"}
    ids = np.random.default_rng(0).integers(0, 3, 3000).astype(np.uint16)
    write_nanogpt(str(tmp_path / "data"), ids[:2700], ids[2700:], facts)
    assert train(tmp_path / "data", tmp_path / "out", "--max-iters", "1").returncode == 0
    result = run_main("test.py", "--ckpt", tmp_path / "out" / "ckpt.pt", "--device", "cpu",
                      "--num-samples", "1", "--max-new-tokens", "8", "--no-stream")
    assert result.returncode == 0, result.stderr
    assert (set(result.stdout.splitlines()[0]) <= set("abc") and
            len(result.stdout.splitlines()[0]) == 8)


# 6. long generation shows its progress

def test_genfile_generation_shows_tokens_done_and_time_left(run_dir, tmp_path):
    # the bar is for a person watching: test.py as a real process whose stderr is a terminal
    leader, follower = pty.openpty()
    # a new pty is 0 columns wide
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "test.py", "--ckpt", str(run_dir / "ckpt.pt"),
                             "--device", "cpu", "--num-samples", "3", "--max-new-tokens", "20",
                             "--genfile", str(tmp_path / "g.jsonl")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, shown.decode(errors="replace")
    text = shown.decode(errors="replace")
    samples = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    made = sum(sample["length"] + sample["finished"] for sample in samples)  # (end-of-text too)
    assert "sampling: 100%" in text and f"{made}/{made}" in text and len(samples) == 3, text



def test_an_export_never_replaces_a_model_unless_overwrite(tmp_path):
    """Issue 49: an export into a folder that holds a model refuses without --overwrite; with it,
    the folder is replaced whole (the old model's tokenizer.json does not stay beside new
    weights)."""
    def checkpoint(path, vocab_size, facts):
        torch.manual_seed(vocab_size)
        model = GPT(GPTConfig(block_size=16, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=16))
        torch.save({"model": model.state_dict(), "model_config": vars(model.config),
                    "tokenizer": facts, "iter_num": 1}, path)
        return model

    checkpoint(tmp_path / "gpt2.pt", 50257,
               {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256})
    char = checkpoint(tmp_path / "char.pt", 4,
                      {"tokenizer": "char", "vocab_size": 4, "eot_id": 3, "chars": "abc"})
    hf = tmp_path / "hf"
    assert run_main("test.py", "--ckpt", tmp_path / "gpt2.pt", "--export-hf", hf).returncode == 0
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    assert "tokenizer.json" in before
    (hf / "notes.txt").write_text("mine")
    refused = run_main("test.py", "--ckpt", tmp_path / "char.pt", "--export-hf", hf)
    assert_one_line_error(refused, "already holds files", "--overwrite")
    assert {p.name: p.read_bytes() for p in hf.iterdir() if p.name != "notes.txt"} == before
    replaced = run_main("test.py", "--ckpt", tmp_path / "char.pt", "--export-hf", hf, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert sorted(p.name for p in hf.iterdir()) == ["README.md", "config.json",
                                                    "generation_config.json", "model.safetensors",
                                                    "tokenizer_facts.json"]
    # no temporary folder left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]
    sample = run_main("test.py", "--ckpt", hf, "--prompt", "ab", "--max-new-tokens", "3",
                      "--device", "cpu")
    assert sample.returncode == 0, sample.stderr
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"someone's model")
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "char.pt", "--export-gguf",
                                   gguf), "already holds a file")
    assert gguf.read_bytes() == b"someone's model"
    assert run_main("test.py", "--ckpt", tmp_path / "char.pt", "--export-gguf", gguf,
                    "--overwrite").returncode == 0
    assert gguf.read_bytes()[:4] == b"GGUF"
    assert char.config.vocab_size == 4


def test_out_of_gpu_memory_is_one_line_saying_what_to_change_and_keeps_the_checkpoint(
        run_dir, char_data, monkeypatch, tmp_path):
    """Issue 49: torch's OutOfMemoryError, raised where a real GPU raises it (the model's forward),
    in training (resumed, so a checkpoint is on disk), fine-tuning, sampling, evaluation and
    embedding."""
    import model
    calls = {"n": 0}

    def out_of_memory(self, *args, **kwargs):
        calls["n"] += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(model.GPT, "_trunk", out_of_memory)
    before = (run_dir / "ckpt.pt").read_bytes()
    ckpt = run_dir / "ckpt.pt"
    (tmp_path / "docs.txt").write_text("a document\n")
    (tmp_path / "cls.jsonl").write_text('{"text": "a b", "label": "x"}\n'
                                        '{"text": "c d", "label": "y"}\n')
    runs = {"train.py": train(char_data, run_dir, "--init-from", "resume", "--max-iters", "8"),
            "finetune.py": run_main("finetune.py", "--task", "classify", "--train",
                                    tmp_path / "cls.jsonl", "--val", tmp_path / "cls.jsonl",
                                    "--init-from", ckpt, "--out-dir", tmp_path / "ft",
                                    "--device", "cpu"),
            "test.py": run_main("test.py", "--ckpt", ckpt, "--max-new-tokens", "5",
                                "--device", "cpu"),
            "eval.py": run_main("eval.py", "--ckpt", ckpt, "--data-dir", char_data,
                                "--device", "cpu"),
            "embed.py": run_main("embed.py", "encode", "--ckpt", ckpt, "--input",
                                 tmp_path / "docs.txt", "--out", tmp_path / "emb",
                                 "--device", "cpu")}
    for script, result in runs.items():
        assert result.returncode == 1, (script, result.stderr[-2000:])
        assert_one_line_error(result, "out of GPU memory", "Tried to allocate 20.00 GiB",
                              "--batch-size")
    assert calls["n"] >= len(runs)
    assert_unchanged(run_dir, before)
    assert not list(tmp_path.glob("emb*"))


@pytest.mark.parametrize("size", ["100000000000000000000", "1000000000"])
def test_an_absurd_bpe_vocabulary_size_is_one_line(tmp_path, size):
    (tmp_path / "t.txt").write_text("some text to train on\n")
    result = run_main("tokenizer.py", "--input", tmp_path / "t.txt", "--tokenizer", "bpe",
                      "--vocab-size", size, "--output-dir", tmp_path / "out")
    assert_one_line_error(result, f"--vocab-size {size} is more than 1,048,576")


def test_a_tokenizer_file_with_a_gap_in_its_ids_keeps_every_id(tmp_path):
    """Issue 49: 258 entries, one of them id 70000: the vocabulary is 70001 ids, in 32-bit bins."""
    from toolkit.tokenizers import SPELLING
    vocab = {SPELLING[b]: b for b in range(256)}
    vocab["<|endoftext|>"], vocab["ab"] = 256, 70000
    spec = {"version": "1.0", "added_tokens": [{"id": 256, "content": "<|endoftext|>",
                                                "single_word": False, "lstrip": False,
                                                "rstrip": False, "normalized": False,
                                                "special": True}],
            "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                                  "trim_offsets": True, "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                                "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                      "merges": [["a", "b"]]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "t.txt").write_text("ab ab cab\n" * 50)
    out = tmp_path / "out"
    result = run_main("tokenizer.py", "--input", tmp_path / "t.txt", "--tokenizer-file",
                      tmp_path / "tokenizer.json", "--output-dir", out)
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 70001 and meta["dtype"] == "uint32", meta
    ids = np.concatenate([np.fromfile(out / name, np.uint32) for name in ("train.bin", "val.bin")])
    assert 70000 in ids and ids.max() == 70000


def test_a_request_that_would_never_finish_shows_progress_and_ctrl_c_keeps_the_samples(
        run_dir, tmp_path):
    """Issue 49: no terminal, a billion tokens a sample: progress on stderr within seconds; Ctrl-C
    keeps the samples finished by then in the genfile."""
    def interrupted_once_sampling(genfile, max_new_tokens) -> tuple[int, str]:
        proc = subprocess.Popen([sys.executable, "test.py", "--ckpt", str(run_dir / "ckpt.pt"),
                                 "--device", "cpu", "--num-samples", "1000000", "--max-new-tokens",
                                 max_new_tokens, "--genfile", str(genfile)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        shown, began = "", time.monotonic()
        # (a bar without a terminal ends no line)
        while "tok/s" not in shown and time.monotonic() - began < 120:
            shown += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        try:
            status = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # where every thread is: faulthandler's dump on SIGABRT
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            pytest.fail(f"no exit 60 s after SIGINT: {shown[-300:]}"
                        f"{proc.stderr.read().decode(errors='replace')}")
        return status, shown + proc.stderr.read().decode(errors="replace")

    status, shown = interrupted_once_sampling(tmp_path / "huge.jsonl", "1000000000")
    kept = [json.loads(line) for line in (tmp_path / "huge.jsonl").read_text().splitlines()]
    # the total: 10**15 less what the samples that ended never made
    total = int(re.findall(r"sampling:.*?/(\d+) ", shown)[-1])
    assert status == 130 and 10**15 - 10**9 * len(kept) <= total <= 10**15, shown
    # only samples that ended (at end-of-text), each whole
    assert all(line["finished"] for line in kept)
    status, shown = interrupted_once_sampling(tmp_path / "short.jsonl", "4")
    assert status == 130 and "holds the samples finished before the interrupt" in shown, shown
    lines = [json.loads(line) for line in (tmp_path / "short.jsonl").read_text().splitlines()]
    assert lines and all(line["length"] <= 4 for line in lines)


@pytest.mark.parametrize("jinja, fragment", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "it ran for over 0.5 s"),
    ("{{ 'x' * 10**10 }}", "a sequence repeated beyond what a prompt can hold"),
    ("{{ 'x'|center(10**10) }}", "a number past 16,777,216 given to a function"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "it renders over 16,777,216"),
])
def test_a_downloaded_chat_template_that_never_ends_or_fills_memory_is_one_line(
        gpt2_vocabulary, tmp_path, monkeypatch, jinja, fragment):
    """A template is code from a download: rendering it has a time and a size limit (Jinja's
    sandbox bounds range() alone; nested loops once rendered forever, 'x' * 10**10 took
    gigabytes)."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    save_gpt2(GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)),
              str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": jinja}))
    began = time.monotonic()
    result = run_main("test.py", "--ckpt", tmp_path, "--chat", "--max-new-tokens", "2",
                      "--device", "cpu", input="hi\n")
    assert_one_line_error(result, "the model's chat template fails: " + fragment)
    assert time.monotonic() - began < 30


def llama_folder_with(tmp_path, config_change: dict | None = None, weights_change=None) -> str:
    """conftest's tiny Llama 3.2 folder with its config.json and its weights changed."""
    folder = llama3_folder(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **(config_change or {})}))
    if weights_change:
        weights = load_file(tmp_path / "hf" / "model.safetensors")
        weights_change(weights)
        save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("change, fragment", [
    ({"rope_theta": -10000.0, "rope_parameters": None},
     "rope_theta must be a finite number above 0"),
    ({"rope_theta": 0, "rope_parameters": None}, "rope_theta must be a finite number above 0"),
    ({"rope_theta": float("nan"), "rope_parameters": None}, "rope_theta must be a finite number"),
    ({"rms_norm_eps": -1}, "norm_eps must be a finite number of at least 0, got -1"),
])
def test_a_config_that_would_sample_garbage_or_nan_is_refused(tmp_path, change, fragment):
    """Once these sampled garbage or NaN logits and exited 0."""
    folder = llama_folder_with(tmp_path, change)
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "2",
                                   "--num-samples", "1", "--device", "cpu"), fragment)


def test_a_tied_head_that_differs_from_the_embedding_is_refused(tmp_path):
    """tie_word_embeddings true and another lm_head.weight in the file: once the file's head was
    dropped without a word (and the samples differed from transformers')."""
    def other_head(weights):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1.0
    folder = llama_folder_with(tmp_path / "llama", weights_change=other_head)
    fragment = "ties the head to the token embedding (tie_word_embeddings true) but its lm_head"
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "2",
                                   "--device", "cpu"), fragment)
    # GPT-2's (always tied): the same
    save_gpt2(GPT(GPTConfig(block_size=16, vocab_size=257, n_layer=1, n_head=2, n_embd=16)),
              str(tmp_path / "gpt2"), tokenizer=Tokenizer("byte").facts())
    weights = load_file(tmp_path / "gpt2" / "model.safetensors")
    weights["lm_head.weight"] = weights["transformer.wte.weight"] * 2
    save_file(weights, tmp_path / "gpt2" / "model.safetensors", metadata={"format": "pt"})
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "gpt2", "--max-new-tokens",
                                   "2", "--device", "cpu"), fragment)


def test_a_weights_shard_that_is_a_named_pipe_is_refused(tmp_path):
    """A shard listed in model.safetensors.index.json that is a FIFO once blocked test.py forever
    (and SIGTERM with it)."""
    folder = llama_folder_with(tmp_path)
    os.rename(tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "real.safetensors")
    os.mkfifo(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "2",
                                   "--device", "cpu"), "is a pipe or a device, not a weights shard")
