"""Weight-only int8 and int4 for inference (toolkit/quantize.py): the rows it keeps, the model it
makes, and `--quantize` in test.py and eval.py."""
import json

import pytest
import torch

from conftest import assert_one_line_error, run_main
from model import GPT, GPTConfig
from toolkit.checkpoint import save_checkpoint
from toolkit.cli import CLIError
from toolkit.quantize import INT4_GROUP, Int4Linear, Int8Linear, check_quantize, quantize_model


def test_an_int8_row_is_the_float_row_to_half_a_step_of_its_scale():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 70)
    with torch.no_grad():
        linear.weight[3] = 0.0  # a row of zeros keeps a finite scale
    q = Int8Linear(linear)
    assert q.int8_weight.dtype == torch.int8 and q.int8_weight.abs().max() == 127
    step = q.scales.float()[:, None]
    # the bfloat16 scale's own rounding (2^-9) moves the row's largest value by as much again
    assert ((q.weight - linear.weight).abs() <= step / 2 + linear.weight.abs() * 2**-8).all()
    assert q.weight[3].eq(0).all()
    x = torch.randn(2, 5, 48)
    err = (q(x) - linear(x)).norm() / linear(x).norm()
    assert 0 < err < 0.01  # int8 weights and bfloat16 activations: close, not equal


def test_an_int4_group_is_the_float_group_to_half_a_step_of_its_scale():
    """70 rows (the kernel's 16-row packing padded and cut off again), 96 inputs: 3 groups a row."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 70)
    q = Int4Linear(linear)
    groups = linear.weight.reshape(70, -1, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (q.weight - linear.weight).reshape(70, -1, INT4_GROUP).abs().amax(-1)
    # the bfloat16 scale and zero point round by 2^-9 of the group's values as well
    assert (error <= step / 2 + groups.abs().amax(-1) * 2**-7).all()
    x = torch.randn(2, 5, 96)
    exact = torch.nn.functional.linear(x, q.weight, linear.bias)
    assert (q(x) - exact).norm() / exact.norm() < 0.01  # the kernel is its dequantized weight
    err = (q(x) - linear(x)).norm() / linear(x).norm()
    assert 0.005 < err < 0.1  # 16 levels a group: coarser than int8
    assert isinstance(quantize_model(torch.nn.Sequential(torch.nn.Linear(48, 16)), "int4")[0],
                      Int8Linear)  # inputs that are no multiple of the group stay int8


@pytest.mark.parametrize("quantize,linear,tolerance", [("int8", Int8Linear, 0.02),
                                                       ("int4", Int4Linear, 0.15)])
@pytest.mark.parametrize("family", [dict(bias=True), dict(arch="llama", bias=False, qk_norm=True,
                                                          tie_embeddings=False, n_kv_head=1)],
                         ids=["gpt2", "llama"])
def test_a_quantized_model_has_no_float_linear_and_predicts_as_the_float_one(family, quantize,
                                                                            linear, tolerance):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, vocab_size=70, n_layer=2, n_head=2, n_embd=32, **family))
    idx = torch.randint(0, 70, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, loss = model(idx, idx)
        q = quantize_model(model, quantize)
        q_logits, q_loss = q(idx, idx)
        generated = q.generate(idx[:, :5], 30, temperature=0.0)
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    assert sum(isinstance(m, linear) for m in q.modules()) == 4 * 2 + 1
    assert (q_logits - logits).norm() / logits.norm() < tolerance
    assert abs(q_loss.item() - loss.item()) < 0.01
    assert generated.shape == (3, 35)


def test_quantize_runs_on_a_cpu_only():
    check_quantize("int8", torch.device("cpu"))
    check_quantize(None, torch.device("cuda"))
    with pytest.raises(CLIError, match="--quantize int8 runs on a CPU.*use --dtype bfloat16, or "
                                       "add --device cpu"):
        check_quantize("int8", torch.device("cuda"))


@pytest.fixture(scope="module")
def char_ckpt(char_data, tmp_path_factory):
    facts = json.loads((char_data / "meta.json").read_text())
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=facts["vocab_size"], n_layer=1, n_head=2,
                          n_embd=32))
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": facts}, str(path))
    return path


def test_test_py_samples_and_eval_py_scores_with_int8_and_int4_weights(char_ckpt, char_data):
    for quantize in ("int8", "int4"):
        result = run_main("test.py", "--ckpt", char_ckpt, "--device", "cpu", "--quantize",
                          quantize, "--prompt", "def ", "--num-samples", "2", "--max-new-tokens",
                          "20", "--stream")
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("def ") >= 2
    scores = {}
    for quantize in ([], ["--quantize", "int8"], ["--quantize", "int4"]):
        result = run_main("eval.py", "--ckpt", char_ckpt, "--data-dir", char_data, "--limit", "8",
                          "--device", "cpu", *quantize)
        assert result.returncode == 0, result.stderr
        scores[" ".join(quantize)] = json.loads(result.stdout.splitlines()[-1])["val"]["loss"]
    float_loss = scores.pop("")
    assert all(loss != float_loss and abs(loss - float_loss) < 0.05 for loss in scores.values())
    assert scores["--quantize int8"] != scores["--quantize int4"]


def test_an_unknown_quantization_is_one_line(char_ckpt):
    assert_one_line_error(run_main("test.py", "--ckpt", char_ckpt, "--quantize", "int3"),
                          "--quantize: invalid choice: 'int3'")


def test_one_row_compiled_is_the_dequantized_product_in_float32():
    """Compiled (test.py --compile), one row reads the int8 weights in a fused float32 reduction:
    the product of the dequantized weight to float32's rounding (inductor keeps the activations in
    float32 inside the kernel), where the int8 kernel multiplies bfloat16 activations."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(256, 96))
    x = torch.randn(1, 256)
    exact = torch.nn.functional.linear(x, layer.weight, layer.bias)
    compiled = torch.compile(layer, dynamic=False)(x)
    assert torch.allclose(compiled, exact, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x), exact, rtol=1e-5, atol=1e-5)  # bfloat16 activations
    assert torch.allclose(layer(x), exact, rtol=2e-2, atol=2e-2)
