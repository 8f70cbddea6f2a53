"""Shared fixtures: the real embedded corpus prepared once, and two runners for the scripts as users
run them: in this process (run_main: the same main() and error handling, without an interpreter
start) and as a process of its own (run_script: where the process is the point, e.g. signals,
launchers, imports)."""
import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
import unittest.mock
from pathlib import Path

import pytest

# One thread for the tiny models of the tests, in this process and in the processes it starts: they
# run faster on one, and two OpenMP threads that wait for each other while DeepSpeed's ops compile
# on the other core (a fresh machine, ds_ops_build) made single tests up to 30 times slower.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402  (after OMP_NUM_THREADS, which torch reads once)

from model import GPT, GPTConfig  # noqa: E402
from toolkit.prepare import install_gpt2_vocab  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
DS_OPS = ("cpu_adam",)  # the build folder of the DeepSpeed op the tests build (ds_ops_build)
TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
              "--batch-size", "4", "--device", "cpu", "--dtype", "float32", "--eval-iters", "2",
              "--log-interval", "1"]


# A tiny GPT for the model's own tests (test_model.py, test_hf.py): a vocabulary that is not a
# multiple of 64
VOCAB = 211


def tiny_config(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64),
                        **kw})


def perturb(m: torch.nn.Module, std: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Add noise to every parameter so biases and LayerNorms are not at their trivial init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return m.eval()


def tiny_gpt(seed: int = 0, std: float = 0.05, **kw) -> GPT:
    torch.manual_seed(seed)
    return perturb(GPT(tiny_config(**kw)), std, seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def gguf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits (llama-cpp-python) at every position of ids, for a GGUF file."""
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=max(64, len(ids)), logits_all=True, verbose=False,
                n_threads=1)
    llm.eval(ids)
    logits = torch.tensor(np.array(llm.scores[: len(ids)]))
    llm.close()
    return logits


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>")
# Llama 3.2's chat template as its instruct folders lay it out, tool calls left out: the system
# turn always, with the knowledge cutoff and today's date (strftime_now, or a date_string given),
# tools as JSON (tojson with indent), the system message trimmed out of the history
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'
            + message['content'] | trim + '<|eot_id|>' }}
    {%- else %}
        {{- raise_exception("tool calls are left out of this template") }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""


def llama3_folder(path: Path, instruct: bool = False) -> str:
    """A tiny random Llama 3.2 folder written by transformers: Llama 3.1's rope scaling (an original
    context of 40 of 128 positions, so that each kind of frequency occurs), a tied head, and a
    tokenizer.json as Meta's: a byte-level BPE with Llama 3's pattern (digits in threes), its
    special tokens after the merges and a post-processor that puts <|begin_of_text|> before every
    text. instruct adds the chat template and the stop ids of an instruct folder."""
    import json

    import transformers
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTokenizer

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    texts = ["hello world, a tiny corpus of 12345 words " * 20,
             "中文的句子也在这里，模型读它。" * 20, "def f(x):\n    return x + 1\n" * 20]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for name in LLAMA3_SPECIAL])
    ids = {name: bpe.token_to_id(name) for name in LLAMA3_SPECIAL}
    bpe.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", ids["<|begin_of_text|>"])])])
    config = transformers.LlamaConfig(
        vocab_size=bpe.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 40},
        bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    perturb(model)
    model.save_pretrained(path)
    bpe.save(str(path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                        "bos_token": "<|begin_of_text|>",
                        "eos_token": "<|eot_id|>" if instruct else "<|end_of_text|>"}
    if instruct:
        tokenizer_config["chat_template"] = LLAMA3_TEMPLATE
        (path / "generation_config.json").write_text(json.dumps({
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(path)


def run_script(script: str, *args: str, cwd: Path | None = None, timeout: float = 300,
               env: dict | None = None, input: str = "") -> subprocess.CompletedProcess:
    """Run one of the project's scripts in a subprocess, the way a user would."""
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd or ROOT,
                          text=True, input=input, capture_output=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


LAUNCHED_SCRIPTS = {"train_ddp.py", "train_ds.py", "finetune.py"}  # run under torchrun too


def run_main(script: str, *args: str, cwd: Path | None = None, env: dict | None = None,
             input: str = "") -> subprocess.CompletedProcess:
    """Run one of the project's scripts in this process as `python SCRIPT ARGS` would in one
    process: its main() under cli.run's one-line-error contract, stdout and stderr captured, the
    exit status returned; cwd, the environment and stdin are restored afterwards."""
    from toolkit import cli
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_stdin = dict(os.environ), os.getcwd(), sys.stdin
    status = 0
    try:
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        os.chdir(cwd or ROOT)
        sys.stdin = io.StringIO(input)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main = runpy.run_path(str(ROOT / script), run_name="script")["main"]
            if script in LAUNCHED_SCRIPTS:  # their cli.run_distributed would end this process
                with unittest.mock.patch.object(cli, "refuse_launcher", lambda: None):
                    cli.run(lambda: main([str(a) for a in args]))
            else:
                cli.run(lambda: main([str(a) for a in args]))
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.stdin = saved_stdin
    return subprocess.CompletedProcess([script, *map(str, args)], status, out.getvalue(),
                                       err.getvalue())


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """Bad input: non-zero exit, exactly one line on stderr starting with 'error:', no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one run logged under log_dir (OUT_DIR/tensorboard/RUN_NAME), as
    {tag: [(step, value), ...]}, read back by TensorBoard itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    runs = [p for p in log_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    events = EventAccumulator(str(runs[0]))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="session", autouse=True)
def gpt2_vocabulary() -> str:
    """GPT-2's vocabulary in tiktoken's cache, installed from the package registry when it is
    missing (the same installer as `python tokenizer.py --install-gpt2-vocab`), so a fresh machine
    needs no extra step."""
    return install_gpt2_vocab()


# DeepSpeed's C++ op for the CPU, built or loaded from ~/.cache/torch_extensions (train_ds.py leaves
# shm_comm unbuilt)
BUILD_DS_OPS = ("from deepspeed.accelerator import get_accelerator as g; "
                "g().create_op_builder('CPUAdamBuilder').load()")
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # pytest-xdist's name of this worker


def pytest_collection_modifyitems(items: list) -> None:
    """The README's commands first: the longest test, whose lane without DeepSpeed runs while the
    ops build (ds_ops_build); the tests that load DeepSpeed's ops last, so that no worker sits
    waiting for that build."""
    def needs_ds_ops(item) -> bool:
        return "ds_ops" in getattr(item, "fixturenames", ())

    items.sort(key=lambda item: 0 if item.path.name == "test_readme.py" else
               2 if needs_ds_ops(item) else 1)


@pytest.fixture(scope="session", autouse=True)
def ds_ops_build() -> subprocess.Popen | None:
    """The ops built in the background by the first worker from the start of the session, beside the
    first tests: on a fresh machine the first DeepSpeed test then finds them built (or nearly)
    instead of waiting for all of the build."""
    if WORKER != "gw0":
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", BUILD_DS_OPS], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                            start_new_session=True)
    yield proc
    # a session that needed no DeepSpeed: stop the build, its compilers included
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        remove_build_locks(DS_OPS)


def remove_build_locks(names: tuple[str, ...]) -> None:
    """torch's extension builder holds a `lock` file in the op's build folder while it builds and
    waits, with no time limit, for it to go; a build killed midway leaves it, and the next session's
    build would wait forever."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or
                Path.home() / ".cache" / "torch_extensions")
    for name in names:
        # the default root has py*_cpu/
        for lock in [*root.glob(f"{name}/lock"), *root.glob(f"*/{name}/lock")]:
            lock.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def ds_ops(ds_ops_build):
    """The ops built, before parallel ranks need them."""
    wait_for_ds_ops(ds_ops_build)


def wait_for_ds_ops(build: subprocess.Popen | None) -> None:
    """Wait for the first worker's build; another worker waits on torch's build lock instead."""
    if build is None:
        result = subprocess.run([sys.executable, "-c", BUILD_DS_OPS], capture_output=True,
                                text=True, timeout=900, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert result.returncode == 0, result.stdout + result.stderr
    elif build.returncode != 0:
        output = build.communicate(timeout=900)[0] if build.returncode is None else ""
        assert build.returncode == 0, output


def fake_deepspeed_folder(ds_dir: Path, tag: str = "global_step4", payload=None,
                          model_config: dict | None = None, tokenizer: dict | None = None) -> None:
    """A DeepSpeed checkpoint folder laid out as train_ds.py writes it (one process, ZeRO-3), whose
    model-states file also holds `payload`."""
    import json

    import torch

    from model import GPT, GPTConfig
    (ds_dir / tag).mkdir(parents=True)
    (ds_dir / "latest").write_text(tag)
    model = GPT(GPTConfig(**(model_config or dict(block_size=8, vocab_size=16, n_layer=1, n_head=1,
                                                  n_embd=8))))
    state = {"model_config": vars(model.config), "train_config": {},
             "tokenizer": tokenizer or {"tokenizer": "byte"}, "iter_num": 4, "best_val_loss": None,
             "history": {}, "world_size": 1, "zero_stage": 3, "tag": tag}
    (ds_dir / tag / "train_state.json").write_text(json.dumps(state))
    torch.save({"module": model.state_dict(), "extra": payload},
               ds_dir / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> Path:
    """The embedded default corpus (Python's documentation, char level), prepared by
    `python tokenizer.py`."""
    workdir = tmp_path_factory.mktemp("pydoc")
    result = run_main("tokenizer.py", cwd=workdir)
    assert result.returncode == 0, result.stderr
    return workdir / "data" / "pydoc_char"


def write_llmc_shard(path: Path, tokens) -> None:
    """One shard as llm.c's dev/data/data_common.py writes it: 256 int32 (magic 20240520, version 1,
    the token count, zeros), then the ids as uint16."""
    import numpy as np
    header = np.zeros(256, np.int32)
    header[:3] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, np.uint16).tobytes())


@pytest.fixture(scope="session")
def llmc_data(char_data, tmp_path_factory) -> Path:
    """char_data's tokens as llm.c shards written here: its val split as pydoc_val_000000.bin, its
    train split cut into three shards (windows then run from one into the next), its meta.json
    beside them. Training on it must equal training on char_data."""
    import numpy as np
    folder = tmp_path_factory.mktemp("llmc")
    write_llmc_shard(folder / "pydoc_val_000000.bin", np.fromfile(char_data / "val.bin", np.uint16))
    train = np.fromfile(char_data / "train.bin", np.uint16)
    for i, part in enumerate(np.array_split(train, 3), start=1):
        write_llmc_shard(folder / f"pydoc_train_{i:06d}.bin", part)
    (folder / "meta.json").write_text((char_data / "meta.json").read_text())
    return folder

