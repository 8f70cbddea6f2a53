"""Train a GPT on one device: the CPU, one CUDA GPU or Apple MPS.

With no arguments it prepares the embedded default corpus (Python's own documentation, character
level) and trains a small model on it in about a minute on a laptop CPU; then `python test.py`
samples from ckpt/ckpt.pt (on a CUDA GPU, a larger model: the run header names the defaults it
takes). Every option is listed by --help; README.md has recipes. The options and their settling are
toolkit/train_config.py, the setup (data, model, objective) toolkit/pretraining.py, the loop and
its step toolkit/training.py, the network and its loss model.py.
"""
import os

from toolkit import cli, distributed
from toolkit.checkpoint import CHECKPOINT_FILE
from toolkit.emissions import tracking_emissions
from toolkit.pretraining import setup
from toolkit.train_config import parse_config
from toolkit.training import TorchEngine


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config(argv, description=__doc__)
    trainer = setup(cfg, TorchEngine(os.path.join(cfg.out_dir, CHECKPOINT_FILE)))
    with tracking_emissions(trainer.cfg, master=distributed.rank() == 0):
        trainer.fit()


if __name__ == "__main__":
    cli.run(main)
