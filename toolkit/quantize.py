"""Weight-only int8 for inference (`--quantize int8` of test.py, test_ds.py and eval.py): every
linear layer's weight becomes int8 with one float scale per output row (symmetric, absmax / 127,
as gpt-fast's and llama.cpp's q8 per-row scales), and its products run in PyTorch's own int8
matrix kernel, `torch._weight_int8pack_mm`, on bfloat16 activations. A decode step reads a quarter
of float32's bytes; docs/performance.md has the speed and the change in val loss.

    add_quantize_argument(parser); ...; check_quantize(args.quantize, device)
    model = quantize_model(model, args.quantize)   # in place; the model now only infers
"""
import argparse

import torch
from torch import nn

from toolkit.cli import CLIError

QUANTIZE_CHOICES = ("int8",)


class Int8Linear(nn.Module):
    """A linear layer whose weight is held as int8 rows and their float scales."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("int8_weight", (weight / scale[:, None]).round().to(torch.int8))
        # the kernel takes its scales in the activations' dtype
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        """The float weight the int8 one stands for, for code that reads a layer's weight rather
        than calling it (model.py's logits for a loss)."""
        return self.int8_weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if torch.compiler.is_compiling() and rows.size(0) == 1:
            # one row, compiled (--compile): inductor fuses the widening into a float32 reduction
            # that reads 12.6 GB/s of int8 where the int8 kernel reads 9.8 (2 threads)
            y = (self.int8_weight.float() * rows.float()).sum(-1)[None] * self.scales.float()
        else:
            y = torch._weight_int8pack_mm(rows, self.int8_weight, self.scales.to(torch.bfloat16))
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def add_quantize_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                        help="weight-only int8 on a CPU: a quarter of float32's weight bytes, one "
                             "sequence decodes about twice as fast (default: the weights as "
                             "stored)")


def check_quantize(quantize: str | None, device: torch.device) -> None:
    """--quantize runs on a CPU only: PyTorch's int8 matrix kernel is a CPU one."""
    if quantize and device.type != "cpu":
        raise CLIError(f"--quantize {quantize} runs on a CPU (PyTorch's int8 matrix kernel is a "
                       f"CPU one): on {device.type} use --dtype bfloat16, or add --device cpu")


def quantize_model(model: nn.Module, quantize: str | None) -> nn.Module:
    """model with every nn.Linear replaced by its int8 form (quantize "int8"), or as it is (None).
    In place; embeddings stay float."""
    if quantize is None:
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model.eval()
