"""train_ddp.py under torchrun, real processes on CPU with gloo: equality with one process, two
"nodes", restart after a killed rank, checkpoints shared with train.py, signals and bad input."""
import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_MODEL, assert_one_line_error, run_main, tensorboard_scalars
from toolkit import flags
from model import GPT, GPTConfig
from toolkit.checkpoint import load_checkpoint
from toolkit.distributed import add_distributed_flags, free_port
from toolkit.fsdp_checkpoint import read_sharded, save_sharded
from toolkit.megatron import ALIASES
from toolkit.train_config import TrainConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="finds worker processes in /proc")

# 8 sequences per step: 4 per micro-batch x 2 micro-batches (1 per rank with 2 ranks, 2 in sequence
# in one process)
COMMON = [*TINY_MODEL, "--grad-accum", "2", "--lr", "3e-3", "--warmup-iters", "2",
          "--lr-decay-iters", "10", "--eval-interval", "5"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
WORKER_TRACEBACK = re.compile(r'File "[^"]*(train_ddp|training|pretraining|model|data)\.py"')


def torchrun_cmd(launcher: list, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, str(ROOT / "train_ddp.py"),
            *map(str, args)]


def popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, **ENV}, **kwargs)


def torchrun(nproc: int, *args, launcher=("--standalone",),
             timeout=300) -> subprocess.CompletedProcess:
    cmd = torchrun_cmd([*launcher, "--nproc_per_node", str(nproc)], *args)
    return subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout,
                          env={**os.environ, **ENV})


def ok(result) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train_py(*args) -> subprocess.CompletedProcess:
    return ok(run_main("train.py", *args))


def assert_same_training(a: dict, b: dict, tol=1e-5, weights_tol=1e-5) -> None:
    assert a["iter_num"] == b["iter_num"]
    assert a["history"]["iter"] == b["history"]["iter"]
    assert a["history"]["loss"] == pytest.approx(b["history"]["loss"], abs=tol)
    assert a.keys() == b.keys()
    for key, value in a["model"].items():
        assert torch.allclose(value, b["model"][key], rtol=0, atol=weights_tol), key


def workers(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes torchrun started (its direct children)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = dict(v.split(b"=", 1)
                       for v in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                       if b"=" in v)
        except (OSError, IndexError, ValueError):
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
    return found


def stop(proc: subprocess.Popen) -> None:
    """Kill a launcher that is still running and its workers (killing torchrun alone would orphan
    them), and wait until the workers are gone: their folder locks go only when they exit."""
    if proc.poll() is None:
        pids = list(workers(proc.pid).values())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()
        wait_for(lambda: not any(alive(pid) for pid in pids), timeout=30, what="workers to exit")


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped, has closed its files: not alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(condition, timeout=120, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory) -> dict:
    """One process, 10 steps: what every DDP variant below must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    train_py("--data-dir", char_data, "--out-dir", out, *COMMON, "--max-iters", "10")
    return load_checkpoint(str(out / "ckpt.pt"))


def test_two_ranks_train_exactly_like_one_process(llmc_data, tmp_path, reference):
    """Two ranks reading llm.c shards train the weights of one process reading nanoGPT's files of
    the same tokens."""
    port = free_port()
    result = ok(torchrun(2, "--data-dir", llmc_data, "--out-dir", tmp_path, *COMMON, "--max-iters",
                         "10", launcher=("--master_port", str(port))))
    assert "4 micro x 1 accumulation x 2 processes = 8 sequences" in result.stdout
    assert result.stdout.count("step 10: train loss") == 1  # rank 0 alone logs
    ddp = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert_same_training(ddp, reference)
    assert ddp["history"]["eval_iter"] == reference["history"]["eval_iter"] == [0, 5, 10]
    assert ddp["history"]["val"] == pytest.approx(reference["history"]["val"], abs=1e-5)
    # rank 0's, flushed before the workers exit
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert [step for step, _ in scalars["loss/train"]] == list(range(1, 11))
    assert [v for _, v in scalars["eval/val_loss"]] == pytest.approx(ddp["history"]["val"])


def test_two_nodes_over_localhost_then_train_py_resumes_and_samples(char_data, tmp_path, reference):
    """Steps 1-6 on two "nodes" (two torchrun agents), steps 7-10 by train.py: the same training as
    one process throughout; test.py samples the result."""
    port = free_port()
    procs = [popen(torchrun_cmd(["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                                 "--master_addr", "127.0.0.1", "--master_port", str(port)],
                                "--data-dir", char_data, "--out-dir", tmp_path, *COMMON,
                                "--max-iters", "6", "--timeout", "60"))
             for node in (0, 1)]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            stop(p)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out[-2000:] + err[-2000:]
    assert "1 accumulation x 2 processes" in outputs[0][0] and "done:" not in outputs[1][0]
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 6
    train_py("--data-dir", char_data, *COMMON, "--out-dir", tmp_path, "--init-from", "resume",
             "--max-iters", "10")
    assert_same_training(load_checkpoint(str(tmp_path / "ckpt.pt")), reference)
    sample = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--device", "cpu", "--num-samples",
                      "1", "--max-new-tokens", "30", "--prompt", "def ")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("def ") and len(sample.stdout) > 10


def test_a_train_py_checkpoint_resumes_under_torchrun(char_data, tmp_path, reference):
    common = ["--data-dir", char_data, *COMMON]
    train_py(*common, "--out-dir", tmp_path / "b", "--max-iters", "6")
    # its global batch of 2 micro-batches: 3 processes cannot share it, and are told so
    three = torchrun(3, "--data-dir", char_data, *TINY_MODEL, "--out-dir", tmp_path / "b",
                     "--init-from", "resume", "--max-iters", "10", timeout=120)
    errors = [line for line in three.stderr.splitlines() if line.startswith("error:")]
    assert three.returncode != 0 and len(errors) == 1, three.stderr
    assert "ckpt.pt was trained with --grad-accum 2" in errors[0] and "3 processes" in errors[0]
    result = ok(torchrun(2, *common, "--out-dir", tmp_path / "b", "--init-from", "resume",
                         "--max-iters", "10"))
    assert "iter 7:" in result.stdout and "iter 6:" not in result.stdout
    assert_same_training(load_checkpoint(str(tmp_path / "b" / "ckpt.pt")), reference)


def test_fsdp_checkpoints_are_sharded_and_resume_at_any_world_size(char_data, tmp_path):
    """A global batch of 6 micro-batches of one sequence, which 1, 2 and 3 processes share. Steps
    1-4 in one process (ckpt.pt); 5-20 sharded over two, from ckpt.pt (Muon's state cut into
    shards, blocks recomputed in the backward pass), each rank writing its shard: in float32 the
    weights of one process, within 1e-5. Then 21-22 over three, from those shards (DCP reshards),
    and 23-24 in one, the shards gathered: the same loss curve. test.py samples the sharded folder,
    and its --export-ckpt file holds the same weights."""
    common = ["--data-dir", char_data, *COMMON, "--batch-size", "1", "--grad-accum", "6",
              "--lr-decay-iters", "24"]
    one = tmp_path / "one"
    train_py(*common, "--out-dir", one, "--max-iters", "20")
    one_at_20 = load_checkpoint(str(one / "ckpt.pt"))
    train_py(*common, "--out-dir", one, "--init-from", "resume", "--max-iters", "24")
    out, sharded = tmp_path / "run", tmp_path / "run" / "dcp"
    train_py(*common, "--out-dir", out, "--max-iters", "4")
    two = ok(torchrun(2, "--fsdp", *common, "--out-dir", out, "--init-from", "resume",
                      "--max-iters", "20", "--activation-checkpointing"))
    assert f"resumed from {out / 'ckpt.pt'} at iteration 4" in two.stdout
    assert "1 micro x 3 accumulation x 2 processes = 6 sequences" in two.stdout
    assert (sharded / "latest").read_text() == "iter_0000020"
    assert sorted(p.name for p in (sharded / "iter_0000020").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    at_20 = read_sharded(str(sharded))
    assert_same_training(at_20, one_at_20)
    sample = ok(run_main("test.py", "--ckpt", out, "--max-new-tokens", "20", "--num-samples", "1",
                         "--prompt", "def ", "--device", "cpu"))
    assert sample.stdout.startswith("def ")
    ok(run_main("test.py", "--ckpt", out, "--export-ckpt", tmp_path / "one.pt"))
    exported = load_checkpoint(str(tmp_path / "one.pt"))
    assert all(torch.equal(exported["model"][k], v) for k, v in at_20["model"].items())
    three = ok(torchrun(3, "--fsdp", *common, "--out-dir", out, "--init-from", "resume",
                        "--max-iters", "22"))
    assert f"resumed from {sharded} at iteration 20" in three.stdout
    assert sorted(p.name for p in sharded.iterdir()) == ["iter_0000022", "latest"]
    resumed = train_py(*common, "--out-dir", out, "--init-from", "resume", "--max-iters", "24")
    assert f"resumed from {sharded} at iteration 22" in resumed.stdout
    # 1e-3: a rare token's embedding row, whose gradients nearly cancel, takes Adam's normalised
    # step on the rounding of 3 ranks' sums (DDP over 3 ranks differs there as much)
    assert_same_training(load_checkpoint(str(out / "ckpt.pt")),
                         load_checkpoint(str(one / "ckpt.pt")), weights_tol=1e-3)


def test_a_second_save_of_a_step_goes_beside_the_first_then_replaces_it(tmp_path):
    """A step saved again (a signal just after a periodic save, or a run that --overwrites one
    that stopped at the same step) never writes into the tag `latest` names."""
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16))
    state = {"model_config": vars(model.config), "train_config": {}, "tokenizer": None,
             "iter_num": 3, "best_val_loss": None, "history": {}}
    weights = []
    for name in ("iter_0000003", "iter_0000003_1", "iter_0000003"):
        weights.append({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        save_sharded(str(tmp_path), state, weights[-1], None, None, {})
        assert sorted(p.name for p in tmp_path.iterdir()) == [name, "latest"]
        saved = read_sharded(str(tmp_path))
        assert all(torch.equal(saved["model"][k], v) for k, v in weights[-1].items())


def test_fsdp_in_the_default_precision_killed_while_saving_loses_nothing(char_data, tmp_path,
                                                                         reference):
    """--dtype auto (bfloat16 where the CPU computes it: parameters gathered in it, gradients
    reduced in float32), a sharded save after every step, and the whole job killed (-9) in the
    middle: `latest` names a complete checkpoint, of float32 weights and the losses of float32
    training within bfloat16's rounding, which train.py resumes; a tag a kill cut short (one
    rank's shard, no metadata) is passed over."""
    flags = ["--data-dir", char_data, "--out-dir", tmp_path, *COMMON, "--save-interval", "1",
             "--dtype", "auto"]
    sharded = tmp_path / "dcp"
    proc = popen(torchrun_cmd(["--standalone", "--nproc_per_node", "2"], "--fsdp", *flags,
                              "--max-iters", "100000"))
    try:
        wait_for(lambda: (sharded / "latest").exists() and
                 int((sharded / "latest").read_text()[5:12] or 0) >= 3 or proc.poll() is not None,
                 what="three saves")
    finally:
        stop(proc)
    step = int((sharded / "latest").read_text()[5:12])
    saved = read_sharded(str(sharded))
    first = min(step, len(reference["history"]["loss"]))
    assert saved["history"]["loss"][:first] == \
        pytest.approx(reference["history"]["loss"][:first], abs=0.02)
    assert all(value.dtype == torch.float32 for value in saved["model"].values())
    cut = sharded / f"iter_{step + 1:07d}"  # what a kill in the middle of the next save leaves
    cut.mkdir(exist_ok=True)
    (cut / "__0_0.distcp").write_bytes(b"half a shard")
    (cut / ".metadata").unlink(missing_ok=True)
    result = train_py(*flags, "--init-from", "resume", "--max-iters", str(step + 1))
    assert f"resumed from {sharded} at iteration {step}" in result.stdout
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == step + 1


def test_killed_rank_restarts_and_resumes_from_checkpoint(char_data, tmp_path):
    proc = popen(torchrun_cmd(["--standalone", "--nproc_per_node", "2", "--max-restarts", "1"],
                              "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                              "--grad-accum", "2", "--max-iters", "100", "--save-interval", "10",
                              "--eval-interval", "1000", "--log-interval", "10"))
    try:
        wait_for(lambda: (tmp_path / "ckpt.pt").exists() or proc.poll() is not None,
                 what="the first checkpoint")
        victim = workers(proc.pid).get(1)
        assert victim, "rank 1 not found"
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert proc.returncode == 0, out[-3000:] + "\n".join(
        line for line in err.splitlines()
        if re.search(r"error|Error|restart|exitcode|signal", line))
    resumed = re.search(r"resumed from \S+ at iteration (\d+) after restart 1", out)
    assert resumed and 10 <= int(resumed.group(1)) < 100, out[-2000:]
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["iter_num"] == 100
    # restored history, no step logged twice
    assert ckpt["history"]["iter"] == list(range(10, 101, 10))


@pytest.mark.parametrize("target", ["launcher", "workers"])
def test_sigterm_saves_and_stops_all_ranks(char_data, tmp_path, target):
    """The form the README and the source design show, with no --grad-accum (one micro-batch per
    process), stopped by SIGTERM to torchrun or to its workers."""
    proc = popen(torchrun_cmd(["--standalone", "--nproc_per_node", "2"], "--data-dir", char_data,
                              "--out-dir", tmp_path, *TINY_MODEL, "--max-iters", "100000",
                              "--eval-interval", "100000"))
    header = []
    try:
        for line in proc.stdout:  # training is really running in both ranks
            header.append(line)
            if line.startswith("iter 3:"):
                break
        pids = [proc.pid] if target == "launcher" else list(workers(proc.pid).values())
        assert pids
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert "stopped by signal" in out, out[-2000:] + err[-2000:]
    assert not WORKER_TRACEBACK.search(err), err
    # torchrun itself re-raises a signal it received (torch/distributed/launcher/api.py) and exits 1
    # after its workers saved and exited 0; when only the workers get the signal, torchrun exits 0.
    assert proc.returncode == (1 if target == "launcher" else 0), err[-3000:]
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert 3 <= ckpt["iter_num"] < 100000
    assert "4 micro x 1 accumulation x 2 processes = 8 sequences" in "".join(header)
    assert ckpt["train_config"]["grad_accum"] == 2


@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "CUDA is not available"),  # --grad-accum 3: the next test
])
def test_bad_input_is_one_line_from_rank_0(char_data, tmp_path, flags, message):
    start = time.monotonic()
    result = torchrun(2, "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL, "--max-iters",
                      "5", *flags, timeout=120)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines()
              if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stdout + result.stderr
    # torchrun adds its own failure report
    assert not WORKER_TRACEBACK.search(result.stderr), result.stderr
    assert time.monotonic() - start < 90


def torchrun_wrapped(tmp_path: Path, prelude: str, *args) -> tuple[list[str], str]:
    """train_ddp.py on 2 processes, each running the Python prelude first (it sees RANK); the error
    lines and all it printed."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(f"import os, runpy, sys, time\nsys.path.insert(0, {str(ROOT)!r})\n{prelude}"
                       f"sys.argv[0] = {str(ROOT / 'train_ddp.py')!r}\n"
                       "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(wrapper), "--out-dir", str(tmp_path / "out"), *TINY_MODEL, *map(str, args)]
    result = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=120,
                            env={**os.environ, **ENV})
    printed = result.stdout + result.stderr
    assert result.returncode != 0, printed
    return [line for line in printed.splitlines() if line.startswith("error:")], printed


@pytest.mark.parametrize("flag", [
    "--config",  # read before the process group exists
    "--eval-tasks",  # read after: rank 0 waits in a collective until rank 1 has gone
])
def test_an_input_only_one_rank_lacks_is_said_by_that_rank_alone(char_data, tmp_path, flag):
    """A file on one node only: rank 1 fails, rank 0 does not; rank 1 says why, once, and rank 0
    adds no line of its own about the peer it lost."""
    errors, printed = torchrun_wrapped(
        tmp_path, f"if os.environ['RANK'] == '1':\n"
                  f"    sys.argv += [{flag!r}, {str(tmp_path / 'missing.json')!r}]\n",
        "--data-dir", char_data, "--max-iters", "5")
    assert len(errors) == 1, printed
    assert errors[0].startswith("error: rank 1:") and "missing.json" in errors[0], errors
    # waiting for rank 0's word leaves no C++ warnings of a timed-out store wait
    assert "socket.cpp" not in printed


def test_rank_0_failing_the_same_way_seconds_later_still_says_it_alone(char_data, tmp_path):
    """Rank 1 fails a check first, rank 0 the same check 4 s later (a loaded machine): rank 1 waits
    for rank 0's word, which rank 0's store keeps until rank 1 has read it; one line, no C++
    warnings of a store that went away."""
    errors, printed = torchrun_wrapped(
        tmp_path, "from toolkit import cli\n"
                  "report = cli.report_distributed_error\n"
                  "if os.environ['RANK'] == '0':\n"
                  "    cli.report_distributed_error = lambda m: (time.sleep(4), report(m))\n",
        "--data-dir", char_data, "--eval-tasks", tmp_path / "missing.json")
    assert len(errors) == 1, printed
    assert not errors[0].startswith("error: rank") and "missing.json" in errors[0], errors
    assert "TCPStore" not in printed


def test_bad_input_is_not_restarted_by_torchrun(char_data, tmp_path):
    result = torchrun(2, "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                      "--grad-accum", "3", launcher=("--standalone", "--max-restarts", "3"),
                      timeout=120)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines()
              if line.startswith("error:")]
    assert errors == ["error: --grad-accum 3 cannot be split across 2 processes; "
                      "use a multiple of 2"], errors
    assert "restart" not in result.stdout.lower()


def test_without_torchrun_or_peers_fails_fast_with_one_line(char_data, tmp_path):
    assert not {"RANK", "WORLD_SIZE"} & set(os.environ)
    assert_one_line_error(run_main("train_ddp.py", "--data-dir", char_data), "torchrun")
    lonely = run_main("train_ddp.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                      "--timeout", "2",
                      env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert_one_line_error(lonely, "rendezvous at 127.0.0.1:", "2 processes expected")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "2"}, "RANK=2 is outside WORLD_SIZE=2"),  # would wait for its peers until --timeout
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a non-negative integer"),
    ({"RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
])
def test_torchrun_variables_set_by_hand_are_checked(char_data, env, message):
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", **env}
    assert_one_line_error(run_main("train_ddp.py", "--data-dir", char_data, "--timeout", "600",
                                   env=env), message)


@pytest.mark.parametrize("script", ["train_ddp.py", "train_ds.py"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e20", "1e-7", "0", "soon"])
def test_a_timeout_out_of_range_is_one_line_before_any_rendezvous(script, value):
    """gloo holds the timeout in milliseconds: past a year it overflows (a traceback, or a "bad
    rendezvous"), and under a second the store's connection gives up with C++ frames."""
    assert_one_line_error(run_main(script, "--timeout", value),
                          f"argument --timeout: {value!r} is not a number of seconds from 1 to")


def test_no_flag_collides_with_torchrun_options():
    """argparse matches abbreviations of torchrun's own options even after the script name."""
    from torch.distributed.run import get_args_parser
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    flags.add_flags(parser, TrainConfig, ALIASES)
    add_distributed_flags(parser)
    ours = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    assert "--backend" in ours and "--grad-accum" in ours
    for flag in ours:
        args = get_args_parser().parse_args(["--nproc_per_node", "2", "train_ddp.py", flag, "1"])
        assert args.training_script_args == [flag, "1"], flag


def test_memory_estimate_is_the_state_a_step_makes_and_fsdp_divides_it():
    """estimate_torch_memory's optimizer bytes are what one real step of Muon or AdamW allocates,
    FSDP over 2 processes holds half of DDP's weights, gradients and optimizer state (plus what it
    gathers), and train_ddp.py --estimate-memory prints it without torchrun, on the defaults."""
    from model import GPT, GPTConfig
    from toolkit.model_parallel import estimate_torch_memory
    from toolkit.optim import make_optimizer
    config = GPTConfig(block_size=16, vocab_size=50, n_layer=8, n_head=2, n_embd=32, arch="llama",
                       bias=False, tie_embeddings=False)
    for name in ("muon", "adamw"):
        model = GPT(config)
        optimizer = make_optimizer(model, name, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95),
                                   muon_lr=0.02)
        idx = torch.randint(0, 50, (2, 16))
        model(idx, idx)[1].backward()
        optimizer.step()
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                    for key, t in s.items() if key != "step")
        ddp = estimate_torch_memory(config, 1, False, "float32", name == "muon", 2)
        assert ddp.optimizer == state, name
        assert ddp.weights == 4 * sum(p.numel() for p in model.parameters())
        fsdp = estimate_torch_memory(config, 2, True, "float32", name == "muon", 2)
        assert fsdp.optimizer == ddp.optimizer / 2
        assert ddp.weights / 2 < fsdp.weights < ddp.weights
    result = run_main("train_ddp.py", "--estimate-memory", "--num-gpus", "2", "--fsdp")
    assert result.returncode == 0, result.stderr
    assert "2 processes, FSDP2" in result.stdout and "per process: weights" in result.stdout
