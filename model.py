"""
A GPT in one file, of two families: the network, its loss, and sampling with a KV cache. It imports
only torch.

    logits, loss = model(idx, targets)

arch "gpt2" follows OpenAI's GPT-2 exactly (pre-LN blocks, LayerNorm eps 1e-5, tanh GELU, learned
positions, biases, tied embedding / LM head), so HF GPT-2 checkpoints load unchanged
(toolkit/hf.py).
arch "llama" is today's layout (Llama, Qwen3, SmolLM, nanochat): the same pre-norm blocks with
RMSNorm, rotary positions, grouped-query attention and optional QK-norm, a gated SiLU MLP, no biases
and an untied head (toolkit/hf_llama.py maps HF's Llama and Qwen3 folders). Where they differ:
`norm`, `CausalSelfAttention.forward`, `MLP`, `GPT._trunk`.
"""
import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2
    attn_kernel: str = "auto"  # one of ATTN_KERNELS
    # the llama family's (GPT-2 keeps their defaults)
    arch: str = "gpt2"  # one of ARCHS
    n_kv_head: int | None = None  # key/value heads of grouped-query attention (default: n_head)
    head_dim: int | None = None  # default n_embd // n_head (Qwen3 sets its own)
    mlp_hidden: int | None = None  # the gated MLP's width (default: 8/3 n_embd rounded up to 32)
    qk_norm: bool = False  # RMSNorm of each head's queries and keys (Qwen3, nanochat)
    rope_theta: float = 10000.0  # the base of the rotary frequencies
    # Llama 3.1's long-context frequencies (HF's rope_type "llama3"): factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings; None: theta's alone
    rope_scaling: dict[str, float] | None = None
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    tie_embeddings: bool = True  # the LM head is the token embedding (GPT-2; small Qwen3, SmolLM)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        if self.arch == "gpt2":
            return 4 * self.n_embd
        return self.mlp_hidden or -(-8 * self.n_embd // 3 // 32) * 32


ARCHS = ("gpt2", "llama")
SDPA_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
# "auto": manual_attention for bfloat16 on CPU up to MANUAL_MAX_KEYS keys, else SDPA's own choice
ATTN_KERNELS = ("auto", "manual", *SDPA_KERNELS)
MANUAL_MAX_KEYS = 512
MAX_LAYERS = 1024  # GPT-3's largest has 96: a config with more blocks than this lies
OPTIONAL_SIZES = ("n_kv_head", "head_dim", "mlp_hidden")  # None: the default of GPTConfig's comment
ROPE_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_config(config: GPTConfig) -> None:
    """Refuse a shape that cannot be built (ValueError), before anything is allocated."""
    for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", *OPTIONAL_SIZES):
        value, optional = getattr(config, name), name in OPTIONAL_SIZES
        if not (optional and value is None) and (type(value) is not int or value < 1):
            raise ValueError(f"model config: {name} must be a positive integer"
                             f"{' or unset' if optional else ''}, got {value!r}")
    if config.n_layer > MAX_LAYERS:
        raise ValueError(f"model config: n_layer {config.n_layer} is more than {MAX_LAYERS}")
    if config.head_dim is None and config.n_embd % config.n_head:
        raise ValueError(f"model config: n_embd ({config.n_embd}) must be divisible by n_head "
                         f"({config.n_head})")
    if type(config.bias) is not bool:
        raise ValueError(f"model config: bias must be true or false, got {config.bias!r}")
    if type(config.dropout) not in (int, float) or not 0 <= config.dropout < 1:
        raise ValueError(f"model config: dropout must be in [0, 1), got {config.dropout!r}")
    if config.attn_kernel not in ATTN_KERNELS:
        raise ValueError(f"unknown attn_kernel '{config.attn_kernel}'; "
                         f"choose from {', '.join(ATTN_KERNELS)}")
    if config.arch not in ARCHS:
        raise ValueError(f"unknown arch '{config.arch}'; choose from {', '.join(ARCHS)}")
    if config.n_head % config.kv_heads or config.head_size % 2:
        raise ValueError(f"model config: n_head ({config.n_head}) must be a multiple of n_kv_head "
                         f"({config.kv_heads}), and the head size ({config.head_size}) even")
    gpt2_like = dict(n_kv_head=config.kv_heads == config.n_head,
                     head_dim=config.head_size * config.n_head == config.n_embd,
                     mlp_hidden=config.mlp_hidden is None, qk_norm=not config.qk_norm,
                     tie_embeddings=config.tie_embeddings)
    if config.arch == "gpt2" and not all(gpt2_like.values()):
        raise ValueError("model config: GPT-2 has no "
                         f"{', '.join(k for k, ok in gpt2_like.items() if not ok)}; use arch llama")
    if config.arch == "llama" and config.bias:
        raise ValueError("model config: the llama family has no biases (bias false)")
    # (a base of 0 or below, or an epsilon below 0, gives garbage or NaN logits, not an error)
    for name, ok, wanted in (("rope_theta", lambda v: v > 0, "above 0"),
                             ("norm_eps", lambda v: v >= 0, "of at least 0")):
        value = getattr(config, name)
        if type(value) not in (int, float) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"model config: {name} must be a finite number {wanted}, "
                             f"got {value!r}")
    scaling = config.rope_scaling
    if scaling is not None and not (
            isinstance(scaling, dict) and set(scaling) == set(ROPE_SCALING)
            and all(type(v) in (int, float) and 0 < v < math.inf for v in scaling.values())
            and scaling["factor"] >= 1
            and scaling["high_freq_factor"] > scaling["low_freq_factor"]):
        raise ValueError("model config: rope_scaling must be null or an object of "
                         f"{', '.join(ROPE_SCALING)}, factors of at least 1 with high_freq_factor "
                         f"above low_freq_factor, got {scaling!r:.200}")


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, its weight in the input's dtype: under bfloat16 autocast the queries and
    keys reach QK-norm in bfloat16, and a float32 weight would leave the fused kernel, warning."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


def norm(config: GPTConfig, width: int) -> nn.Module:
    """GPT-2's LayerNorm, or the llama family's RMSNorm."""
    if config.arch == "gpt2":
        return nn.LayerNorm(width, eps=1e-5, bias=config.bias)
    return RMSNorm(width, eps=config.norm_eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.head_dim, self.dropout = config.head_size, config.dropout
        self.kernel = config.attn_kernel
        qkv_width = (config.n_head + 2 * config.kv_heads) * config.head_size  # q, k, v
        self.c_attn = nn.Linear(config.n_embd, qkv_width, bias=config.bias)
        self.c_proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        if config.qk_norm:
            self.q_norm = norm(config, config.head_size)
            self.k_norm = norm(config, config.head_size)

    def forward(self, x: torch.Tensor, kv_cache: "KVCache | None" = None,
                rope: tuple | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.c_attn(x)
        # n_head, or this rank's tensor-parallel share; as many kv heads for GPT-2, fewer with GQA
        heads = qkv.size(-1) * self.n_head // ((self.n_head + 2 * self.n_kv_head) * self.head_dim)
        kv_heads = heads * self.n_kv_head // self.n_head
        # (B, T, (heads + 2 kv_heads) * head_dim) -> (B, heads or kv_heads, T, head_dim) views
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in
                   qkv.split([heads * self.head_dim, kv_heads * self.head_dim,
                              kv_heads * self.head_dim], -1))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        # with a cache: all its keys, masked (slots: x's places), so a step's shapes stay fixed
        k, v, mask = (k, v, None) if kv_cache is None else kv_cache.update(k, v, slots)
        dropout_p = self.dropout if self.training else 0.0
        cpu_bf16 = q.device.type == "cpu" and q.dtype == torch.bfloat16
        auto_manual = self.kernel == "auto" and cpu_bf16 and k.size(-2) <= MANUAL_MAX_KEYS
        manual = self.kernel == "manual" or auto_manual
        # each key/value head serves heads // kv_heads query heads: SDPA on a CPU reads it in place
        # (enable_gqa: decoding 1.1x), elsewhere it is copied for each (GPUs: not measured yet)
        if kv_heads != heads and (manual or not q.is_cpu):
            k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
        if manual:
            y = manual_attention(q, k, v, dropout_p, mask)
        else:
            named = self.kernel in SDPA_KERNELS  # else SDPA chooses; toolkit/device.py checks it
            with sdpa_kernel([SDPA_KERNELS[self.kernel]]) if named else contextlib.nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, mask, dropout_p,
                                                   is_causal=T > 1 and mask is None,
                                                   enable_gqa=k.size(1) != heads)
        y = y.transpose(1, 2).reshape(B, T, heads * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


def manual_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v where mask (default: causal, queries at the last keys) is
    True: plain bfloat16 matmuls beat SDPA's flash kernel on CPUs without AMX for short contexts."""
    T, S = q.size(-2), k.size(-2)
    # the mask is added as -inf rather than masked_fill'ed: one pass fewer over the scores
    hidden = torch.full((T, S), float("-inf"), dtype=q.dtype, device=q.device).triu(S - T + 1) \
        if mask is None else torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, -math.inf)
    att = torch.softmax((q * q.size(-1) ** -0.5) @ k.transpose(-2, -1) + hidden, dim=-1)
    if dropout_p:
        att = F.dropout(att, dropout_p)
    return att @ v


def rotary(positions: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (T, head_dim) of RoPE's angles at positions (T,), or (B, 1, T, head_dim) at
    (B, T): pair (i, i + head_dim/2) of a head turns by position * its frequency, as HF's Llama lays
    the pairs out (rotate_half)."""
    frequencies = rope_frequencies(config.head_size, config.rope_theta, config.rope_scaling,
                                   positions.device)
    angles = positions.float()[..., None] * frequencies
    angles = torch.cat((angles, angles), dim=-1)
    angles = angles[:, None] if positions.dim() == 2 else angles  # one set for every head
    return angles.cos(), angles.sin()


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, float] | None = None,
                     device: torch.device | None = None) -> torch.Tensor:
    """The head_dim/2 angles per position, theta^(-2i / head_dim). Llama 3.1's scaling (Meta's
    apply_scaling, HF's _compute_llama3_parameters) slows the ones whose wavelength is past
    original_max_position_embeddings / low_freq_factor by factor, keeps those under
    original_max_position_embeddings / high_freq_factor, and blends linearly in between."""
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling is None:
        return inverse
    factor, low, high, context = (scaling[key] for key in ROPE_SCALING)
    wavelength = 2 * math.pi / inverse
    blend = ((context / wavelength - low) / (high - low)).clamp(0, 1)  # 0: slowed, 1: kept
    return (1 - blend) * inverse / factor + blend * inverse


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, head_dim) turned by the rotary angles of its positions."""
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-second, first), dim=-1) * sin.to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh-approximated GELU ("gelu_new")."""
    if torch.compiler.is_compiling():
        # 0.5 * (1 + tanh(u)) == sigmoid(2u), 1.5957691216057308 == 2 * sqrt(2 / pi): Inductor
        # fuses this into one exp kernel (its CPU tanh is slow); eager F.gelu's kernel is faster
        return x * torch.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """GPT-2's c_proj(gelu(c_fc(x))); the llama family's c_proj(silu(gate) * up), both from c_fc."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gated = config.arch == "llama"
        self.c_fc = nn.Linear(config.n_embd, (1 + self.gated) * config.mlp_width, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_width, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            return self.dropout(self.c_proj(F.silu(gate) * up))
        return self.dropout(self.c_proj(gelu_tanh(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: "KVCache | None" = None,
                rope: tuple | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, rope, slots)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        check_config(config)
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            # learned positions for GPT-2; the llama family rotates queries and keys instead
            **({"wpe": nn.Embedding(config.block_size, config.n_embd)}
               if config.arch == "gpt2" else {}),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=norm(config, config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # GPT-2's, and small open models'
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer): each block adds two
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                chunked_loss: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits (B, T, V), mean cross-entropy or None), as nanoGPT; targets of -1 are ignored.
        chunked_loss=True, training's path, gives (None, the same loss) without building logits."""
        x = self.hidden_states(idx)
        if targets is not None and chunked_loss:
            return None, chunked_cross_entropy(x, self.lm_head.weight, targets)
        logits = padded_logits(x, self.lm_head.weight)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits[..., : self.config.vocab_size], loss

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T, n_embd) states after the final LayerNorm, i.e. the LM head's input."""
        self._check_shape(idx)
        return self._trunk(idx)

    def _trunk(self, idx: torch.Tensor, kv_caches: "list[KVCache] | None" = None,
               start: int | torch.Tensor = 0) -> torch.Tensor:
        """Final-LayerNorm states of idx placed at positions start, start+1, ... (unchecked)."""
        slots = pos = torch.arange(idx.size(1), device=idx.device) + start
        if kv_caches and kv_caches[0].pad is not None:  # a left-padded row counts from its prompt
            pos = (pos - kv_caches[0].pad[:, None]).clamp(min=0)
        x, rope = self.transformer.wte(idx), None
        if self.config.arch == "gpt2":
            x = x + self.transformer.wpe(pos)
        else:
            rope = rotary(pos, self.config)
        x = self.transformer.drop(x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, kv_caches[i] if kv_caches else None, rope, slots)
        return self.transformer.ln_f(x)

    def _check_shape(self, idx: torch.Tensor) -> None:
        """Shape and dtype only (no device sync, no graph break); ids are checked on entry."""
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            shape = tuple(idx.shape)
            raise ValueError(f"idx must be a (batch, time) integer tensor, got {shape} {idx.dtype}")
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence of length {idx.size(1)} is longer than block_size "
                             f"{self.config.block_size}")

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context length, e.g. to fine-tune a pretrained model on shorter blocks."""
        if not 0 < block_size <= self.config.block_size:
            raise ValueError(f"block_size must be in [1, {self.config.block_size}]: {block_size}")
        self.config.block_size = block_size
        if self.config.arch == "gpt2":
            wpe = self.transformer.wpe
            wpe.weight = nn.Parameter(wpe.weight.detach()[:block_size].clone())
            wpe.num_embeddings = block_size

    def resize_token_embeddings(self, vocab_size: int) -> None:
        """Grow the tied embedding / LM head (special tokens): new rows are the old rows' mean
        (Hewitt 2021, as HF) plus noise of std 0.02, so new tokens differ (docs/performance.md)."""
        if vocab_size < self.config.vocab_size:
            raise ValueError(f"vocab_size can only grow: {self.config.vocab_size} -> {vocab_size}")
        for module in (self.lm_head, self.transformer.wte)[: 2 - self.config.tie_embeddings]:
            old = module.weight
            weight = old.new_empty(vocab_size, old.size(1)).normal_(mean=0.0, std=0.02)
            weight += old.detach().mean(dim=0)
            weight[: old.size(0)] = old.detach()
            module.weight = nn.Parameter(weight)
        if self.config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight
        self.lm_head.out_features = self.transformer.wte.num_embeddings = vocab_size
        self.config.vocab_size = vocab_size

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
        """idx (B, T) followed by up to max_new_tokens tokens; the options are generate_stream's."""
        new = list(self.generate_stream(idx, max_new_tokens, **options))
        return torch.cat([idx, torch.stack(new, dim=1)], dim=1) if new else idx.clone()

    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None,
                        eos_token: int | list[int] | None = None, use_cache: bool = True,
                        pad: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """Yield the (B,) next tokens after the prompts idx (B, T): greedy at temperature 0, else
        sampled (top_k, top_p nucleus); a sequence that emitted eos_token (or one of a list, as HF's
        eos_token_id) leaves the batch, and its row repeats the first until all have. A row's first
        pad (B,) tokens are padding (HF's left padding). Learned positions keep a KV cache from
        sliding: a full context keeps its last half, refilled by one prefill (nanoGPT recomputes all
        a step). use_cache=False gives the same tokens."""
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"prompt must be a non-empty (batch, time) tensor, "
                             f"got shape {tuple(idx.shape)}")
        if pad is not None and (not use_cache or pad.shape != idx.shape[:1] or pad.min() < 0
                                or not pad.max() < idx.size(1) <= self.config.block_size):
            raise ValueError(f"pad must be (batch,) counts below the width {idx.size(1)} of prompts"
                             f" within the block, with the KV cache; got {pad.tolist()}")
        self._check_shape(idx[:, -self.config.block_size :])
        vocab = self.config.vocab_size
        if idx.numel() and (idx.min() < 0 or idx.max() >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}); "
                             f"got min {idx.min().item()}, max {idx.max().item()}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_sampling(temperature, top_k, top_p)
        stops = [] if eos_token is None else torch.as_tensor(eos_token).flatten().tolist()
        if not all(0 <= i < vocab for i in stops):
            raise ValueError(f"eos_token must be in [0, {vocab}), got {eos_token}")
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        stops = torch.tensor(stops, dtype=torch.long, device=idx.device) if stops else None
        return self._stream(idx, max_new_tokens, sampling, stops, use_cache, pad)

    @torch.no_grad()
    def _stream(self, idx, max_new_tokens, sampling, stops, use_cache, pad):
        """The generation loop; the context is cut (and the cache rebuilt) when full."""
        was_training = self.training
        self.eval()
        try:
            block_size, half = self.config.block_size, max(1, self.config.block_size // 2)
            ctx = idx[:, -block_size:]
            caches = None  # None means: (re)build by a prefill of ctx
            finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
            rows = torch.arange(idx.size(0), device=idx.device)  # the sequences still generating
            for step in range(max_new_tokens):
                if use_cache and caches is not None:  # a filled cache: the last token alone
                    start = torch.full((), ctx.size(1) - 1, device=ctx.device)
                    # (a CUDA graph's output is overwritten by its next replay)
                    tok = self.decode_step(ctx[:, -1:], caches, start, **sampling).clone()
                else:  # the prefill, eager even where --compile compiles decode_step
                    if use_cache:  # as long as what is left needs, up to the block
                        length = min(block_size, ctx.size(1) + max_new_tokens - step)
                        caches = [KVCache(length, pad) for _ in self.transformer.h]
                    tok = sample(self.lm_head(self._trunk(ctx, caches)[:, -1]).float(), **sampling)
                if stops is not None:
                    tok = stops[0].repeat(idx.size(0)).index_copy(0, rows, tok)
                    finished |= torch.isin(tok, stops)
                yield tok
                if stops is not None and finished.all():
                    return
                going = None if stops is None else ~finished[rows]
                if going is not None and not going.all():  # finished ones leave: cost what is left
                    rows, ctx = rows[going], ctx[going]
                    pad = None if pad is None else pad[going]
                    for cache in caches or []:
                        cache.keep(going)
                ctx = torch.cat([ctx, tok[rows][:, None]], dim=1)
                if ctx.size(1) > block_size:  # a full row keeps its last half, the rest is padding
                    pads = torch.zeros_like(rows) if pad is None else pad
                    pads = pads.where(ctx.size(1) - pads <= block_size, ctx.size(1) - half)
                    ctx, caches = ctx[:, int(pads.min()):], None
                    pad = None if pad is None else pads - pads.min()
        finally:
            self.train(was_training)

    def decode_step(self, tok: torch.Tensor, caches: "list[KVCache]", start: torch.Tensor,
                    **sampling) -> torch.Tensor:
        """The (B,) tokens after tok (B, 1) at position start (0-d: compiled, an int would make a
        graph per position), the cached positions before it."""
        return sample(self.lm_head(self._trunk(tok, caches, start)[:, -1]).float(), **sampling)


VOCAB_MULTIPLE = 64  # the head computes the vocabulary padded to a multiple of this, as nanochat


def padded_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T over the vocabulary padded with -inf columns to a multiple of VOCAB_MULTIPLE:
    aligned rows make GPU kernels far faster (docs/performance.md); weights keep the true size."""
    pad = -weight.size(0) % VOCAB_MULTIPLE
    if pad == 0:
        return F.linear(x, weight)
    no_probability = F.pad(weight.new_zeros(weight.size(0)), (0, pad), value=float("-inf"))
    return F.linear(x, F.pad(weight, (0, 0, 0, pad)), no_probability)


# Logits per chunk of the chunked loss: 16M fp32 elements (64 MB), 333 rows of GPT-2's vocabulary;
# fewer rows leave the weight-gradient matmul (K = rows) far below peak. On CPU, glibc maps blocks
# this big afresh unless toolkit.device.keep_freed_memory_in_heap raises its mmap threshold.
CHUNK_ELEMENTS = 16 * 2**20


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of x @ weight.T, a chunk of logits at a time; gradients made in forward."""

    @staticmethod
    def forward(ctx, x, weight, targets, compute_dtype, need_grad_x, need_grad_w):
        N, V = x.size(0), weight.size(0)
        xs, w = x.to(compute_dtype), weight.to(compute_dtype)
        valid = targets != -1
        scale = (valid / valid.sum()).unsqueeze(1)  # mean over non-ignored rows; ignored rows get 0
        tgt = targets.clamp(min=0).unsqueeze(1)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        grad_x = torch.empty_like(xs) if need_grad_x else None
        grad_w = weight.new_zeros(weight.shape, dtype=torch.float32) if need_grad_w else None
        # in low precision each chunk's weight gradient lands in one reused buffer, then in fp32
        reuse = need_grad_w and compute_dtype != torch.float32
        grad_w_chunk = torch.empty_like(w) if reuse else None
        rows = max(1, CHUNK_ELEMENTS // V)
        for s in range(0, N, rows):
            xc, tc, sc = xs[s : s + rows], tgt[s : s + rows], scale[s : s + rows]
            logits = (xc @ w.t()).float()  # softmax statistics in fp32 even under autocast
            target_logit = logits.gather(1, tc)
            top = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # unnormalised softmax, in place: one exp pass
            total = probs.sum(dim=1, keepdim=True)
            loss += ((top + total.log() - target_logit) * sc).sum()
            if need_grad_x or need_grad_w:
                # d loss / d logits = (softmax - onehot(target)) * scale
                g = probs.mul_(sc / total).scatter_add_(1, tc, -sc).to(compute_dtype)
                if need_grad_x:
                    torch.mm(g, w, out=grad_x[s : s + rows])
                if grad_w_chunk is not None:
                    grad_w += torch.mm(g.t(), xc, out=grad_w_chunk)
                elif need_grad_w:
                    grad_w.addmm_(g.t(), xc)
        ctx.save_for_backward(grad_x.to(x.dtype) if need_grad_x else None,
                              grad_w.to(weight.dtype) if need_grad_w else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = (None if g is None else g * grad_loss for g in ctx.saved_tensors)
        return *grads, None, None, None, None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
                          ) -> torch.Tensor:
    """F.cross_entropy(x @ weight.T, targets, ignore_index=-1), value and gradients, a chunk of rows
    at a time: the (N, V) logits, most of a training step's memory, are never held."""
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    dev = x.device.type
    compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    grad = torch.is_grad_enabled()  # a frozen weight (LoRA) gets no gradient: its matmul is skipped
    return _ChunkedCrossEntropy.apply(x, weight, targets, compute_dtype,
                                      grad and x.requires_grad, grad and weight.requires_grad)


class KVCache:
    """Keys and values of one attention layer, preallocated for max_len positions in the dtype the
    layer produces (autocast). A step writes its positions in place and attends over all max_len,
    masked, as gpt-fast's static cache: its shapes never change, so a CUDA graph replays it."""

    def __init__(self, max_len: int, pad: torch.Tensor | None = None):
        self.max_len, self.pad = max_len, pad  # pad: GPT.generate_stream's
        self.k = self.v = None  # (B, H, max_len, D) tensors once the first keys come

    def update(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v (B, H, T, D) at positions slots (T,); return all keys and values, and which
        keys each query sees (T, max_len; B, 1, T, max_len padded): none after it, no other pad."""
        if self.k is None:  # zeros: a hidden key still enters q k^T, and NaN * 0 is NaN
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        self.k.index_copy_(2, slots, k)  # (past max_len: an index error)
        self.v.index_copy_(2, slots, v)
        keys = torch.arange(self.max_len, device=slots.device)
        seen = keys <= slots[:, None]
        if self.pad is not None:
            seen = seen & ((keys >= self.pad[:, None, None, None]) | (keys == slots[:, None]))
        return self.k, self.v, seen

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the sequences of the batch where rows (B,) is True."""
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]
        self.pad = None if self.pad is None else self.pad[rows]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError unless temperature is finite and >= 0, top_k >= 1 and top_p in (0, 1]."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
           ) -> torch.Tensor:
    """One token per row of (B, V) fp32 logits: greedy at temperature 0, else drawn from the
    softmax of logits / temperature restricted to the top_k likeliest and the top_p nucleus."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # the largest logit becomes 0 first: a temperature of 1e-40 leaves the others -inf, not all inf
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the likelier ones already reach top_p (the likeliest always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    # inverse-CDF sampling: one random number a row (torch.multinomial on CPU draws one an entry)
    cdf = logits.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand(cdf.size(0), 1, dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.size(1) - 1)
