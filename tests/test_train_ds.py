"""train_ds.py and test_ds.py end to end, through the real `deepspeed` launcher, 2 ranks on the
CPU (gloo).

One ZeRO-3 + CPU offload run (real DeepSpeedCPUAdam) is shared by several tests; DeepSpeed's C++ ops
are built (or found in the cache) once per session before any launch.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import (ROOT, TINY_MODEL, assert_one_line_error, fake_deepspeed_folder, gguf_logits,
                      rel_err, run_main)
from toolkit.distributed import free_port
from toolkit.model_sources import load_model

pytest.importorskip("deepspeed")

# the CPU path even on a machine with GPUs; one thread per process, as each of the simulated "nodes"
# would use all cores of its own machine (the same thread count everywhere keeps the runs bitwise
# comparable)
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
COMMON = ["--max-iters", "12", "--lr-decay-iters", "12", "--warmup-iters", "2", "--lr", "3e-3",
          "--grad-accum", "4", "--eval-interval", "6",
          "--optimizer", "adamw"]  # train.py's reference: DeepSpeed's configs use AdamW


def launcher_cmd(hostfile, *extra_launcher_args) -> list[str]:
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *extra_launcher_args]


def train_ds_args(data, out_dir, *extra, config="ds_config.json") -> list[str]:
    return [str(ROOT / "train_ds.py"), "--deepspeed", "--deepspeed_config", str(ROOT / config),
            "--data-dir", str(data), "--out-dir", str(out_dir), *TINY_MODEL, *map(str, extra)]


def launch(hostfile, data, out_dir, *extra, config="ds_config.json", env=None, timeout=300):
    cmd = launcher_cmd(hostfile, "--no_ssh_check") + train_ds_args(data, out_dir, *extra,
                                                                   config=config)
    return subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout,
                          env={**os.environ, **ENV, **(env or {})})


def train_state(out_dir) -> dict:
    ds = out_dir / "ds"
    return json.loads((ds / (ds / "latest").read_text().strip() / "train_state.json").read_text())


def final_weights(out_dir) -> dict:
    """The full fp32 weights of the run's latest checkpoint, gathered by
    DeepSpeed's zero_to_fp32."""
    from toolkit.ds_checkpoint import gather_deepspeed_weights
    return gather_deepspeed_weights(str(out_dir / "ds"), train_state(out_dir)["tag"])


def assert_same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b), set(a) ^ set(b)
    different = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a
                 if not torch.equal(a[k].float(), b[k].float())}
    assert not different, different


@pytest.fixture(scope="session")
def hostfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hosts") / "hostfile"
    path.write_text("localhost slots=2\n")
    return path


@pytest.fixture(scope="session")
def zero3_run(ds_ops, char_data, hostfile, tmp_path_factory):
    """12 steps of ZeRO-3 with CPU offload on 2 ranks, and the final weights."""
    out = tmp_path_factory.mktemp("zero3")
    result = launch(hostfile, char_data, out, *COMMON)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result, final_weights(out)


def test_zero3_offload_trains_converts_and_samples(zero3_run, tmp_path):
    out, result, engine_weights = zero3_run
    assert ("ZeRO stage 3, optimizer offload to cpu, param offload to cpu, "
            "optimizer DeepSpeedCPUAdam") in result.stdout
    assert "global batch: 4 micro x 2 accumulation x 2 processes = 16 sequences" in result.stdout
    port = result.args[result.args.index("--master_port") + 1]
    # DeepSpeed's shared-memory all-reduce: not built
    assert "shm_comm" not in result.stdout + result.stderr
    # torch's renamed collectives, once a rank
    assert "FutureWarning" not in result.stdout + result.stderr
    if os.path.isdir("/dev/shm"):  # nor its buffers left behind
        assert not [name for name in os.listdir("/dev/shm") if f"_127.0.0.1_{port}_" in name]
    state = train_state(out)
    assert state["iter_num"] == 12 and state["world_size"] == 2 and state["zero_stage"] == 3
    assert state["train_config"]["dtype"] == "float32" and state["tokenizer"]["vocab_size"] > 0
    loss, val = state["history"]["loss"], state["history"]["val"]
    assert loss[-1] < loss[0] - 0.3 and val[-1] < val[0] - 0.3, (loss, val)

    # the seed's flow: cd ckpt/ds && python zero_to_fp32.py . ckpt_ds.pt (an output folder now)
    ds = out / "ds"
    conv = subprocess.run([sys.executable, "zero_to_fp32.py", ".", "ckpt_ds.pt"], cwd=ds, text=True,
                          capture_output=True, timeout=120, env={**os.environ, **ENV})
    assert conv.returncode == 0, conv.stderr[-2000:]
    cli_weights = torch.load(ds / "ckpt_ds.pt" / "pytorch_model.bin", weights_only=True)
    assert_same_weights(cli_weights, engine_weights)

    for ckpt in (ds / "ckpt_ds.pt", ds):  # converted output, and the checkpoint folder (in memory)
        genfile = tmp_path / f"{ckpt.name}.jsonl"
        sampled = run_main("test_ds.py", "--ckpt", ckpt, "--num-samples", "2", "--max-new-tokens",
                           "20", "--device", "cpu", "--prompt", "def ", "--genfile", genfile,
                           env=ENV)
        assert sampled.returncode == 0, sampled.stderr[-2000:]
        lines = [json.loads(line) for line in genfile.read_text().splitlines()]
        assert len(lines) == 2 and all(line["text"].startswith("def ") for line in lines)
    # both sources hold the same weights, so the same seed gives the same samples
    assert (tmp_path / "ckpt_ds.pt.jsonl").read_text() == (tmp_path / "ds.jsonl").read_text()

    exported = run_main("test_ds.py", "--ckpt", ds, "--export-hf", tmp_path / "hf", env=ENV)
    assert exported.returncode == 0, exported.stderr
    hf, _ = load_model(str(tmp_path / "hf"))  # the default family's: an HF Qwen3 folder
    assert_same_weights(hf.state_dict(), engine_weights)
    exported = run_main("test_ds.py", "--ckpt", ds, "--export-gguf", tmp_path / "m.gguf",
                        "--outtype", "f32", env=ENV)
    assert exported.returncode == 0, exported.stderr
    ids = list(range(20))
    with torch.no_grad():
        assert rel_err(gguf_logits(tmp_path / "m.gguf", ids),
                       hf.eval()(torch.tensor([ids]))[0][0]) < 1e-3


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory) -> dict:
    """train.py on one process, 4 micro-steps of 4 (fp32 AdamW): what every DeepSpeed run here
    must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    single = run_main("train.py", "--data-dir", char_data, "--out-dir", out, *TINY_MODEL, *COMMON)
    assert single.returncode == 0, single.stderr
    return torch.load(out / "ckpt.pt", weights_only=True)


def assert_losses_close(losses: list[float], expected: list[float],
                        tolerance: float = 1e-4) -> None:
    differences = [round(abs(a - b), 7) for a, b in zip(losses, expected)]
    assert max(differences) < tolerance, str(differences)


def test_zero3_offload_matches_train_py(zero3_run, reference):
    """2 ranks x 2 micro-steps under ZeRO-3 offload = 1 process x 4 micro-steps of train.py
    (fp32 AdamW)."""
    out, _, gathered = zero3_run
    losses = train_state(out)["history"]["loss"]
    assert len(losses) == len(reference["history"]["loss"]) == 12
    assert_losses_close(losses, reference["history"]["loss"])
    # what zero_to_fp32 gathers is what train.py computed
    assert set(gathered) == set(reference["model"])
    assert all(torch.allclose(gathered[k], reference["model"][k], atol=1e-4) for k in gathered)


def test_ctrl_c_under_the_zero2_config_saves_a_checkpoint_of_the_same_training(ds_ops, llmc_data,
                                                                               hostfile, reference,
                                                                               tmp_path):
    """The shipped ZeRO-2 (optimizer offload) config on llm.c shards, stopped by Ctrl-C: the
    terminal signals every process of the job (the launcher then also sends SIGTERM to each rank);
    the ranks finish the step together and save a complete checkpoint, whose losses are train.py's
    on nanoGPT files of the same tokens. It replaces (--overwrite) an earlier run of more steps,
    whose tag goes when the new run has saved, not the new one's."""
    fake_deepspeed_folder(tmp_path / "ds", tag="global_step999999")
    cmd = launcher_cmd(hostfile, "--no_ssh_check") + train_ds_args(llmc_data, tmp_path, *COMMON[2:],
                                                                   "--max-iters", "100000",
                                                                   "--overwrite",
                                                                   config="ds_config_zero2.json")
    proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iter 6:"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # the whole job, as a terminal's Ctrl-C
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert "ZeRO stage 2, optimizer offload to cpu, optimizer DeepSpeedCPUAdam" in out, out[-3000:]
    assert "stopped by signal" in out, out[-3000:]
    state = train_state(tmp_path)
    assert 6 <= state["iter_num"] < 100000 and state["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "ds").glob("global_step*")) == \
        [f"global_step{state['iter_num']}"]
    assert state["train_config"]["grad_accum"] == 4
    # the same schedule for the first 12 steps: --lr-decay-iters 12
    losses = state["history"]["loss"][:12]
    assert_losses_close(losses, reference["history"]["loss"][:len(losses)])


def test_two_node_no_ssh_then_exact_resume_here_and_on_one_process(zero3_run, char_data, hostfile,
                                                                   reference, tmp_path):
    """Steps 1-6 on two "nodes" (two launchers, no ssh), then steps 7-12 by one launcher with
    --activation-checkpointing: the weights equal the uninterrupted run's bitwise. The same step-6
    checkpoint continued on 1 process goes through DeepSpeed's universal checkpoint, with
    train.py's losses."""
    _, _, engine_weights = zero3_run
    nodes = tmp_path / "nodes"
    nodes.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(free_port())
    args = train_ds_args(char_data, tmp_path, *COMMON[:1], "6", *COMMON[2:])
    procs = [subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile",
                               str(nodes), "--no_ssh", "--node_rank", str(rank), "--master_addr",
                               "127.0.0.1", "--master_port", port, *args], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, **ENV}) for rank in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    assert "1 micro x" not in outputs[0] and "2 processes" in outputs[0]
    assert train_state(tmp_path)["iter_num"] == 6
    conv = subprocess.run([sys.executable, "zero_to_fp32.py", ".", "ckpt_ds.pt"],
                          cwd=tmp_path / "ds", text=True, capture_output=True, timeout=120,
                          env={**os.environ, **ENV})  # the seed's flow, at step 6
    assert conv.returncode == 0, conv.stderr[-2000:]
    shutil.copytree(tmp_path / "ds", tmp_path / "one" / "ds")

    # steps 7-12 recompute each block's activations in backward, gathering its weights again
    resumed = launch(hostfile, char_data, tmp_path, "--init-from", "resume", "--max-iters", "12",
                     "--activation-checkpointing")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert_same_weights(final_weights(tmp_path), engine_weights)
    assert train_state(tmp_path)["history"]["loss"] == train_state(zero3_run[0])["history"]["loss"]
    assert sorted(p.name for p in (tmp_path / "ds").glob("global_step*")) == ["global_step12"]

    # plain `python test_ds.py` samples the newest weights, not the conversion made at step 6,
    # and says so
    user = tmp_path / "user"
    user.mkdir()
    (user / "ckpt").symlink_to(tmp_path)
    default = run_main("test_ds.py", "--num-samples", "1", "--max-new-tokens", "5", "--device",
                       "cpu", cwd=user, env=ENV)
    assert default.returncode == 0, default.stderr[-2000:]
    assert "loaded ckpt/ds (global_step12, iteration 12)" in default.stderr
    stale = run_main("test_ds.py", "--ckpt", "ckpt/ds/ckpt_ds.pt", "--num-samples", "1",
                     "--max-new-tokens", "5", "--device", "cpu", cwd=user, env=ENV)
    assert stale.returncode == 0 and \
        "zero_to_fp32 output older than global_step12" in stale.stderr, stale.stderr

    one = tmp_path / "one.hosts"
    one.write_text("localhost slots=1\n")
    single = launch(one, char_data, tmp_path / "one", "--init-from", "resume", "--max-iters", "12")
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in single.stdout and \
        "x 1 process =" in single.stdout
    state = train_state(tmp_path / "one")
    assert state["iter_num"] == 12 and state["world_size"] == 1
    assert_losses_close(state["history"]["loss"], reference["history"]["loss"])
    assert sorted(p.name for p in (tmp_path / "one" / "ds").glob("global_step*")) == \
        ["global_step12"]
    # the conversion is removed once loaded
    assert not (tmp_path / "one" / "ds" / "universal").exists()

    # a config of another precision resumes the float32 checkpoint through the universal one too
    # (DeepSpeed names its optimizer files by precision)
    config = json.loads((ROOT / "ds_config.json").read_text())
    (tmp_path / "bf16.json").write_text(json.dumps({**config, "bf16": {"enabled": True}}))
    bf16 = launch(one, char_data, tmp_path / "one", "--init-from", "resume", "--max-iters", "13",
                  "--dtype", "bfloat16", config=tmp_path / "bf16.json")
    assert bf16.returncode == 0, bf16.stdout[-3000:] + bf16.stderr[-3000:]
    assert "in bfloat16 through DeepSpeed's universal checkpoint" in bf16.stdout
    state = train_state(tmp_path / "one")
    assert state["iter_num"] == 13 and state["train_config"]["dtype"] == "bfloat16"
    assert abs(state["history"]["loss"][-1] - state["history"]["loss"][-2]) < 0.2


def test_an_input_one_node_lacks_ends_both_nodes_at_once(char_data, tmp_path):
    """Rank 1 fails a check alone (a file missing on its node): it says why, once, and rank 0 stops
    within --timeout instead of waiting 30 minutes in deepspeed.initialize's process groups."""
    wrapper = tmp_path / "rank1_flag.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "if os.environ['RANK'] == '1':\n"
        f"    sys.argv += ['--eval-tasks', {str(tmp_path / 'missing.jsonl')!r}]\n"
        f"sys.argv[0] = {str(ROOT / 'train_ds.py')!r}\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    nodes = tmp_path / "nodes"
    nodes.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    args = [str(wrapper), *train_ds_args(char_data, tmp_path / "out", "--timeout", "100")[1:]]
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile",
                               str(nodes), "--no_ssh", "--node_rank", str(rank), "--master_addr",
                               "127.0.0.1", "--master_port", port, *args], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, **ENV}) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    errors = [line for out in outputs for line in out.splitlines() if line.startswith("error:")]
    assert all(p.returncode == 1 for p in procs) and len(errors) == 1, outputs
    assert errors[0].startswith("error: rank 1: file not found") and "missing.jsonl" in errors[0]


def test_a_resume_in_another_layout_names_the_export(tmp_path):
    """A pipeline or tensor-parallel layout other than the checkpoint's cannot resume it: one line,
    naming the export that starts a new run from its weights."""
    from toolkit.cli import CLIError
    from toolkit.deepspeed_engine import DeepSpeedEngine
    fake_deepspeed_folder(tmp_path / "ds")  # 1 process, no pipeline, no tensor parallel
    ds = json.loads((ROOT / "ds_config.json").read_text())
    engine = DeepSpeedEngine(ds, "ds_config.json", str(tmp_path), 1, pipeline_stages=1, tp_size=2,
                             world_size=2)
    with pytest.raises(CLIError, match="--pipeline-stages 1 --tp-size 1; resume with the same "
                                       "layout.*--export-hf"):
        engine.read_resume()


@pytest.mark.parametrize("change, flags, fragments", [
    ({"train_micro_batch_size_per_gpu": 4}, {"batch_size": 8},
     ["train_micro_batch_size_per_gpu 4", "--batch-size 8"]),
    ({"gradient_clipping": 0.5}, {"grad_clip": 2.0}, ["gradient_clipping 0.5", "--grad-clip 2.0"]),
    ({"scheduler": {"type": "WarmupLR"}}, {}, ["scheduler section", "remove it"]),
    ({"train_batch_size": 100}, {}, ["train_batch_size 100", "derived"]),
    ({"bf16": {"enabled": True}}, {"dtype": "float32"}, ["precision bfloat16", "--dtype float32"]),
])
def test_a_flag_contradicting_ds_config_is_refused(change, flags, fragments):
    """Each value has one source of truth: set in ds_config.json and by a flag to something else, it
    is an error."""
    from toolkit.cli import CLIError
    from toolkit.ds_config import reconcile
    from toolkit.train_config import TrainConfig
    ds = {**json.loads((ROOT / "ds_config.json").read_text()), **change}
    cfg = TrainConfig(grad_accum=2, **flags, given=frozenset(flags))
    with pytest.raises(CLIError) as error:
        reconcile(cfg, ds, "ds_config.json", 2, torch.device("cpu"))
    assert all(fragment in str(error.value) for fragment in fragments), str(error.value)
    agreed, full = reconcile(TrainConfig(grad_accum=2),
                             json.loads((ROOT / "ds_config.json").read_text()), "ds_config.json", 2,
                             torch.device("cpu"))
    assert full["train_micro_batch_size_per_gpu"] == agreed.batch_size and \
        full["gradient_accumulation_steps"] == 1


@pytest.mark.parametrize("config, fragment", [
    ({"zero_optimization": {"stage": None}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": [3]}, "zero_optimization must be an object"),
    ({"bf16": True}, "bf16 must be an object"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.01}}}, "optimizer.type must be \"AdamW\""),
    ({"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}}, "optimizer.params.betas must be"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be an integer >= 1"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu must be an integer"),
    ({"bf16": {"enabled": "false"}}, "bf16.enabled must be true or false, got 'false'"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": "1e-8"}}}, "optimizer.params.eps must be"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}},
     "zero_optimization.offload_optimizer must be an object"),
    ({"tensor_parallel": "x"}, "tensor_parallel must be an object"),
    ({"checkpoint": "x"}, "checkpoint must be an object"),
])
def test_a_ds_config_value_of_the_wrong_kind_is_one_line(tmp_path, config, fragment):
    """Before any process group: DeepSpeed would meet these halfway through start-up, on every
    rank, with a traceback (or take 2.5 as 2 and 0 as its default)."""
    (tmp_path / "ds.json").write_text(json.dumps(config))
    assert_one_line_error(run_main("train_ds.py", "--deepspeed", "--deepspeed_config",
                                   tmp_path / "ds.json", "--out-dir", tmp_path / "out", env=ENV),
                          fragment)
    assert not (tmp_path / "out").exists()


def test_gradients_deepspeed_skips_as_non_finite_stop_the_run(ds_ops, char_data, tmp_path):
    """Outside float16 a skipped step is no loss scaling: DeepSpeed found the gradients non-finite,
    and going on would train nothing while saving a checkpoint every interval."""
    result = run_main("train_ds.py", "--deepspeed", "--deepspeed_config", "ds_config_zero1.json",
                      "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL, "--lr", "1e30",
                      "--warmup-iters", "0", "--max-iters", "6", "--save-interval", "1",
                      "--eval-interval", "100", env=ENV)
    assert_one_line_error(result, "loss is nan at iteration 1; stopped without saving")
    assert sorted(p.name for p in (tmp_path / "ds").glob("global_step*")) == ["global_step1"]


def test_test_ds_bad_input_is_one_line(tmp_path):
    assert_one_line_error(run_main("test_ds.py", "--ckpt", tmp_path / "missing", env=ENV),
                          "not found")
    (tmp_path / "junk").mkdir()
    assert_one_line_error(run_main("test_ds.py", "--ckpt", tmp_path / "junk", env=ENV),
                          "not a DeepSpeed checkpoint")
    # a training state without a field every run writes: named, not an AssertionError
    fake_deepspeed_folder(tmp_path / "ds")
    state_file = tmp_path / "ds" / "global_step4" / "train_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({k: v for k, v in state.items() if k != "history"}))
    assert_one_line_error(run_main("test_ds.py", "--ckpt", tmp_path / "ds", "--export-ckpt",
                                   tmp_path / "out.pt", env=ENV), "has no history")
    state_file.write_text(json.dumps(state))
    # two exports to one path: refused before either is written
    assert_one_line_error(run_main("test_ds.py", "--ckpt", tmp_path / "ds", "--export-ckpt",
                                   tmp_path / "same", "--export-hf", tmp_path / "same", env=ENV),
                          "--export-hf and --export-ckpt both name")
    assert not (tmp_path / "same").exists()
    # a file export onto a folder: said as such, not as a folder to --overwrite
    assert_one_line_error(run_main("test_ds.py", "--ckpt", tmp_path / "ds", "--export-ckpt",
                                   tmp_path / "junk", env=ENV), "is not a regular file")
