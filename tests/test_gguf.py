"""GGUF export (test.py --export-gguf, toolkit/gguf_export.py), checked by llama.cpp itself through
llama-cpp-python: on the same ids its logits equal ours, and its tokenizer gives our ids on held-out
English, Chinese and code, for both model families and every tokenizer the toolkit makes."""
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp import Llama, llama_vocab_is_eog
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from conftest import (ROOT, TINY_MODEL, assert_one_line_error, llama3_folder, rel_err, run_main,
                      tiny_gpt)
from toolkit.chat import add_chat_tokens, chat_prompt
from toolkit.cli import CLIError
from toolkit.checkpoint import load_checkpoint, save_checkpoint
from toolkit.gguf_export import SPLIT_PATTERNS, save_gguf
from toolkit.model_sources import load_model
from toolkit.prepare import default_corpus_documents
from toolkit.sampling import prompt_ids
from toolkit.prepare import train_bpe
from toolkit.tokenizers import Tokenizer, load_tokenizer

# written for these tests; the trained BPE never sees them
HELD_OUT = {"english": "The quick brown fox jumps over the lazy dog, twice; then it rests "
                       "(quietly).\n",
            "chinese": "小明今天去图书馆借了三本书，回家以后一直读到晚上十点。",
            "code": "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # circle\n"
                    "\tprint({'a': [1, 2]})\n"}
FAMILIES = {"qwen3": dict(arch="llama", bias=False, qk_norm=True),  # the default family
            # GQA, untied, no QK-norm
            "llama": dict(arch="llama", bias=False, n_kv_head=2, tie_embeddings=False),
            "gpt2": dict()}
CHARS = "".join(sorted(set("".join(HELD_OUT.values()))))
QWEN2_PATTERN = next(pattern for pattern, name in SPLIT_PATTERNS.items() if name == "qwen2")


def llama_cpp(path: Path) -> Llama:
    return Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                 seed=0)


def logits_of(llm: Llama, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.tensor(np.array(llm.scores[: len(ids)]))


def ours(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_computes_our_logits_for_both_families(family, tmp_path):
    tok = Tokenizer("char", chars=CHARS, char_eot=True)
    model = tiny_gpt(vocab_size=tok.vocab_size, block_size=64, **FAMILIES[family])
    print(save_gguf(model, tmp_path / "m.gguf", tok.facts(), "f32"))
    llm = llama_cpp(tmp_path / "m.gguf")
    assert llm.metadata["general.architecture"] == family
    ids = tok.encode(HELD_OUT["code"][:60])
    theirs, mine = logits_of(llm, ids), ours(model, ids)
    assert rel_err(theirs, mine) < 1e-3 and (theirs.argmax(-1) == mine.argmax(-1)).all()
    llm.close()


def test_an_embedding_with_more_rows_than_ids_exports_as_qwen3s_does(tmp_path):
    """Qwen3's folders pad the embedding past the tokenizer (151,936 rows, 151,669 ids): the rows
    without text become control tokens, as llama.cpp's converter writes them."""
    tok = Tokenizer("char", chars=CHARS, char_eot=True)
    model = tiny_gpt(vocab_size=tok.vocab_size + 13, block_size=64, **FAMILIES["qwen3"])
    save_gguf(model, tmp_path / "m.gguf", tok.facts(), "f32")
    llm = llama_cpp(tmp_path / "m.gguf")
    assert llm.n_vocab() == tok.vocab_size + 13
    ids = tok.encode(HELD_OUT["code"][:60])
    assert llm.tokenize(HELD_OUT["code"][:60].encode(), add_bos=False, special=False) == ids
    theirs, mine = logits_of(llm, ids), ours(model, ids)
    assert rel_err(theirs, mine) < 1e-3 and (theirs.argmax(-1) == mine.argmax(-1)).all()
    llm.close()
    # fewer rows than ids: the tokenizer would name tokens the model has no row for
    small = tiny_gpt(vocab_size=tok.vocab_size - 1, block_size=64, **FAMILIES["qwen3"])
    with pytest.raises(CLIError, match="token rows but its tokenizer"):
        save_gguf(small, tmp_path / "small.gguf", tok.facts(), "f32")


def test_weight_types_are_smaller_and_stay_close(tmp_path):
    tok = Tokenizer("char", chars=CHARS, char_eot=True)
    model = tiny_gpt(vocab_size=tok.vocab_size, block_size=64, **FAMILIES["qwen3"])
    ids = tok.encode(HELD_OUT["english"][:60])
    mine, sizes = ours(model, ids), {}
    for outtype, bound in (("f32", 1e-3), ("f16", 3e-3), ("bf16", 3e-2), ("q8_0", 3e-2)):
        save_gguf(model, tmp_path / f"{outtype}.gguf", tok.facts(), outtype)
        llm = llama_cpp(tmp_path / f"{outtype}.gguf")
        theirs = logits_of(llm, ids)
        llm.close()
        agree = (theirs.argmax(-1) == mine.argmax(-1)).float().mean().item()
        print(outtype, rel_err(theirs, mine), agree)
        assert rel_err(theirs, mine) < bound and agree > 0.9, \
            (outtype, rel_err(theirs, mine), agree)
        sizes[outtype] = (tmp_path / f"{outtype}.gguf").stat().st_size
    assert sizes["q8_0"] < sizes["f16"] == sizes["bf16"] < sizes["f32"]


def trained_bpe_facts() -> dict:
    """A byte-level BPE trained as tokenizer.py --tokenizer bpe trains it, on Chinese, English
    and code."""
    chinese = ["今天的天气很好，我们一起去公园散步。", "机器学习模型需要大量的数据来训练。",
               "北京的冬天很冷，但是屋里有暖气，很暖和。",
               "这个软件的界面很简洁，用起来很方便。"] * 20
    texts = chinese + default_corpus_documents()[:30] + [(ROOT / "model.py").read_text()]
    return Tokenizer("bpe", tokenizer_json=train_bpe(texts, vocab_size=600)).facts()


def qwen_style_facts() -> dict:
    """The trained BPE with the pre-tokenizer of Qwen2's and Qwen3's tokenizer.json (a Split
    pattern, then ByteLevel without its own), as an HF Qwen3 folder read by --ckpt brings it."""
    spec = json.loads(trained_bpe_facts()["json"])
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
         "use_regex": False}]}
    return Tokenizer("bpe", tokenizer_json=json.dumps(spec)).facts()


@pytest.mark.parametrize("kind", ["gpt2", "bpe", "qwen2", "char", "byte"])
def test_llama_cpp_tokenizes_held_out_text_into_our_ids(kind, tmp_path):
    facts = {"gpt2": lambda: {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256},
             "bpe": trained_bpe_facts, "qwen2": qwen_style_facts,
             "char": lambda: Tokenizer("char", chars=CHARS, char_eot=True).facts(),
             "byte": lambda: {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}}[kind]()
    tok = load_tokenizer(facts)
    model = tiny_gpt(vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=2, **FAMILIES["qwen3"])
    save_gguf(model, tmp_path / "m.gguf", facts)  # the default weight type
    llm = llama_cpp(tmp_path / "m.gguf")
    for name, text in HELD_OUT.items():
        ids = tok.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, (kind, name)
        assert llm.detokenize(ids) == text.encode(), (kind, name)
    assert llm.token_eos() == tok.eot_id and llama_vocab_is_eog(llm._model.vocab, tok.eot_id)
    assert not llm._model.add_bos_token()
    llm.close()


def test_a_llama_3_folder_runs_in_llama_cpp_with_its_rope_scaling_and_bos(tmp_path):
    """Llama 3.1's rope scaling as llama.cpp's rope_freqs, its pattern as llama.cpp's llama-bpe
    pre-tokenizer, and its BOS put before every text, as transformers' tokenizer puts
    it (tests/test_hf_llama.py)."""
    model, facts = load_model(llama3_folder(tmp_path / "hf"))
    tok = load_tokenizer(facts)
    save_gguf(model, tmp_path / "m.gguf", facts, "f32")
    llm = Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=128, logits_all=True, verbose=False,
                n_threads=1)
    assert llm.metadata["tokenizer.ggml.pre"] == "llama-bpe" and llm._model.add_bos_token()
    assert (llm.token_bos(), llm.token_eos()) == (tok.bos_id, tok.eot_id)
    for name, text in HELD_OUT.items():
        # (llama.cpp adds the BOS)
        assert llm.tokenize(text.encode()) == prompt_ids(text, tok), name
    ids = prompt_ids(HELD_OUT["code"] * 2, tok)[:100]  # positions past the original context of 40
    theirs, mine = logits_of(llm, ids), ours(model, ids)
    assert rel_err(theirs, mine) < 1e-3 and (theirs.argmax(-1) == mine.argmax(-1)).all()
    # (llama.cpp's are the scaled rope's logits, not the plain one's)
    model.config.rope_scaling = None
    assert rel_err(theirs, ours(model, ids)) > 1e-2
    llm.close()
    # an instruct folder: its eos token <|eot_id|> (one of its stop ids) is llama.cpp's eos, as its
    # converter writes it, rather than the first stop id <|end_of_text|>
    model, facts = load_model(llama3_folder(tmp_path / "instruct", instruct=True))
    save_gguf(model, tmp_path / "instruct.gguf", facts, "f16")
    llm = Llama(model_path=str(tmp_path / "instruct.gguf"), n_ctx=64, verbose=False, n_threads=1)
    eot_id = load_tokenizer(facts).encode_with_special_tokens("<|eot_id|>")
    assert facts["chat_template"]["stop_ids"] == [tok.eot_id, *eot_id]
    assert [llm.token_eos()] == eot_id
    llm.close()


def test_an_instruction_tuned_model_carries_its_chat_template(tmp_path):
    tok = Tokenizer("char", chars=CHARS, char_eot=True)
    model = tiny_gpt(vocab_size=tok.vocab_size, **FAMILIES["qwen3"])
    special = add_chat_tokens(model, tok)
    save_gguf(model, tmp_path / "chat.gguf", tok.facts(), "f32")
    llm = llama_cpp(tmp_path / "chat.gguf")
    history = [{"role": "system", "content": "be brief."},
               {"role": "user", "content": HELD_OUT["chinese"]},
               {"role": "assistant", "content": "ok."},
               {"role": "user", "content": "def f(): pass"}]
    # llama-cpp-python's chat formats turns with the file's own template, as llama.cpp's
    # --jinja does
    formatter = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="",
                                    bos_token="")
    prompt = formatter(messages=history).prompt
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == chat_prompt(history, tok)
    # a reply ends at the turn's end
    assert llama_vocab_is_eog(llm._model.vocab, special["<|end|>"])
    llm.close()


def test_the_export_from_a_checkpoint_on_the_defaults_runs_in_llama_cpp(char_data, tmp_path):
    trained = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                       "--max-iters", "2")
    assert trained.returncode == 0, trained.stderr[-2000:]
    result = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--export-gguf",
                      tmp_path / "model.gguf")
    assert result.returncode == 0 and "f16 weights" in result.stdout, result.stderr
    model, facts = load_model(str(tmp_path / "ckpt.pt"))
    tok = load_tokenizer(facts)
    llm = llama_cpp(tmp_path / "model.gguf")
    ids = tok.encode("def f(x):\n    return x")
    theirs, mine = logits_of(llm, ids), ours(model, ids)
    assert rel_err(theirs, mine) < 3e-3 and \
        (theirs.argmax(-1) == mine.argmax(-1)).float().mean() > 0.9
    out = llm("def ", max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] > 0
    llm.close()
    # benchmarks/bench_gguf.py: a row per weight type
    bench = run_main("benchmarks/bench_gguf.py", "--ckpt", tmp_path / "ckpt.pt", "--data-dir",
                     char_data)
    assert bench.returncode == 0, bench.stderr
    rows = {line.split()[0]: line.split() for line in bench.stdout.splitlines()[1:]}
    assert list(rows) == ["f32", "f16", "bf16", "q8_0"] and float(rows["f32"][2]) < 1e-3, \
        bench.stdout


def test_what_gguf_cannot_hold_is_one_error_line(char_data, tmp_path):
    model = tiny_gpt(vocab_size=3, **FAMILIES["qwen3"])
    # char data before eot ids
    old = {"tokenizer": "char", "vocab_size": 3, "eot_id": None, "chars": "abc"}
    checkpoint = {"model": model.state_dict(), "model_config": asdict(model.config),
                  "tokenizer": old, "iter_num": 0}
    save_checkpoint(checkpoint, str(tmp_path / "old.pt"))
    assert load_checkpoint(str(tmp_path / "old.pt"))["tokenizer"]["eot_id"] is None
    result = run_main("test.py", "--ckpt", tmp_path / "old.pt", "--export-gguf",
                      tmp_path / "old.gguf")
    assert_one_line_error(result, "no end-of-text token")
    assert not (tmp_path / "old.gguf").exists()
    result = run_main("test.py", "--ckpt", tmp_path / "old.pt", "--export-gguf",
                      tmp_path / "old.pt")
    assert_one_line_error(result, "would overwrite the input")
    result = run_main("test.py", "--ckpt", tmp_path / "old.pt", "--export-gguf",
                      tmp_path / "x.gguf", "--outtype", "q4_0")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    other = json.loads(trained_bpe_facts()["json"])
    other["pre_tokenizer"] = {"type": "Metaspace", "replacement": "_"}
    facts = {"tokenizer": "bpe", "json": json.dumps(other), "vocab_size": 600, "eot_id": 0}
    with pytest.raises(Exception, match="pre-tokenizer .* is not one llama.cpp knows"):
        save_gguf(tiny_gpt(vocab_size=600, **FAMILIES["qwen3"]), tmp_path / "bpe.gguf", facts)
    assert not (tmp_path / "bpe.gguf").exists()


def test_a_context_length_past_gguf_s_32_bits_is_one_error_line(tmp_path):
    """max_position_embeddings 10**12 (a rotary model reads, as transformers does): GGUF's context
    length is a uint32, once a struct.error traceback."""
    folder = llama3_folder(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["max_position_embeddings"] = 10**12
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = run_main("test.py", "--ckpt", folder, "--export-gguf", tmp_path / "big.gguf")
    assert_one_line_error(result, "GGUF holds the context length as a 32-bit number",
                          "1,000,000,000,000 positions")
    assert not (tmp_path / "big.gguf").exists()
