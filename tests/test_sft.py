"""Instruction tuning (finetune.py --task sft, toolkit/chat.py), LoRA (toolkit/lora.py, --lora-rank,
--merge-lora), the chat loop (test.py --chat), exact resume of a fine-tuning, torchrun, and bad
input."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
import transformers

from conftest import ROOT, assert_one_line_error, gguf_logits, rel_err, run_main, run_script
from model import GPT, GPTConfig
from toolkit import lora
from toolkit.chat import (CHAT_TOKENS, add_chat_tokens, chat_prompt, encode_conversation,
                          export_template, fit_history, messages_of, pad_conversations, render)
from toolkit.checkpoint import load_checkpoint
from toolkit.distributed import free_port
from toolkit.files import fingerprint
from toolkit.finetune_config import FinetuneConfig
from toolkit.finetuning import setup
from toolkit.gpt2_vocab import GPT2_FACTS
from toolkit.hf import save_gpt2
from toolkit.hf_llama import save_llama
from toolkit.model_sources import load_model
from toolkit.sft import PackedConversations, read_packed
from toolkit.tokenizers import Tokenizer, load_tokenizer

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# not about learning
FAST = ["--device", "cpu", "--dtype", "float32", "--epochs", "2", "--batch-size", "16"]


def ok(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def pretrained(char_data, tmp_path_factory) -> str:
    """A tiny char-level GPT with room for a question and its answer (block 128), pretrained by
    train.py."""
    out = tmp_path_factory.mktemp("pretrained")
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", out, "--n-layer", "2",
                      "--n-head", "2", "--n-embd", "64", "--block-size", "128", "--batch-size",
                      "16", "--max-iters", "300", "--eval-interval", "300", "--eval-iters", "2",
                      "--log-interval", "300", "--device", "cpu", env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    return str(out / "ckpt.pt")


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> tuple[str, str]:
    """The recipe's conversations about Python's documentation topics (docs/finetune.md), as its
    script writes them."""
    out = tmp_path_factory.mktemp("chats")
    result = run_script("examples/pydoc_chat.py", "--out-dir", out)
    assert result.returncode == 0, result.stderr
    return str(out / "train.jsonl"), str(out / "val.jsonl")


def char_tokenizer_and_model(pretrained: str):
    model, facts = load_model(pretrained)
    tok = load_tokenizer(facts)
    add_chat_tokens(model, tok)
    return model, tok


# ------------------------------------------------------------------------ the template and the mask


def test_the_loss_covers_exactly_the_assistant_tokens_and_their_end(pretrained):
    _, tok = char_tokenizer_and_model(pretrained)
    system, user, assistant, end = (tok.special_tokens[name] for name in CHAT_TOKENS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "Done"}]
    [c] = encode_conversation(messages, tok, block_size=128)
    e = tok.encode
    assert c.ids == [system, *e("Be brief."), end, user, *e("Hi?"), end, assistant, *e("Hello."),
                     end, user, *e("And?"), end, assistant, *e("Done"), end] and not c.cut
    idx, targets = pad_conversations([c, *encode_conversation(messages[:3], tok, 128)],
                                     torch.device("cpu"))
    assert idx[0].tolist() == c.ids[:-1]
    learnt = [(i, t) for i, t in enumerate(targets[0].tolist()) if t != -1]
    assert [t for _, t in learnt] == [*e("Hello."), end, *e("Done"), end]
    assert all(c.ids[i + 1] == t for i, t in learnt)  # each target is the next token
    # padding
    assert (targets[1, len(encode_conversation(messages[:3], tok, 128)[0].ids) - 1:] == -1).all()
    # the generation prompt: the history and the assistant's role token
    assert chat_prompt(messages[:2], tok) == c.ids[: c.ids.index(assistant) + 1]
    # too long: cut at block_size + 1 tokens; left out when no assistant token remains
    [cut] = encode_conversation(messages, tok, block_size=30)
    assert cut.cut and len(cut.ids) == 31 and cut.ids == c.ids[:31]
    packed = PackedConversations()
    for _ in range(2):
        packed.add(encode_conversation(messages, tok, block_size=12))
    kept, left_out, cut = packed.select(np.ones(2, bool))
    assert len(kept) == 0 and left_out == 2 and cut == 0
    # the history of a chat drops its oldest turns first, never the system turn
    fitted, dropped = fit_history(messages, tok,
                                  room=len(chat_prompt(messages[:1] + messages[3:], tok)))
    assert fitted == messages[:1] + messages[3:] and dropped == 2


# ----------------------------------------------------------------------------- learning, chat


def test_sft_on_the_defaults_learns_and_test_py_chats(pretrained, chats, tmp_path):
    train, val = chats
    out = tmp_path / "sft"
    result = run_main("finetune.py", "--task", "sft", "--train", train, "--val", val, "--init-from",
                      pretrained, "--out-dir", out, "--device", "cpu", env=ENV)
    best = ok(result)
    history = load_checkpoint(str(out / "ckpt.pt"))["history"]
    start = history["metrics"][0]["val_loss"]  # evaluated before the first step
    assert best["val_loss"] < start - 0.1, (start, best)
    assert "warning" not in result.stderr
    assert not (out / "last.pt").exists()  # the run finished: only the best epoch stays

    talk = run_main("test.py", "--ckpt", out / "ckpt.pt", "--chat", "--temperature", "0",
                    "--max-new-tokens", "40", "--device", "cpu",
                    input="中文?\nTitle of assert?\n\nTitle of lambda?\n")
    assert talk.returncode == 0, talk.stderr
    assert talk.stdout.count("model> ") == 2 and "Ctrl-D" in talk.stderr
    # a message the char vocabulary cannot spell, the first one too: said, and the chat goes on
    assert "error: character '中' is not in the char vocabulary" in talk.stderr
    replies = [line.split("model> ", 1)[1] for line in talk.stdout.splitlines()
               if "model> " in line]
    assert all(replies) and not any(name in talk.stdout for name in CHAT_TOKENS)
    # --prompt frames one question with the template and prints only the answer
    one = run_main("test.py", "--ckpt", out / "ckpt.pt", "--prompt", "Title of assert?",
                   "--temperature", "0", "--num-samples", "1", "--max-new-tokens", "40", "--device",
                   "cpu")
    assert one.returncode == 0 and one.stdout.splitlines()[0] == replies[0], (one.stdout, replies)
    genfile = tmp_path / "answers.jsonl"
    assert run_main("test.py", "--ckpt", out / "ckpt.pt", "--prompt", "Title of assert?",
                    "--temperature", "0", "--num-samples", "1", "--max-new-tokens", "40",
                    "--device", "cpu", "--genfile", genfile).returncode == 0
    assert json.loads(genfile.read_text())["text"] == replies[0]  # the answer alone, as printed
    refused = run_main("test.py", "--ckpt", pretrained, "--chat")
    assert_one_line_error(refused, "never instruction-tuned", "--prompt")
    # fine-tuning it again is refused with the way to use it: chat, not --predict
    again = run_main("finetune.py", "--task", "sft", "--train", train, "--init-from",
                     out / "ckpt.pt", "--out-dir", tmp_path / "again", "--device", "cpu")
    assert_one_line_error(again, "is already fine-tuned; talk to it with test.py", "--chat")


# ----------------------------------------------------------------------------- LoRA


def test_lora_trains_only_the_adapters_and_merges_to_the_same_model(pretrained, chats, tmp_path):
    train, val = chats
    cfg = FinetuneConfig(task="sft", train=train, val=val, init_from=pretrained,
                         out_dir=str(tmp_path / "lora"), lora_rank=4, device="cpu", dtype="float32",
                         epochs=2, batch_size=16)
    trainer = setup(cfg)
    body = trainer.objective.model
    frozen = {name: p.detach().clone() for name, p in body.named_parameters()
              if not p.requires_grad}
    trained = {id(p) for group in trainer.engine.optimizer.param_groups for p in group["params"]}
    adapters = [m for m in body.modules() if isinstance(m, lora.LoRALinear)]
    rows = {id(m.parametrizations.weight[0].rows) for m in (body.lm_head, body.transformer.wte)}
    assert len(adapters) == 4 * 2  # c_attn, c_proj, c_fc, c_proj in each of 2 blocks
    # the untied head's new rows, the embedding's own
    assert len(rows) == 2 and not body.config.tie_embeddings
    assert trained == {id(p) for m in adapters for p in (m.lora_a, m.lora_b)} | rows
    assert body.lm_head.parametrizations.weight[0].rows.shape == (len(CHAT_TOKENS), 64)
    trainer.fit()
    assert all(torch.equal(p, frozen[name]) for name, p in body.named_parameters()
               if not p.requires_grad)
    assert any(m.lora_b.abs().sum() > 0 for m in adapters)

    adapter_ckpt = tmp_path / "lora" / "ckpt.pt"
    saved = load_checkpoint(str(adapter_ckpt))
    assert "model" not in saved and saved["lora"]["base"]["sha256"] == fingerprint(pretrained)
    # the adapters as trained (unmerged), read back merged, and merged into a full checkpoint:
    # one function
    idx = torch.randint(0, body.config.vocab_size, (2, 40))
    body.eval()
    with torch.no_grad():
        unmerged = body(idx)[0]
        loaded, _ = load_model(str(adapter_ckpt))
        # merged: W + BA rounds anew
        torch.testing.assert_close(loaded(idx)[0], unmerged, atol=1e-5, rtol=1e-5)
        merged = ok(run_main("finetune.py", "--merge-lora", adapter_ckpt, "--out-dir",
                             tmp_path / "merged"))
        full = load_checkpoint(merged["out"])
        assert "model" in full and full["finetune"]["lora"]["rank"] == 4
        assert os.path.getsize(adapter_ckpt) < 0.25 * os.path.getsize(merged["out"])
        torch.testing.assert_close(load_model(merged["out"])[0](idx)[0], unmerged, atol=1e-5,
                                   rtol=1e-5)
    # every reader takes the adapter checkpoint: sampling and the HF export
    assert run_main("test.py", "--ckpt", adapter_ckpt, "--prompt", "Title of dict?",
                    "--max-new-tokens", "5", "--num-samples", "1", "--device",
                    "cpu").returncode == 0
    assert run_main("test.py", "--ckpt", adapter_ckpt, "--export-hf",
                    tmp_path / "hf").returncode == 0
    exported = run_main("test.py", "--ckpt", adapter_ckpt, "--export-gguf", tmp_path / "m.gguf",
                        "--outtype", "f32")
    assert exported.returncode == 0, exported.stderr
    ids = idx[0].tolist()
    # llama.cpp runs the merged model
    assert rel_err(gguf_logits(tmp_path / "m.gguf", ids), unmerged[0]) < 1e-3


def test_lora_for_a_gpt1_task_trains_the_adapters_and_the_head(pretrained, tmp_path):
    rows = [{"text": f"def f{i}(x): return x", "label": "code"} if i % 2 else
            {"text": f"The value {i} is", "label": "prose"} for i in range(64)]
    path = tmp_path / "cls.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_main("finetune.py", "--task", "classify", "--train", path, "--val", path,
                      "--init-from", pretrained, "--out-dir", tmp_path / "cls", "--lora-rank", "4",
                      "--lora-targets", "attn", *FAST)
    metrics = ok(result)
    assert metrics["val_accuracy"] >= 0.9, metrics
    saved = load_checkpoint(str(tmp_path / "cls" / "ckpt.pt"))
    assert set(saved["adapters"]) == {f"transformer.h.{i}.attn.{n}.lora_{ab}" for i in (0, 1)
                                      for n in ("c_attn", "c_proj") for ab in "ab"} | \
        {lora.NEW_ROWS, lora.NEW_INPUT_ROWS}
    predictions = tmp_path / "p.jsonl"
    assert ok(run_main("finetune.py", "--init-from", tmp_path / "cls" / "ckpt.pt", "--predict",
                       path, "--out", predictions, "--device", "cpu", "--dtype",
                       "float32"))["predictions"] == 64


def test_a_lora_checkpoint_whose_base_is_missing_or_changed_is_refused(pretrained, chats, tmp_path):
    base = tmp_path / "base" / "ckpt.pt"
    base.parent.mkdir()
    shutil.copy(pretrained, base)
    train, val = chats
    ok(run_main("finetune.py", "--task", "sft", "--train", train, "--val", val, "--init-from", base,
                "--out-dir", tmp_path / "lora", "--lora-rank", "2", *FAST, "--epochs", "1"))
    adapters = tmp_path / "lora" / "ckpt.pt"
    # no output replaces the base the adapters read, --overwrite or not
    (tmp_path / "t.jsonl").write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    for script, *args in [
            ("finetune.py", "--merge-lora", adapters, "--out-dir", base.parent),
            ("test.py", "--ckpt", adapters, "--genfile", base),
            ("test.py", "--ckpt", adapters, "--export-gguf", base),
            ("eval.py", "--ckpt", adapters, "--tasks", tmp_path / "t.jsonl", "--output", base),
            ("embed.py", "tune", "--ckpt", adapters, "--pairs", train, "--out-dir", base.parent),
            ("train.py", "--init-from", adapters, "--out-dir", base.parent)]:
        assert_one_line_error(run_main(script, *args, "--overwrite"), "would overwrite the input",
                              str(base))
    assert base.read_bytes() == open(pretrained, "rb").read()
    with open(base, "ab") as f:
        f.write(b"\0")
    assert_one_line_error(run_main("test.py", "--ckpt", adapters),
                          "has changed since they were trained")
    base.unlink()
    assert_one_line_error(run_main("test.py", "--ckpt", adapters), "is missing", str(base))
    assert_one_line_error(run_main("finetune.py", "--merge-lora", adapters, "--out-dir",
                                   tmp_path / "m"), "is missing")
    assert not (tmp_path / "m").exists()


# ----------------------------------------------------------------------------- resume, torchrun


def test_an_interrupted_fine_tuning_resumes_exactly(pretrained, chats, tmp_path):
    train, val = chats
    args = ["--task", "sft", "--train", train, "--val", val, "--init-from", pretrained,
            "--lora-rank", "4", *FAST, "--epochs", "4", "--batch-size", "8",
            "--log-interval", "1"]  # 16 steps an epoch
    whole = ok(run_main("finetune.py", *args, "--out-dir", tmp_path / "whole", env=ENV))
    proc = subprocess.Popen([sys.executable, str(ROOT / "finetune.py"), *map(str, args),
                             "--out-dir", str(tmp_path / "cut")], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **ENV})
    try:
        for line in proc.stdout:
            if line.startswith("iter 20:"):  # into the second epoch
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "--init-from resume" in out, err[-2000:]
    latest = load_checkpoint(str(tmp_path / "cut" / "last.pt"))
    assert 20 <= latest["iter_num"] < 64 and latest["optimizer"]
    for changed in (["--lora-rank", "8"], ["--lora-rank", "0"], ["--lora-targets", "mlp"]):
        assert_one_line_error(run_main("finetune.py", "--init-from", "resume", "--out-dir",
                                       tmp_path / "cut", *changed, env=ENV),
                              f"was fine-tuned with {changed[0]} ", "same LoRA settings")
    resumed = ok(run_main("finetune.py", "--init-from", "resume", "--out-dir", tmp_path / "cut",
                          env=ENV))
    assert resumed == whole
    saved = [load_checkpoint(str(tmp_path / run / "ckpt.pt")) for run in ("whole", "cut")]
    assert all(torch.equal(saved[0]["adapters"][k], saved[1]["adapters"][k])
               for k in saved[0]["adapters"])
    assert saved[0]["history"]["metrics"] == saved[1]["history"]["metrics"]
    assert not (tmp_path / "cut" / "last.pt").exists()
    assert_one_line_error(run_main("finetune.py", "--init-from", "resume", "--out-dir",
                                   tmp_path / "cut"),
                          "nothing to resume")


def test_two_processes_instruction_tune_like_one(pretrained, chats, tmp_path):
    train, val = chats
    args = ["--task", "sft", "--train", train, "--val", val, "--init-from", pretrained,
            "--lora-rank", "4", *FAST, "--epochs", "1", "--batch-size", "8",
            "--lora-dropout", "0"]  # x 2 micro-batches a step
    one = ok(run_main("finetune.py", *args, "--grad-accum", "2", "--out-dir", tmp_path / "one",
                      env=ENV))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port()),
           "--nproc_per_node", "2", str(ROOT / "finetune.py"), *map(str, args), "--out-dir",
           str(tmp_path / "two")]
    two = ok(subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=300,
                            env={**os.environ, **ENV}))
    assert two["steps"] == one["steps"] == 8 and two["val_loss"] == pytest.approx(one["val_loss"],
                                                                                  abs=2e-4)
    adapters = [load_checkpoint(str(tmp_path / run / "ckpt.pt"))["adapters"]
                for run in ("one", "two")]
    for key in adapters[0]:
        torch.testing.assert_close(adapters[0][key], adapters[1][key], atol=1e-4, rtol=0)


def test_alpaca_and_sharegpt_files_train_as_their_messages_do(pretrained, chats, tmp_path):
    """LLaMA-Factory's two layouts (most Chinese instruction sets), alpaca's as one JSON array."""
    train, val = chats
    layouts = {"alpaca": lambda m: {"instruction": m[0]["content"], "input": "",
                                    "output": m[1]["content"]},
               "sharegpt": lambda m: {"conversations": [{"from": "human", "value": m[0]["content"]},
                                                        {"from": "gpt", "value": m[1]["content"]}]}}
    args = ["--task", "sft", "--val", val, "--init-from", pretrained, *FAST]
    reports = {"messages": ok(run_main("finetune.py", *args, "--train", train, "--out-dir",
                                       tmp_path / "m", env=ENV))}
    records = [json.loads(line)["messages"] for line in open(train)]
    for name, layout in layouts.items():
        path = tmp_path / f"{name}.json"
        if name == "alpaca":
            path.write_text(json.dumps([layout(m) for m in records], indent=2, ensure_ascii=False))
        else:
            path.write_text("".join(json.dumps(layout(m)) + "\n" for m in records))
        reports[name] = ok(run_main("finetune.py", *args, "--train", path, "--out-dir",
                                    tmp_path / name, env=ENV))
    assert reports["alpaca"] == reports["sharegpt"] == reports["messages"]
    alpaca = {"system": "简短回答。", "instruction": "翻译成英文", "input": "数据放在哪里？",
              "output": "Where is the data?"}
    assert messages_of(alpaca) == [{"role": "system", "content": "简短回答。"},
                                   {"role": "user", "content": "翻译成英文\n数据放在哪里？"},
                                   {"role": "assistant", "content": "Where is the data?"}]
    # (in the model's characters: each record is encoded as it is read)
    english = {"instruction": "Where is the data?", "input": "", "output": "Here."}
    (tmp_path / "bad.json").write_text(json.dumps([english, {"instruction": "no output"}],
                                                  indent=2))
    assert_one_line_error(run_main("finetune.py", *args, "--train", tmp_path / "bad.json",
                                   "--out-dir", tmp_path / "bad"),
                          f"{tmp_path / 'bad.json'} line 7: expected")


def test_sft_data_takes_the_memory_of_its_token_arrays(tmp_path):
    """An alpaca .json array is encoded as it is read into flat arrays: reading 4,000 records of
    300 characters peaks within 2x their token arrays (held as Python lists of dicts and of ints,
    such data once took 19x its file)."""
    tok = Tokenizer("byte")
    add_chat_tokens(GPT(GPTConfig(block_size=16, vocab_size=257, n_layer=1, n_head=1, n_embd=8)),
                    tok)
    words = "".join(f"word{i} " for i in range(200_000))
    records = [{"instruction": words[i * 300:i * 300 + 100], "input": "",
                "output": words[i * 300 + 100:i * 300 + 300]} for i in range(4000)]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    del records, words
    tracemalloc.start()
    packed = read_packed(str(tmp_path / "a.json"), tok, 512)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    kept, left_out, cut = packed.select(np.ones(packed.records, bool))
    template = len(encode_conversation(messages_of({"instruction": "a", "output": "b"}), tok,
                                       512)[0].ids) - 2
    assert (len(kept), left_out, cut) == (4000, 0, 0) and len(kept[3999].ids) == 300 + template
    arrays = len(packed.tokens) * 5 + len(kept) * 22  # ids, flags; each sequence's start, ...
    assert peak < 2 * arrays, (peak, arrays)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"role": "user", "content": "hi"}]},
     "line 2: the conversation has no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]},
     "line 2: message 0 has the unknown role 'robot'"),
    ({"messages": [{"role": "assistant", "content": 3}]},
     "line 2: message 0 (assistant) has content that is not"),
    ({"prompt": "hi"}, 'line 2: expected {"messages"'),
    # ShareGPT's "from" as a list or an object (once a TypeError traceback: unhashable)
    ({"conversations": [{"from": ["human"], "value": "hi"}, {"from": "gpt", "value": "b"}]},
     "line 2: message 0 has the unknown role ['human']"),
    ({"conversations": [{"from": {"who": "human"}, "value": "hi"}]},
     "line 2: message 0 has the unknown role {'who': 'human'}"),
])
def test_a_bad_conversation_is_one_line_and_writes_nothing(line, message, pretrained, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps(line) + "\n")
    result = run_main("finetune.py", "--task", "sft", "--train", path, "--val", path, "--init-from",
                      pretrained, "--out-dir", tmp_path / "out", "--device", "cpu")
    assert_one_line_error(result, f"{path} {message}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family",
                         [{}, dict(arch="llama", bias=False, qk_norm=True, tie_embeddings=False)],
                         ids=["gpt2", "llama"])
def test_the_hf_export_of_an_instruction_tuned_model_carries_the_template(family, tmp_path):
    model = GPT(GPTConfig(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16,
                          **family))
    tok = load_tokenizer(dict(GPT2_FACTS))
    special = add_chat_tokens(model, tok)
    (save_llama if family else save_gpt2)(model, str(tmp_path), tok.facts(),
                                          export_template(tok.facts()))
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.convert_ids_to_tokens(list(range(50257, 50261))) == list(CHAT_TOKENS)
    assert hf_tok.encode("<|user|>Hi") == [tok.special_tokens["<|user|>"], *tok.encode("Hi")]
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "列表的标题？"},
               {"role": "assistant", "content": " Lists"}, {"role": "user", "content": "And dict?"}]
    ids = hf_tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    # the prompt test.py --chat gives the model
    assert hf_tok.encode(ids) == chat_prompt(history, tok)
    # and eval.py --apply-chat-template's: the template rendered as text, its tokens read back
    # as tokens
    assert tok.encode_with_special_tokens(render(export_template(tok.facts()), history)) == \
        chat_prompt(history, tok)
    # generate() ends a reply at the turn's end, as test.py --chat does
    generation = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert generation.eos_token_id == [tok.eot_id, special["<|end|>"]]
    # the toolkit chats with it again
    assert load_model(str(tmp_path))[1]["special_tokens"] == special
