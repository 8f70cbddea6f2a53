"""The optimizers: AdamW (with weight decay on matrices only), and Muon for the transformer's
matrices with AdamW for everything else, in one torch optimizer.

    optimizer = make_optimizer(model, "muon", lr=4e-3, muon_lr=0.03, weight_decay=0.1,
                               betas=(0.9, 0.99))

Muon (Keller Jordan, 2024; kellerjordan.github.io/posts/muon) replaces each 2-D weight's update by
the orthogonalised Nesterov momentum: a few Newton-Schulz iterations push the singular values of the
momentum towards 1, so every direction of the matrix learns at a similar rate. It is meant for the
hidden matrices; embeddings, the LM head, biases and norm gains keep AdamW (an untied input
embedding at a 30x larger rate, as nanochat's and modded-nanogpt's embeddings). It is the
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

# Muon's AdamW lr times this for an untied input embedding (measured: docs/performance.md)
EMBEDDING_LR_SCALE = 30
# the Muon write-up's quintic Newton-Schulz coefficients: singular values converge fast near 1
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int = 5,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately U V^T of update's SVD U S V^T (of each matrix of a stack), by Newton-Schulz
    iterations in dtype (the write-up runs them in bfloat16: the iteration only pushes singular
    values towards 1, so rounding errors do not accumulate)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on groups with muon=True, AdamW on the other groups. The element-wise work of a step is
    a few foreach kernels over all of a group's tensors, not a loop of small kernels per tensor."""

    def __init__(self, param_groups: list[dict], lr: float,
                 betas: tuple[float, float] = (0.9, 0.99), momentum: float = 0.95,
                 eps: float = 1e-8, ns_dtype: torch.dtype = torch.float32):
        defaults = dict(lr=lr, betas=betas, momentum=momentum, eps=eps, weight_decay=0.0,
                        muon=False)
        super().__init__(param_groups, defaults)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self.muon_step if group["muon"] else self.adamw_step)(params, group)

    def muon_step(self, params: list[torch.Tensor], group: dict) -> None:
        by_shape = {}
        for p in params:
            by_shape.setdefault(p.shape, []).append(p)
        for shape, same in by_shape.items():
            buffers = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                       for p in same]
            grads = [p.grad for p in same]
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, grads)
            nesterov = torch._foreach_add(grads, buffers, alpha=group["momentum"])
            # one batched Newton-Schulz: a GPU runs a small model's step launch-bound
            if same[0].is_cuda:
                updates = orthogonalize(torch.stack(nesterov), dtype=self.ns_dtype).unbind(0)
            else:  # a CPU's batched products of large matrices measured slower than a loop of them
                updates = [orthogonalize(u, dtype=self.ns_dtype) for u in nesterov]
            torch._foreach_mul_(same, 1 - group["lr"] * group["weight_decay"])
            rms_scale = max(1, shape[0] / shape[1]) ** 0.5  # the same RMS for any shape
            torch._foreach_add_(same, updates, alpha=-group["lr"] * rms_scale)

    def adamw_step(self, params: list[torch.Tensor], group: dict) -> None:
        """torch.optim.AdamW's update (decoupled weight decay, bias correction), in foreach ops."""
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
        steps = [state["step"].item() for state in states]  # CPU tensors: no device sync
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        grads = [p.grad for p in params]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        denominators = torch._foreach_div(exp_avg_sqs, [1 - beta2**step for step in steps])
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_addcdiv_(params, exp_avgs, denominators,
                                [-group["lr"] / (1 - beta1**step) for step in steps])


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups of the trainable parameters: decay on matrices and embeddings (dim >= 2),
    none on biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float,
                   betas: tuple[float, float], muon_lr: float | None = None,
                   device_type: str = "cpu",
                   dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """adamw: torch's AdamW over decay_groups (fused on CUDA). muon: Muon at muon_lr without weight
    decay (its updates have a fixed size) for the 2-D weights of the transformer blocks (of the GPT
    or its .body), AdamW at lr for the rest, an untied input embedding at EMBEDDING_LR_SCALE x lr;
    each group's lr_scale (muon_lr / lr for Muon's) moves it along the schedule. Newton-Schulz
    runs in bfloat16 when the run computes in it (dtype), else float32."""
    if name == "adamw":
        impl = dict(fused=True) if device_type == "cuda" else dict(foreach=True)
        return torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr, betas=betas, **impl)
    gpt = getattr(model, "body", model)
    matrices = [p for p in gpt.transformer.h.parameters() if p.requires_grad and p.dim() == 2]
    embedding = gpt.transformer.wte.weight
    untied = [embedding] if not gpt.config.tie_embeddings and embedding.requires_grad else []
    chosen = set(matrices) | set(untied)
    rest = [g | {"params": [p for p in g["params"] if p not in chosen]}
            for g in decay_groups(model, weight_decay)]
    muon = {"params": matrices, "muon": True, "weight_decay": 0.0, "lr": muon_lr,
            "lr_scale": muon_lr / lr}
    # an untied input embedding takes far larger steps than the head that reads the same tokens (as
    # nanochat and modded-nanogpt): each of its rows learns only where its token occurs
    fast = [{"params": untied, "weight_decay": weight_decay, "lr": lr * EMBEDDING_LR_SCALE,
             "lr_scale": EMBEDDING_LR_SCALE}] if untied else []
    ns_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    return Muon([muon, *rest, *fast], lr=lr, betas=betas, ns_dtype=ns_dtype)


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
        fall = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.shape == "cosine" else \
            1.0 - progress
        return self.min_lr + fall * (self.lr - self.min_lr)
