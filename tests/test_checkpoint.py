"""The checkpoint formats: ckpt.pt (old files still load), atomic writes, weight files
(toolkit/checkpoint.py), DeepSpeed folders (toolkit/ds_checkpoint.py), and one reader for every
source (toolkit/model_sources.py)."""
import json
import os
import pickle
import shutil
import time

import numpy as np
import pytest
import torch

from conftest import ROOT, assert_one_line_error, fake_deepspeed_folder, run_main
from model import GPT, GPTConfig
from toolkit import ds_checkpoint
from toolkit.checkpoint import load_checkpoint, model_from_checkpoint, read_weights, save_checkpoint
from toolkit.cli import CLIError
from toolkit.hf import save_gpt2
from toolkit.model_sources import load_model
from toolkit.writers import write_nanogpt

# written by train.py at commit a684da2 (3 steps)
OLD_CHECKPOINT = ROOT / "tests" / "data" / "ckpt_a684da2.pt"
# what test.py printed from it at that commit
OLD_GREEDY = "def  TT\u2013\u2013\u2013000" + "\u201c" * 21


def test_checkpoint_written_by_an_older_version_samples_and_resumes(tmp_path):
    sample = run_main("test.py", "--ckpt", OLD_CHECKPOINT, "--temperature", "0", "--prompt", "def ",
                      "--max-new-tokens", "30", "--num-samples", "1", "--device", "cpu",
                      "--no-stream")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.splitlines()[0] == OLD_GREEDY
    old = load_checkpoint(str(OLD_CHECKPOINT))
    # data in the checkpoint's own vocabulary, whatever this Python's pydoc holds
    facts = old["tokenizer"]
    ids = np.random.default_rng(0).integers(0, facts["vocab_size"], 4000).astype(np.uint16)
    write_nanogpt(str(tmp_path / "data"), ids[:3600], ids[3600:], facts)
    shutil.copy(OLD_CHECKPOINT, tmp_path / "ckpt.pt")
    resumed = run_main("train.py", "--init-from", "resume", "--out-dir", tmp_path, "--data-dir",
                       tmp_path / "data", "--max-iters", "5", "--device", "cpu")
    assert resumed.returncode == 0, resumed.stderr
    new = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert new["iter_num"] == 5 and \
        new["history"]["iter"][:len(old["history"]["iter"])] == old["history"]["iter"]
    # what it was trained with, before the option existed
    assert new["train_config"]["optimizer"] == "adamw"


@pytest.mark.parametrize("edit, says", [
    ({"iter_num": "3"}, "its iter_num is str '3'"),
    ({"iter_num": -2}, "its iter_num -2 is negative"),
    ({"best_val_loss": "low"}, "its best_val_loss is str"),
    ({"rng": {"torch": 5}}, "its rng is not a dict of generator states"),
    ({"history": {"iter": 3}}, "its history is not a dict of lists"),
    ({"optimizer": 3}, "its optimizer is int"),
    ({"train_config": {"lr": "high"}}, "train_config: lr must be null or float, got 'high'"),
    ({"train_config": {"optimizer": "sgd"}}, "optimizer must be one of auto, muon, adamw"),
    ({"model_config": {"n_layer": "1"}}, "n_layer must be a positive integer, got '1'"),
])
def test_an_edited_checkpoint_is_refused_in_one_line_before_resuming(tmp_path, edit, says):
    checkpoint = load_checkpoint(str(OLD_CHECKPOINT))
    for key, value in edit.items():
        checkpoint[key] = {**checkpoint[key], **value} if key.endswith("_config") else value
    save_checkpoint(checkpoint, str(tmp_path / "ckpt.pt"))
    assert_one_line_error(run_main("train.py", "--init-from", "resume", "--out-dir", tmp_path,
                                   "--max-iters", "5", "--device", "cpu"), says)
    assert load_checkpoint(str(tmp_path / "ckpt.pt")).keys() == checkpoint.keys()


def test_checkpoint_of_compiled_model_loads_in_plain_model(tmp_path):
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8))
    state = torch.compile(model).state_dict()
    assert all(k.startswith("_orig_mod.") for k in state)
    save_checkpoint({"model": state, "model_config": vars(model.config)}, str(tmp_path / "ckpt.pt"))
    plain = model_from_checkpoint(load_checkpoint(str(tmp_path / "ckpt.pt")))
    idx = torch.randint(0, 16, (2, 8))
    assert torch.equal(plain(idx)[0], model(idx)[0])


def test_weights_of_another_model_name_the_keys_that_differ():
    from toolkit.checkpoint import load_weights
    from toolkit.cli import CLIError
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=1, n_embd=8))
    weights = {**model.state_dict(), "transformer.h.0.attn.c_attn.lora_a": torch.zeros(4, 8)}
    with pytest.raises(CLIError, match='fit its model config: Unexpected key.*"transformer.h.0'):
        load_weights(model, weights, "x.pt")


def test_checkpoint_is_written_atomically(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"model": {}, "model_config": {}, "iter_num": 1}, str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind
    mask = os.umask(0o022)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_weight_files_of_every_layout(tmp_path):
    torch.manual_seed(0)
    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(4)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert all(torch.equal(read_weights(str(tmp_path))[k], v) for k, v in state.items())
    shards = tmp_path / "shards"
    shards.mkdir()
    torch.save({"a.weight": state["a.weight"]}, shards / "part-1.bin")
    torch.save({"b.bias": state["b.bias"]}, shards / "part-2.bin")
    (shards / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "part-1.bin", "b.bias": "part-2.bin"}}))
    assert all(torch.equal(read_weights(str(shards))[k], v) for k, v in state.items())
    torch.save({"module": state}, tmp_path / "wrapped.pt")  # DeepSpeed's model-states layout
    assert set(read_weights(str(tmp_path / "wrapped.pt"))) == set(state)
    with pytest.raises(FileNotFoundError):
        read_weights(str(tmp_path / "shards" / "nothing"))


def test_deepspeed_tags_and_a_missing_tag(tmp_path):
    fake_deepspeed_folder(tmp_path / "ds", "global_step4")
    (tmp_path / "ds" / "global_step12").mkdir()
    (tmp_path / "ds" / "global_step9").mkdir()
    assert ds_checkpoint.deepspeed_tags(str(tmp_path / "ds")) == \
        ["global_step4", "global_step9", "global_step12"]
    with pytest.raises(CLIError, match="has no checkpoint global_step20; it holds global_step4, "
                                       "global_step9, global_step12"):
        ds_checkpoint.read_train_state(str(tmp_path / "ds"), "global_step20")


def test_a_converted_file_older_than_the_newest_tag_is_not_the_default(tmp_path):
    ds = tmp_path / "ds"
    fake_deepspeed_folder(ds, "global_step4")
    weights = torch.load(next((ds / "global_step4").glob("*model_states.pt")),
                         weights_only=True)["module"]
    (ds / "ckpt_ds.pt").mkdir()
    torch.save(weights, ds / "ckpt_ds.pt" / "pytorch_model.bin")  # converted after global_step4
    assert ds_checkpoint.converted_from(str(ds / "ckpt_ds.pt"), str(ds)) == "global_step4"
    assert ds_checkpoint.default_deepspeed_source(str(ds), "ckpt_ds.pt") == str(ds / "ckpt_ds.pt")
    time.sleep(0.01)
    # training went on
    shutil.copytree(ds / "global_step4", ds / "global_step8", copy_function=shutil.copy)
    (ds / "latest").write_text("global_step8")
    assert ds_checkpoint.default_deepspeed_source(str(ds), "ckpt_ds.pt") == str(ds)
    _, state, label = ds_checkpoint.load_deepspeed_model(str(ds / "ckpt_ds.pt"))
    assert state["tag"] == "global_step4" and "output of global_step4" in label and \
        "newer global_step8" in label


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, pickle.dumps({"model": 1})])
def test_unreadable_checkpoints_are_one_line_errors(tmp_path, content):
    (tmp_path / "ckpt.pt").write_bytes(content)
    with pytest.raises(CLIError, match="ckpt.pt"):
        load_checkpoint(str(tmp_path / "ckpt.pt"))


def test_load_model_reads_every_source_alike(tmp_path):
    """A ckpt.pt, an HF folder written from it, and a DeepSpeed folder's zero_to_fp32 output: the
    same weights and tokenizer facts, with dropout off unless asked for."""
    facts = {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}
    config = dict(block_size=8, vocab_size=257, n_layer=1, n_head=1, n_embd=8)
    torch.manual_seed(0)
    source = GPT(GPTConfig(**config))
    save_checkpoint({"model": source.state_dict(), "model_config": vars(source.config),
                     "tokenizer": facts}, str(tmp_path / "ckpt.pt"))
    save_gpt2(source, str(tmp_path / "hf"), facts)
    fake_deepspeed_folder(tmp_path / "ds", tokenizer=facts, model_config=config)
    torch.save(source.state_dict(), tmp_path / "ds" / "ckpt_ds.pt")
    for path in (tmp_path / "ckpt.pt", tmp_path / "hf", tmp_path / "ds" / "ckpt_ds.pt"):
        model, read = load_model(str(path))
        assert read["tokenizer"] == "byte" and model.config.dropout == 0.0, path
        torch.testing.assert_close(model.state_dict(), source.state_dict())
        assert load_model(str(path), dropout=0.1)[0].config.dropout == 0.1
