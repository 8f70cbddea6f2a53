"""A byte-level BPE trained here (tokenizer.py --tokenizer bpe) on mixed Chinese, English and code,
and a model trained on its data, through every script: sampling, evaluation, fine-tuning,
embeddings, HF export."""
import argparse
import json
import lzma
import random
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, TINY_MODEL, assert_one_line_error, run_main
from toolkit.checkpoint import load_checkpoint
from toolkit import prepare
from toolkit.model_sources import load_model
from toolkit.prepare import default_corpus_documents
from toolkit.prepare import TRAINING_RUN, cut_long_runs, train_bpe
from toolkit.tokenizers import EOT_TEXT, Tokenizer, load_tokenizer, same_vocabulary

# Chinese of everyday kinds (reviews, news, school), written for these tests
CHINESE = ["今天的天气很好，我们一起去公园散步。", "这本书写得非常好，我已经看了三遍了。",
           "快递很快，包装也很结实，下次还会再买。", "机器学习模型需要大量的数据来训练。",
           "他每天早上六点起床，先跑步，再吃早饭。", "这家餐厅的菜味道一般，服务态度还可以。",
           "我们的团队正在开发一个小型的语言模型。", "读书使人进步，学习让生活更加丰富。",
           "手机的电池不太耐用，一天要充两次电。", "北京的冬天很冷，但是屋里有暖气，很暖和。",
           "请把这份文件发给我，谢谢！", "中文分词是自然语言处理中的一个基本问题。",
           "质量不错，价格也便宜，推荐大家购买。", "老师说，明天的考试要带铅笔和橡皮。",
           "上海是一个国际化的大城市，人口超过两千万。", "这个软件的界面很简洁，用起来很方便。"]
CODE = [(ROOT / "model.py").read_text(), (ROOT / "toolkit" / "optim.py").read_text()]
VOCAB = 800


def chinese_document(rng: random.Random, sentences: int = 40) -> str:
    return "".join(rng.choice(CHINESE) for _ in range(sentences))


def mixed_documents(n: int = 600) -> list[str]:
    """Chinese, English prose (the pydoc corpus) and Python code, interleaved."""
    rng, english = random.Random(0), default_corpus_documents()
    return [[chinese_document(rng), english[i % len(english)][:2000], CODE[i % 2][:2000]][i % 3]
            for i in range(n)]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory) -> Path:
    """The mixed documents as JSON lines, prepared with a BPE trained on them (the defaults but the
    size)."""
    folder = tmp_path_factory.mktemp("bpe")
    (folder / "mixed.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                for d in mixed_documents()))
    result = run_main("tokenizer.py", "--input", folder / "mixed.jsonl", "--tokenizer", "bpe",
                      "--vocab-size", VOCAB, "--output-dir", folder / "data")
    assert result.returncode == 0, result.stderr
    return folder / "data"


@pytest.fixture(scope="module")
def bpe_model(bpe_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe-model")
    result = run_main("train.py", "--data-dir", bpe_data, "--out-dir", out, *TINY_MODEL,
                      "--block-size", "64", "--max-iters", "60", "--eval-interval", "30")
    assert result.returncode == 0, result.stderr[-2000:]
    return out / "ckpt.pt"


def tokenizer_of(bpe_data: Path) -> Tokenizer:
    return load_tokenizer(json.loads((bpe_data / "meta.json").read_text()))


def test_the_trained_bpe_is_written_beside_the_data_and_spends_fewer_tokens_on_chinese(bpe_data):
    tok = tokenizer_of(bpe_data)
    assert tok.name == "bpe" and tok.vocab_size == VOCAB and tok.eot_id == 0
    assert json.loads((bpe_data / "tokenizer.json").read_text()) == json.loads(tok.tokenizer_json)
    unseen = chinese_document(random.Random(99), 5)
    gpt2 = tiktoken.get_encoding("r50k_base").encode(unseen)
    assert len(tok.encode(unseen)) < 0.6 * len(gpt2), (len(tok.encode(unseen)), len(gpt2))
    # --tokenizer-file encodes with it again: the same ids
    again = run_main("tokenizer.py", "--input", bpe_data.parent / "mixed.jsonl", "--tokenizer-file",
                     bpe_data / "tokenizer.json", "--output-dir", bpe_data.parent / "again")
    assert again.returncode == 0, again.stderr
    for split in ("train.bin", "val.bin"):
        assert (bpe_data / split).read_bytes() == (bpe_data.parent / "again" / split).read_bytes()


def random_unicode(rng: random.Random) -> str:
    """Text from many scripts and the hard cases: emoji (with skin tones and joiners), CJK (with the
    astral planes), combining marks, right-to-left, controls, the replacement character, private
    use."""
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x17F), (0x300, 0x36F), (0x4E00, 0x9FFF),
              (0x20000, 0x2A6DF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x600, 0x6FF),
              (0x1F300, 0x1FAFF), (0x1F3FB, 0x1F3FF), (0xE000, 0xF8FF), (0xFFFD, 0xFFFD),
              (0x200D, 0x200D), (0xFE0F, 0xFE0F)]
    pieces = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randrange(1, 40))]
    pieces += rng.sample(["👩‍👩‍👧", "e\u0301", "🇨🇳", " ", "\n", "\t", EOT_TEXT, "  ", "中文"], 2)
    rng.shuffle(pieces)
    return "".join(pieces)


def test_chinese_without_punctuation_trains_in_pieces_of_its_letter_runs():
    """A run of letters is one word to the trainer, which slows down faster than its length grows:
    it sees runs cut every TRAINING_RUN letters, and text with shorter runs whole."""
    rng = random.Random(0)
    letters = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地"
    run = "".join(rng.choice(letters) for _ in range(3000))
    text = "标题：" + run + "。 end 12"
    pieces = list(cut_long_runs([text, "你好，世界。 plain words"]))
    assert "".join(pieces[:-1]) == text and pieces[-1] == "你好，世界。 plain words"
    assert max(len(p) for p in pieces) <= TRAINING_RUN + len("标题：")
    tok = Tokenizer("bpe", tokenizer_json=train_bpe([text] * 20, 400))
    assert tok.vocab_size == 400 and tok.decode(tok.encode(text)) == text
    assert len(tok.encode(run)) < len(run)  # merges past whole characters (3 bytes each)


def test_decode_of_encode_is_the_text_for_any_unicode_and_surrogates_are_refused(bpe_data):
    tok = tokenizer_of(bpe_data)
    rng = random.Random(0)
    for _ in range(500):
        text = random_unicode(rng)
        assert tok.decode(tok.encode(text)) == text, ascii(text)
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("ok \ud83d then")
    # through tokenizer.py: JSON may spell a lone surrogate; it is one line naming it
    bad = bpe_data.parent / "surrogate.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "half an emoji \\ud83d"}\n')
    result = run_main("tokenizer.py", "--input", bad, "--tokenizer-file",
                      bpe_data / "tokenizer.json", "--output-dir", bpe_data.parent / "surrogate")
    assert_one_line_error(result, "surrogate")
    assert not (bpe_data.parent / "surrogate").exists() or \
        not any((bpe_data.parent / "surrogate").iterdir())


def test_what_is_shown_while_decoding_never_holds_half_a_character(bpe_data):
    """Each prefix of the ids decodes to whole characters, the start of the whole text: a streamed
    sample grows and never shows a replacement character for a character still being spelled."""
    tok = tokenizer_of(bpe_data)
    for text in ["中文分词😀是自然语言处理", "e\u0301🇨🇳👩‍👩‍👧 mixed 混合 text"]:
        ids = tok.encode(text)
        cut = [i for i in range(len(ids))
               if len(tok.decode(ids[:i]).encode()) < len(tok.decode_bytes(ids[:i]))]
        assert cut, "no token of this text ends inside a character: the test would test nothing"
        for i in range(len(ids) + 1):
            shown = tok.decode(ids[:i])
            assert "\ufffd" not in shown and text.startswith(shown), (i, shown)


def test_the_model_samples_streams_and_evaluates_in_bits_per_byte(bpe_data, bpe_model):
    common = ["--ckpt", bpe_model, "--prompt", "今天的天气", "--num-samples", "1",
              "--max-new-tokens", "40", "--seed", "3", "--device", "cpu"]
    streamed, whole = run_main("test.py", *common, "--stream"), \
        run_main("test.py", *common, "--no-stream")
    assert streamed.returncode == 0 and whole.returncode == 0, streamed.stderr + whole.stderr
    assert streamed.stdout == whole.stdout and streamed.stdout.startswith("今天的天气"), \
        streamed.stdout
    history = load_checkpoint(str(bpe_model))["history"]
    last = history["metrics"][-1]
    assert 0 < last["val_bpb"] < 16, last
    evaluated = run_main("eval.py", "--ckpt", bpe_model, "--data-dir", bpe_data, "--device", "cpu")
    assert evaluated.returncode == 0, evaluated.stderr
    val = json.loads(evaluated.stdout.splitlines()[-1])["val"]
    assert val["bpb"] == pytest.approx(val["loss"] * val["tokens"] / (val["bytes"] * np.log(2)))


def test_the_model_fine_tunes_on_characters_pretraining_never_saw(bpe_model, tmp_path):
    """classify and sft add their special tokens to the trained vocabulary; a rare character is just
    bytes."""
    rng = random.Random(1)
    rows = [{"text": chinese_document(rng) + ("玄奘" if i % 2 else ""),
             "label": "rare" if i % 2 else "plain"}
            for i in range(40)]
    (tmp_path / "cls.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                for r in rows))
    result = run_main("finetune.py", "--task", "classify", "--train", tmp_path / "cls.jsonl",
                      "--val", tmp_path / "cls.jsonl", "--init-from", bpe_model, "--out-dir",
                      tmp_path / "cls", "--epochs", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "val_accuracy" in json.loads(result.stdout.splitlines()[-1])
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for q, a in zip(CHINESE[::2], CHINESE[1::2])]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c, ensure_ascii=False) + "\n"
                                                 for c in chats))
    result = run_main("finetune.py", "--task", "sft", "--train", tmp_path / "chat.jsonl", "--val",
                      tmp_path / "chat.jsonl", "--init-from", bpe_model, "--out-dir",
                      tmp_path / "sft", "--epochs", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    talk = run_main("test.py", "--ckpt", tmp_path / "sft" / "ckpt.pt", "--chat", "--max-new-tokens",
                    "8", "--device", "cpu", input="你好\n")
    assert talk.returncode == 0 and "model> " in talk.stdout, talk.stderr


def test_the_model_embeds_chinese_documents(bpe_model, tmp_path):
    docs = [{"id": f"d{i}", "text": text} for i, text in enumerate(CHINESE)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n"
                                                 for d in docs))
    made = run_main("embed.py", "index", "--ckpt", bpe_model, "--input", tmp_path / "docs.jsonl",
                    "--out", tmp_path / "index", "--device", "cpu")
    assert made.returncode == 0, made.stderr
    found = run_main("embed.py", "search", "--index", tmp_path / "index", "--query", CHINESE[3],
                     "--json", "--device", "cpu")
    assert found.returncode == 0, found.stderr
    # a text retrieves itself first
    assert json.loads(found.stdout.splitlines()[-1])["results"][0]["id"] == "d3"


def test_the_hf_export_holds_the_same_tokenizer_and_model(bpe_model, tmp_path):
    result = run_main("test.py", "--ckpt", bpe_model, "--export-hf", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    checkpoint = load_checkpoint(str(bpe_model))
    tok = load_tokenizer(checkpoint["tokenizer"])
    rng = random.Random(5)
    for text in [*mixed_documents(6),
                 *(random_unicode(rng).replace(EOT_TEXT, "") for _ in range(50))]:
        assert hf_tok(text)["input_ids"] == tok.encode(text), ascii(text[:80])
    assert hf_tok.eos_token_id == tok.eot_id
    ids = tok.encode(CHINESE[0])
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _ = load_model(str(bpe_model))
    with torch.no_grad():
        ours, _ = model.eval()(torch.tensor([ids]))
        theirs = hf_model(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # data prepared with the export's tokenizer.json (laid out otherwise) is the model's data
    exported = Tokenizer("bpe", tokenizer_json=(tmp_path / "hf" / "tokenizer.json").read_text())
    assert exported.facts()["json"] != checkpoint["tokenizer"]["json"]
    assert same_vocabulary(exported.facts(), checkpoint["tokenizer"])
    other = json.loads(exported.facts()["json"])
    other["model"]["merges"] = other["model"]["merges"][:-1]
    assert not same_vocabulary({**exported.facts(), "json": json.dumps(other)},
                               checkpoint["tokenizer"])


def test_a_tokenizer_file_that_cannot_separate_documents_or_is_not_bpe_is_one_line(tmp_path):
    plain = HFTokenizer(models.BPE())  # a byte-level BPE with no special token at all
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.train_from_iterator(["some text to learn from, 一些文字"] * 20,
                              trainers.BpeTrainer(vocab_size=300))
    (tmp_path / "no-eot.json").write_text(plain.to_str())
    word_level = {"version": "1.0",
                  "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}
    (tmp_path / "words.json").write_text(json.dumps(word_level))
    (tmp_path / "in.txt").write_text("hello")
    for name, fragment in [("no-eot.json", EOT_TEXT),
                           ("words.json", "not the tokenizer.json of a BPE model")]:
        result = run_main("tokenizer.py", "--input", tmp_path / "in.txt", "--tokenizer-file",
                          tmp_path / name, "--output-dir", tmp_path / "out")
        assert_one_line_error(result, fragment)
    small = run_main("tokenizer.py", "--input", tmp_path / "in.txt", "--tokenizer", "bpe",
                     "--vocab-size", "256", "--output-dir", tmp_path / "out")
    assert_one_line_error(small, "--vocab-size 256 is too small", "257")
    assert not (tmp_path / "out").exists()


def test_a_bpe_of_another_kind_encodes_trains_and_samples(tmp_path, monkeypatch):
    """An HF BPE that is not byte-level (SentencePiece's word boundary `▁`, as Llama-style
    tokenizer.json files have): its own decoder gives the text back, and a model trains on it and
    samples."""
    spm = HFTokenizer(models.BPE(unk_token="<unk>"))
    spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    texts = [d[:2000] for d in default_corpus_documents()[:40]]
    spm.train_from_iterator(texts,
                            trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", EOT_TEXT]))
    (tmp_path / "spm.json").write_text(spm.to_str())
    tok = Tokenizer("bpe", tokenizer_json=spm.to_str())
    assert not tok.byte_level and tok.decode(tok.encode("the return value of a function")) == \
        "the return value of a function"
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepared = run_main("tokenizer.py", "--input", tmp_path / "docs.jsonl", "--tokenizer-file",
                        tmp_path / "spm.json", "--append-eod", "--output-dir", tmp_path / "data")
    assert prepared.returncode == 0 and "warning" not in prepared.stderr, prepared.stderr
    # a long text file, read and encoded in pieces (small ones here), has the ids of the whole:
    # Metaspace would mark each piece's start with ▁, so this tokenizer encodes it whole
    from toolkit import documents, prepare
    monkeypatch.setattr(documents, "BLOCK", 4096)
    monkeypatch.setattr(prepare, "PIECE_CHARS", 1000)
    whole = "\n".join(texts)
    (tmp_path / "long.txt").write_text(whole)
    assert run_main("tokenizer.py", "--input", tmp_path / "long.txt", "--tokenizer-file",
                    tmp_path / "spm.json", "--output-dir", tmp_path / "long").returncode == 0
    ids = np.fromfile(tmp_path / "long" / "train.bin", np.uint16).tolist() + \
        np.fromfile(tmp_path / "long" / "val.bin", np.uint16).tolist()
    assert len(whole) > 10 * 4096 and ids == spm.encode(whole).ids
    # characters outside its alphabet become <unk>: said, not silently
    (tmp_path / "zh.txt").write_text("the return value 是函数的结果")
    chinese = run_main("tokenizer.py", "--input", tmp_path / "zh.txt", "--tokenizer-file",
                       tmp_path / "spm.json", "--output-dir", tmp_path / "zh")
    assert chinese.returncode == 0, chinese.stderr
    lost = " ".join(repr(char) for char in sorted("是函数的结果"))
    assert f"{tmp_path / 'spm.json'} has no token for 6 character(s) of the input, which the " \
        f"data leaves out or holds as its unknown token: {lost}\n" in chinese.stderr
    trained = run_main("train.py", "--data-dir", tmp_path / "data", "--out-dir", tmp_path / "ckpt",
                       *TINY_MODEL, "--max-iters", "2", "--eval-interval", "2")
    assert trained.returncode == 0 and "val bpb" in trained.stdout, trained.stderr
    sampled = run_main("test.py", "--ckpt", tmp_path / "ckpt" / "ckpt.pt", "--prompt", "the value",
                       "--max-new-tokens", "5", "--num-samples", "1", "--device", "cpu")
    assert sampled.returncode == 0 and sampled.stdout.startswith("the value"), sampled.stderr


def test_data_in_other_tokens_than_the_weights_names_how_to_prepare_it(bpe_model, char_data,
                                                                        tmp_path):
    result = run_main("train.py", "--data-dir", char_data, "--init-from", bpe_model,
                      "--out-dir", tmp_path / "a", "--block-size", "32")
    assert_one_line_error(result, "need data tokenized with their own bpe vocabulary of",
                          "but", "has char vocabulary of", "--tokenizer-file T, T the "
                          "tokenizer.json of the data it was trained on")
    exported = tmp_path / "hf"
    assert run_main("test.py", "--ckpt", bpe_model, "--export-hf",
                    exported).returncode == 0
    result = run_main("train.py", "--data-dir", char_data, "--init-from", exported,
                      "--out-dir", tmp_path / "b", "--block-size", "32")
    assert_one_line_error(result, f"--tokenizer-file {exported / 'tokenizer.json'}")


def test_a_bpe_trains_on_a_bounded_sample_spread_over_the_input(tmp_path, monkeypatch):
    """BPE training's memory grows with its text: it reads at most BPE_SAMPLE bytes (small here),
    every k-th document, so the end of the input is in the sample as well as its start."""
    monkeypatch.setattr(prepare, "BPE_SAMPLE", 10_000)
    texts = [f"document {i:03d} " + "x" * 87 for i in range(1000)]  # 100 KB of text
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = argparse.Namespace(json_key="text", errors="strict", skip_bad_lines=False)
    sample = list(prepare.bpe_sample([str(tmp_path / "in.jsonl")], args))
    every = round((tmp_path / "in.jsonl").stat().st_size / 10_000)  # (of the input's bytes)
    assert every == 11 and sample == texts[::every][:len(sample)]
    assert 9_000 <= len("".join(sample)) < 10_100 and sample[-1] >= "document 900"
    # a compressed input's size is unknown: its first 10,000 bytes
    (tmp_path / "in.jsonl.xz").write_bytes(lzma.compress((tmp_path / "in.jsonl").read_bytes()))
    assert list(prepare.bpe_sample([str(tmp_path / "in.jsonl.xz")], args)) == texts[:100]
