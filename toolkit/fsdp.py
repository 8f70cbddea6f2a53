"""Sharded data parallel with PyTorch's FSDP2 (`torchrun ... train_ddp.py --fsdp`): every
transformer block, then the whole model, `fully_shard`ed over the processes, so each rank holds a
world-size-th of the parameters, of their gradients and of the optimizer's state (DDP holds all of
each), and gathers a block's parameters only while it computes. Its checkpoints are sharded
(toolkit/fsdp_checkpoint.py); a ckpt.pt of train.py or DDP is read whole and cut into shards.

    shard_model(model, blocks, dtype)                    # before the optimizer is built
    optimizer.load_state_dict(shard_optimizer_state(optimizer, saved["optimizer"]))
"""
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def shard_model(model: nn.Module, blocks: nn.ModuleList, dtype: torch.dtype) -> None:
    """fully_shard each block, then the rest (embeddings, final norm, head) as the root, in place.
    Under bfloat16 or float16 the gathered parameters are in that dtype and the gradients are
    reduced in float32 (torchtitan's policy); float32 keeps float32 throughout."""
    precision = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                 if dtype != torch.float32 else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, mp_policy=precision)
    fully_shard(model, mp_policy=precision)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """A whole optimizer state (a ckpt.pt's, of any number of processes) cut to this rank's shards:
    each state tensor shaped as its parameter is laid out as that parameter is (no communication:
    every rank read the whole state)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in saved["state"].items():
        p = params[int(index)]
        state[index] = {key: (distribute_tensor(value.to(p.device), p.device_mesh, p.placements,
                                                src_data_rank=None)
                              if isinstance(p, DTensor) and value.shape == p.shape else value)
                        for key, value in values.items()}
    return {**saved, "state": state}
