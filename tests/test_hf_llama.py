"""toolkit/hf_llama.py: HF Llama and Qwen3 folders both ways, checked against transformers' own
models: folders built by transformers itself (random weights, tiny shapes, a BPE trained here),
nothing downloaded."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import assert_one_line_error, llama3_folder, rel_err, run_main
from toolkit.chat import add_chat_tokens, chat_prompt, encode_conversation
from toolkit.checkpoint import load_checkpoint
from toolkit.cli import CLIError
from toolkit.data import read_megatron_index
from toolkit.gguf_export import save_gguf
from toolkit.exports import save_hf
from toolkit.model_sources import load_model
from toolkit.sampling import prompt_ids
from toolkit.prepare import train_bpe
from toolkit.tokenizers import Tokenizer, check_facts, load_tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

HELD_OUT = ["The quick brown fox reads the manual.", "模型在这里读中文的句子。",
            "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    texts = ["hello world, a tiny corpus of words " * 20, "中文的句子也在这里，模型读它。" * 20,
             "def f(x):\n    return x + 1\n" * 20]
    return train_bpe(iter(texts), 320)


def hf_folder(path, tokenizer_json: str, family: str, tie: bool, shards: bool = False) -> str:
    """A tiny random LlamaForCausalLM or Qwen3ForCausalLM written by transformers, with our
    tokenizer.json."""
    vocab = Tokenizer("bpe", tokenizer_json=tokenizer_json).vocab_size
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 tie_word_embeddings=tie, rope_theta=5000.0)
    torch.manual_seed(0)  # the same weights whatever ran before
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
def test_an_hf_folder_reads_and_writes_back_as_the_same_model(tmp_path, tokenizer_json, family, tie,
                                                              shards):
    folder = hf_folder(tmp_path / "hf", tokenizer_json, family, tie, shards)
    assert shards == os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model, facts = load_model(folder)
    assert (model.config.arch, model.config.qk_norm, model.config.tie_embeddings) == \
        ("llama", family == "qwen3", tie)
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


def test_tokenizer_facts_that_do_not_describe_the_model_are_one_line(tmp_path):
    """tokenizer_facts.json (what an export of a char or byte model holds) is checked when read:
    every use of the folder, exports too, meets a damaged or foreign file as one line."""
    from conftest import tiny_gpt
    tok = Tokenizer("char", chars="abcdef", char_eot=True)
    model = tiny_gpt(vocab_size=tok.vocab_size, arch="llama", bias=False, qk_norm=True)
    save_hf(model, str(tmp_path / "hf"), tok.facts())
    facts_file = tmp_path / "hf" / "tokenizer_facts.json"
    for facts, says in [({"tokenizer": "char"}, "the tokenizer facts say chars None"),
                        (Tokenizer("char", chars="abcdefghij", char_eot=True).facts(),
                         "its tokenizer has 11 ids but the model 7 token rows")]:
        facts_file.write_text(json.dumps(facts))
        for export in ("--export-gguf", "--export-hf"):
            assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "hf", export,
                                           tmp_path / "out"), says)


def test_a_folder_this_toolkit_cannot_run_is_one_line(tmp_path, tokenizer_json):
    folder = hf_folder(tmp_path / "hf", tokenizer_json, "llama", tie=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0}
    config.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "3"),
                          "rope_type yarn")
    # Llama 3's, without its other three
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "3"),
                          "rope_scaling must be")
    config["rope_scaling"] = ["llama3", 8.0]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "3"),
                          "rope_scaling must be an object")
    config.pop("rope_scaling")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    os.remove(tmp_path / "hf" / "tokenizer.json")
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--max-new-tokens", "3"),
                          "no tokenizer.json")


# a ChatML template as Qwen's and SmolLM's instruct folders ship one (a default system turn,
# raise_exception, transformers' {% generation %} block around what an assistant turn learns,
# Jinja's whitespace control)
CHATML = """{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\nBe brief.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
        {{- message['content'] + '<|im_end|>\n' }}
        {%- endgeneration %}
    {%- else %}
        {{- message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""
# Qwen3's way: the answer after the last question opens with an empty <think> block, earlier
# ones do not
QWEN3_LIKE = """{%- set ns = namespace(last_query=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['role'] == 'assistant' and loop.index0 > ns.last_query %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
    {{- message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""
HISTORY = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "我在。"},
           {"role": "user", "content": "What is a tuple?"}]


def instruct_folder(path, tokenizer_json: str, template: str = CHATML) -> tuple[str, dict]:
    """A tiny random Qwen3 folder laid out as a downloaded instruct model's: ChatML's special tokens
    in its tokenizer.json, the template and eos token in tokenizer_config.json, two stop ids in
    generation_config.json; and those ids."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    bpe = HFTokenizer.from_str(tokenizer_json)
    bpe.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for name in ("<|im_start|>", "<|im_end|>")])
    # (tied, a random model repeats its last token)
    folder = hf_folder(path, bpe.to_str(), "qwen3", tie=False)
    ids = {name: bpe.token_to_id(name) for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
        "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"}))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    return folder, ids


def test_a_downloaded_instruct_folder_chats_in_its_own_template_as_transformers_does(
        tmp_path, tokenizer_json):
    folder, ids = instruct_folder(tmp_path / "hf", tokenizer_json)
    model, facts = load_model(folder)
    tok, theirs = load_tokenizer(facts), transformers.AutoTokenizer.from_pretrained(folder)
    for history in (HISTORY, [{"role": "system", "content": "回答要短。"}, *HISTORY]):
        expected = theirs.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        assert chat_prompt(history, tok) == expected
    assert facts["chat_template"]["stop_ids"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]

    # greedy, the reply ends at the first stop id that generation_config.json lists, as generate()
    # ends it
    prompt = torch.tensor([chat_prompt(HISTORY[-1:], tok)])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    free = reference.generate(prompt, max_new_tokens=8, do_sample=False,
                              eos_token_id=None)[0, prompt.shape[1]:]
    cut = next(k for k in range(1, 8) if free[k] not in free[:k])
    stop = int(free[cut])
    (tmp_path / "hf" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids["<|im_end|>"], stop]}))
    stopped = reference.generate(
        prompt, max_new_tokens=8, do_sample=False,
        generation_config=transformers.GenerationConfig.from_pretrained(folder))
    assert stopped[0, prompt.shape[1]:].tolist() == free[:cut + 1].tolist()
    talk = run_main("test.py", "--ckpt", folder, "--chat", "--temperature", "0", "--max-new-tokens",
                    "8", "--device", "cpu", "--dtype", "float32", input="What is a tuple?\n")
    assert talk.returncode == 0, talk.stderr
    # then Ctrl-D
    assert talk.stdout.split("model> ", 1)[1] == tok.decode(free[:cut].tolist()) + "\nyou> "

    # the export keeps the template, its eos token and its stop ids; the toolkit reads it back
    # the same
    save_hf(model, str(tmp_path / "out"), facts)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert exported.apply_chat_template(HISTORY, add_generation_prompt=True, tokenize=True,
                                        return_dict=False) == chat_prompt(HISTORY, tok)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert generation.eos_token_id == facts["chat_template"]["stop_ids"] == [ids["<|im_end|>"],
                                                                             ids["<|endoftext|>"]]
    assert load_model(str(tmp_path / "out"))[1]["chat_template"] == facts["chat_template"]
    # and so does the GGUF export, laid out by llama.cpp's own chat formatter in the same ids
    from llama_cpp import Llama, llama_vocab_is_eog
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    save_gguf(model, tmp_path / "chat.gguf", facts, "f32")
    llm = Llama(str(tmp_path / "chat.gguf"), n_ctx=64, verbose=False)
    formatter = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"], eos_token="<|im_end|>",
                                    bos_token="")
    prompt = formatter(messages=HISTORY).prompt
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == chat_prompt(HISTORY, tok)
    assert llm.token_eos() == ids["<|im_end|>"] and llama_vocab_is_eog(llm._model.vocab,
                                                                       ids["<|im_end|>"])
    llm.close()


def test_instruction_tuning_learns_what_the_folders_template_marks_as_the_assistants(
        tmp_path, tokenizer_json):
    folder, _ = instruct_folder(tmp_path / "hf", tokenizer_json)
    model, facts = load_model(folder)
    tok, theirs = load_tokenizer(facts), transformers.AutoTokenizer.from_pretrained(folder)
    vocab = model.config.vocab_size
    # it keeps its own template
    assert add_chat_tokens(model, tok) == {} and model.config.vocab_size == vocab
    conversation = [{"role": "system", "content": "回答要短。"}, *HISTORY,
                    {"role": "assistant", "content": "A list."}]
    [c] = encode_conversation(conversation, tok, block_size=512)
    # transformers' mask of the template's {% generation %} blocks: the answers and their ends
    reference = theirs.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    assert c.ids == reference["input_ids"] and \
        c.trained == [bool(m) for m in reference["assistant_masks"]]
    assert sum(c.trained) > 0 and not c.cut


def test_a_template_that_lays_out_a_turn_otherwise_once_another_follows_gives_a_sequence_per_answer(
        tmp_path, tokenizer_json):
    folder, _ = instruct_folder(tmp_path / "hf", tokenizer_json, QWEN3_LIKE)
    tok, theirs = load_tokenizer(load_model(folder)[1]), \
        transformers.AutoTokenizer.from_pretrained(folder)
    conversation = [*HISTORY, {"role": "assistant", "content": "A list."}]
    first, second = encode_conversation(conversation, tok, block_size=512)
    # each ends with its answer, laid out as it was last
    for sequence, upto in ((first, 2), (second, 4)):
        assert sequence.ids == theirs.apply_chat_template(conversation[:upto], tokenize=True,
                                                          return_dict=False)
        before = len(theirs.apply_chat_template(conversation[:upto - 1], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        assert sequence.trained == [False] * before + [True] * (len(sequence.ids) - before)
        assert tok.decode(sequence.ids[before:]).startswith("<think>\n\n</think>\n\n")
    # a generation prompt that is not how the template lays out an answer: the answer cannot be
    # told apart
    other = QWEN3_LIKE.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>bot\n' }}")
    assert other != QWEN3_LIKE
    tok = load_tokenizer(load_model(instruct_folder(tmp_path / "other", tokenizer_json,
                                                    other)[0])[1])
    with pytest.raises(ValueError, match="does not lay out message 1 after its generation prompt"):
        encode_conversation(conversation, tok, block_size=512)


def test_chat_template_kwargs_set_the_templates_variables_as_transformers_and_lm_eval_set_them(
        tmp_path, tokenizer_json):
    """--chat-template-kwargs '{"enable_thinking": false}' on a template that opens an empty <think>
    block for it (Qwen3's way): test.py's prompt is apply_chat_template(...,
    enable_thinking=False)'s, eval.py's prompts are lm-eval's hf model's with enable_thinking=False;
    what is not a JSON object of new variables is one line."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from toolkit.harness import GPTHarness
    thinking = QWEN3_LIKE.replace("{{ '<|im_start|>assistant\n' }}",
                                  "{{ '<|im_start|>assistant\n' }}{%- if "
                                  "enable_thinking is defined and enable_thinking is false %}"
                                  "{{ '<think>\n\n</think>\n\n' }}{%- endif %}")
    assert thinking != QWEN3_LIKE
    folder, ids = instruct_folder(tmp_path / "hf", tokenizer_json, thinking)
    model, facts = load_model(folder)
    tok, theirs = load_tokenizer(facts), transformers.AutoTokenizer.from_pretrained(folder)
    off = {"enable_thinking": False}
    expected = theirs.apply_chat_template(HISTORY[-1:], add_generation_prompt=True, tokenize=True,
                                          return_dict=False, **off)
    assert chat_prompt(HISTORY[-1:], tok, off) == expected != chat_prompt(HISTORY[-1:], tok)

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    free = reference.generate(torch.tensor([expected]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None)
    reply = free[0, len(expected):].tolist()
    reply = reply[:next((k for k, i in enumerate(reply) if i in facts["chat_template"]["stop_ids"]),
                        len(reply))]
    options = ("--temperature", "0", "--max-new-tokens", "6", "--device", "cpu", "--dtype",
               "float32")
    talk = run_main("test.py", "--ckpt", folder, "--chat", "--chat-template-kwargs",
                    json.dumps(off), *options, input=HISTORY[-1]["content"] + "\n")
    assert talk.returncode == 0, talk.stderr
    assert talk.stdout.split("model> ", 1)[1] == tok.decode(reply) + "\nyou> "

    ours = GPTHarness(model, tok, 2, torch.device("cpu"), torch.float32, chat=True, variables=off)
    hf = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=2, enable_thinking=False)
    for history in (HISTORY, [{"role": "system", "content": "Answer."}, *HISTORY[-1:]]):
        assert ours.apply_chat_template(history) == hf.apply_chat_template(history)
        assert ours.apply_chat_template(history).endswith("<think>\n\n</think>\n\n")

    for value, message in (("[1]", "must be a JSON object"),
                           ('{"messages": []}', "cannot set messages"), ("{oops", "invalid JSON")):
        assert_one_line_error(run_main("test.py", "--ckpt", folder, "--chat",
                                       "--chat-template-kwargs", value, *options), message)
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--chat-template-kwargs", "{}",
                                   *options), "in a --chat")
    assert_one_line_error(run_main("eval.py", "--ckpt", folder, "--tasks", "hellaswag",
                                   "--chat-template-kwargs", "{}"), "add --apply-chat-template")


def test_finetune_on_the_defaults_instruction_tunes_a_downloaded_folder_in_its_template(
        tmp_path, tokenizer_json):
    folder, ids = instruct_folder(tmp_path / "hf", tokenizer_json)
    colours = ["红色", "蓝色", "绿色", "黄色"]
    train = tmp_path / "chats.jsonl"
    train.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"第{i}个颜色？"},
                                                      {"role": "assistant",
                                                       "content": colours[i % 4]}]},
                                        ensure_ascii=False) + "\n" for i in range(40)))
    result = run_main("finetune.py", "--task", "sft", "--train", train, "--init-from", folder,
                      "--out-dir", tmp_path / "sft", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    checkpoint = load_checkpoint(str(tmp_path / "sft" / "ckpt.pt"))
    metrics = checkpoint["history"]["metrics"]
    # it learns the answers
    assert min(m["val_loss"] for m in metrics[1:]) < metrics[0]["val_loss"] - 0.5, metrics
    facts = load_model(str(tmp_path / "sft" / "ckpt.pt"))[1]
    assert facts["chat_template"] == load_model(folder)[1]["chat_template"] and \
        not facts.get("special_tokens")
    talk = run_main("test.py", "--ckpt", tmp_path / "sft" / "ckpt.pt", "--chat", "--temperature",
                    "0", "--max-new-tokens", "8", "--device", "cpu", input="第5个颜色？\n")
    assert talk.returncode == 0 and talk.stdout.count("model> ") == 1, talk.stderr


@pytest.mark.parametrize("template, fragments", [
    ("{{ raise_exception('this model takes no system turn') }}",
     ("chat template fails", "no system turn")),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ("chat template fails", "unsafe")),
    ("{% for m in messages %}{{ m['content'] }}", ("not valid Jinja",))])
def test_a_chat_template_that_fails_or_reaches_outside_its_sandbox_is_one_line(
        tmp_path, tokenizer_json, template, fragments):
    folder, _ = instruct_folder(tmp_path / "hf", tokenizer_json, template)
    result = run_main("test.py", "--ckpt", folder, "--chat", "--device", "cpu", input="hi\n")
    assert_one_line_error(result, *fragments)


def test_where_a_folder_keeps_its_template_and_stop_ids(tmp_path, tokenizer_json):
    folder, ids = instruct_folder(tmp_path / "hf", tokenizer_json, template="unused")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    config.update(chat_template=[{"name": "tool_use", "template": "tools"},
                                 {"name": "default", "template": CHATML}],
                  eos_token={"content": "<|im_end|>", "special": True})
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    os.remove(tmp_path / "hf" / "generation_config.json")  # the eos token's id ends a reply
    template = load_model(folder)[1]["chat_template"]
    assert (template["jinja"], template["eos_token"], template["stop_ids"]) == \
        (CHATML, "<|im_end|>", [ids["<|im_end|>"]])
    # transformers 5 writes this file
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ 'jinja file' }}")
    assert load_model(folder)[1]["chat_template"]["jinja"] == "{{ 'jinja file' }}"
    result = run_main("test.py", "--ckpt", folder, "--system", "Be brief.", "--device", "cpu")
    assert_one_line_error(result, "frames --system only in a chat", "--chat")
    with pytest.raises(CLIError, match="chat_template"):
        check_facts({**load_model(folder)[1],
                     "chat_template": {"jinja": CHATML, "stop_ids": [10**9]}})
    (tmp_path / "hf" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ["<|im_end|>"]}))
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--chat", "--device", "cpu",
                                   input="hi\n"),
                          "generation_config.json: eos_token_id must be token ids")
    os.remove(tmp_path / "hf" / "generation_config.json")

    os.remove(tmp_path / "hf" / "chat_template.jinja")
    os.remove(tmp_path / "hf" / "tokenizer_config.json")  # a base model's folder
    assert_one_line_error(run_main("test.py", "--ckpt", folder, "--chat", "--device", "cpu",
                                   input="hi\n"),
                          "was never instruction-tuned")


def test_eval_lays_out_a_harness_task_in_the_folders_template_as_lm_evals_hf_model(
        tmp_path, tokenizer_json):
    """eval.py --apply-chat-template --system-instruction on a harness task, against lm-eval's own
    `hf` model with the same options on the same folder: the same prompts, every log-likelihood
    within 1e-4."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from toolkit.harness import task_manager
    folder, _ = instruct_folder(tmp_path / "hf", tokenizer_json)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}?",
                                        "choices": [str(a + b), str(a * b + 1), "不知道"],
                                        "label": "0"}) + "\n"
                            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]))
    task = tmp_path / "sums.yaml"
    task.write_text("task: sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    validation: {data}\n"
                    "validation_split: validation\noutput_type: multiple_choice\n"
                    "doc_to_text: '{{question}}'\ndoc_to_target: '{{label}}'\n"
                    # (gen_prefix: the answer's start, left open)
                    "doc_to_choice: choices\ngen_prefix: 'Sum:'\nmetric_list:\n  - metric: acc\n")
    options = ("--apply-chat-template", "--system-instruction", "Answer.", "--dtype", "float32",
               "--device", "cpu")
    result = run_main("eval.py", "--ckpt", folder, "--tasks", task, *options, "--output",
                      tmp_path / "out.json")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads((tmp_path / "out.json").read_text())["tasks"]["harness"]["samples"]["sums"]
    theirs = simple_evaluate(model=HFLM(pretrained=folder, device="cpu", dtype="float32",
                                        batch_size=4),
                             tasks=["sums"], task_manager=task_manager((str(tmp_path),), False),
                             apply_chat_template=True, system_instruction="Answer.",
                             log_samples=True, bootstrap_iters=0)["samples"]["sums"]
    theirs = json.loads(json.dumps(theirs, default=str))
    assert [s["arguments"] for s in ours] == [s["arguments"] for s in theirs]
    assert ours[0]["arguments"][0] == ["<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\n"
                                       "1+2?<|im_end|>\n<|im_start|>assistant\nSum:", " 3"]
    lls = [(a[0][0], b[0][0]) for s, t in zip(ours, theirs) for a, b in zip(s["resps"], t["resps"])]
    assert len(lls) == 12 and max(abs(float(a) - float(b)) for a, b in lls) < 1e-4

    # a generation task: greedy replies end where generate() ends them, here at a token of the first
    # item's reply
    prompt = torch.tensor([chat_prompt([{"role": "system", "content": "Answer."},
                                        {"role": "user", "content": "1+2?"}],
                                       load_tokenizer(load_model(folder)[1]))])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    free = reference.generate(prompt, max_new_tokens=12, do_sample=False,
                              eos_token_id=None)[0, prompt.shape[1]:]
    cut = next(k for k in range(2, 12) if free[k] not in free[:k])
    (tmp_path / "hf" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [int(free[cut])]}))
    # (a folder of its own: the harness's index of the first one is cached)
    (tmp_path / "say").mkdir()
    (tmp_path / "say" / "say.yaml").write_text(
        f"task: say\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: {data}\n"
        "validation_split: validation\noutput_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['。']\n  do_sample: false\n"
        "  max_gen_toks: 12\nmetric_list:\n  - metric: exact_match\n")
    result = run_main("eval.py", "--ckpt", folder, "--tasks", tmp_path / "say" / "say.yaml",
                      *options, "--output", tmp_path / "say.json")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads((tmp_path / "say.json").read_text())["tasks"]["harness"]["samples"]["say"]
    theirs = simple_evaluate(model=HFLM(pretrained=folder, device="cpu", dtype="float32",
                                        batch_size=4),
                             tasks=["say"],
                             task_manager=task_manager((str(tmp_path / "say"),), False),
                             apply_chat_template=True, system_instruction="Answer.",
                             log_samples=True, bootstrap_iters=0)["samples"]["say"]
    mine, hf = ([sample["resps"][0][0] for sample in samples] for samples in (ours, theirs))
    # the same greedy replies: transformers shows a character cut at the end as U+FFFD where the
    # toolkit leaves it out, and keeps the text of a stop token that is not a special token (the
    # first item's here)
    assert mine[0] == load_tokenizer(load_model(folder)[1]).decode(free[:cut].tolist()) and \
        hf[0].startswith(mine[0])
    assert mine[1:] == [text.rstrip("\ufffd") for text in hf[1:]] and len(set(mine)) == 4
    # a reasoning model's end of thinking, given as a token id: what follows its last occurrence
    think = str(int(free[1]))
    result = run_main("eval.py", "--ckpt", folder, "--tasks", tmp_path / "say" / "say.yaml",
                      *options, "--think-end-token", think, "--output", tmp_path / "think.json")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads((tmp_path / "think.json").read_text())["tasks"]["harness"]["samples"]["say"]
    theirs = simple_evaluate(model=HFLM(pretrained=folder, device="cpu", dtype="float32",
                                        batch_size=4, think_end_token=think),
                             tasks=["say"],
                             task_manager=task_manager((str(tmp_path / "say"),), False),
                             apply_chat_template=True, system_instruction="Answer.",
                             log_samples=True, bootstrap_iters=0)["samples"]["say"]
    thought, hf = ([sample["resps"][0][0] for sample in samples] for samples in (ours, theirs))
    assert thought == [text.rstrip("\ufffd") for text in hf] and thought[0] != mine[0]

    # a base model's folder: no template
    plain = hf_folder(tmp_path / "base", tokenizer_json, "qwen3", tie=True)
    assert_one_line_error(run_main("eval.py", "--ckpt", plain, "--tasks", task, *options),
                          "never instruction-tuned")


def test_a_llama_3_folder_runs_samples_prepares_data_and_exports_as_transformers_does(tmp_path):
    """Llama 3.1's rope scaling, its <|end_of_text|>, and the <|begin_of_text|> its tokenizer puts
    before every text, against transformers on a tiny Llama 3.2 folder: the logits, a prompt's ids,
    greedy sampling, data prepared with its tokenizer.json, and the export."""
    folder = llama3_folder(tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    model, facts = load_model(folder)
    tok = load_tokenizer(facts)
    assert model.config.rope_scaling == {"factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 40}
    assert (tok.bos_id, tok.eot_id) == (theirs.bos_token_id, theirs.eos_token_id) == (320, 321)
    idx = torch.randint(0, model.config.vocab_size, (2, 120))
    with torch.no_grad():
        ours = model(idx)[0]
        assert rel_err(ours, reference(idx).logits) <= 1e-5
        # (without it, other logits)
        scaling, model.config.rope_scaling = model.config.rope_scaling, None
        assert rel_err(model(idx)[0], ours) > 1e-2
        model.config.rope_scaling = scaling
    for text in HELD_OUT:
        assert prompt_ids(text, tok) == theirs(text)["input_ids"], text

    prompt = theirs("hello world")["input_ids"]  # greedy from the BOS, as generate() continues
    free = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None)
    sample = run_main("test.py", "--ckpt", folder, "--prompt", "hello world", "--temperature", "0",
                      "--max-new-tokens", "6", "--num-samples", "1", "--device", "cpu", "--dtype",
                      "float32")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("hello world" + tok.decode(free[0, len(prompt):].tolist()) +
                                    "\n")

    # each prepared as BOS, its text, end-of-text
    documents = ["第一篇文档。", "The second document, 123456."]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                                 for t in documents * 50))
    prepared = run_main("tokenizer.py", "--input", tmp_path / "docs.jsonl", "--tokenizer-file",
                        tmp_path / "hf" / "tokenizer.json", "--append-eod", "--format", "megatron",
                        "--output-prefix", tmp_path / "data" / "docs", "--quiet")
    assert prepared.returncode == 0, prepared.stderr
    dtype, sizes, _, _ = read_megatron_index(str(tmp_path / "data" / "docs_text_document.idx"))
    tokens = np.fromfile(tmp_path / "data" / "docs_text_document.bin", dtype=dtype)
    expected = [theirs(t)["input_ids"] + [tok.eot_id] for t in documents]
    assert tokens[:sizes[0] + sizes[1]].tolist() == expected[0] + expected[1]
    # trained on it from the folder, then resumed: the run keeps the folder's rope scaling
    options = ("--data-dir", tmp_path / "data" / "docs_text_document", "--out-dir",
               tmp_path / "run", "--device", "cpu", "--dtype", "float32", "--eval-interval", "2",
               "--eval-iters", "1")
    for start, steps in ((folder, "2"), ("resume", "4")):
        trained = run_main("train.py", "--init-from", start, "--max-iters", steps, "--block-size",
                           "16", "--batch-size", "2", *options)
        assert trained.returncode == 0, trained.stderr[-2000:]
    resumed = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    assert resumed["iter_num"] == 4 and resumed["model_config"]["rope_scaling"] == scaling

    save_hf(model, str(tmp_path / "out"), facts)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert again.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        assert rel_err(again(idx).logits, ours) <= 1e-5
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (exported.bos_token, exported.eos_token, len(exported)) == \
        ("<|begin_of_text|>", "<|end_of_text|>", 325)
    assert all(exported(text)["input_ids"] == theirs(text)["input_ids"] for text in HELD_OUT)


def test_a_llama_3_folder_scores_and_chats_as_lm_eval_and_transformers_do(tmp_path):
    """eval.py on a Llama 3 base folder, against lm-eval's own `hf` model (which puts the BOS before
    each context): the same log-likelihoods; an instruct folder's prompts equal
    apply_chat_template's; instruction tuning a base folder in this toolkit's template starts each
    conversation with the BOS, and so does its export."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from toolkit.evaluation import encode_pair
    from toolkit.harness import task_manager
    folder = llama3_folder(tmp_path / "base")
    data = tmp_path / "pick.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": "0"},
                                       ensure_ascii=False) + "\n"
                            for q, c in [("hello", [" world", " 12345"]),
                                         ("中文的", ["句子", "模型"]),
                                         ("def f(x):", ["\n    return x", " pass"]),
                                         ("", ["hello", "模型"])]))  # (an empty context)
    (tmp_path / "pick.yaml").write_text(
        f"task: pick\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: {data}\n"
        "validation_split: validation\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{label}}'\ndoc_to_choice: choices\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    result = run_main("eval.py", "--ckpt", folder, "--tasks", tmp_path / "pick.yaml", "--dtype",
                      "float32", "--device", "cpu", "--output", tmp_path / "out.json")
    assert result.returncode == 0, result.stderr[-3000:]
    ours = json.loads((tmp_path / "out.json").read_text())["tasks"]["harness"]["samples"]["pick"]
    hf = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=4)
    theirs = simple_evaluate(model=hf, tasks=["pick"],
                             task_manager=task_manager((str(tmp_path),), False),
                             log_samples=True, bootstrap_iters=0)["samples"]["pick"]
    lls = [(float(a[0][0]), float(b[0][0])) for s, t in zip(ours, theirs)
           for a, b in zip(s["resps"], t["resps"])]
    assert len(lls) == 8 and max(abs(a - b) for a, b in lls) < 1e-4
    # the toolkit's own scoring of .jsonl files splits the same way
    tok = load_tokenizer(load_model(folder)[1])
    for context, continuation in [("hello", " world"), ("中文的", "句子"), ("", "hello")]:
        expected = hf._encode_pair(context, continuation) if context else \
            ([320], tok.encode(continuation))
        assert encode_pair(tok, context, continuation) == expected

    instruct = llama3_folder(tmp_path / "instruct", instruct=True)
    model, facts = load_model(instruct)
    tok, theirs = load_tokenizer(facts), transformers.AutoTokenizer.from_pretrained(instruct)
    expected = theirs.apply_chat_template(HISTORY, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert chat_prompt(HISTORY, tok) == expected and expected[0] == 320 and expected.count(320) == 1
    assert facts["chat_template"]["stop_ids"] == [321, theirs.convert_tokens_to_ids("<|eot_id|>")]
    dated = {"date_string": "26 Jul 2024"}  # (the template's variable, else today's date)
    assert chat_prompt(HISTORY, tok, dated) == theirs.apply_chat_template(
        HISTORY, add_generation_prompt=True, tokenize=True, return_dict=False, **dated)
    assert "Today Date: 26 Jul 2024" in tok.decode(chat_prompt(HISTORY, tok, dated))
    (sequence,) = encode_conversation(HISTORY[:2], tok, 256)  # instruction tuning in its template
    assert sequence.ids == theirs.apply_chat_template(HISTORY[:2], tokenize=True, return_dict=False)
    learnt = [i for i, trained in zip(sequence.ids, sequence.trained) if trained]
    assert learnt == tok.encode("我在。") + [theirs.convert_tokens_to_ids("<|eot_id|>")]

    model, facts = load_model(folder)  # the base, tuned in this toolkit's template
    tok = load_tokenizer(facts)
    add_chat_tokens(model, tok)
    (sequence,) = encode_conversation(HISTORY[:2], tok, 64)
    assert sequence.ids[0] == 320 and chat_prompt(HISTORY, tok)[0] == 320
    save_hf(model, str(tmp_path / "tuned"), tok.facts())
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "tuned")
    assert exported.apply_chat_template(HISTORY, add_generation_prompt=True, tokenize=True,
                                        return_dict=False) == chat_prompt(HISTORY, tok)
