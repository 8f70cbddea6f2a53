"""model.py: the network, nanoGPT's (logits, loss) contract and the chunked loss, attention kernels,
the KV cache and sampling. HF numerics are tests/test_hf.py's."""
import pytest
import torch
import torch.nn.functional as F

import model
from conftest import VOCAB, rel_err, tiny_config, tiny_gpt
from model import GPT, GPTConfig
from toolkit.train_config import PRESETS
from toolkit.device import check_attn_kernel, check_memory, flops_per_token, num_params
from toolkit.optim import make_optimizer


@torch.no_grad()
def test_bad_inputs_raise_clear_value_errors():
    m = tiny_gpt()
    with pytest.raises(ValueError, match="longer than block_size 32"):
        m(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 211\)"):
        m.generate(torch.full((1, 4), VOCAB), 3)
    with pytest.raises(ValueError, match="token ids"):
        m.generate(torch.full((1, 4), -1), 3)
    with pytest.raises(ValueError, match="unknown attn_kernel"):
        GPT(tiny_config(attn_kernel="fast"))


def test_training_forward_is_one_graph():
    """Token ids are checked where they enter (data, generate), not per forward: no host sync, no
    graph break."""
    m = tiny_gpt()
    idx = torch.randint(0, VOCAB, (2, 16))
    # fullgraph: a graph break is an error
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    assert torch.equal(compiled(idx, idx, chunked_loss=True)[1], m(idx, idx, chunked_loss=True)[1])


@torch.no_grad()
def test_attention_kernels_agree_on_cpu():
    ref = tiny_gpt(attn_kernel="math")
    idx = torch.randint(0, VOCAB, (2, 32))
    flash = GPT(tiny_config(attn_kernel="flash")).eval()
    flash.load_state_dict(ref.state_dict())
    assert torch.allclose(flash(idx)[0], ref(idx)[0], atol=1e-5)
    for kernel in ("auto", "manual"):
        m = GPT(tiny_config(attn_kernel=kernel)).eval()
        m.load_state_dict(ref.state_dict())
        assert torch.allclose(m(idx)[0], ref(idx)[0], atol=1e-5)
    # checked where a script meets the device (toolkit/device.py)
    for kernel in ("efficient", "cudnn"):
        m = GPT(tiny_config(attn_kernel=kernel))
        with pytest.raises(ValueError,
                           match=f"attn_kernel '{kernel}' cannot run on cpu.*available: auto, "
                                 "manual, flash, math"):
            check_attn_kernel(m, torch.device("cpu"), torch.float32)


@torch.no_grad()
def test_auto_kernel_writes_attention_out_for_bfloat16_on_cpu():
    ref = tiny_gpt(attn_kernel="manual").to(torch.bfloat16)
    idx = torch.randint(0, VOCAB, (2, 32))
    for kernel, same in (("auto", True), ("flash", False)):
        m = GPT(tiny_config(attn_kernel=kernel)).to(torch.bfloat16).eval()
        m.load_state_dict(ref.state_dict())
        assert torch.equal(m(idx)[0], ref(idx)[0]) == same


@torch.no_grad()
def test_auto_kernel_leaves_long_bfloat16_attention_to_sdpa():
    """Beyond MANUAL_MAX_KEYS keys, auto is SDPA's flash kernel on CPU, not the written-out form."""
    T = model.MANUAL_MAX_KEYS + 1
    layer = model.CausalSelfAttention(GPTConfig(block_size=T, vocab_size=VOCAB, n_layer=1, n_head=1,
                                                n_embd=8)).eval()
    x = torch.randn(1, T, 8).to(torch.bfloat16)
    outputs = {}
    for kernel in ("auto", "flash", "manual"):
        layer.kernel = kernel
        outputs[kernel] = layer.to(torch.bfloat16)(x)
    assert torch.equal(outputs["auto"], outputs["flash"]) and \
        not torch.equal(outputs["auto"], outputs["manual"])


def test_manual_attention_matches_sdpa_in_gradients_and_drops_attention_weights():
    q, k, v = (torch.randn(2, 3, 10, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    ours = torch.autograd.grad(model.manual_attention(q, k, v, 0.0), (q, k, v), grad)
    sdpa = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v),
                               grad)
    for a, b in zip(ours, sdpa):
        assert torch.allclose(a, b, atol=1e-12)
    # every weight dropped
    assert torch.equal(model.manual_attention(q, k, v, 1.0), torch.zeros_like(q))


@pytest.mark.parametrize("kernel", ["auto", "manual", "math", "flash"])
@torch.no_grad()
def test_kv_cache_forward_matches_full_forward(kernel):
    """A prefill, one-token steps at a 0-d tensor position (as the compiled decode_step gets it),
    then several tokens: the states of one forward over all. The cache is written in place and
    read whole, masked, so every step sees the same shapes and storage (what a CUDA graph needs)."""
    m = tiny_gpt(attn_kernel=kernel)
    idx = torch.randint(0, VOCAB, (2, 20))
    full = m.hidden_states(idx)
    caches = [model.KVCache(32) for _ in m.transformer.h]
    parts = [m._trunk(idx[:, :7], caches)]
    storage = [(c.k.data_ptr(), c.v.data_ptr(), c.k.shape) for c in caches]
    for t in (7, 8):
        parts.append(m._trunk(idx[:, t:t + 1], caches, start=torch.tensor(t)))
        assert [(c.k.data_ptr(), c.v.data_ptr(), c.k.shape) for c in caches] == storage
    parts.append(m._trunk(idx[:, 9:], caches, start=9))
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_a_step_sees_the_whole_cache_masked():
    """Whatever the position, a step's keys are the whole preallocated cache, and the mask hides
    the positions after it and a left-padded row's padding (a padding query sees itself)."""
    cache = model.KVCache(6, pad=torch.tensor([0, 2]))
    k = torch.randn(2, 1, 3, 4)
    keys, values, seen = cache.update(k, -k, torch.arange(3))
    assert keys.shape == values.shape == (2, 1, 6, 4) and torch.equal(keys[:, :, :3], k)
    assert seen[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert seen[1, 0].int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]
    keys, _, seen = cache.update(k[:, :, :1], k[:, :, :1], torch.tensor([3]))
    assert keys.shape == (2, 1, 6, 4) and seen[1, 0].int().tolist() == [[0, 0, 1, 1, 0, 0]]


def reference_greedy(m: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """The documented context policy, written out naively."""
    bs = m.config.block_size
    out, ctx = idx, idx[:, -bs:]
    for _ in range(n):
        tok = m(ctx)[0][:, -1].argmax(-1, keepdim=True)
        out, ctx = torch.cat([out, tok], 1), torch.cat([ctx, tok], 1)
        if ctx.size(1) > bs:
            ctx = ctx[:, -(bs // 2) :]
    return out


@pytest.mark.parametrize("batch,prompt_len", [(1, 5), (3, 4), (2, 40)])
@torch.no_grad()
def test_greedy_kv_cache_equals_no_cache(batch, prompt_len):
    m = tiny_gpt(std=0.3, block_size=16)
    idx = torch.randint(0, VOCAB, (batch, prompt_len))
    cached = m.generate(idx, 50, temperature=0)
    uncached = m.generate(idx, 50, temperature=0, use_cache=False)
    assert cached.shape == (batch, prompt_len + 50)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, reference_greedy(m, idx, 50))
    assert cached[:, prompt_len:].unique().numel() > 1


@torch.no_grad()
def test_top_k_1_tiny_top_p_and_tiny_temperature_equal_greedy():
    m = tiny_gpt(std=0.3)
    idx = torch.randint(0, VOCAB, (2, 3))
    greedy = m.generate(idx, 20, temperature=0)
    assert torch.equal(m.generate(idx, 20, top_k=1), greedy)
    assert torch.equal(m.generate(idx, 20, temperature=0.8, top_p=1e-6), greedy)
    # logits / 1e-40 overflow to inf: sampling must still be greedy, not the last id
    assert torch.equal(m.generate(idx, 20, temperature=1e-40), greedy)


@torch.no_grad()
def test_eos_stops_each_sequence():
    m = tiny_gpt(std=0.3)
    idx = torch.randint(0, VOCAB, (2, 3))
    new = m.generate(idx, 30, temperature=0)[:, 3:]
    # an eos that both rows emit, first at different steps
    firsts = {t: [row.tolist().index(t) for row in new]
              for t in set(new[0].tolist()) & set(new[1].tolist())}
    eos, (f0, f1) = next((t, f) for t, f in firsts.items() if f[0] != f[1])
    out = m.generate(idx, 30, temperature=0, eos_token=eos)[:, 3:]
    assert out.size(1) == max(f0, f1) + 1 < 30
    for row, first in zip(range(2), (f0, f1)):
        assert torch.equal(out[row, : first + 1], new[row, : first + 1])
        assert (out[row, first:] == eos).all()
    # several stop ids, as HF's eos_token_id lists them: a row ends at the first of any (here one
    # row ends sooner, at the second id), then repeats the first id
    rows = new.tolist()
    other = next(t for t in sorted(set(rows[0] + rows[1]) - {eos})
                 if any(t in r[: r.index(eos)] for r in rows))
    ends = [next(i for i, t in enumerate(r) if t in (eos, other)) for r in rows]
    assert ends != [f0, f1]
    out = m.generate(idx, 30, temperature=0, eos_token=[eos, other])[:, 3:]
    assert out.size(1) == max(ends) + 1
    for row, end in enumerate(ends):
        assert torch.equal(out[row, : end + 1], new[row, : end + 1])
        assert (out[row, end + 1:] == eos).all()


@torch.no_grad()
def test_a_finished_sequence_leaves_the_batch():
    """Once a row has emitted its eos, the steps after run the other rows alone (a block sees a
    smaller batch), and the rows' tokens are those of the whole batch's run."""
    m = tiny_gpt(std=0.3)
    idx = torch.randint(0, VOCAB, (3, 3), generator=torch.Generator().manual_seed(4))
    new = m.generate(idx, 12, temperature=0)[:, 3:]
    eos = next(t for t in new[0].tolist() if t not in new[1].tolist() + new[2].tolist())
    seen = []
    hook = m.transformer.h[0].register_forward_hook(lambda _, args, out: seen.append(len(out)))
    out = m.generate(idx, 12, temperature=0, eos_token=eos)[:, 3:]
    hook.remove()
    first = new[0].tolist().index(eos)
    assert seen == [3] * (first + 1) + [2] * (11 - first)
    assert torch.equal(out[1:], new[1:]) and (out[0, first:] == eos).all()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@torch.no_grad()
def test_left_padded_prompts_generate_what_each_generates_alone(arch):
    """Prompts of three lengths in one batch, left-padded (as eval.py's generation tasks batch
    them): each row's greedy tokens are those it gets alone, past the block (its context slides and
    the cache is refilled), and with a stop token, after which a row leaves the batch."""
    m = tiny_gpt(std=0.3, block_size=16, arch=arch, bias=arch == "gpt2")
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
               for n in (9, 2, 5)]
    pad = torch.tensor([9 - len(p) for p in prompts])
    idx = torch.stack([torch.cat([torch.full((9 - len(p),), VOCAB - 1), p]) for p in prompts])
    alone = [m.generate(p[None], 30, temperature=0)[0, len(p):] for p in prompts]
    batched = m.generate(idx, 30, temperature=0, pad=pad)[:, 9:]
    for row, tokens in enumerate(alone):
        assert torch.equal(batched[row], tokens), row
    eos = next(t for t in alone[1].tolist() if t not in alone[0].tolist() + alone[2].tolist())
    first = alone[1].tolist().index(eos)
    stopped = m.generate(idx, 30, temperature=0, pad=pad, eos_token=eos)[:, 9:]
    assert torch.equal(stopped[1, : first + 1], alone[1][: first + 1])
    assert torch.equal(stopped[::2], batched[::2])
    for bad in (torch.tensor([0, 9, 0]), torch.tensor([0, 1]), torch.tensor([-1, 0, 0])):
        with pytest.raises(ValueError, match="pad must be"):
            m.generate(idx, 3, pad=bad)
    with pytest.raises(ValueError, match="with the KV cache"):
        m.generate(idx, 3, pad=pad, use_cache=False)


def test_generate_stream_matches_generate_and_restores_mode():
    m = tiny_gpt(std=0.3).train()
    idx = torch.randint(0, VOCAB, (2, 3))
    torch.manual_seed(1)
    out = m.generate(idx, 40, top_k=20, top_p=0.9)
    assert m.training
    torch.manual_seed(1)
    steps = list(m.generate_stream(idx, 40, top_k=20, top_p=0.9))
    assert m.training and all(s.shape == (2,) and not s.requires_grad for s in steps)
    assert torch.equal(torch.cat([idx, torch.stack(steps, 1)], 1), out)


def naive_loss(m: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = m.lm_head(m.hidden_states(idx))
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                           ignore_index=-1)


def loss_and_grads(m, loss_fn):
    m.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_forward_returns_logits_and_loss_as_nanogpt():
    m = tiny_gpt()
    idx, targets = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    targets[1, :4] = -1
    logits, loss = m(idx, targets)
    assert logits.shape == (2, 16, VOCAB) and loss.shape == ()
    assert torch.equal(logits, m(idx)[0]) and m(idx)[1] is None
    assert loss.item() == pytest.approx(F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1),
                                                        ignore_index=-1)
                                        .item(), rel=1e-6)


@pytest.mark.parametrize("chunk_elements", [None, 1000])  # 1000: several row chunks
def test_chunked_loss_matches_plain_cross_entropy(monkeypatch, chunk_elements):
    if chunk_elements:
        monkeypatch.setattr(model, "CHUNK_ELEMENTS", chunk_elements)
    m = tiny_gpt().train()
    idx = torch.randint(0, VOCAB, (3, 32))
    targets = torch.randint(0, VOCAB, (3, 32))
    targets[0, :10] = -1
    targets[2, -1] = -1
    fused, fused_grads = loss_and_grads(m, lambda: m(idx, targets, chunked_loss=True)[1])
    assert m(idx, targets, chunked_loss=True)[0] is None  # the logits are never built
    ref, ref_grads = loss_and_grads(m, lambda: m(idx, targets)[1])
    assert torch.allclose(fused, ref, rtol=1e-6) and \
        torch.allclose(ref, naive_loss(m, idx, targets), rtol=1e-6)
    for name, g in ref_grads.items():
        assert rel_err(fused_grads[name], g) < 1e-5, name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, fused_grads = loss_and_grads(m, lambda: m(idx, targets, chunked_loss=True)[1])
        ref, ref_grads = loss_and_grads(m, lambda: naive_loss(m, idx, targets))
    assert fused.dtype == torch.float32 and torch.allclose(fused, ref, rtol=1e-2)
    for name, g in ref_grads.items():
        assert fused_grads[name].dtype == torch.float32
        assert rel_err(fused_grads[name], g) < 3e-2, name


def test_compiled_gelu_form_equals_tanh_gelu():
    """The sigmoid form used under torch.compile is GPT-2's tanh GELU, values and gradients."""
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    compiled = torch.compile(model.gelu_tanh, backend="aot_eager")  # traces the compile-only branch
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    y_compiled, y_eager = compiled(xs[0]), F.gelu(xs[1], approximate="tanh")
    y_compiled.sum().backward()
    y_eager.sum().backward()
    assert torch.allclose(y_compiled, y_eager, rtol=0, atol=1e-12)
    assert torch.allclose(xs[0].grad, xs[1].grad, rtol=0, atol=1e-12)


def test_chunked_loss_without_grad():
    m = tiny_gpt()
    idx, targets = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        _, loss = m(idx, targets, chunked_loss=True)
        assert torch.allclose(loss, naive_loss(m, idx, targets), rtol=1e-6)


def test_chunked_loss_with_a_frozen_head_gives_the_same_gradients_and_none_for_the_head():
    m = tiny_gpt().train()
    idx, targets = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    _, ref_grads = loss_and_grads(m, lambda: m(idx, targets)[1])
    # as LoRA freezes it (tied: the embedding too): no gradient matmul
    m.lm_head.weight.requires_grad_(False)
    m.zero_grad()
    m(idx, targets, chunked_loss=True)[1].backward()
    assert m.lm_head.weight.grad is None
    trained = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert len(trained) == len(ref_grads) - 1
    for name, g in trained.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


def test_param_count_and_flops():
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig(**PRESETS["gpt2"]))
    assert num_params(gpt2.config, non_embedding=False) == 124_439_808
    assert num_params(gpt2.config) == 124_439_808 - 1024 * 768
    assert flops_per_token(gpt2.config) == 6 * num_params(gpt2.config) + 12 * 12 * 12 * 64 * 1024
    # counted from the config (ZeRO-3 partitions the tensors), equal to the tensors
    for bias in (True, False):
        m = tiny_gpt(bias=bias)
        assert num_params(m.config, non_embedding=False) == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("change, message", [
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(n_embd="64"), "n_embd must be a positive integer"), (dict(n_head=3), "divisible"),
    (dict(dropout=1.0), "dropout"), (dict(bias="no"), "bias")])
def test_impossible_config_is_refused_before_allocation(change, message):
    with pytest.raises(ValueError, match=message):
        GPT(tiny_config(**change))


def test_a_model_larger_than_the_memory_is_refused_before_it_is_built():
    check_memory(tiny_config())
    with pytest.raises(ValueError, match="GiB for their float32 weights alone, more than"):
        check_memory(tiny_config(n_layer=100_000, n_embd=1024, n_head=16))


def test_crop_block_size_and_optimizer():
    m = tiny_gpt()
    m.crop_block_size(16)
    assert m.config.block_size == 16 and m.transformer.wpe.weight.shape == (16, 64)
    assert m(torch.zeros(1, 16, dtype=torch.long))[0].shape == (1, 16, VOCAB)
    with pytest.raises(ValueError):
        m.crop_block_size(17)
    opt = make_optimizer(m, "adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == \
        num_params(m.config, non_embedding=False)


def test_sampling_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(40000, 4)
    torch.manual_seed(0)

    def freqs(**kw):
        return torch.bincount(model.sample(logits, **kw), minlength=4) / 40000

    assert torch.allclose(freqs(temperature=1.0, top_k=None, top_p=None), logits[0].softmax(-1),
                          atol=0.01)
    assert torch.allclose(freqs(temperature=2.0, top_k=None, top_p=None),
                          (logits[0] / 2).softmax(-1), atol=0.01)
    top2 = torch.tensor([1.0, 1.0, 0.0, 0.0]) * logits[0].softmax(-1) / \
        logits[0].softmax(-1)[:2].sum()
    assert torch.allclose(freqs(temperature=1.0, top_k=2, top_p=None), top2, atol=0.01)
    # softmax is about [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps the first two
    assert torch.allclose(freqs(temperature=1.0, top_k=None, top_p=0.8), top2, atol=0.01)


def test_the_padded_vocabulary_is_invisible_outside_the_head():
    """The head computes the vocabulary padded to a multiple of 64 (aligned GPU kernels): the padded
    columns get no probability and no gradient, and the weights, the logits returned and the state
    dict keep the true vocabulary (211)."""
    m = tiny_gpt().train()
    idx = torch.randint(0, VOCAB, (2, 16))
    hidden = m.hidden_states(idx)
    padded = model.padded_logits(hidden, m.lm_head.weight)
    assert padded.shape == (2, 16, 256) and torch.isneginf(padded[..., VOCAB:]).all()
    assert padded.softmax(-1)[..., VOCAB:].sum() == 0
    assert torch.allclose(padded[..., :VOCAB], m.lm_head(hidden), rtol=0, atol=1e-6)
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 16, VOCAB) and torch.isfinite(logits).all()
    loss.backward()
    assert m.lm_head.weight.grad.shape == (VOCAB, 64) and \
        torch.isfinite(m.lm_head.weight.grad).all()
    assert m.state_dict()["lm_head.weight"].shape == (VOCAB, 64)
    aligned = tiny_gpt(vocab_size=128)  # a multiple of 64 already: the head as it is
    hidden = aligned.hidden_states(idx % 128)
    assert torch.equal(model.padded_logits(hidden, aligned.lm_head.weight), aligned.lm_head(hidden))


def tiny_llama(**kw) -> GPT:
    return tiny_gpt(arch="llama", bias=False, tie_embeddings=False, n_kv_head=2, qk_norm=True, **kw)


def test_the_llama_family_generates_the_same_tokens_with_and_without_its_cache():
    """Rotary positions, GQA (2 key/value heads for 4 query heads) and QK-norm through the KV cache,
    past the block size (the context is cut and prefilled again), greedy and sampled."""
    m = tiny_llama()
    prompt = torch.randint(0, VOCAB, (2, 5))
    for options in (dict(temperature=0), dict(temperature=1.0, top_k=20)):
        outputs = []
        for use_cache in (True, False):
            torch.manual_seed(1)
            outputs.append(m.generate(prompt, 45, use_cache=use_cache, **options))
        assert torch.equal(*outputs) and outputs[0].shape == (2, 50)


def test_grouped_query_attention_on_a_cpu_reads_the_shared_heads_in_place():
    """On a CPU, SDPA serves 2 query heads from each key/value head without copying it (no
    repeat_interleave, with and without the KV cache): the outputs and gradients of the written-out
    form, which copies them."""
    copied, shared = tiny_llama(attn_kernel="manual"), tiny_llama(attn_kernel="flash")
    shared.load_state_dict(copied.state_dict())
    idx, targets = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    losses = [loss_and_grads(m, lambda m=m: m(idx, targets)[1]) for m in (copied, shared)]
    assert torch.allclose(losses[0][0], losses[1][0], rtol=1e-6)
    assert all(rel_err(losses[0][1][name], g) < 1e-5 for name, g in losses[1][1].items())
    with torch.profiler.profile() as prof:
        loss_and_grads(shared, lambda: shared(idx, targets)[1])
        tokens = shared.generate(idx[:, :4], 8, temperature=0.0)
    assert torch.equal(tokens, copied.generate(idx[:, :4], 8, temperature=0.0))
    assert not any("repeat_interleave" in e.key for e in prof.key_averages())


def test_the_llama_family_trains_both_loss_paths_alike_in_one_graph():
    m = tiny_llama().train()
    idx, targets = torch.randint(0, VOCAB, (3, 32)), torch.randint(0, VOCAB, (3, 32))
    chunked, chunked_grads = loss_and_grads(m, lambda: m(idx, targets, chunked_loss=True)[1])
    full, full_grads = loss_and_grads(m, lambda: m(idx, targets)[1])
    assert torch.allclose(chunked, full, rtol=1e-6)
    assert all(rel_err(chunked_grads[name], g) < 1e-5 for name, g in full_grads.items())
    assert not torch.equal(m.lm_head.weight, m.transformer.wte.weight)  # untied
    assert "transformer.wpe.weight" not in m.state_dict()  # rotary positions: none learned
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    assert torch.equal(compiled(idx, targets, chunked_loss=True)[1],
                       m(idx, targets, chunked_loss=True)[1])
    assert num_params(m.config, non_embedding=False) == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("config, message", [
    (dict(qk_norm=True), "GPT-2 has no qk_norm"), (dict(n_kv_head=2), "GPT-2 has no n_kv_head"),
    (dict(arch="llama"), "no biases"),
    (dict(arch="llama", bias=False, n_kv_head=3), "multiple of n_kv_head"),
    (dict(arch="mamba"), "unknown arch")])
def test_a_config_of_neither_family_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        GPT(tiny_config(**config))
