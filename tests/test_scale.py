"""Issue 15: Megatron's flag names and data command, the example launch scripts, pipeline and tensor parallel
through DeepSpeed, layout-free conversion, memory estimates. Real processes on the CPU (gloo)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cli import free_port
from conftest import ROOT, TINY_MODEL, assert_one_line_error, run_script
from test_tokenizer import data_gym_files, read_megatron, write_jsonl

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
EXAMPLES = sorted((ROOT / "examples").glob("*.sh"))


def run_example(name: str, env: dict, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "examples" / name), *map(str, args)], text=True, capture_output=True,
                          timeout=timeout, env={**os.environ, **ENV, **env})


# ----- Megatron's flag names -----

def test_megatron_flags_set_the_same_values_and_load_resumes(char_data, tmp_path):
    """--micro-batch-size 4 --global-batch-size 8: 2 micro-batches per step; samples become steps of 8."""
    out = tmp_path / "run"
    flags = ["--data-path", char_data, "--save", out, "--num-layers", "1", "--hidden-size", "32",
             "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "4",
             "--global-batch-size", "8", "--train-samples", "48", "--lr-warmup-samples", "16",
             "--lr-decay-samples", "40", "--device", "cpu", "--dtype", "float32", "--eval-iters", "2",
             "--eval-interval", "100"]
    first = run_script("train.py", *flags)
    assert first.returncode == 0, first.stderr
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    cfg = ckpt["train_config"]
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["block_size"], cfg["batch_size"]) == (1, 32, 2, 32, 4)
    assert (cfg["grad_accum"], cfg["max_iters"], cfg["warmup_iters"], cfg["lr_decay_iters"]) == (2, 6, 2, 5)
    assert ckpt["iter_num"] == 6
    # --load: the same folder, resumed because it holds a checkpoint (--train-iters is Megatron's --max-iters)
    resumed = run_script("train.py", "--load", out, "--data-path", char_data, "--train-iters", "8", "--device", "cpu")
    assert resumed.returncode == 0, resumed.stderr
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 8
    # --load of an empty folder starts from scratch there
    fresh = run_script("train.py", "--load", tmp_path / "new", *flags[4:], "--data-path", char_data)
    assert fresh.returncode == 0, fresh.stderr
    assert torch.load(tmp_path / "new" / "ckpt.pt", weights_only=True)["iter_num"] == 6


@pytest.mark.parametrize("flags, fragments", [
    (["--micro-batch-size", "4", "--global-batch-size", "10"], ["--global-batch-size 10", "multiple"]),
    (["--global-batch-size", "8", "--batch-size", "4", "--grad-accum", "4"], ["--grad-accum 4"]),
    (["--lr-decay-samples", "80", "--lr-decay-iters", "10"], ["--lr-decay-samples", "give one"]),
    (["--load", "a", "--save", "b"], ["--load a", "differ"]),
])
def test_megatron_flags_that_disagree_are_one_line(char_data, tmp_path, flags, fragments):
    result = run_script("train.py", "--data-dir", char_data, "--out-dir", tmp_path / "o", *TINY_MODEL[:8], *flags,
                        "--max-iters", "1", cwd=tmp_path)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "o").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("script", ["train.py", "train_ddp.py", "train_ds.py"])
def test_every_trainer_takes_megatron_names(script):
    text = run_script(script, "--help", env=ENV).stdout
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                 "--global-batch-size", "--data-path", "--save", "--load", "--lr-decay-samples",
                 "--lr-warmup-samples", "--train-samples"):
        assert flag in text, flag


# ----- the source design's data command and launch scripts -----

@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_megatron_data_command_runs_as_written(gpt2_vocabulary, tmp_path):
    """examples/create-data.sh: --vocab/--merge-file (GPT-2's files, built here from r50k's ranks), --dataset-impl
    mmap, --tokenizer-type GPT2BPETokenizer, --append-eod, --workers -> PREFIX_text_document.bin/.idx."""
    import tiktoken
    r50k = tiktoken.get_encoding("r50k_base")
    vocab, merges = data_gym_files(r50k._mergeable_ranks, tmp_path)
    texts = ["Hello world! The café is open.", "Second document, with numbers 1234.", "third"]
    source = write_jsonl(tmp_path / "oscar-tiny.jsonl", texts)
    result = run_example("create-data.sh", {"INPUT": source, "VOCAB": vocab, "MERGES": merges,
                                            "OUTPUT_PREFIX": str(tmp_path / "my-gpt2"), "WORKERS": "2"})
    assert result.returncode == 0, result.stderr
    code, documents = read_megatron(str(tmp_path / "my-gpt2_text_document"))
    assert code == 8  # uint16
    assert [list(d) for d in documents] == [r50k.encode_ordinary(t) + [50256] for t in texts]


def test_one_node_example_trains_with_megatron_names(ds_ops, char_data, tmp_path):
    """examples/run-one-node.sh at a tiny size: 2 processes, Megatron's flags through train_ds.py, --load resumes."""
    env = {"N_GPUS": "2", "MASTER_PORT": str(free_port()), "DS_CONFIG": str(ROOT / "ds_config_zero1.json"),
           "DATA_PATH": str(char_data), "CHECKPOINT_PATH": str(tmp_path / "ckpt"), "NLAYERS": "1", "NHIDDEN": "32",
           "NHEADS": "2", "SEQ_LEN": "32", "MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "16", "TRAIN_SAMPLES": "32",
           "EVAL_ITERS": "2"}
    result = run_example("run-one-node.sh", env, "--device", "cpu", "--dtype", "float32", "--log-interval", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "global batch: 4 micro x 2 accumulation x 2 processes = 16 sequences" in result.stdout
    state = json.loads((tmp_path / "ckpt" / "ds" / "global_step2" / "train_state.json").read_text())
    assert state["iter_num"] == 2 and state["train_config"]["n_embd"] == 32
    more = run_example("run-one-node.sh", {**env, "TRAIN_SAMPLES": "64", "MASTER_PORT": str(free_port())},
                       "--device", "cpu", "--dtype", "float32")
    assert more.returncode == 0 and "resumed from" in more.stdout, more.stdout[-3000:] + more.stderr[-3000:]
    assert (tmp_path / "ckpt" / "ds" / "latest").read_text().strip() == "global_step4"
