"""eval.py, toolkit/evaluation.py and toolkit/harness.py: HellaSwag-format files scored as
lm-evaluation-harness scores them (checked against its own `hf` model on the exported folder), task
YAMLs, --eval-tasks in training (one process and two), the HF export read by transformers alone, and
bad input."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from conftest import (ROOT, TINY_MODEL, assert_one_line_error, perturb, run_main, run_script,
                      tensorboard_scalars)
from model import GPT, GPTConfig
from toolkit.checkpoint import load_checkpoint, save_checkpoint
from toolkit.distributed import free_port
from toolkit.gpt2_vocab import GPT2_FACTS
from toolkit.prepare import default_corpus_documents

WORDS = "the a cat dog sat on mat ran fast slowly house tree big small red blue".split()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """As on a machine without internet: the Hugging Face libraries fetch nothing (a test that
    needed a download fails instead of waiting on the network)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def hellaswag_rows(n: int, seed: int = 0) -> list[dict]:
    """Items in HellaSwag's own layout, with the WikiHow artifacts its preprocessing removes."""
    rng = random.Random(seed)
    return [{"activity_label": "Making " + rng.choice(WORDS),
             "ctx_a": " ".join(rng.choices(WORDS, k=8)),
             "ctx_b": " ".join(rng.choices(WORDS, k=3)), "label": str(rng.randrange(4)),
             "endings": [" ".join(rng.choices(WORDS, k=rng.randint(2, 7))) + " [title] [step] x"
                         for _ in range(4)]}
            for _ in range(n)]


def task_yaml(folder, data: str, name: str = "local_hellaswag") -> str:
    """An lm-eval task over a local file, preprocessed by the harness's own hellaswag code."""
    import lm_eval
    utils = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "hellaswag", "utils.py")
    (folder / "utils.py").write_text(open(utils).read())
    path = folder / f"{name}.yaml"
    path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    validation: {data}\n"
                    "validation_split: validation\noutput_type: multiple_choice\n"
                    "process_docs: !function utils.process_docs\ndoc_to_text: '{{query}}'\n"
                    "doc_to_target: '{{label}}'\ndoc_to_choice: choices\nmetric_list:\n"
                    "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
                    "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    return str(path)


@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory, gpt2_vocabulary):
    """A tiny GPT-2-vocabulary model (weights perturbed off their init), its ckpt.pt, and its HF
    export."""
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=32))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": dict(GPT2_FACTS)}, str(folder / "ckpt.pt"))
    exported = run_main("test.py", "--ckpt", folder / "ckpt.pt", "--export-hf", folder / "hf")
    assert exported.returncode == 0, exported.stderr
    return folder


def metrics(result) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_export_loads_alone_in_transformers_and_encodes_as_the_toolkit(gpt2_model, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.tokenizers import load_tokenizer
    folder = gpt2_model / "hf"
    assert {"config.json", "model.safetensors", "generation_config.json", "vocab.json",
            "merges.txt", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    ours = load_tokenizer(GPT2_FACTS)
    theirs = AutoTokenizer.from_pretrained(folder)
    text = "\n\n".join(default_corpus_documents())[:50_000] + " café naïve 𝔘𝔫𝔦𝔠𝔬𝔡𝔢  spaces\t\n"
    assert theirs(text)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == 50256 and theirs.decode(ours.encode(text)) == text
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = GPT(GPTConfig(**load_checkpoint(str(gpt2_model / "ckpt.pt"))["model_config"]))
    model.load_state_dict(load_checkpoint(str(gpt2_model / "ckpt.pt"))["model"])
    idx = torch.tensor([ours.encode("The cat sat on the mat and then it ran fast.")])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model.eval()(idx)[0], atol=1e-5, rtol=0)
    # generate() as users call it, with no warning about a length the folder sets
    from transformers.utils import logging as hf_logging
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            hf.generate(idx, max_new_tokens=3, do_sample=False)
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "max_length" in r.getMessage()], caplog.text


def test_a_char_model_exports_weights_and_says_what_no_hf_tokenizer_holds(char_data, tmp_path):
    facts = json.loads((char_data / "meta.json").read_text())
    model = GPT(GPTConfig(block_size=16, vocab_size=facts["vocab_size"], n_layer=1, n_head=1,
                          n_embd=8))
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": facts}, str(tmp_path / "ckpt.pt"))
    result = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--export-hf", tmp_path / "hf")
    assert result.returncode == 0 and "no HF tokenizer: see its README.md" in result.stdout
    assert "vocab.json" not in os.listdir(tmp_path / "hf")
    assert "AutoTokenizer` cannot load" in (tmp_path / "hf" / "README.md").read_text()
    sampled = run_main("test.py", "--ckpt", tmp_path / "hf", "--num-samples", "1",
                       "--max-new-tokens", "5")
    # the toolkit reads the folder with its own tokenizer
    assert sampled.returncode == 0, sampled.stderr


def test_a_local_file_and_a_task_yaml_score_as_lm_evals_own_hf_model(gpt2_model, tmp_path):
    """The same items through eval.py (a .jsonl, and a task YAML through the harness) and through
    lm-eval's own `hf` model on the exported folder: the same acc and acc_norm, every request's
    log-likelihood within 1e-4."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from toolkit.harness import GPTHarness, task_manager
    from toolkit.model_sources import load_model
    from toolkit.tokenizers import load_tokenizer
    data = write_jsonl(tmp_path / "items.jsonl", hellaswag_rows(24))
    yaml = task_yaml(tmp_path, data)
    result = metrics(run_main("eval.py", "--ckpt", gpt2_model / "ckpt.pt", "--tasks",
                              f"{data},{yaml}", "--dtype", "float32", "--batch-size", "5",
                              "--output", tmp_path / "out.json"))
    assert set(result) == {"items", "local_hellaswag"} and \
        result["items"] == result["local_hellaswag"]
    assert json.loads((tmp_path / "out.json").read_text())["results"] == result

    manager = task_manager((str(tmp_path),), False)
    theirs = simple_evaluate(model=HFLM(pretrained=str(gpt2_model / "hf"), device="cpu",
                                        dtype="float32", batch_size=8),
                             tasks=["local_hellaswag"], task_manager=manager, log_samples=True,
                             bootstrap_iters=0)
    model, facts = load_model(str(gpt2_model / "ckpt.pt"))
    ours = simple_evaluate(model=GPTHarness(model, load_tokenizer(facts), 3, torch.device("cpu"),
                                            torch.float32),
                           tasks=["local_hellaswag"], task_manager=manager, log_samples=True,
                           bootstrap_iters=0)
    assert theirs["results"]["local_hellaswag"]["acc,none"] == result["items"]["acc"]
    assert theirs["results"]["local_hellaswag"]["acc_norm,none"] == result["items"]["acc_norm"]
    their_lls = [r[0][0] for s in theirs["samples"]["local_hellaswag"] for r in s["resps"]]
    our_lls = [r[0][0] for s in ours["samples"]["local_hellaswag"] for r in s["resps"]]
    assert len(their_lls) == len(our_lls) == 96
    assert max(abs(a - b) for a, b in zip(their_lls, our_lls)) < 1e-4


def char_choices(n: int, seed: int = 0) -> list[dict]:
    """The true 20-character continuation of a 40-character span of the corpus among three from
    elsewhere."""
    documents = [d for d in default_corpus_documents() if len(d) > 200]
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        doc = rng.choice(documents)
        start = rng.randrange(len(doc) - 60)
        others = [(o := rng.choice(documents))[(s := rng.randrange(len(o) - 20)):s + 20]
                  for _ in range(3)]
        label = rng.randrange(4)
        rows.append({"ctx": doc[start:start + 40],
                     "endings": others[:label] + [doc[start + 40:start + 60]] + others[label:],
                     "label": label})
    return rows


def test_eval_tasks_in_training_log_acc_and_acc_norm_as_eval_py_and_two_processes_score_them(
        char_data, tmp_path):
    choices = write_jsonl(tmp_path / "pydoc_choice.jsonl", char_choices(30))
    common = [*TINY_MODEL, "--max-iters", "20", "--eval-interval", "10", "--eval-tasks", choices]
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path / "one", *common,
                      "--grad-accum", "2")
    assert result.returncode == 0, result.stderr
    assert "pydoc choice acc " in result.stdout and "pydoc choice acc norm " in result.stdout
    checkpoint = load_checkpoint(str(tmp_path / "one" / "ckpt.pt"))
    last = checkpoint["history"]["metrics"][-1]
    assert len(checkpoint["history"]["metrics"]) == 3 and 0 <= last["pydoc_choice_acc"] <= 1
    scalars = tensorboard_scalars(tmp_path / "one" / "tensorboard")
    assert [step for step, _ in scalars["eval/pydoc_choice_acc_norm"]] == [0, 10, 20]
    scored = metrics(run_main("eval.py", "--ckpt", tmp_path / "one" / "ckpt.pt", "--tasks", choices,
                              "--dtype", "float32"))
    assert scored["pydoc_choice"] == {"acc": last["pydoc_choice_acc"],
                                      "acc_norm": last["pydoc_choice_acc_norm"]}

    # two processes (one micro-batch each: the same global batch) share the items out and score
    # them alike
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port()),
           "--nproc_per_node", "2", str(ROOT / "train_ddp.py"), "--data-dir", str(char_data),
           "--out-dir", str(tmp_path / "two"), *common]
    ddp = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    two = load_checkpoint(str(tmp_path / "two" / "ckpt.pt"))["history"]["metrics"]
    for a, b in zip(checkpoint["history"]["metrics"], two, strict=True):
        assert (a["pydoc_choice_acc"], a["pydoc_choice_acc_norm"]) == (b["pydoc_choice_acc"],
                                                                       b["pydoc_choice_acc_norm"])


@pytest.mark.parametrize("line, message", [
    ('{"ctx": "a", "endings": ["b", "c"], "label": 2}',
     "line 2: label must be the index of the right ending"),
    ('{"ctx": "a", "label": 0}', "line 2: 'endings' must be a list of at least two strings"),
    ('{"ctx": "a", "endings": ["b"', "line 2: invalid JSON"),
    ('{"endings": ["b", "c"], "label": 0}', "line 2: no string 'ctx'"),
    ('{"ctx": "a", "endings": ["b", "[title]"], "label": 0}', "line 2: ending 1 is empty"),
    ('{"ctx": "a", "endings": ["b", "%s"], "label": 0}' % ("c " * 2000),
     "bad.jsonl item 2, ending 2: its 2000 tokens are more than the block size"),
])
def test_a_bad_line_is_named(gpt2_model, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 1}\n' + line + "\n")
    assert_one_line_error(run_main("eval.py", "--ckpt", gpt2_model / "ckpt.pt", "--tasks", path),
                          message)


def test_a_json_array_task_file_scores_as_its_json_lines(gpt2_model, tmp_path):
    rows = hellaswag_rows(6)
    lines = write_jsonl(tmp_path / "lines.jsonl", rows)
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=1))
    scores = metrics(run_main("eval.py", "--ckpt", gpt2_model / "ckpt.pt", "--tasks",
                              f"{lines},{tmp_path / 'array.json'}"))
    assert scores["array"] == scores["lines"]


def test_bad_input_is_one_line(gpt2_model, tmp_path):
    ckpt = gpt2_model / "ckpt.pt"
    assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks",
                                   tmp_path / "missing.jsonl"), "task file not found")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    items = write_jsonl(tmp_path / "ok.jsonl", hellaswag_rows(2))
    assert_one_line_error(run_main("eval.py", "--ckpt", tmp_path / "junk.pt", "--tasks", items),
                          "junk.pt")
    # an --output no folder can hold: said before the scoring, not after it
    assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", items, "--output",
                                   tmp_path / "junk.pt" / "results.json"),
                          "cannot be written", "junk.pt is a file, not a folder")
    # the data a task YAML reads is an input too, named directly or by a glob
    for data in (items, tmp_path / "o*.jsonl"):
        task = tmp_path / "task.yaml"
        task.write_text(f"task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                        f"    validation: [{data}]\n")
        assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", task, "--output",
                                       items, "--overwrite"), f"would overwrite the input {items}")
    assert json.loads(open(items).readline())["endings"]
    # two tasks of one name: the second's scores would replace the first's in the results
    (tmp_path / "sub").mkdir()
    twin = write_jsonl(tmp_path / "sub" / "ok.jsonl", hellaswag_rows(2))
    (tmp_path / "ok_task.yaml").write_text("task: ok\ndataset_path: json\n")
    for other in (twin, tmp_path / "ok_task.yaml"):
        assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", f"{items},{other}"),
                              "are both named ok")
    assert_one_line_error(run_main("train.py", "--eval-tasks", f"{items},{twin}"),
                          "--eval-tasks", "are both named ok")
    # the harness indexes a folder's *.yaml files only
    (tmp_path / "t.yml").write_text("task: t\n")
    assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", tmp_path / "t.yml"),
                          "task YAMLs named *.yaml")
    pytest.importorskip("lm_eval")
    # a Hub with no address (RFC 2606's .invalid) and no offline mode set: eval.py sets it, or the
    # hub libraries retry for 25 s with a warning each time (on the real stderr: hence a process of
    # its own)
    no_hub = {"HF_ENDPOINT": "https://hub.invalid", "HF_HUB_OFFLINE": "",
              "HF_DATASETS_OFFLINE": "", "HTTPS_PROXY": "", "https_proxy": "", "ALL_PROXY": "",
              "all_proxy": ""}
    offline = run_script("eval.py", "--ckpt", ckpt, "--tasks", "hellaswag", "--limit", "2",
                         timeout=120, env=no_hub)
    assert_one_line_error(offline, "cannot load the data of hellaswag", "local file")
    assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", "hellaswagg"),
                          "unknown task 'hellaswagg'")


def test_text_written_without_spaces_is_continued_without_one(tmp_path):
    """A Chinese item is scored as its context runs on into each ending: a char vocabulary of its
    text alone (no space in it) scores it; English keeps HellaSwag's space."""
    from toolkit.evaluation import ChoiceTask
    from toolkit.tokenizers import Tokenizer
    rows = [{"ctx": "小明今天去", "endings": ["学校。", "公园。"], "label": 0},
            {"ctx": "He went to", "endings": ["school.", "the park."], "label": 1}]
    tok = Tokenizer("char", chars="".join(sorted(set(json.dumps(rows, ensure_ascii=False)))))
    task = ChoiceTask(write_jsonl(tmp_path / "mixed.jsonl", rows), tok, block_size=16)
    assert task.requests == [(tok.encode(context), tok.encode(ending)) for context, ending in (
        ("小明今天去", "学校。"), ("小明今天去", "公园。"), ("He went to", " school."),
        ("He went to", " the park."))]


def test_a_continuation_the_context_swallows_is_encoded_apart_and_scored():
    """A BPE trained on unspaced text makes one token of the context's end and the ending: split
    where the context's tokens end, nothing would be left to score. (Where the join's token holds
    only part of the ending, the split stays the harness's.)"""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from toolkit.evaluation import encode_pair, gpt_logits_at, loglikelihoods
    from toolkit.tokenizers import Tokenizer
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["小红在杭州相遇。"] * 50 + ["小红在杭州"] * 5, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer("bpe", tokenizer_json=bpe.to_str())
    assert len(tok.encode("小红在杭州相遇")) == 1  # the whole pair is one token
    assert encode_pair(tok, "小红在杭州", "相遇") == (tok.encode("小红在杭州"), tok.encode("相遇"))
    # and a batch of empty continuations (the harness's own split may leave them) scores 0
    model = GPT(GPTConfig(block_size=8, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_embd=8))
    lls, greedy = loglikelihoods(gpt_logits_at(model, torch.device("cpu"), torch.float32),
                                 [([1, 2], []), ([3], [])], 8, 2, torch.device("cpu"))
    assert lls.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("think", ["</think>", None])
def test_a_generated_reply_is_cut_as_lm_evals_hf_model_cuts_it(think):
    """After the last end of thinking (--think-end-token as text), then at the first stop."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.utils import postprocess_generated_text

    from toolkit.harness import GPTHarness
    from toolkit.tokenizers import load_tokenizer
    model = GPT(GPTConfig(block_size=8, vocab_size=257, n_layer=1, n_head=1, n_embd=8))
    lm = GPTHarness(model, load_tokenizer({"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}),
                    1, torch.device("cpu"), torch.float32, think_end=think)
    until = ["\n\n", "Q:"]
    for text in ("<think>a\n\nb</think> </think>  42\n\nQ: more", "no thinking: 7 Q: 8",
                 "思考</think>答案是 5", "</think>", "cut short <think>x\n\ny"):
        assert lm.reply(list(text.encode()), until) == \
            postprocess_generated_text(text, until, think), text


def test_generation_requests_decoded_in_batches_reply_as_one_at_a_time():
    """generate_until in batches of --batch-size, left-padded, each group of the same options apart:
    the replies of requests one at a time, cut at an until string or ended by a stop token, in the
    order asked; 200 new tokens slide past the block of 64."""
    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from toolkit.harness import GPTHarness
    from toolkit.tokenizers import load_tokenizer
    torch.manual_seed(0)
    model = perturb(GPT(GPTConfig(block_size=64, vocab_size=257, n_layer=2, n_head=2,
                                  n_embd=32)), std=0.3)
    tok = load_tokenizer({"tokenizer": "byte", "vocab_size": 257, "eot_id": 256})
    contexts = ["The cat sat on", "Q: 1+1?\nA:", "x", "一二三四五六七八九十" * 3, "def f(x):"]
    requests = [SimpleNamespace(args=(context, {"until": [" ", "\n"], "max_gen_toks": 200}))
                for context in contexts]
    requests += [SimpleNamespace(args=(context, {"until": "q", "max_gen_toks": 6}))
                 for context in contexts[:3]]
    alone = GPTHarness(model, tok, 1, torch.device("cpu"), torch.float32)
    replies = alone.generate_until(requests)
    assert len(set(map(len, replies))) > 3 and max(map(len, replies[:5])) > 64
    batched = GPTHarness(model, tok, 3, torch.device("cpu"), torch.float32)
    assert batched.generate_until(requests) == replies
    # a stop token (an instruction-tuned model's end of turn) ends a row's reply
    first = model.generate(torch.tensor([tok.encode(contexts[0])]), 1, temperature=0)[0, -1]
    batched.stops = alone.stops = [first.item()]
    assert alone.generate_until(requests[:1]) == [""]
    assert batched.generate_until(requests) == alone.generate_until(requests)


def test_think_end_token_needs_a_harness_task_and_a_real_token(gpt2_model, tmp_path):
    ckpt = gpt2_model / "ckpt.pt"
    items = write_jsonl(tmp_path / "ok.jsonl", hellaswag_rows(2))
    for flag in (["--think-end-token", "</think>"], ["--compile"]):
        assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", items, *flag),
                              f"{flag[0]} is for lm-evaluation-harness's tasks")
    assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", "hellaswag",
                                   "--think-end-token", ""), "--think-end-token is empty")
    pytest.importorskip("lm_eval")
    yaml = task_yaml(tmp_path, items)
    assert_one_line_error(run_main("eval.py", "--ckpt", ckpt, "--tasks", yaml,
                                   "--think-end-token", "99999"), "no such token id", "50,257")


@pytest.mark.parametrize("change, fragment", [
    (("'{{query}}'", "'{{no_such_field}}'"), "UndefinedError: 'no_such_field' is undefined"),
    (("'{{query}}'", "'{{query'"), "TemplateSyntaxError"),
    (("utils.process_docs", "utils.no_such_function"), "has no function 'no_such_function'"),
    (("output_type: multiple_choice", "output_type: bogus"), "invalid output_type 'bogus'"),
    (("  - metric: acc_norm\n    aggregation: mean\n", "  - metric: no_such_metric\n"), "KeyError"),
    (("doc_to_choice: choices", "doc_to_choice: '{{query}}'"), "SyntaxError"),
    (("doc_to_target: '{{label}}'", "doc_to_target: '7'"), "IndexError")])
def test_a_broken_task_yaml_is_one_line_naming_the_task_not_the_network(gpt2_model, tmp_path,
                                                                          change, fragment):
    pytest.importorskip("lm_eval")
    yaml = task_yaml(tmp_path, write_jsonl(tmp_path / "items.jsonl", hellaswag_rows(2)))
    with open(yaml) as f:
        text = f.read()
    with open(yaml, "w") as f:
        f.write(text.replace(*change))
    result = run_main("eval.py", "--ckpt", gpt2_model / "ckpt.pt", "--tasks", yaml)
    # (after the data library's progress lines, when the data was read)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith("error: lm-evaluation-harness cannot run local_hellaswag") and \
        fragment in last and "internet" not in last, last


def test_without_lm_eval_a_harness_task_names_the_install(gpt2_model):
    code = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "eval.py"), "--ckpt",
                             str(gpt2_model / "ckpt.pt"), "--tasks", "arc_easy"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert_one_line_error(result, "pip install lm_eval")


def test_a_task_file_shows_its_progress(gpt2_model, tmp_path, monkeypatch):
    """Issue 49: a huge task file is read, tokenized and scored with bars on stderr (in a log from
    cli.PROGRESS_DELAY on, so that a quick error stays one line: here from the start)."""
    from toolkit import cli
    monkeypatch.setattr(cli, "PROGRESS_DELAY", 0.0)
    path = write_jsonl(tmp_path / "many.jsonl", hellaswag_rows(40))
    result = run_main("eval.py", "--ckpt", gpt2_model / "ckpt.pt", "--tasks", path)
    assert result.returncode == 0, result.stderr
    for bar in ("many.jsonl: reading", "many: tokenizing", "many: 100%", "160/160"):
        assert bar in result.stderr, result.stderr
