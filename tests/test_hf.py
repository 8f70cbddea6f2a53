"""toolkit/hf.py: HF GPT-2 folders both ways, checked against transformers' own
GPT2LMHeadModel."""
import json
import os

import pytest
import torch

from conftest import VOCAB, perturb, rel_err, run_main, tiny_gpt
from toolkit.chat import chat_prompt
from toolkit.hf import load_gpt2, save_gpt2
from toolkit.model_sources import load_model
from toolkit.tokenizers import load_tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def random_hf_model():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg)
    hf.config._attn_implementation = "eager"
    return perturb(hf)


@torch.no_grad()
def test_load_hf_safetensors_matches_transformers(tmp_path):
    hf = random_hf_model()
    hf.save_pretrained(tmp_path)
    m = load_gpt2(str(tmp_path))
    idx = torch.randint(0, VOCAB, (2, 32))
    assert rel_err(m(idx)[0], hf(idx).logits) < 1e-5
    assert m.lm_head.weight is m.transformer.wte.weight


@torch.no_grad()
def test_load_hf_bin_without_prefix(tmp_path):
    hf = random_hf_model()
    hf.config.to_json_file(tmp_path / "config.json")
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()
             if k != "lm_head.weight"}
    # old checkpoints carry mask buffers
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    torch.save(state, tmp_path / "pytorch_model.bin")
    m = load_gpt2(str(tmp_path))
    idx = torch.randint(0, VOCAB, (2, 17))
    assert rel_err(m(idx)[0], hf(idx).logits) < 1e-5


@pytest.mark.parametrize("bias", [True, False])
@torch.no_grad()
def test_save_pretrained_loads_in_transformers(tmp_path, bias):
    m = tiny_gpt(bias=bias)
    save_gpt2(m, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json",
                                                     "merges.txt", "model.safetensors",
                                                     "special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json", "vocab.json"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out",
                                                      attn_implementation="eager").eval()
    idx = torch.randint(0, VOCAB, (2, 32))
    assert rel_err(m(idx)[0], hf(idx).logits) < 1e-5
    again = load_gpt2(str(tmp_path / "out"))
    assert torch.equal(again(idx)[0], load_gpt2(str(tmp_path / "out"))(idx)[0])
    assert rel_err(again(idx)[0], m(idx)[0]) < 1e-6


def test_from_pretrained_rejects_incompatible_config(tmp_path):
    m = tiny_gpt()
    save_gpt2(m, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    with pytest.raises(ValueError, match="activation_function"):
        load_gpt2(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_norm_epsilon": 1e-6}))
    with pytest.raises(ValueError, match="layer_norm_epsilon"):
        load_gpt2(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        load_gpt2(str(tmp_path))


def test_from_pretrained_hub_names_only_from_local_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError) as e:
        load_gpt2("gpt2")
    # the CLI that the pinned huggingface_hub installs
    assert ("\n" not in str(e.value)
            and "`hf download openai-community/gpt2 --local-dir DIR`" in str(e.value))
    with pytest.raises(FileNotFoundError, match="no model directory"):
        load_gpt2(str(tmp_path / "missing"))
    # a snapshot in the cache, laid out as huggingface_hub writes it, is found under either
    # repository name
    m = tiny_gpt()
    repo = tmp_path / "hub" / "models--openai-community--gpt2"
    save_gpt2(m, str(repo / "snapshots" / "abc123"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    idx = torch.randint(0, VOCAB, (1, 8))
    for name in ("gpt2", "openai-community/gpt2"):
        assert torch.allclose(load_gpt2(name)(idx)[0], m(idx)[0], atol=1e-6)


def test_a_gpt2_folder_that_ships_a_chat_template_chats_in_it(tmp_path, gpt2_vocabulary):
    save_gpt2(tiny_gpt(vocab_size=50257, n_embd=16), str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}"
                               "{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}")
    # (not end-of-text: the stop id is the eos token's, one token in GPT-2's vocabulary)
    config["eos_token"] = "hello"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    os.remove(tmp_path / "generation_config.json")  # the eos token's id ends a reply
    facts = load_model(str(tmp_path))[1]
    assert facts["chat_template"]["stop_ids"] == [31373]
    tok = load_tokenizer(facts)
    assert chat_prompt([{"role": "user", "content": "你好<|endoftext|>"}], tok) == [
        *tok.encode("user: 你好"), 50256, *tok.encode("hello")]


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab.json and merges.txt"])
def test_a_gpt2_folder_of_its_own_vocabulary_samples_and_exports_as_transformers_does(tmp_path,
                                                                                     files):
    """A GPT-2 trained on another vocabulary ships it (tokenizer.json, or GPT2Tokenizer's
    vocab.json and merges.txt): read as transformers reads it, the same ids and greedy text, and
    exported, a folder transformers reads as the same tokenizer and model."""
    from tokenizers import Tokenizer as HFTokenizer

    from toolkit.prepare import train_bpe
    from toolkit.tokenizers import EOT_TEXT
    texts = ["模型在这里读中文的句子。数据准备在平坦的内存中。", "The quick brown fox reads the "
             "manual, then the model writes its own text."] * 20
    bpe = HFTokenizer.from_str(train_bpe(texts, 300))
    folder = tmp_path / "hf"
    config = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=bpe.token_to_id(EOT_TEXT),
                                     eos_token_id=bpe.token_to_id(EOT_TEXT))
    torch.manual_seed(0)
    perturb(transformers.GPT2LMHeadModel(config), std=0.3).save_pretrained(folder)
    if files == "tokenizer.json":
        transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT_TEXT,
                                             bos_token=EOT_TEXT).save_pretrained(folder)
    else:
        spec = json.loads(bpe.to_str())["model"]
        (folder / "vocab.json").write_text(json.dumps(spec["vocab"]))
        (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(
            (m if isinstance(m, str) else " ".join(m)) + "\n" for m in spec["merges"]))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    reference = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    model, facts = load_model(str(folder))
    tok = load_tokenizer(facts)
    assert facts["tokenizer"] == "bpe" and tok.eot_id == bpe.token_to_id(EOT_TEXT)
    for text in ("模型读中文的句子。", "The fox writes text 123."):
        assert tok.encode(text) == theirs(text)["input_ids"]
    prompt = theirs("The model")["input_ids"]
    free = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    sample = run_main("test.py", "--ckpt", folder, "--prompt", "The model", "--temperature", "0",
                      "--max-new-tokens", "8", "--num-samples", "1", "--device", "cpu",
                      "--dtype", "float32")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("The model" + theirs.decode(free[0, len(prompt):]) + "\n")
    exported = run_main("test.py", "--ckpt", folder, "--export-hf", tmp_path / "out")
    assert exported.returncode == 0, exported.stderr
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert again("模型读中文。The fox.")["input_ids"] == theirs("模型读中文。The fox.")["input_ids"]
    assert load_model(str(tmp_path / "out"))[1] == facts
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(back[k], v) for k, v in reference.state_dict().items())
    if files == "tokenizer.json":  # data in its vocabulary, and training from the folder
        (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                     for t in texts))
        assert run_main("tokenizer.py", "--input", tmp_path / "docs.jsonl", "--tokenizer-file",
                        folder / "tokenizer.json", "--append-eod", "--output-dir",
                        tmp_path / "data").returncode == 0
        trained = run_main("train.py", "--init-from", folder, "--data-dir", tmp_path / "data",
                           "--out-dir", tmp_path / "run", "--max-iters", "2", "--block-size",
                           "16", "--batch-size", "2", "--eval-interval", "2", "--eval-iters", "1",
                           "--device", "cpu")
        assert trained.returncode == 0, trained.stderr[-2000:]
