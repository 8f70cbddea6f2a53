"""train.py end to end: learning on the embedded corpus, checkpoints, exact resume, signals, bad
input."""
import json
import math
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY_MODEL, assert_one_line_error, run_main, tensorboard_scalars
from model import GPT, GPTConfig
from toolkit.checkpoint import load_checkpoint, model_from_checkpoint
from toolkit.data import load_corpus
from toolkit.hf import save_gpt2
from toolkit.pretraining import evaluation_windows, setup
from toolkit.cli import CLIError
from toolkit.train_config import TrainConfig, parse_config, schedule
from toolkit.training import TorchEngine
from toolkit.writers import write_nanogpt


def train(char_data, out_dir, *extra):
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", out_dir, *TINY_MODEL,
                      *extra)
    assert result.returncode == 0, result.stderr
    return load_checkpoint(str(out_dir / "ckpt.pt"))


def test_trains_on_embedded_corpus_and_samples(char_data, tmp_path):
    ckpt = train(char_data, tmp_path, "--max-iters", "60", "--eval-interval", "30", "--lr", "3e-3")
    val = ckpt["history"]["val"]
    assert ckpt["iter_num"] == 60 and len(val) == 3
    assert val[-1] < val[0] - 0.5, val  # from ~ln(vocab) towards character statistics
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert [step for step, _ in scalars["loss/train"]] == list(range(1, 61))  # --log-interval 1
    assert [v for _, v in scalars["eval/val_loss"]] == pytest.approx(val)
    assert {"eval/train_loss", "eval/val_ppl", "eval/val_bpb", "lr",
            "perf/tokens_per_s"} <= set(scalars)
    assert [m["val_loss"] for m in ckpt["history"]["metrics"]] == val
    # char level: pydoc's characters are mostly one byte each, so bits per byte are near nats per
    # token / ln 2
    assert [m["val_bpb"] for m in ckpt["history"]["metrics"]] == pytest.approx(
        [v / math.log(2) for v in val], rel=0.05)

    genfile = tmp_path / "samples.jsonl"
    result = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--num-samples", "3",
                      "--max-new-tokens", "40", "--genfile", genfile, "--device", "cpu",
                      "--prompt", "def ")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in genfile.read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert set(line) == {"text", "length", "finished"}
        assert line["text"].startswith("def ") and 0 < line["length"] <= 40
    assert lines[0]["text"] in result.stdout


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_resume_is_bitwise_exact(char_data, tmp_path, optimizer):
    common = ["--max-iters", "16", "--lr-decay-iters", "16", "--warmup-iters", "4",
              "--eval-interval", "8", "--dropout", "0.1", "--save-interval", "8",
              "--optimizer", optimizer]
    full = train(char_data, tmp_path / "full", *common)
    first = train(char_data, tmp_path / "split", *common[:1], "10", *common[2:])
    assert first["iter_num"] == 10 and first["train_config"]["optimizer"] == optimizer
    resumed = train(char_data, tmp_path / "split", "--init-from", "resume", "--max-iters", "16")
    # bitwise: dropout RNG and data position too
    assert resumed["history"]["loss"] == full["history"]["loss"]
    for key, value in full["model"].items():
        assert torch.equal(value, resumed["model"][key]), key


def test_sigterm_saves_a_loadable_checkpoint(char_data, tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "--data-dir", str(char_data),
           "--out-dir", str(tmp_path), *TINY_MODEL, "--max-iters", "100000",
           "--eval-interval", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stdout:  # wait until training is really running
        if line.startswith("iter 3:"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert 3 <= ckpt["iter_num"] < 100000
    assert "stopped by signal" in out + err


# Counts glibc's mmapped blocks (mallinfo2().hblks) around allocating a 64 MB tensor, before and
# after keep_freed_memory_in_heap, in a fresh process so the test sees glibc's defaults.
MMAP_PROBE = """
import ctypes, torch
from toolkit import device
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t)
                for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks """ \
"""fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def mmapped_during_alloc():
    before = libc.mallinfo2().hblks
    t = torch.empty(16 * 2**20)
    return libc.mallinfo2().hblks - before
print(mmapped_during_alloc(), end=" ")
device.keep_freed_memory_in_heap()
print(mmapped_during_alloc())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_big_cpu_blocks_come_from_the_heap():
    out = subprocess.run([sys.executable, "-c", MMAP_PROBE], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == ["1", "0"]


def test_learning_rate_schedule():
    learning_rate = schedule(TrainConfig(lr=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=110,
                                         max_iters=200))
    assert learning_rate(0) < learning_rate(9) < 1e-3
    assert learning_rate(10) == pytest.approx(1e-3)
    assert learning_rate(60) == pytest.approx(5.5e-4)
    assert learning_rate(110) == learning_rate(150) == pytest.approx(1e-4)
    linear = schedule(TrainConfig(lr=1e-3, min_lr=0.0, warmup_iters=0, max_iters=100))
    linear.shape = "linear"
    assert (linear(0) == pytest.approx(1e-3) and linear(50) == pytest.approx(5e-4) and
            linear(100) == 0)


def test_train_samples_sets_the_steps_and_the_schedule_follows_them(char_data, tmp_path):
    """Megatron's --train-samples: 48 samples of 4 = 12 steps, and the cosine decay ends at step 12,
    not 1200."""
    ckpt = train(char_data, tmp_path, "--train-samples", "48", "--warmup-iters", "2",
                 "--lr", "1e-3", "--eval-interval", "100")
    assert ckpt["iter_num"] == 12 and ckpt["train_config"]["max_iters"] == 12
    lrs = [lr for _, lr in tensorboard_scalars(tmp_path / "tensorboard")["lr"]]
    assert len(lrs) == 12 and lrs[-1] == pytest.approx(schedule(TrainConfig(lr=1e-3, warmup_iters=2,
                                                                            max_iters=12))(11))
    assert lrs[-1] < 0.15e-3  # near min_lr (lr/10): the decay ran over the 12 steps trained


def test_config_file_and_flag_precedence(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"n_layer": 6, "lr": 0.01, "batch-size": 8}))
    cfg, _ = parse_config(["--config", str(config), "--lr", "0.002"])
    explicit = cfg.given
    assert (cfg.n_layer, cfg.lr, cfg.batch_size, cfg.n_head) == (6, 0.002, 8, TrainConfig().n_head)
    assert {"n_layer", "lr", "batch_size"} <= explicit and "n_head" not in explicit
    config.write_text(json.dumps({"max_iters": 3, "max-iters": 5}))  # one option twice
    with pytest.raises(CLIError, match="max-iters and max_iters are one option, given twice"):
        parse_config(["--config", str(config)])


def test_help_lists_flags_with_megatron_names_in_their_own_group():
    result = run_main("train.py", "--help")
    assert result.returncode == 0
    ours, megatron = result.stdout.split("Megatron-LM's names:")
    for flag in ("--eval-interval", "--eval-iters", "--init-from", "--grad-accum", "--dtype",
                 "--muon-lr"):
        assert f"  {flag} " in ours, flag
    for flag in ("--train-samples", "--global-batch-size", "--load", "--learning-rate",
                 "--num-layers", "--save", "--micro-batch-size", "--seq-length"):
        assert f"  {flag} " in megatron and f"  {flag} " not in ours, flag


# ----- bad input: one line, non-zero exit, nothing lost -----

def test_missing_data_dir(tmp_path):
    result = run_main("train.py", "--data-dir", tmp_path / "nope", "--out-dir", tmp_path / "run",
                      *TINY_MODEL)
    assert_one_line_error(result, "nope")
    assert not (tmp_path / "run").exists()  # the folder it made for the run (and its lock) went


@pytest.mark.parametrize("split", ["abc", "nan,1,1", "inf,1,1", "1,2,3,4", "0,0,0", "-1,2,0"])
def test_a_split_that_is_no_weights_is_refused_before_any_data_is_read(tmp_path, split):
    result = run_main("train.py", "--data-dir", tmp_path / "nope", "--out-dir", tmp_path / "run",
                      f"--split={split}")
    assert_one_line_error(result, "--split must be up to 3 comma-separated finite weights",
                          repr(split))
    assert not (tmp_path / "run").exists()


def test_block_size_longer_than_data(char_data, tmp_path):
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                        "--block-size", "10000000")
    assert_one_line_error(result, "block")


def test_resume_and_init_from_with_conflicting_shape(char_data, tmp_path):
    train(char_data, tmp_path, "--max-iters", "2", "--eval-interval", "100")
    before = (tmp_path / "ckpt.pt").read_bytes()
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                        "--init-from", "resume", "--n-layer", "3")
    assert_one_line_error(result, "n_layer")
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    # the same shape in other words: --n-kv-head as many as --n-head, QK-norm as trained
    train(char_data, tmp_path, "--init-from", "resume", "--max-iters", "3", "--n-kv-head", "2",
          "--qk-norm")
    # pretrained weights fix the shape too: a flag that differs is refused, one that agrees is not
    copy = tmp_path / "from_ckpt"
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", copy, *TINY_MODEL,
                      "--init-from", tmp_path / "ckpt.pt", "--n-layer", "3", "--max-iters", "4")
    assert_one_line_error(result, "has n_layer=1 but --n-layer 3 was given", "--init-from")
    assert not copy.exists()
    assert train(char_data, copy, "--init-from", tmp_path / "ckpt.pt", "--max-iters", "4",
                 "--no-bias")["model_config"]["n_layer"] == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_checkpoint(char_data, tmp_path, damage):
    train(char_data, tmp_path, "--max-iters", "2", "--eval-interval", "100")
    path = tmp_path / "ckpt.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else
                     b"\x00not a checkpoint" * 100)
    for result in (run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                            "--init-from", "resume"),
                   run_main("test.py", "--ckpt", path, "--device", "cpu")):
        assert_one_line_error(result, "ckpt.pt", "is truncated or corrupt" if damage == "truncated"
                              else "is not a checkpoint (no file that torch.save writes)")


class _Exploit:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('x')",))


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_pickle_that_is_not_a_checkpoint_never_runs(tmp_path, writer):
    path = tmp_path / "ckpt.pt"
    payload = {"model": _Exploit(), "model_config": {}}
    if writer == "pickle":
        path.write_bytes(pickle.dumps(payload))
    else:
        torch.save(payload, path)
    result = run_main("test.py", "--ckpt", path, "--device", "cpu", cwd=tmp_path)
    assert_one_line_error(result, "ckpt.pt")
    assert not (tmp_path / "PWNED").exists()


def test_float16_on_cpu_without_support(char_data, tmp_path):
    if torch.cpu._is_amx_fp16_supported():
        pytest.skip("this CPU computes float16 natively")
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL[:-6],
                        "--dtype", "float16", "--device", "cpu")
    assert_one_line_error(result, "float16")


def test_vocabulary_of_data_differs_from_checkpoint(char_data, tmp_path):
    train(char_data, tmp_path, "--max-iters", "2", "--eval-interval", "100")
    byte_data = tmp_path / "bytes"
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"{i}.txt").write_text(f"document {i}: a tiny byte-level corpus. " * 100)
    assert run_main("tokenizer.py", "--input", texts, "--tokenizer", "byte", "--output-dir",
                    byte_data, "--val-fraction", "0.5").returncode == 0
    result = run_main("train.py", "--data-dir", byte_data, "--out-dir", tmp_path, *TINY_MODEL,
                        "--init-from", "resume")
    assert_one_line_error(result, "tokenizer")


def test_nan_loss_stops_and_keeps_last_checkpoint(char_data, tmp_path):
    train(char_data, tmp_path, "--max-iters", "2", "--eval-interval", "100")
    before = (tmp_path / "ckpt.pt").read_bytes()
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                      "--init-from", "resume", "--max-iters", "50", "--lr", "1e30",
                      "--grad-clip", "0", "--warmup-iters", "0")
    assert_one_line_error(result, "loss is")
    assert (tmp_path / "ckpt.pt").read_bytes() == before


# ----- what a new user runs into -----

def test_preset_and_a_contradicting_shape_flag(char_data, tmp_path):
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path / "out",
                      "--preset", "gpt2", "--n-layer", "2", "--device", "cpu")
    assert_one_line_error(result, "--preset gpt2 has n-layer 12 but --n-layer 2 was given")
    assert not (tmp_path / "out").exists()


def test_a_new_run_never_replaces_another_runs_checkpoint_silently(char_data, tmp_path):
    train(char_data, tmp_path, "--max-iters", "2", "--eval-interval", "100")
    before = (tmp_path / "ckpt.pt").read_bytes()
    again = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                     "--max-iters", "2")
    assert_one_line_error(again, "holds the checkpoint of another run", "--init-from resume",
                          "--overwrite")
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    replaced = train(char_data, tmp_path, "--max-iters", "3", "--overwrite",
                     "--eval-interval", "100")
    assert replaced["iter_num"] == 3


def test_each_run_logs_to_its_own_tensorboard_folder(char_data, tmp_path):
    train(char_data, tmp_path, "--max-iters", "2", "--eval-interval", "100", "--run-name", "first")
    train(char_data, tmp_path, "--max-iters", "4", "--eval-interval", "100",
          "--init-from", "resume")
    # a resume continues its run
    assert [p.name for p in (tmp_path / "tensorboard").iterdir()] == ["first"]
    steps = [step for step, _ in tensorboard_scalars(tmp_path / "tensorboard")["loss/train"]]
    assert steps == [1, 2, 3, 4]
    train(char_data, tmp_path, "--max-iters", "2", "--eval-interval", "100", "--overwrite")
    runs = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    # a new run: a folder of its start time
    assert len(runs) == 2 and runs[1] == "first" and runs[0][:8].isdigit()


def test_a_validation_split_too_short_names_the_split_and_the_fix(tmp_path):
    write_nanogpt(str(tmp_path / "data"), np.zeros(5000, np.uint16), np.zeros(20, np.uint16),
                  {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256})
    result = run_main("train.py", "--data-dir", tmp_path / "data", "--out-dir", tmp_path / "out",
                      *TINY_MODEL)
    assert_one_line_error(result, "the val split", "has 20 tokens", "--block-size",
                          "--val-fraction")


def test_init_from_hf_with_a_longer_block_size_fails_at_start_and_without_it_fits(tmp_path):
    save_gpt2(GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)),
              str(tmp_path / "hf"))
    write_nanogpt(str(tmp_path / "data"), np.zeros(5000, np.uint16), np.zeros(500, np.uint16),
                  {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256,
                   "encoding": "r50k_base"})
    result = run_main("train.py", "--data-dir", tmp_path / "data", "--out-dir", tmp_path / "out",
                        "--init-from", tmp_path / "hf", "--block-size", "32", "--device", "cpu")
    assert_one_line_error(result, "--block-size 32 is longer than the 16 positions")
    assert "iter 1:" not in result.stdout
    # without the flag, the default (64) gives way to the weights' 16 positions
    result = run_main("train.py", "--data-dir", tmp_path / "data", "--out-dir", tmp_path / "out",
                      "--init-from", tmp_path / "hf", "--device", "cpu", "--max-iters", "2",
                      "--eval-iters", "1", "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    saved = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert saved["model_config"]["block_size"] == saved["train_config"]["block_size"] == 16


def test_a_small_validation_split_is_scored_whole(tmp_path):
    """Fewer non-overlapping windows than eval_iters batches would draw: every window is scored,
    exactly."""
    assert evaluation_windows(100, 32, 8, seed=0, stream=2).tolist() == [0, 32, 64]
    assert len(evaluation_windows(10_000, 32, 8, seed=0, stream=2)) == 8
    ids = np.random.default_rng(0).integers(0, 257, 6000).astype(np.uint16)
    write_nanogpt(str(tmp_path / "data"), ids[:5900], ids[5900:],
                  {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256})
    ckpt = train(tmp_path / "data", tmp_path / "out", "--max-iters", "3", "--eval-interval", "3")
    model = model_from_checkpoint(ckpt).eval()
    val = load_corpus(str(tmp_path / "data")).val
    x = torch.tensor(np.stack([val[o:o + 32] for o in (0, 32, 64)]).astype(np.int64))
    y = torch.tensor(np.stack([val[o + 1:o + 33] for o in (0, 32, 64)]).astype(np.int64))
    with torch.no_grad():
        assert ckpt["history"]["val"][-1] == pytest.approx(model(x, y)[1].item(), rel=1e-5)


def test_activation_checkpointing_keeps_block_inputs_only_and_trains_the_same_weights(char_data,
                                                                                      tmp_path):
    """--activation-checkpointing: a forward keeps under half the bytes for the backward (each
    block's input, not its activations), and 4 steps end at the same weights in float32."""
    saved, weights = {}, {}
    for on in (False, True):
        out = tmp_path / str(on)
        cfg, _ = parse_config(["--data-dir", str(char_data), "--out-dir", str(out), *TINY_MODEL,
                               "--n-layer", "2", "--max-iters", "4",
                               *(["--activation-checkpointing"] if on else [])])
        trainer = setup(cfg, TorchEngine(str(out / "ckpt.pt")))
        idx = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(0))
        saved[on] = 0

        def keep(t: torch.Tensor, on=on) -> torch.Tensor:
            saved[on] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            trainer.engine.model(idx, idx, chunked_loss=True)[1].backward()
        trainer.engine.optimizer.zero_grad(set_to_none=True)
        trainer.fit()
        weights[on] = load_checkpoint(str(out / "ckpt.pt"))["model"]
    assert saved[True] < saved[False] / 2, saved
    assert all(torch.equal(weights[True][k], weights[False][k]) for k in weights[False])
