"""toolkit/hf_llama.py: HF Llama and Qwen3 folders both ways, checked against transformers' own models: folders
built by transformers itself (random weights, tiny shapes, a BPE trained here), nothing downloaded."""
import json
import os

import pytest
import torch

from conftest import assert_one_line_error, rel_err, run_main
from toolkit.model_sources import load_model, save_hf
from toolkit.tokenizers import Tokenizer, train_bpe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

HELD_OUT = ["The quick brown fox reads the manual.", "模型在这里读中文的句子。", "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    texts = ["hello world, a tiny corpus of words " * 20, "中文的句子也在这里，模型读它。" * 20,
             "def f(x):\n    return x + 1\n" * 20]
    return train_bpe(iter(texts), 320)


def hf_folder(path, tokenizer_json: str, family: str, tie: bool, shards: bool = False) -> str:
    """A tiny random LlamaForCausalLM or Qwen3ForCausalLM written by transformers, with our tokenizer.json."""
    vocab = Tokenizer("bpe", tokenizer_json=tokenizer_json).vocab_size
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, rope_theta=5000.0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=24, **shape))
    torch.manual_seed(0)
    with torch.no_grad():  # off the trivial init: norms not all ones
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, max_shard_size="20KB" if shards else "5GB")
    (path / "tokenizer.json").write_text(tokenizer_json)
    return str(path)


@pytest.mark.parametrize("family, tie, shards", [("llama", False, False), ("llama", True, True),
                                                 ("qwen3", False, True), ("qwen3", True, False)])
def test_an_hf_folder_reads_and_writes_back_as_the_same_model(tmp_path, tokenizer_json, family, tie, shards):
    folder = hf_folder(tmp_path / "hf", tokenizer_json, family, tie, shards)
    assert shards == os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model, facts = load_model(folder)
    assert (model.config.arch, model.config.qk_norm, model.config.tie_embeddings) == ("llama", family == "qwen3", tie)
    idx = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        ours = model(idx)[0]
        assert rel_err(ours, reference(idx).logits) <= 1e-5
    print(save_hf(model, str(tmp_path / "out"), facts))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(reference)
    with torch.no_grad():
        assert rel_err(again(idx).logits, ours) <= 1e-5
    ours_tokenizer, theirs = Tokenizer("bpe", tokenizer_json=tokenizer_json), \
        transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in HELD_OUT:
        assert theirs(text)["input_ids"] == ours_tokenizer.encode(text), text


def test_a_folder_this_toolkit_cannot_run_is_one_line(tmp_path, tokenizer_json):
    folder = hf_folder(tmp_path / "hf", tokenizer_json, "llama", tie=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    config.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "3"), "rope scaling")
    config.pop("rope_scaling")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    os.remove(tmp_path / "hf" / "tokenizer.json")
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "3"), "no tokenizer.json")


def test_chat_with_a_folder_of_its_own_template_says_what_to_do(tmp_path, tokenizer_json):
    folder = hf_folder(tmp_path / "hf", tokenizer_json, "qwen3", tie=True)
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": chatml}))
    result = run_main("test.py", "--ckpt", folder, "--chat", "--device", "cpu", input="hi\n")
    assert_one_line_error(result, "comes with a chat template of its own", "finetune.py --task sft")
    os.remove(tmp_path / "hf" / "tokenizer_config.json")  # a base model's folder
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--chat", "--device", "cpu", input="hi\n"),
                          "was never instruction-tuned")
