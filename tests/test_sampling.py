"""test.py and toolkit/sampling.py: sampling from checkpoints and HF directories, streaming,
interactive prompts, JSONL output that is whole or absent."""
import argparse
import copy
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, assert_one_line_error, run_main, tiny_gpt
from model import GPT, GPTConfig
from toolkit.checkpoint import save_checkpoint
from toolkit.device import generation_linears
from toolkit.hf import save_gpt2
from toolkit.sampling import Sampler, add_sampling_arguments
from toolkit.tokenizers import Tokenizer, load_tokenizer

SAMPLE = ["--device", "cpu", "--max-new-tokens", "24"]


def write_checkpoint(path, facts: dict, rig_eot: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=facts["vocab_size"], n_layer=1, n_head=2,
                          n_embd=16))
    # every position's hidden state becomes all-ones and the EOT row dominates the logits
    if rig_eot:
        with torch.no_grad():
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.fill_(1.0)
            model.transformer.wte.weight[facts["eot_id"]] = 10.0
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": facts}, str(path))
    return model


@pytest.fixture(scope="module")
def char_ckpt(char_data, tmp_path_factory):
    facts = json.loads((char_data / "meta.json").read_text())
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    write_checkpoint(path, facts)
    return path


def test_streams_samples_with_prompt(char_ckpt):
    result = run_main("test.py", "--ckpt", char_ckpt, *SAMPLE, "--stream", "--prompt", "def ",
                        "--num-samples", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("def ") >= 2 and result.stdout.count("-" * 40) == 2


def test_same_seed_same_samples_and_prompt_from_file(char_ckpt, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("import os\n")
    # --start: nanoGPT's name; the run's folder stands for its ckpt.pt, as nanoGPT's --out_dir does
    runs = [run_main("test.py", "--ckpt", ckpt, *SAMPLE, flag, f"FILE:{prompt}", "--seed", "7")
            for ckpt, flag in ((char_ckpt, "--prompt"), (char_ckpt.parent, "--start"))]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("import os\n")


def test_interactive_prompt_loop(char_ckpt):
    """A prompt the vocabulary cannot spell is said in one line, and the session goes on; a CRLF
    line end is no part of a prompt."""
    result = run_main("test.py", "--ckpt", char_ckpt, *SAMPLE, "--interactive", "--num-samples",
                      "1", input="class \r\n中文\nfor \n\n")
    assert result.returncode == 0, result.stderr
    assert "class " in result.stdout and "for " in result.stdout
    assert "error: character '中' is not in the char vocabulary" in result.stderr and \
        result.stderr.count("error:") == 1


def test_a_genfile_may_go_beside_the_checkpoint_in_its_run_folder(char_ckpt):
    genfile = char_ckpt.parent / "beside.jsonl"
    result = run_main("test.py", "--ckpt", char_ckpt.parent, *SAMPLE, "--genfile", genfile)
    assert result.returncode == 0 and genfile.exists(), result.stderr
    assert_one_line_error(run_main("test.py", "--ckpt", char_ckpt.parent, *SAMPLE, "--genfile",
                                   char_ckpt, "--overwrite"), "would overwrite the input")


def test_outputs_that_are_no_regular_file_are_refused_before_sampling(char_ckpt, tmp_path):
    """A pipe, a device (/dev/null) or a folder where a file would go: the rename that ends a
    write would replace it, so it is refused, --overwrite or not, before anything runs."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    for flag, path in (("--genfile", "pipe"), ("--genfile", "folder"), ("--export-gguf", "pipe")):
        assert_one_line_error(run_main("test.py", "--ckpt", char_ckpt, *SAMPLE, flag,
                                       tmp_path / path, "--overwrite"),
                              f"{flag} {tmp_path / path} is not a regular file")
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)


def test_an_hf_export_never_replaces_a_folder_of_other_files_or_the_input(char_ckpt, tmp_path):
    """--export-hf puts a new folder in place of the old, whole: refused, --overwrite or not, for a
    folder that holds the input checkpoint or files but no model (config.json)."""
    run = tmp_path / "project" / "runs" / "a"
    run.mkdir(parents=True)
    shutil.copy(char_ckpt, run / "ckpt.pt")
    (tmp_path / "project" / "notes.txt").write_text("mine")
    assert_one_line_error(run_main("test.py", "--ckpt", run / "ckpt.pt", "--export-hf",
                                   tmp_path / "project", "--overwrite"), "holds the input")
    assert_one_line_error(run_main("test.py", "--ckpt", char_ckpt, "--export-hf",
                                   tmp_path / "project", "--overwrite"), "no HF model folder")
    assert (run / "ckpt.pt").read_bytes() == char_ckpt.read_bytes()
    assert (tmp_path / "project" / "notes.txt").read_text() == "mine"


def test_a_checkpoint_that_names_no_tokenizer_needs_gpt2s_vocabulary(char_ckpt, tmp_path):
    """One without is read with GPT-2's BPE, whose ids a smaller model cannot emit."""
    checkpoint = torch.load(char_ckpt, weights_only=True)
    del checkpoint["tokenizer"]
    torch.save(checkpoint, tmp_path / "untold.pt")
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "untold.pt", *SAMPLE),
                          "names no tokenizer", "is not GPT-2's")


def test_weights_that_are_not_finite_are_refused(char_ckpt, tmp_path):
    checkpoint = torch.load(char_ckpt, weights_only=True)
    checkpoint["model"]["transformer.h.0.attn.c_attn.weight"][0, 0] = float("nan")
    torch.save(checkpoint, tmp_path / "nan.pt")
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "nan.pt", *SAMPLE),
                          "transformer.h.0.attn.c_attn.weight holds nan or inf values")


def test_unconditional_genfile_and_stop_at_eot(tmp_path):
    path = tmp_path / "ckpt.pt"
    write_checkpoint(path, {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}, rig_eot=True)
    genfile = tmp_path / "gen.jsonl"
    result = run_main("test.py", "--ckpt", path, *SAMPLE, "--num-samples", "3",
                      "--micro-batch-size", "2", "--genfile", genfile, "--temperature", "0")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in genfile.read_text().splitlines()]
    assert lines == [{"text": "", "length": 0, "finished": True}] * 3


def test_samples_from_hf_gpt2_directory(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50257, n_layer=1, n_head=2, n_embd=16))
    save_gpt2(model, str(tmp_path / "hf"))
    genfile = tmp_path / "gen.jsonl"
    result = run_main("test.py", "--ckpt", tmp_path / "hf", *SAMPLE, "--prompt", "Hello world",
                        "--genfile", genfile, "--num-samples", "1")
    assert result.returncode == 0, result.stderr
    line = json.loads(genfile.read_text())
    assert line["text"].startswith("Hello world") and 1 <= line["length"] <= 24
    assert load_tokenizer({"tokenizer": "gpt2"}).encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("args,fragment", [
    (["--num-samples", "0"], "--num-samples"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**63 - 1"),
    (["--chat", "--prompt", "hi"], "--chat talks turn by turn on stdin"),  # (neither is used)
    (["--interactive", "--prompt", "hi"], "--interactive reads its prompts from stdin"),
    (["--export-gguf", "m.gguf", "--genfile", "s.jsonl"], "an export writes no samples"),
    (["--export-hf", "hf_out", "--prompt", "hi"], "an export writes no samples: drop --prompt"),
    (["--outtype", "q8_0"], "--outtype q8_0 is the weight type of --export-gguf FILE"),
    (["--export-hf", str(ROOT / "ckpt" / ".gitkeep"), "--overwrite"],
     "is a file; an HF model is a folder"),
    (["--export-hf", str(ROOT / "README.md"), "--overwrite"], "would overwrite this toolkit's"),
    (["--prompt", "\u4e2d\u6587"], "not in the char vocabulary"),
    (["--prompt", "FILE:/nonexistent/prompt.txt"],
     "--prompt FILE: not found: /nonexistent/prompt.txt"),
    (["--prompt", f"FILE:{ROOT / 'docs'}"], "docs is a folder, not a --prompt FILE:"),
    (["--prompt", "FILE:/dev/zero"], "/dev/zero is a pipe or a device, not a --prompt FILE:"),
    (["--top-k", "x"], "--top-k: invalid int value: 'x'"),
    (["--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    # SDPA's needs CUDA
    (["--attn-kernel", "efficient"], "attn_kernel 'efficient' cannot run on cpu"),
])
def test_bad_sampling_input(char_ckpt, args, fragment):
    assert_one_line_error(run_main("test.py", "--ckpt", char_ckpt, *SAMPLE, *args), fragment)


def test_missing_checkpoint(tmp_path):
    assert_one_line_error(run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--device", "cpu"),
                          "not found")


def test_genfile_is_not_replaced_without_overwrite(char_ckpt, tmp_path):
    genfile = tmp_path / "samples.jsonl"
    genfile.write_text("earlier samples\n")
    result = run_main("test.py", "--ckpt", char_ckpt, *SAMPLE, "--genfile", genfile)
    assert_one_line_error(result, "already exists", "--overwrite")
    assert genfile.read_text() == "earlier samples\n"
    ok = run_main("test.py", "--ckpt", char_ckpt, *SAMPLE, "--genfile", genfile, "--overwrite",
                  "--num-samples", "1")
    assert ok.returncode == 0 and len(genfile.read_text().splitlines()) == 1


def test_hf_export_of_a_char_model_samples_and_generates_in_transformers(char_data, tmp_path):
    """A char vocabulary's end-of-text id is its own (past the characters): the export names it, and
    keeps the toolkit's tokenizer facts."""
    import transformers
    facts = json.loads((char_data / "meta.json").read_text())
    model = write_checkpoint(tmp_path / "ckpt.pt", facts)
    save_gpt2(model, str(tmp_path / "hf"), facts)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == len(facts["chars"]) == \
        facts["eot_id"]
    assert oct((tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777) != oct(0o600)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    out = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8)
    genfile = tmp_path / "gen.jsonl"
    sampled = run_main("test.py", "--ckpt", tmp_path / "hf", *SAMPLE, "--prompt", "def ",
                       "--genfile", genfile, "--num-samples", "1", "--temperature", "0")
    assert sampled.returncode == 0, sampled.stderr
    from_ckpt = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", *SAMPLE, "--prompt", "def ",
                           "--num-samples", "1", "--temperature", "0", "--no-stream")
    assert json.loads(genfile.read_text())["text"] == from_ckpt.stdout.splitlines()[0]


def limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))


def test_a_genfile_that_cannot_be_written_is_one_line_and_leaves_no_partial_file(
        char_ckpt, tmp_path):
    """The file size limit stands in for a full disk: the samples that fit are not left behind as a
    short file."""
    genfile = tmp_path / "samples.jsonl"
    cmd = [sys.executable, str(ROOT / "test.py"), "--ckpt", str(char_ckpt), *SAMPLE,
           "--num-samples", "200", "--batch-size", "50", "--genfile", str(genfile)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                            preexec_fn=limit_file_size)
    assert_one_line_error(result, f"cannot write {genfile}", "file size limit",
                          "nothing was replaced")
    assert list(tmp_path.iterdir()) == []


def test_progress_counts_generated_tokens_not_the_ones_ended_samples_never_made():
    """Samples that end at end-of-text at once: the bar counts the tokens made (one each) and its
    total shrinks to them, so the rate is that of real tokens (it once counted every sample as
    --max-new-tokens long: billions of tokens a second)."""
    tok = Tokenizer("byte")
    model = tiny_gpt(vocab_size=tok.vocab_size)
    with torch.no_grad():  # every position's logits: end-of-text's alone is positive
        model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
        model.lm_head.weight[tok.eot_id] = 1.0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    args = parser.parse_args(["--num-samples", "6", "--batch-size", "4", "--max-new-tokens",
                              "1000000000", "--temperature", "0", "--device", "cpu",
                              "--no-stream"])
    sampler = Sampler(model, tok, args, None)
    sampler.sample("")
    assert sampler.progress.n == sampler.progress.total == 6


@pytest.mark.parametrize("family", [dict(bias=True), dict(arch="llama", bias=False, qk_norm=True,
                                                          tie_embeddings=False, n_kv_head=1)],
                         ids=["gpt2", "llama"])
def test_generation_on_onednn_linears_gives_the_eager_tokens(family):
    """A CPU in float32 generates through oneDNN's linears (test.py's default on a CPU without
    bfloat16): the same greedy tokens as eager PyTorch, one sequence or several, the context
    sliding past the block; in bfloat16 the model stays as it is."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, vocab_size=70, n_layer=2, n_head=2, n_embd=32, **family))
    model.eval()
    cpu = torch.device("cpu")
    assert generation_linears(model, cpu, torch.bfloat16) is model
    fast = generation_linears(copy.deepcopy(model), cpu, torch.float32)
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.modules())
    for batch in (1, 3):
        idx = torch.randint(0, 70, (batch, 5), generator=torch.Generator().manual_seed(batch))
        assert torch.equal(fast.generate(idx, 40, temperature=0.0),
                           model.generate(idx, 40, temperature=0.0))


def test_compiled_decoding_gives_the_eager_tokens(char_ckpt):
    """test.py --compile runs the one-token step compiled (inductor): in float32, greedy, the same
    sample as eager PyTorch."""
    from torch._dynamo.utils import counters
    args = ["--ckpt", char_ckpt, *SAMPLE, "--temperature", "0", "--dtype", "float32",
            "--num-samples", "1", "--prompt", "def ", "--no-stream"]
    eager = run_main("test.py", *args)
    counters.clear()
    compiled = run_main("test.py", *args, "--compile")
    assert compiled.returncode == 0, compiled.stderr
    assert counters["frames"]["ok"] >= 1  # a frame was compiled, not run eagerly
    assert counters["aot_autograd"]["total"] == 1  # traced once: a run's floats are constants
    assert compiled.stdout == eager.stdout and "def " in eager.stdout
