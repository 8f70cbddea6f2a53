"""toolkit/optim.py: Muon's orthogonalised update, its AdamW half, and how train.py picks and keeps
an optimizer."""
import pytest
import torch

from conftest import TINY_MODEL, assert_one_line_error, run_main
from model import GPT, GPTConfig
from toolkit.checkpoint import load_checkpoint, save_checkpoint
from toolkit.optim import EMBEDDING_LR_SCALE, Muon, make_optimizer, orthogonalize
from toolkit.pretraining import settle
from toolkit.train_config import TrainConfig, parse_config, settle_optimizer
from toolkit.training import TorchEngine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 48), (32, 96), (96, 32)])
def test_orthogonalize_pushes_singular_values_towards_one(shape, dtype):
    generator, k = torch.Generator().manual_seed(0), min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=generator))
    update = u @ torch.diag(torch.logspace(-1, 1, k)) @ v.T  # singular values from 0.1 to 10
    orthogonal = orthogonalize(update, dtype=dtype)
    singular = torch.linalg.svdvals(orthogonal)
    assert singular.min() > 0.5 and singular.max() < 1.3, singular  # a spread of 100 -> about 1
    assert orthogonal.shape == update.shape and orthogonal.dtype == update.dtype


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    weights = [torch.randn(8, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    ours, reference = [w.clone().requires_grad_() for w in weights], \
        [w.clone().requires_grad_() for w in weights]
    groups = lambda ps: [{"params": ps[:1], "weight_decay": 0.1},
                         {"params": ps[1:], "weight_decay": 0.0}]
    muon = Muon(groups(ours), lr=1e-2, betas=(0.9, 0.99))
    adamw = torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                              foreach=False)
    for step in range(5):
        for params, optimizer in ((ours, muon), (reference, adamw)):
            grads = torch.randn(12, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(step))
            params[0].grad, params[1].grad = grads[:8, None].expand(8, 4).clone() * grads[8:], \
                grads[8:].clone()
            optimizer.step()
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_muon_update_is_orthogonal_at_muon_lr():
    """Muon's matrices move by ~muon_lr in every direction; the rest is AdamW's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16))
    optimizer = make_optimizer(model, "muon", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99),
                               muon_lr=0.05)
    muon_group, *adamw_groups = optimizer.param_groups
    fc = model.transformer.h[0].mlp.c_fc.weight  # 64 x 16: tall
    assert muon_group["muon"] and any(p is fc for p in muon_group["params"])
    assert muon_group["lr"] == 0.05 and all(not g["muon"] and g["lr"] == 1e-3 for g in adamw_groups)
    # embeddings keep AdamW
    assert not any(p is model.transformer.wte.weight for p in muon_group["params"])
    before = fc.detach().clone()
    # 64 tokens: with 16 the gradient's weakest directions can be too weak for five
    # Newton-Schulz iterations to bring to 1 (the write-up trades that for speed), and the test
    # failed on some draws
    model(torch.randint(0, 16, (8, 8)), torch.randint(0, 16, (8, 8)),
          chunked_loss=True)[1].backward()
    optimizer.step()
    # sqrt(64 / 16) = 2 for a tall matrix
    singular = torch.linalg.svdvals((before - fc.detach()) / (0.05 * 2))
    # LayerNorm's output sums to zero over its 16 features: the gradient has rank 15
    singular = singular[:15]
    assert singular.min() > 0.5 and singular.max() < 1.3, singular


def test_an_untied_embedding_takes_larger_steps_under_muon():
    """The llama family's own input embedding moves EMBEDDING_LR_SCALE x AdamW's rate (AdamW's first
    step moves every weight with a gradient by its rate), its head AdamW's rate; GPT-2's tied
    embedding is its head too and keeps AdamW's rate, as does an untied embedding under AdamW
    (pretrained weights' default)."""
    def first_steps(arch: str, optimizer: str) -> tuple[float, float]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16,
                              arch=arch, bias=arch == "gpt2", tie_embeddings=arch == "gpt2"))
        opt = make_optimizer(model, optimizer, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99),
                             muon_lr=0.05)
        wte, head = model.transformer.wte.weight, model.lm_head.weight
        before = wte.detach().clone(), head.detach().clone()
        model(torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8)),
              chunked_loss=True)[1].backward()
        opt.step()
        return (wte - before[0]).abs().max().item(), (head - before[1]).abs().max().item()
    embedding, head = first_steps("llama", "muon")
    assert embedding == pytest.approx(1e-3 * EMBEDDING_LR_SCALE, rel=1e-3) and \
        head == pytest.approx(1e-3, rel=1e-3)
    assert first_steps("gpt2", "muon") == pytest.approx((1e-3, 1e-3), rel=1e-3)
    assert first_steps("llama", "adamw") == pytest.approx((1e-3, 1e-3), rel=1e-3)


def test_an_optimizer_state_laid_out_otherwise_is_one_line(char_data, tmp_path):
    """A checkpoint whose Muon groups differ from this version's (before the untied embedding's own
    group) is refused in one line that says how to go on from its weights, and is left as it was."""
    flags = ["--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL, "--eval-interval", "100"]
    assert run_main("train.py", *flags, "--max-iters", "2").returncode == 0
    path = tmp_path / "ckpt.pt"
    ckpt = load_checkpoint(str(path))
    *groups, embedding = ckpt["optimizer"]["param_groups"]
    groups[1]["params"] += embedding["params"]  # the embedding back among AdamW's decayed weights
    ckpt["optimizer"]["param_groups"] = groups
    save_checkpoint(ckpt, str(path))
    written = path.read_bytes()
    resumed = run_main("train.py", *flags, "--init-from", "resume", "--max-iters", "4")
    assert_one_line_error(resumed, "optimizer state does not fit",
                          f"--init-from {path} --optimizer muon")
    assert path.read_bytes() == written


def test_newton_schulz_runs_in_the_runs_dtype_where_it_is_bfloat16(tmp_path):
    """bfloat16 iterations where the run computes in bfloat16 (faster where the hardware has it:
    docs/performance.md); float32 everywhere else, as a float16 run's would overflow its range."""
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16))
    picked = {dtype: make_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.99), muon_lr=0.05,
                                    dtype=dtype).ns_dtype
              for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    assert picked == {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32,
                      torch.float32: torch.float32}
    cfg = settled("--dtype", "bfloat16")  # train.py hands its dtype on
    engine = TorchEngine(str(tmp_path / "ckpt.pt"))
    engine.start(model, cfg, torch.device("cpu"), torch.bfloat16, loss=None)
    assert engine.optimizer.ns_dtype == torch.bfloat16


def test_recipe_of_the_quick_start_is_pinned():
    """`python train.py` with no flags is the measured CPU recipe (docs/performance.md): change
    both together."""
    cfg = settled("--device", "cpu")  # the CPU recipe (a GPU has its own defaults)
    recipe = dict(arch="llama", n_layer=4, n_head=4, n_kv_head=None, n_embd=128, block_size=64,
                  batch_size=32, grad_accum=1, max_iters=300, lr=4e-3, min_lr=None, warmup_iters=25,
                  lr_decay_iters=None, optimizer="muon", muon_lr=0.03, weight_decay=0.1, beta1=0.9,
                  beta2=0.99, grad_clip=1.0, dropout=0.0, bias=False, qk_norm=True, dtype="auto",
                  compile=False, eval_interval=100, eval_iters=20)
    assert {k: getattr(cfg, k) for k in recipe} == recipe
    assert settle_optimizer(TrainConfig()).optimizer == "muon"


def settled(*argv: str) -> TrainConfig:
    """The configuration train.py settles from these flags (a new run: nothing to resume)."""
    cfg, _ = parse_config(list(argv))
    return settle(cfg, TorchEngine("no-such-run/ckpt.pt"))[0]


def test_adamw_rate_falls_with_width_from_scratch():
    """4e-3 at the quick start's width; AdamW on the blocks' matrices from scratch gets 4e-3 x 128 /
    width (GPT-3's rates: 6e-4 at 768), the embeddings and norms that Muon leaves to AdamW keep
    4e-3, and a given --lr stands."""
    assert settled("--optimizer", "adamw").lr == 4e-3
    assert settled("--preset", "gpt2", "--optimizer", "adamw").lr == pytest.approx(4e-3 / 6)
    assert settled("--preset", "gpt2").lr == 4e-3
    assert settled("--preset", "gpt2", "--optimizer", "adamw", "--lr", "1e-3").lr == 1e-3


def test_scratch_trains_with_muon_and_a_resume_keeps_the_optimizer(char_data, tmp_path):
    flags = ["--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL, "--max-iters", "4",
             "--eval-interval", "4"]
    assert run_main("train.py", *flags).returncode == 0
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["train_config"]["optimizer"] == "muon" and \
        ckpt["optimizer"]["param_groups"][0]["muon"]
    switched = run_main("train.py", *flags, "--init-from", "resume", "--max-iters", "6",
                        "--optimizer", "adamw")
    assert_one_line_error(switched, "trained with --optimizer muon", "--optimizer adamw")
    resumed = run_main("train.py", *flags, "--init-from", "resume", "--max-iters", "6",
                       "--optimizer", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["train_config"]["optimizer"] == "muon"


def test_train_ds_offers_no_muon(char_data, tmp_path):
    """DeepSpeed trains with the optimizer of its config: train_ds.py lists neither Muon nor
    its rate."""
    help_text = run_main("train_ds.py", "--help", env={"DS_ACCELERATOR": "cpu"}).stdout
    assert "--optimizer {auto,adamw}" in help_text and "--muon-lr" not in help_text
    result = run_main("train_ds.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                      "--optimizer", "muon", cwd=tmp_path, env={"DS_ACCELERATOR": "cpu"})
    assert_one_line_error(result, "--optimizer: invalid choice: 'muon'")
    assert result.returncode == 2 and not (tmp_path / "ds").exists()


def test_a_new_muon_lr_on_resume_takes_effect(char_data, tmp_path):
    """The checkpoint's optimizer state carries the old rates; the flags given on resume must win
    over them."""
    flags = ["--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL, "--eval-interval", "100"]
    assert run_main("train.py", *flags, "--max-iters", "4").returncode == 0
    before = load_checkpoint(str(tmp_path / "ckpt.pt"))["model"]
    resumed = run_main("train.py", *flags, "--init-from", "resume", "--max-iters", "6",
                       "--muon-lr", "0")
    assert resumed.returncode == 0, resumed.stderr
    after = load_checkpoint(str(tmp_path / "ckpt.pt"))["model"]
    fc = "transformer.h.0.mlp.c_fc.weight"
    assert torch.equal(before[fc], after[fc])  # Muon at rate 0: the matrices stay
    # AdamW goes on
    assert not torch.equal(before["transformer.wte.weight"], after["transformer.wte.weight"])
