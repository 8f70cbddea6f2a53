"""Train a GPT on one device: the CPU, one CUDA GPU or Apple MPS.

With no arguments it prepares the embedded default corpus (Python's own documentation, character
level) and trains a small model on it in a few minutes on a laptop CPU, then `python test.py`
samples from ckpt/ckpt.pt. Every option is listed by --help; see README.md for recipes.
"""
import cli
from training import TorchEngine, Trainer, parse_config


def main() -> None:
    cfg, explicit, _ = parse_config(description=__doc__)
    Trainer(cfg, explicit, TorchEngine(cfg.out_dir)).fit()


if __name__ == "__main__":
    cli.run(main)
