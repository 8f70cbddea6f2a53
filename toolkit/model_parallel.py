"""How the GPT is laid out over processes through DeepSpeed: pipeline stages
(deepspeed.pipe.PipelineModule), tensor-parallel shards (AutoTP), the names each layout gives the
weights, and what a layout costs in memory.

Pipeline: the layers are the token embedding (for GPT-2 a TiedLayerSpec "wte", whose weight is
also the LM head), the position embedding (GPT-2's learned one; the llama family's blocks rotate by
position themselves) with the embedding dropout, the blocks, the final norm and the head (the tied
embedding, or the llama family's own lm_head). They are cut from a GPT that every rank builds with
the same seed (so any layout starts from train.py's weights); each stage keeps its own layers and
the blocks are balanced over the stages (embeddings on the first, the head on the last). The loss is
model.chunked_cross_entropy on the head's input and weight, as GPT.forward's training path.

Tensor parallel: AutoTP splits c_attn (q, k and v each by heads) and c_fc (the llama family's gate
and up halves each) by output columns, both c_proj by input rows (an all-reduce after them);
embeddings, norms and the head stay whole. CausalSelfAttention takes its head count from the width
it receives, so a shard runs n_head / T heads.
"""
import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from model import GPT, GPTConfig, chunked_cross_entropy, rotary
from toolkit.device import flops_per_token, num_params

# AutoTP's partition rules for model.py's names: (parameter pattern, column or row, sub-parameters)
TP_RULES = [
    (r".*\.attn\.c_attn\.weight$", "column", 3),  # [q; k; v]: each split by heads
    (r".*\.attn\.c_proj\.weight$", "row", 1),
    (r".*\.mlp\.c_fc\.weight$", "column", 1),  # the llama family's [gate; up]: 2 (tp_rules)
    (r".*\.mlp\.c_proj\.weight$", "row", 1),
]


def tp_rules(config: GPTConfig) -> list[tuple[str, str, int]]:
    """TP_RULES for this family: the gated MLP's c_fc is two matrices, each split by columns."""
    return [(p, kind, 2 if config.arch != "gpt2" and ".c_fc" in p else parts)
            for p, kind, parts in TP_RULES]


@dataclass
class Layout:
    """Processes = tensor-parallel shards x pipeline stages x data-parallel replicas."""
    world_size: int
    pipeline_stages: int = 1
    tp_size: int = 1

    def __post_init__(self):
        if self.pipeline_stages < 1 or self.tp_size < 1:
            raise ValueError("--pipeline-stages and --tp-size must be at least 1")
        if self.world_size % self.model_parallel:
            raise ValueError(f"{self.world_size} processes cannot hold {self.tp_size} "
                             f"tensor-parallel shards x {self.pipeline_stages} pipeline stages; "
                             f"use a world size that is a multiple of {self.model_parallel}")

    @property
    def model_parallel(self) -> int:
        return self.pipeline_stages * self.tp_size

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.model_parallel

    def data_parallel_rank(self, rank: int) -> int:
        """DeepSpeed's rank order: a pipeline's ranks are dp apart (PipeDataParallelTopology, axes
        pipe, data); AutoTP's shards are consecutive ranks (its (dp, tp) device mesh)."""
        return rank % self.data_parallel if self.pipeline_stages > 1 else rank // self.tp_size

    def describe(self) -> str:
        parts = [f"{self.tp_size} tensor-parallel"] * (self.tp_size > 1) + \
                [f"{self.pipeline_stages} pipeline stages"] * (self.pipeline_stages > 1)
        return " x ".join(parts + [f"{self.data_parallel} data-parallel"])


def check_layout(layout: Layout, config: GPTConfig, zero_stage: int, training: bool = True) -> None:
    """ValueError for a layout this model or DeepSpeed cannot run (Layout checks the world size);
    training=False for a memory estimate, which also allows pipeline with tensor parallel."""
    if training and layout.pipeline_stages > 1 and layout.tp_size > 1:
        raise ValueError("--pipeline-stages and --tp-size together are not supported: DeepSpeed's "
                         "pipeline engine does not compose with AutoTP; use one of them "
                         "(--estimate-memory takes both)")
    if layout.pipeline_stages > 1 and zero_stage > 1:
        raise ValueError("DeepSpeed's pipeline engine supports ZeRO stage 0 or 1, not "
                         f"{zero_stage}; use a config with stage 1 (e.g. ds_config_zero1.json)")
    if layout.pipeline_stages > config.n_layer:
        raise ValueError(f"--pipeline-stages {layout.pipeline_stages} is more than the model's "
                         f"{config.n_layer} blocks; each stage needs at least one")
    if layout.tp_size > 1 and config.qk_norm:
        raise ValueError("--tp-size with QK-norm: each shard would train the norms' weights on "
                         "its own heads alone; add --no-qk-norm (Llama's layout) or lay the model "
                         "out in --pipeline-stages")
    if layout.tp_size > 1 and config.kv_heads != config.n_head:
        raise ValueError(f"--tp-size splits q, k and v as equal thirds: --n-kv-head "
                         f"{config.kv_heads} below --n-head {config.n_head} (grouped-query "
                         "attention) trains with ZeRO or a pipeline")
    if config.n_head % layout.tp_size or config.n_embd % layout.tp_size:
        raise ValueError(f"--tp-size {layout.tp_size} must divide the {config.n_head} heads and "
                         f"the width {config.n_embd}")


# ----- tensor parallel (AutoTP) -----

def autotp_config(tp_size: int, config: GPTConfig) -> dict:
    """The "tensor_parallel" section of a DeepSpeed config that shards this model tp_size ways."""
    specs = [{"patterns": [pattern], "partition_type": kind,
              **({"shape": [parts, -1], "partition_dim": 0} if parts > 1 else {})}
             for pattern, kind, parts in tp_rules(config)]
    return {"autotp_size": tp_size, "vocab_parallel_lm_head": False,
            "partition_config": {"use_default_specs": False, "layer_specs": specs}}


# ----- pipeline (deepspeed.pipe) -----

class TokenEmbedding(nn.Module):
    """The token embedding; GPT-2's is tied: input embedding on the first stage, LM head weight on
    the last."""

    def __init__(self, model: GPT):
        super().__init__()
        self.wte = model.transformer.wte

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)


class PositionEmbedding(nn.Module):
    """GPT-2's learned positions (the llama family has none) and the embedding dropout."""

    def __init__(self, model: GPT):
        super().__init__()
        self.drop = model.transformer.drop
        if "wpe" in model.transformer:
            self.wpe = model.transformer.wpe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wpe"):
            x = x + self.wpe(torch.arange(x.size(1), device=x.device))
        return self.drop(x)


class BlockPipe(nn.Module):
    """A block; the llama family's turns queries and keys by their positions (GPT._trunk)."""

    def __init__(self, model: GPT, index: int):
        super().__init__()
        self.block, self.config = model.transformer.h[index], model.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.arch == "gpt2":
            return self.block(x)
        positions = torch.arange(x.size(1), device=x.device)
        return self.block(x, None, rotary(positions, self.config))


class FinalNorm(nn.Module):
    def __init__(self, model: GPT):
        super().__init__()
        self.ln_f = model.transformer.ln_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class Head(nn.Module):
    """An untied LM head: hands the loss the hidden states and its weight (no logits)."""

    def __init__(self, model: GPT):
        super().__init__()
        self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.lm_head.weight


def pipeline_module(model: GPT, stages: int):
    """model as a deepspeed.pipe.PipelineModule of `stages` stages (needs the process group)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # 1.5 s: pipelines only
    # the last layer hands the loss the hidden states and the tied weight: the fused loss never
    # builds logits
    head = lambda embedding, x: (x, embedding.wte.weight)
    loss = lambda outputs, targets: chunked_cross_entropy(*outputs, targets)
    if model.config.tie_embeddings:
        first = TiedLayerSpec("wte", TokenEmbedding, model, tied_weight_attr=["wte.weight"])
        last = TiedLayerSpec("wte", TokenEmbedding, model, forward_fn=head,
                             tied_weight_attr=["wte.weight"])
    else:
        first, last = LayerSpec(TokenEmbedding, model), LayerSpec(Head, model)
    layers = [first, LayerSpec(PositionEmbedding, model),
              *[LayerSpec(BlockPipe, model, i) for i in range(model.config.n_layer)],
              LayerSpec(FinalNorm, model), last]
    return PipelineModule(layers, num_stages=stages, loss_fn=loss,
                          partition_method="type:BlockPipe")


def gpt_state_from_universal(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT's state dict from a pipeline's parameter names ("tied_modules.wte.wte.weight" or
    "0.wte.weight", "1.wpe.weight", "{2 + i}.block.*" for block i, "{n_layer + 2}.ln_f.*",
    "{n_layer + 3}.lm_head.weight" when untied), as the universal checkpoint names them."""
    state = {}
    for name, tensor in weights.items():
        layer, rest = name.split(".", 1)
        if layer == "tied_modules":
            key = "transformer." + rest.removeprefix("wte.")
        elif rest.startswith("block."):
            key = f"transformer.h.{int(layer) - 2}." + rest.removeprefix("block.")
        elif rest.startswith("lm_head."):
            key = rest
        else:
            key = "transformer." + rest  # wte.*, wpe.*, ln_f.*
        state[key] = tensor
    state.setdefault("lm_head.weight", state["transformer.wte.weight"])  # tied
    return state


# ----- what a layout costs -----

def tp_share(name: str, numel: int, tp_size: int) -> int:
    """A parameter's elements in one TP shard (TP_RULES; a row-parallel bias stays whole)."""
    weight = re.sub(r"\.bias$", ".weight", name)  # a column-parallel bias is split as its weight
    for pattern, kind, _ in TP_RULES:
        if re.match(pattern, name) or kind == "column" and re.match(pattern, weight):
            return numel // tp_size
    return numel


@dataclass
class MemoryEstimate:
    params: int  # the whole model
    device_params: int  # on the busiest device: its stage's layers, its tensor-parallel share
    largest_layer: int  # the biggest single module (what ZeRO-3 gathers at once)
    flops_per_token: int
    weights: float  # bytes per device
    gradients: float
    optimizer: float
    activations: float
    cpu: float  # bytes per process offloaded to CPU memory


def estimate_memory(config: GPTConfig, layout: Layout, zero_stage: int, dtype: str,
                    offload_optimizer: bool, offload_param: bool, micro_batch: int,
                    micro_steps: int, recompute: bool = False) -> MemoryEstimate:
    """Training memory per device for this layout, from a GPT built on the meta device (nothing is
    allocated).

    Bytes per parameter as DeepSpeed counts them: float32 weights 4 + gradients 4 + AdamW 8; 16-bit
    weights 2 + gradients 2 + float32 gradients, master weights and AdamW 16. ZeRO stage 1
    partitions the optimizer over the data-parallel ranks, 2 also the gradients, 3 also the weights.
    Activations without recomputation (Korthikanti et al. 2022, sequence s, micro-batch b, width h,
    TP t: s*b*h*(10 + 24/t) 16-bit values per block; SDPA keeps no (s, s) scores), for as many
    micro-batches as the first pipeline stage holds in flight (1F1B); with recompute (activation
    checkpointing) each block keeps its input, s*b*h values, and one block at a time its whole
    activations again."""
    with torch.device("meta"):
        model = GPT(config)
    per_block = sum(tp_share(n, p.numel(), layout.tp_size)
                    for n, p in model.transformer.h[0].named_parameters(prefix="transformer.h.0"))
    blocks = math.ceil(config.n_layer / layout.pipeline_stages)
    wte = model.transformer.wte.weight.numel()
    # GPT-2's positions
    wpe = model.transformer.wpe.weight.numel() if "wpe" in model.transformer else 0
    ln_f = sum(p.numel() for p in model.transformer.ln_f.parameters())
    if layout.pipeline_stages == 1:  # (an untied head is as big as the embedding)
        device_params = wte * (2 - config.tie_embeddings) + wpe + ln_f + config.n_layer * per_block
    else:  # the first stage holds the embeddings, the last the final norm and the head
        # (a tied one copied)
        device_params = max(wte + wpe, wte + ln_f) + blocks * per_block
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False))
                        for m in model.modules())

    width = 2 if dtype != "float32" else 4  # bytes per weight, gradient or activation
    dp = layout.data_parallel
    weights = device_params * width / (dp if zero_stage == 3 else 1)
    gradients = device_params * width / (dp if zero_stage >= 2 else 1)
    optimizer = device_params * (16 if width == 2 else 8) / (dp if zero_stage >= 1 else 1)
    cpu = 0.0
    if offload_optimizer:
        cpu, optimizer = cpu + optimizer, 0.0
    # parameters wait in CPU memory; one layer at a time is gathered
    if offload_param and zero_stage == 3:
        cpu, weights = cpu + weights, largest_layer * width
    in_flight = min(layout.pipeline_stages, micro_steps)
    activations = activation_bytes(config, micro_batch, width, blocks * in_flight, layout.tp_size,
                                   recompute)
    return MemoryEstimate(num_params(config, non_embedding=False), device_params, largest_layer,
                          flops_per_token(config), weights, gradients, optimizer, activations, cpu)


def estimate_torch_memory(config: GPTConfig, world: int, fsdp: bool, dtype: str, muon: bool,
                          micro_batch: int, recompute: bool = False) -> MemoryEstimate:
    """Training memory per process of train.py and train_ddp.py, from a GPT on the meta device.
    Weights and gradients stay float32 under autocast (4 + 4 bytes a parameter); AdamW keeps two
    float32 moments (8), Muon one (4) for the blocks' matrices and AdamW's for the rest. DDP holds
    all of it in every process, and its reducer a second copy of the gradients (flat buckets,
    gradient_as_bucket_view being off). FSDP2 divides it by the processes and gathers, in the
    compute dtype, the root's weights (embeddings, head, final norm) and two blocks' (the one
    computing and the one prefetched), whose gradients are as large until reduce-scattered.
    Activations as estimate_memory's."""
    with torch.device("meta"):
        model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    matrices = sum(p.numel() for p in model.transformer.h.parameters() if p.dim() == 2)
    shards = world if fsdp else 1
    weights = gradients = 4 * params / shards
    optimizer = (8 * params - (4 * matrices if muon else 0)) / shards
    width = 2 if dtype != "float32" else 4
    if fsdp:
        gathered = (params - config.n_layer * block + 2 * block) * width
        weights, gradients = weights + gathered, gradients + gathered
    else:
        gradients *= 2
    activations = activation_bytes(config, micro_batch, width, config.n_layer, 1, recompute)
    return MemoryEstimate(params, params // shards, block, flops_per_token(config), weights,
                          gradients, optimizer, activations, 0.0)


def activation_bytes(config: GPTConfig, micro_batch: int, width: int, blocks: int, tp_size: int,
                     recompute: bool) -> float:
    """Activations kept for the backward of `blocks` blocks (as many micro-batches as are in flight
    times the blocks of a stage; estimate_memory's docstring has the formula)."""
    per_block = config.block_size * micro_batch * config.n_embd * (10 + 24 / tp_size) * width / 2
    if not recompute:
        return per_block * blocks
    return config.block_size * micro_batch * config.n_embd * width * blocks + per_block
