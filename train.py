"""Train a GPT on one device: the CPU, one CUDA GPU or Apple MPS.

With no arguments it prepares the embedded default corpus (Python's own documentation, character level) and
trains a small model on it in about a minute on a laptop CPU; then `python test.py` samples from ckpt/ckpt.pt.
Every option is listed by --help; README.md has recipes. The loop is toolkit/training.py, the setup (options,
resume, data, model) toolkit/pretraining.py, the network model.py.
"""
from toolkit import cli
from toolkit.pretraining import TorchBackend, parse_config, train


def main(argv: list[str] | None = None) -> None:
    cfg, given, _ = parse_config(argv, description=__doc__)
    train(cfg, given, TorchBackend(cfg.out_dir))


if __name__ == "__main__":
    cli.run(main)
