"""finetune.py, toolkit/finetuning.py and toolkit/tasks.py: GPT-1's layouts, padding, the four
tasks learnt from a body pretrained here (and not from a random one), regression, predictions,
torchrun, signals and bad input."""
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_one_line_error, run_main
from model import GPT, GPTConfig
from toolkit.checkpoint import load_checkpoint, save_checkpoint
from toolkit.distributed import free_port
from toolkit.prepare import default_corpus_documents
from toolkit.tasks import (Example, TaskModel, add_special_tokens, encode_records, label_names,
                           label_value, layout, pad_batch)
from toolkit.tokenizers import Tokenizer, load_tokenizer

# one thread runs these tiny models several times faster
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
FINETUNE = ["--device", "cpu"]  # and the defaults: learning is what these tests are about
FAST = ["--device", "cpu", "--dtype", "float32", "--dropout", "0", "--epochs", "3", "--lr", "3e-3",
        "--batch-size", "16"]  # where a test is not about learning
SPECIAL = {"start": 20, "delimiter": 21, "extract": 22}
TRAIN_EXAMPLES = 640
CHANCE = {"classify": 0.5, "entail": 0.5, "similarity": 0.5, "choice": 0.25}


def finetune(*args) -> subprocess.CompletedProcess:
    return run_main("finetune.py", *args)


def ok(result: subprocess.CompletedProcess) -> dict:
    """The JSON object a successful run prints last."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


# ------------------------------------------------------------------- datasets from the pydoc corpus

DOCUMENTS = [d for d in default_corpus_documents() if len(d) >= 400]


def snippet(rng: random.Random, n: int) -> str:
    doc = rng.choice(DOCUMENTS)
    start = rng.randrange(len(doc) - n)
    return doc[start : start + n]


def shuffled(rng: random.Random, chars) -> str:
    chars = list(chars)
    rng.shuffle(chars)
    return "".join(chars)


# Each example is real documentation text or the same characters shuffled: only the order of the
# characters tells them apart, which a body that learnt the language knows and a random one must
# learn from the few examples.
def classify_example(rng, real: bool) -> dict:
    text = snippet(rng, 24)
    return {"text": text if real else shuffled(rng, text), "label": "real" if real else "shuffled"}


def entail_example(rng, real: bool) -> dict:
    text = snippet(rng, 28)
    return {"premise": text[:8], "hypothesis": text[8:] if real else shuffled(rng, text[8:]),
            "label": "yes" if real else "no"}


def similarity_example(rng, real: bool) -> dict:
    a, b = snippet(rng, 13), snippet(rng, 13)
    return {"text_a": a if real else shuffled(rng, a), "text_b": b if real else shuffled(rng, b),
            "label": int(real)}


def graded_similarity_example(rng, real: bool) -> dict:
    """Regression: the share of the characters of both texts left in place (1, about 1/2 or 0); the
    others are shuffled among themselves."""
    moved = rng.choice([0, 7, 13])
    texts = []
    for text in snippet(rng, 13), snippet(rng, 13):
        positions = rng.sample(range(13), moved)
        chars = list(text)
        for position, char in zip(positions, shuffled(rng, [text[p] for p in positions])):
            chars[position] = char
        texts.append("".join(chars))
    return {"text_a": texts[0], "text_b": texts[1], "label": 1 - moved / 13}


def choice_example(rng, real: bool) -> dict:
    """The true continuation among three shuffles of itself (the same characters)."""
    text = snippet(rng, 28)
    context, answer = text[:18], text[18:]
    choices = [shuffled(rng, answer) for _ in range(3)]
    label = rng.randrange(4)
    choices.insert(label, answer)
    return {"context": context, "choices": choices, "label": label}


EXAMPLES = {"classify": classify_example, "entail": entail_example,
            "similarity": similarity_example, "choice": choice_example,
            "graded": graded_similarity_example}


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{task: (train.jsonl, val.jsonl)}: 640 and 200 balanced examples, fixed seeds."""
    folder = tmp_path_factory.mktemp("tasks")
    files = {}
    for name, make in EXAMPLES.items():
        rng = random.Random(0)
        train = [make(rng, i % 2 == 0) for i in range(TRAIN_EXAMPLES)]
        val = [make(rng, i % 2 == 0) for i in range(200)]
        files[name] = (write_jsonl(folder / f"{name}_train.jsonl", train),
                       write_jsonl(folder / f"{name}_val.jsonl", val))
    return files


@pytest.fixture(scope="module")
def pretrained(char_data, tmp_path_factory) -> str:
    """A tiny char-level GPT pretrained on the pydoc corpus by train.py (val loss about 1.65; AdamW,
    as when the figures in docs/finetune.md were measured)."""
    out = tmp_path_factory.mktemp("pretrained")
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", out, "--n-layer", "2",
                      "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "32",
                      "--max-iters", "600", "--lr", "5e-3", "--warmup-iters", "20",
                      "--eval-interval", "600", "--eval-iters", "5", "--log-interval", "600",
                      "--device", "cpu", "--optimizer", "adamw")
    assert result.returncode == 0, result.stderr[-2000:]
    return str(out / "ckpt.pt")


@pytest.fixture(scope="module")
def random_body(pretrained, tmp_path_factory) -> str:
    """The same shape and tokenizer, randomly initialised."""
    checkpoint = load_checkpoint(pretrained)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**checkpoint["model_config"]))
    path = str(tmp_path_factory.mktemp("random") / "ckpt.pt")
    save_checkpoint({"model": model.state_dict(), "model_config": checkpoint["model_config"],
                     "tokenizer": checkpoint["tokenizer"]}, path)
    return path


@pytest.fixture(scope="module")
def finetuned(datasets, pretrained, random_body, tmp_path_factory):
    """finetuned(task, body) -> (out dir, final metrics): each fine-tuning runs once per module."""
    runs = {}

    def run(task: str, body: str) -> tuple[str, dict]:
        if (task, body) not in runs:
            out = tmp_path_factory.mktemp(f"{task}_{body}")
            train, val = datasets[task]
            init = pretrained if body == "pretrained" else random_body
            runs[task, body] = out, ok(finetune("--task", task, "--train", train, "--val", val,
                                                "--init-from", init, "--out-dir", out, *FINETUNE))
        return runs[task, body]

    return run


# ----------------------------------------------------------------------------- layout and padding


def test_layout_of_each_task():
    s, d, e = SPECIAL.values()
    assert layout("classify", [[1, 2, 3]], SPECIAL, 16) == ([[s, 1, 2, 3, e]], False)
    # and alone
    assert layout("entail", [[1, 2], [3]], SPECIAL, 16) == ([[s, 1, 2, d, 3, e], [s, 3, e]], False)
    assert layout("similarity", [[1, 2], [3]], SPECIAL, 16) == \
        ([[s, 1, 2, d, 3, e], [s, 3, d, 1, 2, e]], False)
    assert layout("choice", [[1, 2], [3], [4, 5]], SPECIAL, 16) == \
        ([[s, 1, 2, d, 3, e], [s, 1, 2, d, 4, 5, e]], False)
    # too long: the context loses tokens from its left, never the hypothesis or an answer
    assert layout("classify", [[1, 2, 3, 4, 5, 6]], SPECIAL, 5) == ([[s, 4, 5, 6, e]], True)
    assert layout("entail", [[1, 2, 3, 4, 5, 6], [7, 8, 9]], SPECIAL, 8) == \
        ([[s, 5, 6, d, 7, 8, 9, e], [s, 7, 8, 9, e]], True)
    # one context for all answers, cut for the longest
    assert layout("choice", [[1, 2, 3, 4], [7], [8, 9]], SPECIAL, 7) == \
        ([[s, 3, 4, d, 7, e], [s, 3, 4, d, 8, 9, e]], True)
    # similarity: the longer text gives way first, and both orderings hold the same tokens
    assert layout("similarity", [[1, 2, 3, 4, 5, 6], [7, 8]], SPECIAL, 9) == \
        ([[s, 3, 4, 5, 6, d, 7, 8, e], [s, 7, 8, d, 3, 4, 5, 6, e]], True)
    with pytest.raises(ValueError, match="the hypothesis alone takes 7 tokens"):
        layout("entail", [[1], [2, 3, 4, 5]], SPECIAL, 6)
    # after a BOS (Llama 3's): a token less for the texts
    assert layout("classify", [[1, 2, 3, 4, 5, 6]], SPECIAL, 6, bos=9) == \
        ([[9, s, 4, 5, 6, e]], True)
    assert layout("similarity", [[1, 2], [3]], SPECIAL, 16, bos=9) == \
        ([[9, s, 1, 2, d, 3, e], [9, s, 3, d, 1, 2, e]], False)
    with pytest.raises(ValueError, match="the hypothesis alone takes 8 tokens"):
        layout("entail", [[1], [2, 3, 4, 5]], SPECIAL, 7, bos=9)


def test_special_tokens_are_new_rows_of_the_tied_embedding():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=1, n_embd=8))
    with torch.no_grad():
        model.lm_head.weight.add_(torch.arange(8.0))  # rows far from zero, as trained ones are
    old = model.lm_head.weight.detach().clone()
    tok = Tokenizer("char", chars="abcd", char_eot=True)
    assert add_special_tokens(model, tok) == {"start": 5, "delimiter": 6, "extract": 7}
    assert model.transformer.wte.weight is model.lm_head.weight and \
        model.lm_head.weight.shape == (8, 8)
    assert torch.equal(model.lm_head.weight[:5], old)
    new = model.lm_head.weight[5:].detach()
    # an average token, give or take the init's noise
    assert (new - old.mean(dim=0)).abs().max() < 0.1
    assert not torch.equal(new[0], new[1])  # and each its own
    assert tok.vocab_size == model.config.vocab_size == 8 and tok.decode([5, 0, 6, 1, 7]) == "ab"
    assert model(torch.tensor([[5, 0, 6, 7]]))[0].shape == (1, 4, 8)


def test_records_become_examples_with_label_ids():
    tok = Tokenizer("char", chars="abcdefgh ")
    records = [(1, {"premise": "abc", "hypothesis": "de", "label": "no"}),
               (2, {"premise": "h", "hypothesis": "g", "label": "yes"})]
    examples = encode_records(records, "f.jsonl", "entail", tok, SPECIAL, 16, ["no", "yes"])
    assert [e.sequences for e in examples] == [[[20, 0, 1, 2, 21, 3, 4, 22], [20, 3, 4, 22]],
                                               [[20, 7, 21, 6, 22], [20, 6, 22]]]
    assert [e.label for e in examples] == [0, 1]
    choice = [(1, {"context": "ab", "choices": ["c", "d", "e"], "label": 2})]
    assert encode_records(choice, "f.jsonl", "choice", tok, SPECIAL, 16, None)[0].label == 2


def test_labels_keep_the_json_they_were_written_in():
    """true and 1 are two classes, as their JSON is (Python counts True == 1)."""
    records = [(1, {"label": 1}), (2, {"label": True}), (3, {"label": 0}), (4, {"label": "1"})]
    names = label_names(records, "f.jsonl")
    assert names == [0, 1, True, "1"]
    assert [label_value(r, "classify", names) for _, r in records] == [1, 2, 0, 3]
    # 1.0 is the number 1: one class, named as first written
    assert label_names([*records, (5, {"label": 1.0})], "f.jsonl") == names


def test_a_tokenizer_with_a_bos_puts_it_before_every_sequence(tmp_path):
    """A Llama 3 folder's <|begin_of_text|> starts each sequence, as HF's tokenizer(text) starts
    every text with it."""
    from conftest import llama3_folder
    from toolkit.model_sources import load_model
    model, facts = load_model(llama3_folder(tmp_path / "hf"))
    tok = load_tokenizer(facts)
    special = add_special_tokens(model, tok)
    s, d, e = special.values()
    record = {"premise": "中文的句子", "hypothesis": "hello world", "label": "yes"}
    (example,) = encode_records([(1, record)], "f.jsonl", "entail", tok, special, 128,
                                ["no", "yes"])
    premise, hypothesis = tok.encode(record["premise"]), tok.encode(record["hypothesis"])
    assert tok.bos_id is not None and example.sequences == [
        [tok.bos_id, s, *premise, d, *hypothesis, e], [tok.bos_id, s, *hypothesis, e]]


def task_model(task: str) -> TaskModel:
    """A random body and head (the head starts at zero before its fit: random weights here, so it
    counts)."""
    torch.manual_seed(0)
    body = GPT(GPTConfig(block_size=32, vocab_size=23, n_layer=2, n_head=2, n_embd=32))
    model = TaskModel(body, task, 1 if task == "choice" else 3, 0.1, SPECIAL).eval()
    torch.nn.init.normal_(model.head.weight)
    torch.nn.init.normal_(model.head.bias)
    return model


@pytest.mark.parametrize("task, per_example",
                         [("classify", 1), ("entail", 2), ("similarity", 2), ("choice", 3)])
def test_padding_never_changes_a_result(task, per_example):
    """Right padding: a row alone and in a batch padded to a longer row give the same logits."""
    model = task_model(task)
    rng = random.Random(0)
    examples = [Example([[20] + [rng.randrange(20) for _ in range(rng.randrange(1, 15))] + [21] +
                         [rng.randrange(20) for _ in range(rng.randrange(1, 15))] + [22]
                         for _ in range(per_example)], None, False) for _ in range(6)]
    idx, extract, targets = pad_batch(examples, torch.device("cpu"))
    assert (extract < idx.size(1) - 1).any()  # some rows are padded
    assert ((targets == -1).sum(dim=1) == idx.size(1) - extract).all()  # padding is never a target
    with torch.no_grad():
        batched = model(idx, extract, per_example)[0]
        for i, example in enumerate(examples):
            alone = model(*pad_batch([example], torch.device("cpu"))[:2], per_example)[0]
            torch.testing.assert_close(batched[i : i + 1], alone, atol=1e-5, rtol=0)


def log_probabilities(body: GPT, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final states, log-probabilities of each token predicted by the state before it; 0 at
    position 0)."""
    ids = torch.tensor([sequence])
    hidden = body.hidden_states(ids)[0]
    log_p = torch.log_softmax(body.lm_head(hidden), dim=-1)
    return hidden, torch.cat([torch.zeros(1), log_p[torch.arange(len(sequence) - 1), ids[0, 1:]]])


def test_a_choice_scores_its_answer_by_the_bodys_log_likelihood_plus_the_head():
    """Each answer's score is log p(answer | start, context, delimiter) under the body, plus the
    head's output."""
    model = task_model("choice")
    body = model.body
    # context 1 2 3, answers 4 5 6 and 7
    sequences = [[20, 1, 2, 3, 21, 4, 5, 6, 22], [20, 1, 2, 3, 21, 7, 22]]
    idx, extract, _ = pad_batch([Example(sequences, 0, False)], torch.device("cpu"))
    with torch.no_grad():
        scores = model(idx, extract, 2)[0][0]
        for sequence, score in zip(sequences, scores):
            hidden, log_p = log_probabilities(body, sequence)
            answer = log_p[5 : len(sequence) - 1].sum()  # the tokens after the delimiter
            head = model.head(hidden[-1]).squeeze()
            torch.testing.assert_close(score, answer + head, atol=1e-5, rtol=0)
    assert not torch.allclose(scores[0], scores[1])


def text_terms(hidden: torch.Tensor, log_p: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Over the tokens first..end-1: their mean log-probability, then the mean of the states that
    predicted them (the one before each), each weighted by its token's log-probability."""
    tokens = torch.arange(first, end)
    return torch.cat([log_p[tokens].mean()[None],
                      (log_p[tokens, None] * hidden[tokens - 1]).mean(dim=0)])


@pytest.mark.parametrize("bos", [None, 9])
@pytest.mark.parametrize("task", ["classify", "entail", "similarity"])
def test_the_class_head_reads_the_state_and_the_bodys_likelihood(task, bos):
    """classify: the text's mean log-likelihood and its likelihood-weighted states beside the state
    at extract; entail: those of the hypothesis after the premise minus those of the hypothesis
    alone, beside the first sequence's state; similarity: the same of b after a plus that of a after
    b, beside the two states added. After a BOS, neither it nor start counts as text."""
    model = task_model(task)
    a, b = [1, 2, 3, 4], [5, 6, 7]
    s, d, e = SPECIAL.values()
    sequences = {"classify": [[s, *a, e]], "entail": [[s, *a, d, *b, e], [s, *b, e]],
                 "similarity": [[s, *a, d, *b, e], [s, *b, d, *a, e]]}[task]
    sequences, o = ([[bos, *q] for q in sequences], 1) if bos else (sequences, 0)  # o: offset
    idx, extract, _ = pad_batch([Example(sequences, 0, False)], torch.device("cpu"))
    with torch.no_grad():
        logits = model(idx, extract, len(sequences))[0][0]
        (h0, p0), (h1, p1) = [log_probabilities(model.body, q)
                              for q in sequences + sequences[:2 - len(sequences)]]
        state, feature = h0[-1], text_terms(h0, p0, 1 + o, 5 + o)  # classify: the text after start
        if task == "entail":  # b after the premise's delimiter, b after start alone
            feature = text_terms(h0, p0, 6 + o, 9 + o) - text_terms(h1, p1, 1 + o, 4 + o)
        if task == "similarity":  # b after a, minus b first; a after b, minus a first
            state = h0[-1] + h1[-1]
            feature = (text_terms(h0, p0, 6 + o, 9 + o) - text_terms(h1, p1, 1 + o, 4 + o)) + \
                (text_terms(h1, p1, 5 + o, 9 + o) - text_terms(h0, p0, 1 + o, 5 + o))
        assert model.head.in_features == 2 * 32 + 1
        torch.testing.assert_close(logits, model.head(torch.cat([state, feature])), atol=1e-5,
                                   rtol=0)


# ----------------------------------------------------------------------------- learning the tasks


@pytest.mark.parametrize("task", ["classify", "entail", "similarity", "choice"])
def test_pretrained_body_learns_each_task_and_a_random_one_does_not(finetuned, task):
    """A random body as the baseline for the two kinds of head (the class head, the choices'
    scores): entail and similarity share classify's head."""
    _, pretrained = finetuned(task, "pretrained")
    assert pretrained["val_accuracy"] >= CHANCE[task] + 0.15, pretrained
    if task == "choice":
        _, scratch = finetuned(task, "random")
        # each answer is also scored by the body's own log-likelihood, which a random body partly
        # learns from the answers themselves in as many steps (0.875, against 0.96 pretrained):
        # there the loss tells them apart
        assert pretrained["val_accuracy"] >= 0.8 and \
            pretrained["val_loss"] <= scratch["val_loss"] / 2, (pretrained, scratch)
    elif task == "classify":
        _, scratch = finetuned(task, "random")
        assert pretrained["val_accuracy"] >= scratch["val_accuracy"] + 0.1, (pretrained, scratch)
    # the defaults: 640 examples in batches of 32 are 20 steps an epoch, so 10 epochs reach the
    # 200 steps
    assert pretrained["epochs"] == 10 and pretrained["steps"] == 10 * math.ceil(TRAIN_EXAMPLES / 32)
    assert ("val_f1" in pretrained) == (task != "choice")


def test_the_head_starts_fitted_to_the_pretrained_body(datasets, pretrained, tmp_path):
    """Before the first step the head is the linear probe of the frozen body: at a rate too small to
    move anything, one epoch already scores far above chance (a head starting at zero would score
    every class alike)."""
    train, val = datasets["classify"]
    run = finetune("--task", "classify", "--train", train, "--val", val, "--init-from", pretrained,
                   "--out-dir", tmp_path, "--epochs", "1", "--lr", "1e-12", *FINETUNE)
    result = ok(run)
    # 0.97: the text's likelihood tells real from shuffled
    assert result["val_accuracy"] >= 0.8, result
    assert "labels 'real', 'shuffled' (val_f1: of 'shuffled')" in run.stdout


def test_without_val_a_share_of_train_is_held_out_from_the_seed(datasets, pretrained, tmp_path):
    """As HF's validation_split_percentage: --val-fraction (0.1) of --train, the same on every
    run."""
    from types import SimpleNamespace
    from toolkit.batches import train_and_val
    cfg = SimpleNamespace(train="t", val=None, val_fraction=0.1, seed=1337)
    train, val = train_and_val(cfg, lambda path: list(range(100)))
    assert len(val) == 10 and sorted(train + val) == list(range(100))
    assert train_and_val(cfg, lambda path: list(range(100))) == (train, val)
    assert train_and_val(SimpleNamespace(**{**vars(cfg), "seed": 1}),
                         lambda path: list(range(100)))[1] != val
    train_file, _ = datasets["classify"]
    result = finetune("--task", "classify", "--train", train_file, "--init-from", pretrained,
                      "--out-dir", tmp_path, "--epochs", "1", *FINETUNE)
    assert f"validation: 64 of the 640 examples of {train_file} held out" in result.stdout
    assert "576 train, 64 val examples" in result.stdout and ok(result)["val_accuracy"] > 0.5


def test_similarity_regression_correlates_and_long_pairs_are_cut(datasets, pretrained, tmp_path):
    train, val = datasets["graded"]
    result = finetune("--task", "similarity", "--labels", "float", "--train", train, "--val", val,
                      "--init-from", pretrained, "--out-dir", tmp_path, *FINETUNE,
                      "--block-size", "28")
    metrics = ok(result)
    assert metrics["val_pearson"] > 0.15 and metrics["val_spearman"] > 0.15, metrics
    # 13 + 13 characters and 3 special tokens do not fit in 28: every pair loses one character
    assert f"{train}: 640 of 640 examples cut to the block size of 28 tokens" in result.stdout
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["model_config"]["block_size"] == 28


def test_predictions_round_trip(finetuned, datasets, tmp_path):
    out, metrics = finetuned("classify", "pretrained")
    _, val = datasets["classify"]
    predictions = tmp_path / "predictions.jsonl"
    summary = ok(finetune("--init-from", out / "ckpt.pt", "--predict", val, "--out", predictions,
                          "--device", "cpu"))  # the dtype it was trained and scored with: auto
    assert summary == {"predictions": 200, "out": str(predictions), "truncated": 0}
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    labels = [row["label"] for row in read_jsonl(val)]
    assert all(set(line["probabilities"]) == {"real", "shuffled"} for line in lines)
    assert all(abs(sum(line["probabilities"].values()) - 1) < 1e-4 for line in lines)
    assert all(line["label"] == max(line["probabilities"], key=line["probabilities"].get)
               for line in lines)
    accuracy = sum(line["label"] == label for line, label in zip(lines, labels)) / len(labels)
    # the kept checkpoint is the best epoch's
    assert accuracy == pytest.approx(metrics["val_accuracy"], abs=1e-4)
    # fine-tuned once is enough: said with the way to use it, its HF export (no head) too
    train, _ = datasets["classify"]
    again = ["--task", "classify", "--train", train, "--out-dir", tmp_path / "again"]
    assert_one_line_error(finetune(*again, "--init-from", out / "ckpt.pt"),
                          "is already fine-tuned; use it with --predict")
    assert run_main("test.py", "--ckpt", out / "ckpt.pt", "--export-hf",
                    tmp_path / "hf").returncode == 0
    assert_one_line_error(finetune(*again, "--init-from", tmp_path / "hf"),
                          "its HF export keeps no task head (--predict takes the ckpt.pt)")

    out, metrics = finetuned("choice", "pretrained")
    _, val = datasets["choice"]
    ok(finetune("--init-from", out / "ckpt.pt", "--predict", val, "--out", predictions,
                "--overwrite", "--device", "cpu"))
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert all(line["label"] in range(4) and len(line["probabilities"]) == 4 for line in lines)
    accuracy = sum(line["label"] == row["label"]
                   for line, row in zip(lines, read_jsonl(val))) / len(lines)
    # scored as in training: likelihood and head
    assert accuracy == pytest.approx(metrics["val_accuracy"], abs=1e-4)


@pytest.mark.parametrize("written_before", ["the likelihood", "the weighted states"])
def test_a_checkpoint_of_an_older_version_is_one_error_line(finetuned, datasets, tmp_path,
                                                            written_before):
    """Written before the head read the likelihood (no `likelihood` key, a head as wide as the
    body), or before it read the likelihood-weighted states (one input more than the body's width):
    fine-tune again."""
    out, _ = finetuned("entail", "pretrained")
    checkpoint = load_checkpoint(str(out / "ckpt.pt"))
    width = checkpoint["model_config"]["n_embd"]
    if written_before == "the likelihood":
        assert checkpoint["finetune"].pop("likelihood") is True
    kept = width if written_before == "the likelihood" else width + 1
    checkpoint["head"]["weight"] = checkpoint["head"]["weight"][:, :kept].clone()
    save_checkpoint(checkpoint, str(tmp_path / "old.pt"))
    _, val = datasets["entail"]
    result = finetune("--init-from", tmp_path / "old.pt", "--predict", val,
                      "--out", tmp_path / "p.jsonl", "--device", "cpu")
    assert_one_line_error(result, str(tmp_path / "old.pt"), "older version of finetune.py",
                          "fine-tune again")
    assert not (tmp_path / "p.jsonl").exists()


def test_finetuned_checkpoint_samples_with_test_py(finetuned):
    out, _ = finetuned("classify", "pretrained")
    checkpoint = load_checkpoint(str(out / "ckpt.pt"))
    special = checkpoint["tokenizer"]["special_tokens"]
    vocab = checkpoint["model_config"]["vocab_size"]
    assert sorted(special.values()) == list(range(vocab - 3, vocab)) and \
        checkpoint["tokenizer"]["vocab_size"] == vocab
    assert checkpoint["finetune"]["label_names"] == ["real", "shuffled"] and \
        checkpoint["head"]["weight"].shape[0] == 2
    sample = run_main("test.py", "--ckpt", out / "ckpt.pt", "--device", "cpu", "--num-samples", "1",
                      "--max-new-tokens", "30", "--prompt", "def ")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("def ") and len(sample.stdout) > 10


# ------------------------------------------------------------------ torchrun, signals, init sources


def test_two_processes_give_the_metrics_of_one(datasets, pretrained, tmp_path):
    train, val = datasets["classify"]
    small = [write_jsonl(tmp_path / name, read_jsonl(path)[:n])
             for name, path, n in (("train.jsonl", train, 96), ("val.jsonl", val, 40))]
    args = ["--task", "classify", "--train", small[0], "--val", small[1], "--init-from", pretrained,
            *FAST, "--epochs", "2", "--head-dropout", "0",
            "--batch-size", "8"]  # x 2 micro-batches a step
    one = ok(finetune(*args, "--grad-accum", "2", "--out-dir", tmp_path / "one"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port()),
           "--nproc_per_node", "2", str(ROOT / "finetune.py"), *map(str, args),
           "--out-dir", str(tmp_path / "two")]
    two = ok(subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=300,
                            env={**os.environ, **ENV}))
    assert two.keys() == one.keys() and two["steps"] == one["steps"] == 12
    for name in one:
        assert two[name] == pytest.approx(one[name], abs=2e-4), (one, two)
    heads = [load_checkpoint(str(tmp_path / run / "ckpt.pt"))["head"]["weight"]
             for run in ("one", "two")]
    torch.testing.assert_close(heads[0], heads[1], atol=1e-4, rtol=0)


def test_sigterm_finishes_the_step_saves_the_latest_state_and_exits_0(datasets, pretrained,
                                                                      tmp_path):
    train, val = datasets["classify"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "finetune.py"), "--task", "classify",
                             "--train", train, "--val", val, "--init-from", pretrained,
                             "--out-dir", str(tmp_path), *FAST, "--epochs", "100"],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **ENV})
    try:
        for line in proc.stdout:
            if line.startswith("iter 10:"):  # training is running
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by signal at iteration" in out
    report = json.loads(out.splitlines()[-1])
    assert report["epochs"] == 0 and 1 <= report["steps"] < math.ceil(TRAIN_EXAMPLES / 16)
    assert not (tmp_path / "ckpt.pt").exists()  # no epoch was evaluated: nothing is the best yet
    latest = load_checkpoint(str(tmp_path / "last.pt"))
    assert latest["iter_num"] == report["steps"]
    # the same command again does not start anew over it
    assert_one_line_error(finetune("--task", "classify", "--train", train, "--val", val,
                                   "--init-from", pretrained, "--out-dir", tmp_path, *FAST),
                          "last.pt holds an interrupted fine-tuning")
    # a head of another shape in its place is refused; the run itself resumes and finishes
    shutil.copy(tmp_path / "last.pt", tmp_path / "kept.pt")
    torch.save({**latest, "head": {"weight": torch.zeros(3, 2)}}, tmp_path / "last.pt")
    assert_one_line_error(finetune("--init-from", "resume", "--out-dir", tmp_path),
                          "holds no task head of this task's shape")
    os.replace(tmp_path / "kept.pt", tmp_path / "last.pt")
    resumed = ok(finetune("--init-from", "resume", "--out-dir", tmp_path, "--epochs", "1"))
    assert resumed["epochs"] == 1 and resumed["steps"] == math.ceil(TRAIN_EXAMPLES / 16)


# ----------------------------------------------------------------------------- bad input


def bad_input_cases(tmp_path, datasets, byte_model):
    train, val = datasets["classify"]
    rows = read_jsonl(train)[:4]

    def lines(name, *texts):
        path = tmp_path / name
        path.write_text("".join(text + "\n" for text in texts))
        return str(path)

    good = [json.dumps(row) for row in rows]
    return {
        "unknown task": (["--task", "summarize", "--train", train, "--val", val],
                         "unknown task 'summarize'"),
        "missing field": (["--train", lines("t1.jsonl", good[0], json.dumps({"text": "abc"})),
                           "--val", val],
                          "t1.jsonl line 2: missing field 'label'"),
        "not JSON": (["--train", lines("t2.jsonl", good[0], "", '{"text": "abc",'), "--val", val],
                     "t2.jsonl line 3: invalid JSON"),
        "unseen label": (["--train", train, "--val",
                          lines("v1.jsonl", json.dumps({"text": "abc", "label": "maybe"}))],
                         "v1.jsonl line 1: label 'maybe' never occurs in the training file"),
        "empty file": (["--train", lines("t3.jsonl"), "--val", val], "t3.jsonl has no examples"),
        "too few to hold out": (["--train", lines("t4.jsonl", good[0])],
                                "t4.jsonl has 1 examples, too few to hold"),
        "nothing held out": (["--train", train, "--val-fraction", "0"],
                             "--val-fraction 0 holds nothing out"),
        "val without train": (["--val", val], "give --train too"),
        "a --predict file it cannot encode": (
            ["--train", train, "--val", val, "--predict", lines("p1.jsonl", json.dumps({
                "text": "\u4e2d"})), "--out", tmp_path / "p.jsonl"],
            "p1.jsonl line 1: character '\u4e2d' is not in the char vocabulary"),
        "another tokenizer": (["--train", train, "--val",
                               lines("v2.jsonl", json.dumps({"text": "\u4e2d", "label": "real"}))],
                              "v2.jsonl line 1: character '\u4e2d' is not in the char vocabulary"),
        "checkpoint unlike its tokenizer": (["--train", train, "--val", val,
                                             "--init-from", byte_model],
                                            "does not fit its tokenizer"),
        "output over an input": (["--train", train, "--val", val,
                                  "--init-from", tmp_path / "out" / "ckpt.pt"],
                                 "would overwrite the input"),
        "unequal choices": (["--task", "choice", "--train",
                             lines("t8.jsonl", *[json.dumps({"context": "ab", "choices": c,
                                                             "label": 0})
                                                 for c in (["a", "b"], ["a", "b"], ["a", "b", "c"],
                                                           ["a", "b"])])],
                            "t8.jsonl line 3: 3 choices, but line 1 has 2"),
        "nan as a class": (["--train", lines("t5.jsonl", *good, '{"text": "abc", "label": NaN}'),
                            "--val", val], "t5.jsonl line 5: label must be a string, number or"),
        "an infinite score": (["--task", "similarity", "--labels", "float", "--train",
                               lines("t6.jsonl", *[json.dumps({"text_a": "ab", "text_b": "cd",
                                                               "label": x})
                                                   for x in (0.5, 1.0)], '{"text_a": "ab", '
                                     '"text_b": "cd", "label": Infinity}'), "--val-fraction",
                               "0.3"], "t6.jsonl line 3: label must be a finite number"),
        "a score too large for a float": (["--task", "similarity", "--labels", "float", "--train",
                                           lines("t7.jsonl", *[json.dumps({
                                               "text_a": "ab", "text_b": "cd", "label": x})
                                               for x in (0.5, 1.0, 1e308)]),
                                           "--val-fraction", "0.3"],
                                          "t7.jsonl line 3: label must be a finite number"),
    }


@pytest.mark.parametrize("case", ["unknown task", "missing field", "not JSON", "unseen label",
                                  "empty file", "too few to hold out", "nothing held out",
                                  "val without train", "a --predict file it cannot encode",
                                  "another tokenizer",
                                  "checkpoint unlike its tokenizer", "output over an input",
                                  "unequal choices", "nan as a class", "an infinite score",
                                  "a score too large for a float"])
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, datasets, random_body):
    byte_model = tmp_path / "byte.pt"  # a 100-token model that claims the 257-token byte tokenizer
    model = GPT(GPTConfig(block_size=16, vocab_size=100, n_layer=1, n_head=1, n_embd=8))
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}},
                    str(byte_model))
    args, message = bad_input_cases(tmp_path, datasets, byte_model)[case]
    if "--init-from" not in args:
        args = [*args, "--init-from", random_body]
    if "--task" not in args:
        args = ["--task", "classify", *args]
    result = finetune(*args, "--out-dir", tmp_path / "out", "--device", "cpu")
    assert_one_line_error(result, message)
    assert not (tmp_path / "out").exists()
