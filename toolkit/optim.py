"""The optimizers: AdamW (with weight decay on matrices only), and Muon for the transformer's
matrices with AdamW for everything else, in one torch optimizer.

    optimizer = make_optimizer(model, "muon", lr=4e-3, muon_lr=0.05, weight_decay=0.1, betas=(0.9, 0.99))

Muon (Keller Jordan, 2024; kellerjordan.github.io/posts/muon) replaces each 2-D weight's update by
the orthogonalised Nesterov momentum: a few Newton-Schulz iterations push the singular values of the
momentum towards 1, so every direction of the matrix learns at a similar rate. It is meant for the
hidden matrices; embeddings, the tied LM head, biases and LayerNorm gains keep AdamW. It is the
default for training from scratch because it reaches a given loss in far fewer steps
(docs/performance.md).

Param groups with muon=True get the Muon update, the others AdamW's (decoupled weight decay, bias
correction, as torch.optim.AdamW). Each group has its own lr (Muon's are ~10x AdamW's); the trainer
moves both along one schedule.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

# the Muon write-up's quintic Newton-Schulz coefficients: singular values converge fast near 1
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately U V^T of update's SVD U S V^T, by Newton-Schulz iterations in dtype (the
    write-up runs them in bfloat16: the iteration only pushes singular values towards 1, so rounding
    errors do not accumulate)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on groups with muon=True, AdamW on the other groups."""

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.99),
                 momentum: float = 0.95, eps: float = 1e-8, ns_dtype: torch.dtype = torch.float32):
        defaults = dict(lr=lr, betas=betas, momentum=momentum, eps=eps, weight_decay=0.0, muon=False)
        super().__init__(param_groups, defaults)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self.muon_step if group["muon"] else self.adamw_step)(p, group)

    def muon_step(self, p: torch.Tensor, group: dict) -> None:
        buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        buffer.mul_(group["momentum"]).add_(p.grad)
        update = orthogonalize(p.grad.add(buffer, alpha=group["momentum"]), dtype=self.ns_dtype)  # Nesterov
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)  # the same RMS for any shape

    def adamw_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        denominator = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1 ** step))


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups of the trainable parameters: decay on matrices and embeddings (dim >= 2),
    none on biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, betas: tuple[float, float],
                   muon_lr: float | None = None, device_type: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """adamw: torch's AdamW over decay_groups (fused on CUDA). muon: Muon at muon_lr without weight
    decay (its updates have a fixed size) for the 2-D weights of the transformer blocks (of the GPT
    or its .body), AdamW at lr for the rest; lr_scale (muon_lr / lr) moves the Muon group along the
    schedule. Newton-Schulz runs in bfloat16 when the run computes in it (dtype), else float32."""
    if name == "adamw":
        impl = dict(fused=True) if device_type == "cuda" else dict(foreach=True)
        return torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr, betas=betas, **impl)
    blocks = getattr(model, "body", model).transformer.h
    matrices = [p for p in blocks.parameters() if p.requires_grad and p.dim() == 2]
    chosen = set(matrices)
    rest = [g | {"params": [p for p in g["params"] if p not in chosen]}
            for g in decay_groups(model, weight_decay)]
    muon = {"params": matrices, "muon": True, "weight_decay": 0.0, "lr": muon_lr, "lr_scale": muon_lr / lr}
    ns_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return Muon([muon, *rest], lr=lr, betas=betas, ns_dtype=ns_dtype)


@dataclass
class Schedule:
    """Linear warmup to step warmup_iters, cosine (or linear) decay to min_lr at step decay_iters,
    then flat: nanoGPT's schedule; with shape linear and min_lr 0, GPT-1's fine-tuning one."""
    lr: float
    warmup_iters: int
    decay_iters: int
    min_lr: float
    shape: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup_iters:
            return self.lr * (step + 1) / (self.warmup_iters + 1)
        if step >= self.decay_iters:
            return self.min_lr
        progress = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        fall = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.shape == "cosine" else 1.0 - progress
        return self.min_lr + fall * (self.lr - self.min_lr)
