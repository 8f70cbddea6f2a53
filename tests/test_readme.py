"""Every command the README shows runs, in its order, in a fresh folder, as a user would type it, at
a tiny size.

The only changes to a command: flags that make training and sampling tiny are appended (the last
value of a flag wins), the two-machine placeholders R and A become the two node ranks and 127.0.0.1,
and those two "machines" start one process each, not four. The pip and pytest commands are what
`.ci/run` runs.
"""
import json
import lzma
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, wait_for_ds_ops
from model import GPT, GPTConfig
from toolkit.hf import save_gpt2

TINY_SHAPE = "--n-layer 1 --n-head 2 --n-embd 32"  # (pretrained weights have theirs)
TINY_TRAINING = "--block-size 32 --batch-size 2 --eval-iters 1 --eval-interval 2 --dtype float32"
TINY_SAMPLING = "--max-new-tokens 5 --num-samples 2"
TINY_FINETUNING = "--epochs 1 --batch-size 4 --dtype float32"
LINKED = ["ds_config.json", "hostfile.txt", "toolkit", *(p.name for p in ROOT.glob("*.py"))]


def readme_commands() -> list[str]:
    """The commands of the README's bash blocks, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def tiny(command: str) -> str:
    """The command with tiny-size flags appended to each training and sampling script it runs."""
    parts = []
    for part in command.split(" && "):
        if re.search(r"\btrain(_ddp|_ds)?\.py\b", part):
            pretrained = re.search(r"--init-from (?!resume)", part)
            part += f" {'' if pretrained else TINY_SHAPE} {TINY_TRAINING} --max-iters " \
                    f"{6 if '--init-from resume' in part else 2}"
        elif re.search(r"\btest(_ds)?\.py\b", part):
            part += f" {TINY_SAMPLING}"
        elif re.search(r"\bfinetune\.py\b", part) and "--merge-lora" not in part:
            part += f" {TINY_FINETUNING}"
        parts.append(part)
    return " && ".join(parts)


@pytest.fixture
def user_folder(tmp_path):
    """A fresh folder holding the toolkit's files, the user's texts and task examples, an OSCAR-like
    jsonl.xz and GPT-2 (a tiny stand-in) in a local Hugging Face cache."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "my_texts").mkdir()
    for i in range(8):
        (tmp_path / "my_texts" / f"{i}.md").write_text(f"# Note {i}\n\n" +
                                                       "Some text about nothing much. " * 200)
    # a task's examples, in the char vocabulary
    for name, count in (("my_train", 8), ("my_val", 4), ("my_new", 3)):
        examples = [{"text": f"def f{i}(x): return x", "label": "code"} if i % 2 else
                    {"text": f"The value {i} is", "label": "prose"} for i in range(count)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(example) + "\n"
                                                        for example in examples))
    # conversations for instruction tuning
    chats = [{"messages": [{"role": "user", "content": f"What is {i}?"},
                           {"role": "assistant", "content": f"It is {i}."}]} for i in range(8)]
    (tmp_path / "my_chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    choices = [{"ctx": f"def f{i}(x):", "endings": [" return x", " x = = (", "The end", "!!"],
                "label": i % 4}
               for i in range(6)]  # multiple choice for eval.py, in the char vocabulary
    (tmp_path / "my_choices.jsonl").write_text("".join(json.dumps(item) + "\n" for item in choices))
    # FineWeb's layout: parquet shards with a text column among others
    (tmp_path / "fineweb").mkdir()
    rows = {"text": [f"Page {i} of the web. " * 40 for i in range(200)],
            "url": [f"u{i}" for i in range(200)]}
    pq.write_table(pa.table(rows), tmp_path / "fineweb" / "000_00000.parquet", row_group_size=64)
    with lzma.open(tmp_path / "oscar-1GB.jsonl.xz", "wt") as f:
        for i in range(300):
            f.write(json.dumps({"id": i,
                                "text": f"Document {i}. " + "Words of the web. " * 50}) + "\n")
    snapshot = tmp_path / "hf-cache" / "models--openai-community--gpt2" / "snapshots" / "0123abc"
    save_gpt2(GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)),
              str(snapshot))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abc")
    return tmp_path


def run(command: str, cwd, env: dict) -> None:
    """One README command, as bash runs it, must succeed. The two-machine form starts both
    "machines" here."""
    if "--node_rank R" not in command:
        result = subprocess.run(["bash", "-c", tiny(command)], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=600,
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, \
            f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        return
    procs = [subprocess.Popen(["bash", "-c",
                               tiny(command).replace("--node_rank R", f"--node_rank {rank}")
                               .replace("--master_addr A", "--master_addr 127.0.0.1")
                               .replace("--nproc_per_node 4", "--nproc_per_node 1")],
                              cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), \
        command + "\n" + outputs[0][-2000:] + outputs[1][-2000:]


def launched(command: str) -> bool:
    """A multi-process command, or one that reads what the DeepSpeed run wrote: these run in their
    own lane."""
    return command.startswith(("torchrun", "deepspeed")) or "ckpt/ds" in command or \
        "test_ds.py" in command


def test_every_readme_command_runs(user_folder, ds_ops_build):
    """The quick start first (it prepares the corpus every later run reads); then, each in README
    order, the launchers' lane (torchrun, deepspeed and what reads its checkpoint) beside the lane
    of everything else: neither reads what the other writes, and one process each leaves a core free
    for the other lane."""
    env = {**os.environ, "HF_HUB_CACHE": str(user_folder / "hf-cache"), "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1"}
    commands = [c for c in readme_commands()
                if not c.startswith(("pip install", "python -m pytest"))]  # .ci/run
    run(commands[0], user_folder, env)
    lanes = [[c for c in commands[1:] if launched(c)], [c for c in commands[1:] if not launched(c)]]
    assert len(commands) >= 14 and all(len(lane) >= 4 for lane in lanes), lanes

    def run_lane(lane: list[str]) -> None:
        for command in lane:
            if command.startswith("deepspeed"):
                # built beside the quick start and the lanes' first commands
                wait_for_ds_ops(ds_ops_build)
            run(command, user_folder, env)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run_lane, lanes))  # list(): a lane's error raises
    # what the commands were meant to produce
    for path in ("ckpt/ckpt.pt", "data/mine/meta.json", "data/mine-bpe/tokenizer.json",
                 "data/fineweb/meta.json", "data/my-gpt2_text_document.idx", "ckpt/mine/ckpt.pt",
                 "ckpt/gpt2-mine/ckpt.pt", "samples.jsonl", "ckpt/ddp/ckpt.pt", "ckpt/ddp2/ckpt.pt",
                 "ckpt/fsdp/dcp/latest", "ckpt/ds/latest", "ckpt/ds/ckpt_ds.pt/pytorch_model.bin",
                 "ckpt/cls/ckpt.pt", "predictions.jsonl", "my_hf_model/model.safetensors",
                 "ckpt/sft/ckpt.pt", "ckpt/sft-merged/ckpt.pt"):
        assert (user_folder / path).exists(), path
