"""toolkit/train_config.py: the flags settled once into a frozen configuration, and the defaults
that depend on the device (a CUDA GPU's quick start trains a model that uses it; no GPU here: the
rule takes the device)."""
import dataclasses

import pytest
import torch

from toolkit.pretraining import settle
from toolkit.train_config import CUDA_DEFAULTS, TrainConfig, device_defaults, parse_config
from toolkit.training import TorchEngine


def test_a_cuda_gpu_takes_its_defaults_where_no_flag_was_given(capsys):
    cfg, _ = parse_config(["--batch-size", "16", "--no-compile"])
    on_gpu = device_defaults(cfg, torch.device("cuda", 0))
    assert (on_gpu.n_layer, on_gpu.n_embd, on_gpu.block_size,
            on_gpu.max_iters) == (6, 384, 256, 2000)
    assert on_gpu.batch_size == 16 and on_gpu.compile is False  # the flags given stand
    header = capsys.readouterr().out
    assert ("defaults for a CUDA GPU" in header and "--n-embd 384" in header
            and "--batch-size" not in header)
    # a CPU keeps the measured CPU recipe
    assert device_defaults(cfg, torch.device("cpu")) is cfg
    assert set(CUDA_DEFAULTS) <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_a_preset_keeps_its_shape_on_a_gpu():
    cfg, _ = parse_config(["--preset", "gpt2"])
    on_gpu = device_defaults(cfg, torch.device("cuda", 0))
    assert (on_gpu.n_layer, on_gpu.n_head, on_gpu.n_embd) == (
        TrainConfig.n_layer, TrainConfig.n_head, TrainConfig.n_embd)  # left for --preset
    assert on_gpu.block_size == 256 and on_gpu.compile


def test_the_settled_configuration_is_frozen_and_complete():
    cfg, _ = parse_config(["--n-layer", "2", "--global-batch-size", "64",
                           "--batch-size", "16", "--train-samples", "640"])
    settled, resume, _ = settle(cfg, TorchEngine("no-such-run/ckpt.pt"))
    assert resume is None
    assert (settled.grad_accum, settled.max_iters, settled.optimizer,
            settled.lr) == (4, 10, "muon", 4e-3)
    assert settled.run_name and settled.device == "auto" and not settled.compile  # a CPU here
    with pytest.raises(dataclasses.FrozenInstanceError):
        settled.lr = 1.0
