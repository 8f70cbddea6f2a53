"""Batches: random windows of a token stream for pretraining, epochs of examples for fine-tuning
(and the examples held out of a training file to validate on, when there is no validation file).

    offsets = window_offsets(len(corpus.train), block_size, batch_size, seed, step=iter_num)
    x, y = get_batch(corpus.train, offsets, block_size, device)

Windows are drawn from (seed, step, stream) alone, so every run and every DDP rank sees the same
global draw; each rank takes its own slice of it. An epoch's order of examples likewise comes from
(seed, epoch) alone.
"""
from collections.abc import Callable

import numpy as np
import torch

from toolkit import distributed
from toolkit.cli import CLIError


def window_offsets(n_tokens: int, block_size: int, count: int, seed: int, step: int,
                   stream: int = 0) -> np.ndarray:
    """Start offsets of count random windows of block_size+1 tokens; the same for a given (seed,
    step, stream) everywhere."""
    if n_tokens < block_size + 1:
        raise CLIError(f"data has {n_tokens} tokens, shorter than one window of block_size+1 = "
                       f"{block_size + 1} tokens; use a smaller --block-size")
    rng = np.random.Generator(np.random.PCG64([seed, step, stream]))
    return rng.integers(0, n_tokens - block_size, size=count, dtype=np.int64)


def get_batch(tokens: np.ndarray, offsets: np.ndarray, block_size: int,
              device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x = tokens[o:o+T] and targets y = tokens[o+1:o+T+1] per offset, int64 tensors of shape
    (B, T) on device."""
    # one gather of every window (B, T+1) from the memmap, far cheaper than nanoGPT's per-row
    # torch.stack; x and y are two views of it
    rows = np.asarray(offsets)[:, None] + np.arange(block_size + 1)
    windows = torch.from_numpy(tokens[rows].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if torch.device(device).type == "cuda":  # pinned memory lets the copy overlap with compute
        x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.to(device), y.to(device)


def epoch_batches(n: int, global_batch: int, micro_batches: int, seed: int,
                  epoch: int) -> list[np.ndarray]:
    """Fine-tuning's global batches of an epoch of n examples, in an order drawn from (seed, epoch)
    alone, so every rank and every run sees the same; a last batch with fewer examples than
    micro-batches is left out."""
    order = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)
    batches = [order[i : i + global_batch] for i in range(0, n, global_batch)]
    return batches if len(batches[-1]) >= micro_batches else batches[:-1]


def step_batches(step: int, n: int, cfg,
                 steps_per_epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the example indices of a step's global batch, this rank's micro-batches of it); cfg gives
    batch_size, grad_accum and seed."""
    epoch, index = divmod(step, steps_per_epoch)
    batch = epoch_batches(n, cfg.batch_size * cfg.grad_accum, cfg.grad_accum, cfg.seed,
                          epoch)[index]
    micro_steps = cfg.grad_accum // distributed.world_size()
    mine = np.array_split(batch, cfg.grad_accum)[distributed.rank() * micro_steps:]
    return batch, mine[:micro_steps]


def rank_share(n: int) -> np.ndarray:
    """The indices of this process's contiguous share of n items."""
    return np.array_split(np.arange(n), distributed.world_size())[distributed.rank()]


def train_and_val(cfg, read: Callable[[str], list]) -> tuple[list, list]:
    """The training and validation examples of a fine-tuning: read from cfg.train and cfg.val, or
    without cfg.val a held_out share of cfg.train."""
    train = read(cfg.train)
    if cfg.val:
        return train, read(cfg.val)
    is_val = held_out(cfg, len(train))
    return [x for x, v in zip(train, is_val) if not v], [x for x, v in zip(train, is_val) if v]


def held_out(cfg, n: int) -> np.ndarray:
    """Which of cfg.train's n examples are held out for validation: a cfg.val_fraction share drawn
    from cfg.seed alone (the same on every rank and on resume), as HF's
    validation_split_percentage does."""
    held = max(1, round(n * cfg.val_fraction))
    if held >= n:
        raise CLIError(f"{cfg.train} has {n} examples, too few to hold "
                       f"{cfg.val_fraction:.0%} out for validation; give --val")
    if distributed.rank() == 0:
        print(f"validation: {held} of the {n} examples of {cfg.train} held out "
              f"(--val-fraction {cfg.val_fraction}; or give --val)")
    rng = np.random.Generator(np.random.PCG64([cfg.seed, n]))
    is_val = np.zeros(n, bool)
    is_val[rng.permutation(n)[:held]] = True
    return is_val
