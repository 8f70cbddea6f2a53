"""The llama family (--arch llama) through the scripts: training, exact resume, sampling, the HF
export that transformers reads, and an open model's HF folder instruction-tuned with LoRA, chatted
with and exported back."""
import json

import pytest
import torch

from conftest import TINY_MODEL, assert_one_line_error, rel_err, run_main
from test_hf_llama import hf_folder, tokenizer_json  # noqa: F401  (a fixture)
from test_sft import chats  # noqa: F401  (a fixture)
from toolkit.checkpoint import load_checkpoint
from toolkit.model_sources import load_model

transformers = pytest.importorskip("transformers")
# TINY_MODEL's 2 heads share one key/value head
LLAMA = ["--arch", "llama", "--n-kv-head", "1", "--qk-norm"]


def train(char_data, out_dir, *extra):
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", out_dir, *TINY_MODEL,
                      *LLAMA, *extra)
    assert result.returncode == 0, result.stderr
    return load_checkpoint(str(out_dir / "ckpt.pt"))


def test_it_trains_resumes_exactly_samples_and_exports(char_data, tmp_path):
    common = ["--max-iters", "12", "--lr-decay-iters", "12", "--warmup-iters", "2",
              "--eval-interval", "6", "--dropout", "0.1"]
    full = train(char_data, tmp_path / "full", *common)
    config = full["model_config"]
    assert ((config["arch"], config["n_kv_head"], config["qk_norm"], config["bias"]) ==
            ("llama", 1, True, False))
    assert "transformer.wpe.weight" not in full["model"] and "lm_head.weight" in full["model"]
    assert full["history"]["val"][-1] < full["history"]["val"][0] - 0.3
    train(char_data, tmp_path / "split", *common[:1], "7", *common[2:])
    resumed = train(char_data, tmp_path / "split", "--init-from", "resume", "--max-iters", "12")
    # bitwise, Muon and dropout included
    assert resumed["history"]["loss"] == full["history"]["loss"]
    assert all(torch.equal(value, resumed["model"][key]) for key, value in full["model"].items())

    sample = ["--prompt", "def ", "--temperature", "0", "--max-new-tokens", "20",
              "--num-samples", "1", "--device", "cpu", "--no-stream"]
    from_ckpt = run_main("test.py", "--ckpt", tmp_path / "full" / "ckpt.pt", *sample)
    assert from_ckpt.returncode == 0 and from_ckpt.stdout.startswith("def "), from_ckpt.stderr
    exported = run_main("test.py", "--ckpt", tmp_path / "full" / "ckpt.pt", "--export-hf",
                        tmp_path / "hf")
    # QK-norm: Qwen3's
    assert "LlamaForCausalLM" not in exported.stdout and "Qwen3ForCausalLM" in exported.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_model(str(tmp_path / "full" / "ckpt.pt"))
    idx = torch.randint(0, ours.config.vocab_size, (2, 32))
    with torch.no_grad():
        assert rel_err(hf(idx).logits, ours(idx)[0]) <= 1e-5
    # char vocabulary: its facts beside it
    from_hf = run_main("test.py", "--ckpt", tmp_path / "hf", *sample)
    assert from_hf.stdout == from_ckpt.stdout


@pytest.mark.parametrize("flags, message", [
    # equal thirds
    (["--arch", "llama", "--n-kv-head", "1", "--no-qk-norm"], "--n-kv-head 1 below --n-head 2"),
    # QK-norm (the default) sees a shard's heads
    (["--arch", "llama", "--n-kv-head", "2"], "add --no-qk-norm"),
    (["--arch", "llama", "--no-qk-norm"], None),  # Llama's layout: tests/test_scale.py trains it
])
def test_tensor_parallel_takes_llamas_layout(char_data, tmp_path, flags, message):
    result = run_main("train_ds.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                      *flags, "--tp-size", "2", "--estimate-memory", "--num-gpus", "2",
                      env={"DS_ACCELERATOR": "cpu"})
    if message is None:
        assert result.returncode == 0 and "2 tensor-parallel" in result.stdout, result.stderr
    else:
        assert_one_line_error(result, message)


def test_an_open_models_folder_is_instruction_tuned_with_lora_chats_and_goes_back(
        tmp_path, chats, tokenizer_json):  # noqa: F811
    # as Qwen3-0.6B and SmolLM2: tied
    folder = hf_folder(tmp_path / "open", tokenizer_json, "qwen3", tie=True)
    train, val = chats
    result = run_main("finetune.py", "--task", "sft", "--train", train, "--val", val,
                      "--init-from", folder, "--out-dir", tmp_path / "sft", "--lora-rank", "8",
                      "--epochs", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    adapters = load_checkpoint(str(tmp_path / "sft" / "ckpt.pt"))
    assert "model" not in adapters and adapters["lora"]["base"]["path"] == folder
    talk = run_main("test.py", "--ckpt", tmp_path / "sft" / "ckpt.pt", "--chat",
                    "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu",
                    input="Title of assert?\n")
    assert talk.returncode == 0 and talk.stdout.count("model> ") == 1, talk.stderr
    merged = run_main("finetune.py", "--merge-lora", tmp_path / "sft" / "ckpt.pt", "--out-dir",
                      tmp_path / "merged")
    assert merged.returncode == 0, merged.stderr
    out = json.loads(merged.stdout.splitlines()[-1])["out"]
    assert run_main("test.py", "--ckpt", out, "--export-hf", tmp_path / "back").returncode == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ours, _ = load_model(out)
    idx = torch.randint(0, ours.config.vocab_size, (1, 16))
    with torch.no_grad():
        assert rel_err(back(idx).logits, ours(idx)[0]) <= 1e-5
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    # the chat template's tokens came back with the weights
    assert len(theirs) == ours.config.vocab_size


def test_qk_norm_under_bfloat16_autocast_takes_the_fused_norm_without_warnings():
    """The queries and keys reach QK-norm in bfloat16 (what --dtype auto picks on AVX512-BF16, AMX
    and CUDA): a float32 weight beside them printed torch's 'Mismatch dtype' warning each run."""
    import warnings

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50,
                          arch="llama", bias=False, qk_norm=True))
    idx = torch.randint(0, 50, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
    assert model.transformer.h[0].attn.q_norm.weight.grad.dtype == torch.float32
