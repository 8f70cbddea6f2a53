"""Weight-only int8 and int4 for inference (`--quantize int8|int4` of test.py, test_ds.py and
eval.py). int8: every linear layer's weight becomes int8 with one float scale per output row
(symmetric, absmax / 127, as gpt-fast's and llama.cpp's q8 per-row scales), its products in
PyTorch's own int8 matrix kernel, `torch._weight_int8pack_mm`. int4: 4-bit codes with a scale and
a zero point per group of INT4_GROUP inputs of a row (asymmetric, gpt-fast's int4 layout: weight =
(code - 8) x scale + zero), its products in PyTorch's own `_weight_int4pack_mm_for_cpu`; a layer
whose inputs are not a multiple of the group stays int8. Both on bfloat16 activations. A decode
step reads a quarter (an eighth) of float32's bytes; docs/performance.md has the speed and the
change in val loss.

    add_quantize_argument(parser); ...; check_quantize(args.quantize, device)
    model = quantize_model(model, args.quantize)   # in place; the model now only infers
"""
import argparse

import torch
from torch import nn

from toolkit.cli import CLIError

QUANTIZE_CHOICES = ("int8", "int4")
INT4_GROUP = 32  # inputs sharing a scale and zero point (llama.cpp's q4 blocks are 32 too)
INT4_ROWS = 16  # the int4 kernel packs rows by 16: a layer's rows are padded up to a multiple


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


class Int4Linear(nn.Module):
    """A linear layer whose weight is held as packed 4-bit codes, with a bfloat16 scale and zero
    point for each group of INT4_GROUP inputs of a row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        rows = -(-self.out_features // INT4_ROWS) * INT4_ROWS
        weight = torch.zeros(rows, self.in_features)
        weight[:self.out_features] = linear.weight.detach().float()
        groups = weight.reshape(rows, -1, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low).clamp(min=torch.finfo(torch.float32).tiny) / 15
        codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(rows, -1)
        zero = low + 8 * scale  # the value of code 8, the kernel's middle
        self.register_buffer("int4_weight",
                             torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # (groups, rows, 2) in the activations' dtype, as the kernel takes them
        self.register_buffer("scales_and_zeros", torch.cat([scale, zero], -1).transpose(0, 1)
                             .contiguous().to(torch.bfloat16))
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The float weight the codes stand for (model.py's logits for a loss read it)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self.product(eye).float().T.contiguous()

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.int4_weight, INT4_GROUP,
                                                       self.scales_and_zeros)
        return y[:, :self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features).to(torch.bfloat16))
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def add_quantize_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                        help="weight-only int8 or int4 on a CPU: a quarter (an eighth) of "
                             "float32's weight bytes, one sequence decodes about two (three) times "
                             "as fast (default: the weights as stored)")


def check_quantize(quantize: str | None, device: torch.device) -> None:
    """--quantize runs on a CPU only: PyTorch's int8 and int4 matrix kernels used are CPU ones."""
    if quantize and device.type != "cpu":
        raise CLIError(f"--quantize {quantize} runs on a CPU (PyTorch's {quantize} matrix kernel "
                       f"is a CPU one): on {device.type} use --dtype bfloat16, or add --device cpu")


def quantize_model(model: nn.Module, quantize: str | None) -> nn.Module:
    """model with every nn.Linear replaced by its int8 or int4 form (quantize "int8", "int4"), or as
    it is (None). In place; embeddings stay float."""
    if quantize is None:
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                int4 = quantize == "int4" and child.in_features % INT4_GROUP == 0
                setattr(module, name, Int4Linear(child) if int4 else Int8Linear(child))
    return model.eval()
