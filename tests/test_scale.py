"""Megatron's flag names and data command, the example launch scripts, pipeline and tensor parallel
through DeepSpeed, layout-free conversion, memory estimates, energy records. Real processes on the
CPU (gloo) where the launch is the point."""
import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from test_tokenizer import data_gym_files, read_megatron, write_jsonl

from conftest import ROOT, TINY_MODEL, assert_one_line_error, run_main
from toolkit.distributed import free_port

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
EXAMPLES = sorted((ROOT / "examples").glob("*.sh"))


def run_example(name: str, env: dict, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "examples" / name), *map(str, args)], text=True,
                          capture_output=True, timeout=timeout, env={**os.environ, **ENV, **env})


# ----- Megatron's flag names -----

def test_megatron_flags_set_the_same_values_and_load_resumes(char_data, tmp_path):
    """--micro-batch-size 4 --global-batch-size 8: 2 micro-batches per step; samples become steps
    of 8."""
    out = tmp_path / "run"
    flags = ["--data-path", char_data, "--save", out, "--num-layers", "1", "--hidden-size", "32",
             "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "4",
             "--global-batch-size", "8", "--train-samples", "48", "--lr-warmup-samples", "16",
             "--lr-decay-samples", "40", "--device", "cpu", "--dtype", "float32",
             "--eval-iters", "2", "--eval-interval", "100"]
    first = run_main("train.py", *flags)
    assert first.returncode == 0, first.stderr
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    cfg = ckpt["train_config"]
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["block_size"],
            cfg["batch_size"]) == (1, 32, 2, 32, 4)
    assert (cfg["grad_accum"], cfg["max_iters"], cfg["warmup_iters"],
            cfg["lr_decay_iters"]) == (2, 6, 2, 5)
    assert ckpt["iter_num"] == 6
    # --load: the same folder, resumed because it holds a checkpoint (--train-iters is Megatron's
    # --max-iters)
    resumed = run_main("train.py", "--load", out, "--data-path", char_data, "--train-iters", "8",
                       "--device", "cpu")
    assert resumed.returncode == 0, resumed.stderr
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 8
    # --load of an empty folder starts from scratch there
    fresh = run_main("train.py", "--load", tmp_path / "new", *flags[4:], "--data-path", char_data)
    assert fresh.returncode == 0, fresh.stderr
    assert torch.load(tmp_path / "new" / "ckpt.pt", weights_only=True)["iter_num"] == 6


@pytest.mark.parametrize("flags, fragments", [
    (["--micro-batch-size", "4", "--global-batch-size", "10"],
     ["--global-batch-size 10", "multiple"]),
    (["--global-batch-size", "8", "--batch-size", "4", "--grad-accum", "4"], ["--grad-accum 4"]),
    (["--lr-decay-samples", "80", "--lr-decay-iters", "10"], ["--lr-decay-samples", "give one"]),
    (["--load", "a", "--save", "b"], ["--load a", "differ"]),
])
def test_megatron_flags_that_disagree_are_one_line(char_data, tmp_path, flags, fragments):
    result = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path / "o",
                      *TINY_MODEL[:8], *flags, "--max-iters", "1", cwd=tmp_path)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "o").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("script", ["train.py", "train_ddp.py", "train_ds.py"])
def test_every_trainer_takes_megatron_names(script):
    text = run_main(script, "--help", env=ENV).stdout
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--micro-batch-size", "--global-batch-size", "--data-path", "--save", "--load",
                 "--lr-decay-samples", "--lr-warmup-samples", "--train-samples"):
        assert flag in text, flag


# ----- the source design's data command and launch scripts -----

@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_megatron_data_command_runs_as_written(gpt2_vocabulary, tmp_path):
    """examples/create-data.sh: --vocab/--merge-file (GPT-2's files, built here from r50k's ranks),
    --dataset-impl mmap, --tokenizer-type GPT2BPETokenizer, --append-eod, --workers ->
    PREFIX_text_document.bin/.idx."""
    import tiktoken
    r50k = tiktoken.get_encoding("r50k_base")
    vocab, merges = data_gym_files(r50k._mergeable_ranks, tmp_path)
    texts = ["Hello world! The café is open.", "Second document, with numbers 1234.", "third"]
    source = write_jsonl(tmp_path / "oscar-tiny.jsonl", texts)
    result = run_example("create-data.sh", {"INPUT": source, "VOCAB": vocab, "MERGES": merges,
                                            "OUTPUT_PREFIX": str(tmp_path / "my-gpt2"),
                                            "WORKERS": "2"})
    assert result.returncode == 0, result.stderr
    code, documents = read_megatron(str(tmp_path / "my-gpt2_text_document"))
    assert code == 8  # uint16
    assert [list(d) for d in documents] == [r50k.encode_ordinary(t) + [50256] for t in texts]


# ----- pipeline and tensor parallel: same losses as train.py, one-command conversion -----

# every layout below trains the same model with Megatron's names: 2 blocks, 32 wide, 10 steps of 8
# sequences
MEGATRON_MODEL = {"NLAYERS": "2", "NHIDDEN": "32", "NHEADS": "2", "SEQ_LEN": "32",
                  "MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "TRAIN_SAMPLES": "80"}
# AdamW: DeepSpeed's configs use it
RUN = ["--device", "cpu", "--dtype", "float32", "--eval-iters", "2", "--log-interval", "1",
       "--lr", "3e-3", "--min-lr", "1e-5", "--lr-warmup-samples", "0", "--optimizer", "adamw"]
# Megatron's GPT-2
MODEL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--train-samples", "80", *RUN]


def launch_ds(data, out_dir, *extra, config="ds_config_zero1.json", slots=2, timeout=300):
    hostfile = out_dir.parent / f"{out_dir.name}.hosts"
    hostfile.write_text(f"localhost slots={slots}\n")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile),
           "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(ROOT / "train_ds.py"), "--deepspeed", "--deepspeed_config", str(ROOT / config),
           "--data-path", str(data), "--save", str(out_dir), *MODEL, *map(str, extra)]
    return subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout,
                          env={**os.environ, **ENV})


def ds_state(out_dir) -> dict:
    ds = out_dir / "ds"
    return json.loads((ds / (ds / "latest").read_text().strip() / "train_state.json").read_text())


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    """train.py on one process: the losses and weights every layout must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    result = run_main("train.py", "--data-path", char_data, "--save", out, *MODEL)
    assert result.returncode == 0, result.stderr
    return torch.load(out / "ckpt.pt", weights_only=True)


def logits_of(weights: dict, model_config: dict, idx: torch.Tensor) -> torch.Tensor:
    from toolkit.checkpoint import model_from_weights
    return model_from_weights(model_config, weights, "test")(idx)[0]


def check_layout_run(out, result, reference, tmp_path, raw_weights: dict | None) -> None:
    """Losses within 1e-4 of train.py; test_ds.py --export-ckpt writes a ckpt.pt whose logits equal
    those of the weights in the run's own files (read here independently, where they are whole per
    shard), and test.py samples it."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    state = ds_state(out)
    losses, expected = state["history"]["loss"], reference["history"]["loss"]
    assert len(losses) == len(expected) == 10
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-4, (losses, expected)
    (tmp_path / "ckpt.pt").write_text("an earlier export, which --overwrite replaces")
    exported = run_main("test_ds.py", "--ckpt", out / "ds", "--export-ckpt", tmp_path / "ckpt.pt",
                        "--overwrite", env=ENV)
    assert exported.returncode == 0, exported.stderr[-3000:]
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    idx = torch.randint(0, ckpt["model_config"]["vocab_size"], (2, 32),
                        generator=torch.Generator().manual_seed(0))
    if raw_weights is not None:
        assert torch.equal(logits_of(ckpt["model"], ckpt["model_config"], idx),
                           logits_of(raw_weights, state["model_config"], idx))
    assert torch.allclose(logits_of(ckpt["model"], ckpt["model_config"], idx),
                          logits_of(reference["model"], reference["model_config"], idx), atol=1e-4)
    sampled = run_main("test.py", "--ckpt", tmp_path / "ckpt.pt", "--num-samples", "1",
                       "--max-new-tokens", "10")
    assert sampled.returncode == 0, sampled.stderr


def test_multi_node_example_runs_a_pipeline_over_two_nodes_as_train_py(ds_ops, char_data, reference,
                                                                        tmp_path):
    """examples/run-multi-node.sh without ssh: two "machines" on this host (NODE_RANK 0 and 1), one
    pipeline stage each (deepspeed.pipe, ZeRO-1): train.py's losses, and the layers convert."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "pp"
    env = {**MEGATRON_MODEL, "MODEL": "--num-layers 2 --hidden-size 32 --num-attention-heads 2",
           "HOSTFILE": str(hostfile), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "DS_CONFIG": str(ROOT / "ds_config_zero1.json"), "DATA_PATH": str(char_data),
           "CHECKPOINT_PATH": str(out), "PP_SIZE": "2"}
    nodes = [subprocess.Popen(["bash", str(ROOT / "examples" / "run-multi-node.sh"), *RUN],
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, **ENV, **env, "NODE_RANK": str(rank)})
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][-3000:] + outputs[1][-3000:]
    assert "2 pipeline stages x 1 data-parallel, ZeRO stage 1" in outputs[0], outputs[0][-3000:]
    # each stage's layer files: layer_00 token embedding (the tied head), 01 positions, 02-03
    # blocks, 04 ln_f
    tag = out / "ds" / ds_state(out)["tag"]
    layer = {i: torch.load(tag / f"layer_{i:02d}-model_states.pt", weights_only=True)
             for i in range(5)}
    raw = {"transformer.wte.weight": layer[0]["wte.weight"],
           "transformer.wpe.weight": layer[1]["wpe.weight"],
           **{f"transformer.h.{i}.{k.removeprefix('block.')}": v
              for i in (0, 1) for k, v in layer[2 + i].items()},
           **{f"transformer.{k}": v for k, v in layer[4].items()}}
    check_layout_run(out, subprocess.CompletedProcess([], 0, outputs[0], ""), reference, tmp_path,
                     raw)


def test_one_node_example_trains_tensor_parallel_as_train_py(ds_ops, char_data, reference,
                                                             tmp_path):
    """examples/run-one-node.sh at a tiny size: 2 processes started by the deepspeed launcher,
    Megatron's flags, 2-way AutoTP (ZeRO-1): train.py's losses, and each rank's shards join into its
    weights."""
    out = tmp_path / "tp"
    env = {**MEGATRON_MODEL, "N_GPUS": "2", "MASTER_PORT": str(free_port()), "TP_SIZE": "2",
           "DS_CONFIG": str(ROOT / "ds_config_zero1.json"), "DATA_PATH": str(char_data),
           "CHECKPOINT_PATH": str(out)}
    result = run_example("run-one-node.sh", env, *RUN)
    assert "2 tensor-parallel x 1 data-parallel, ZeRO stage 1" in result.stdout, \
        result.stdout[-3000:]
    assert "global batch: 4 micro x 2 accumulation x 1 replica of 2 processes = 8 sequences" \
        in result.stdout
    # run again, it resumes (as train.py's test shows)
    assert ds_state(out)["train_config"]["load"] == str(out)
    # each rank's shard, joined here: c_attn's q, k and v by heads and c_fc by rows; both c_proj by
    # columns
    tag = out / "ds" / ds_state(out)["tag"]
    shards = [torch.load(tag / f"mp_rank_0{r}_model_states.pt", weights_only=True)["module"]
              for r in (0, 1)]
    raw = {}
    for name, tensor in shards[0].items():
        if ".c_attn." in name:
            raw[name] = torch.cat([torch.cat([s[name].chunk(3)[i] for s in shards])
                                   for i in range(3)])
        elif ".c_fc." in name or name.endswith("c_proj.weight"):
            raw[name] = torch.cat([s[name] for s in shards], dim=0 if ".c_fc." in name else 1)
        else:
            raw[name] = tensor
    check_layout_run(out, result, reference, tmp_path, raw)


def test_autotp_composes_with_zero3_offload(ds_ops, char_data, reference, tmp_path):
    """The shipped ZeRO-3 + CPU offload config with 2-way AutoTP: same losses, and the partitioned
    shards convert."""
    out = tmp_path / "tp3"
    result = launch_ds(char_data, out, "--tp-size", "2", config="ds_config.json")
    assert "2 tensor-parallel x 1 data-parallel, ZeRO stage 3, optimizer offload to cpu" \
        in result.stdout
    check_layout_run(out, result, reference, tmp_path, None)


@pytest.mark.parametrize("layout, family", [
    (["--pipeline-stages", "2"], ["--arch", "llama"]),
    (["--tp-size", "2"], ["--arch", "llama", "--no-qk-norm"]),
])
def test_the_llama_family_trains_in_a_pipeline_and_tensor_parallel_as_train_py(
        ds_ops, char_data, tmp_path, layout, family):
    """Its own head as the pipeline's last layer and rotary positions in each stage's blocks
    (QK-norm on, the default); the gated MLP's gate and up halves each split by AutoTP (Llama's
    layout: a shard's QK-norm would see its own heads alone): train.py's losses, and the layers or
    shards convert."""
    result = run_main("train.py", "--data-path", char_data, "--save", tmp_path / "ref", *MODEL,
                      *family)
    assert result.returncode == 0, result.stderr
    reference = torch.load(tmp_path / "ref" / "ckpt.pt", weights_only=True)
    assert reference["model_config"]["arch"] == "llama" \
        and not reference["model_config"]["tie_embeddings"]
    out = tmp_path / "run"
    result = launch_ds(char_data, out, *layout, *family)
    assert ("pipeline stages" if "--pipeline-stages" in layout else "tensor-parallel") \
        in result.stdout
    check_layout_run(out, result, reference, tmp_path, None)


@pytest.mark.parametrize("world, stages, tp, heads, zero, message", [
    (2, 2, 1, 2, 3, "pipeline engine supports ZeRO stage 0 or 1, not 3"),
    (2, 3, 1, 2, 1, "processes cannot hold"),
    (2, 1, 2, 3, 1, "must divide the 3 heads"),
    (4, 2, 2, 2, 1, "together are not supported"),
    (4, 4, 1, 2, 1, "more than the model's 2 blocks"),
])
def test_layouts_that_cannot_run_are_refused(world, stages, tp, heads, zero, message):
    from model import GPTConfig
    from toolkit.model_parallel import Layout, check_layout
    with pytest.raises(ValueError, match=message):
        check_layout(Layout(world, stages, tp),
                     GPTConfig(n_layer=2, n_head=heads, n_embd=16 * heads), zero)
    if message == "together are not supported":  # a memory estimate takes both
        check_layout(Layout(world, stages, tp),
                     GPTConfig(n_layer=2, n_head=heads, n_embd=16 * heads), zero, training=False)


def test_a_bad_layout_is_one_line_from_the_launched_job(ds_ops, char_data, tmp_path):
    result = launch_ds(char_data, tmp_path / "o", "--pipeline-stages", "2", config="ds_config.json")
    assert_one_line_error(result, "pipeline engine supports ZeRO stage 0 or 1, not 3")
    assert not (tmp_path / "o" / "ds").exists()


# ----- presets and the memory estimate -----

def test_16b_memory_estimate_without_allocating():
    """The source design's 16B on 32 nodes x 4 devices, TP 4 x PP 8, ZeRO-1, float32: nothing is
    allocated (its float32 weights alone would be 65 GB), and no process group is needed."""
    from model import GPTConfig
    from toolkit.device import num_params
    from toolkit.train_config import PRESETS
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = run_main("train_ds.py", "--estimate-memory", "--preset", "gpt2-16b",
                      "--seq-length", "1024", "--tp-size", "4", "--pipeline-stages", "8",
                      "--num-nodes", "32", "--num-gpus", "4", "--micro-batch-size", "1",
                      "--global-batch-size", "64",
                      "--deepspeed_config", ROOT / "ds_config_zero1.json", env=ENV)
    assert result.returncode == 0, result.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before < 2**30
    params = num_params(GPTConfig(**PRESETS["gpt2-16b"]), non_embedding=False)
    assert f"{params:,} parameters (16.22B)" in result.stdout
    assert ("128 devices (32 nodes x 4) = 4 tensor-parallel x 8 pipeline stages x 4 data-parallel; "
            "ZeRO stage 1") in result.stdout
    assert "per device (the busiest stage" in result.stdout and "GFLOP" in result.stdout
    # --checkpoint-activations (Megatron's name) keeps a block's input, not its activations
    recomputed = run_main("train_ds.py", "--estimate-memory", "--preset", "gpt2-16b",
                          "--seq-length", "1024", "--tp-size", "4", "--pipeline-stages", "8",
                          "--num-nodes", "32", "--num-gpus", "4", "--micro-batch-size", "1",
                          "--global-batch-size", "64", "--checkpoint-activations",
                          "--deepspeed_config", ROOT / "ds_config_zero1.json", env=ENV)
    activations = [float(re.search(r"activations ([\d.]+)", r.stdout).group(1))
                   for r in (result, recomputed)]
    assert "(recomputed)" in recomputed.stdout and activations[1] < activations[0] / 3, activations
    # ZeRO-3 with offload (the shipped config) adds DeepSpeed's own estimator
    zero3 = run_main("train_ds.py", "--estimate-memory", "--preset", "gpt2-16b", "--num-nodes", "2",
                     "--num-gpus", "4", env=ENV)
    assert zero3.returncode == 0 and "DeepSpeed's ZeRO-3 estimator" in zero3.stdout, zero3.stderr
    bad = run_main("train_ds.py", "--estimate-memory", "--preset", "gpt2-16b",
                   "--pipeline-stages", "8", "--num-gpus", "8", env=ENV)
    assert_one_line_error(bad, "pipeline engine supports ZeRO stage 0 or 1")
    for flag in ("--num-gpus", "--num-nodes", "--pipeline-stages", "--tp-size"):  # counts
        assert_one_line_error(run_main("train_ds.py", "--estimate-memory", flag, "0", env=ENV),
                              f"argument {flag}: '0' is not an integer >= 1")
    assert_one_line_error(run_main("train_ds.py", "--keep-checkpoints", "-1", env=ENV),
                          "argument --keep-checkpoints: '-1' is not an integer >= 0")


# ----- energy and CO2 -----

def test_codecarbon_records_every_run_however_it_ends(char_data, tmp_path):
    """One row per run in DIR/emissions.csv: a finished run, and one stopped by a NaN loss (an error
    exit)."""
    pytest.importorskip("codecarbon")
    import csv
    track = ["--codecarbon-dir", tmp_path / "cc", "--codecarbon-country", "FRA"]
    done = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path / "a", *TINY_MODEL,
                    "--max-iters", "3", "--eval-interval", "100", *track)
    assert done.returncode == 0, done.stderr
    nan = run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path / "b", *TINY_MODEL,
                   "--max-iters", "50", "--lr", "1e30", "--grad-clip", "0", "--warmup-iters", "0",
                   "--eval-interval", "100", *track)
    assert nan.returncode == 1 and "loss is" in nan.stderr
    rows = list(csv.DictReader(open(tmp_path / "cc" / "emissions.csv")))
    assert len(rows) == 2 and all(float(r["energy_consumed"]) > 0
                                  and r["country_iso_code"] == "FRA" for r in rows)


def test_codecarbon_missing_is_one_line(char_data, tmp_path):
    """Without the optional package (hidden from this process), --codecarbon-dir stops before
    anything is written."""
    code = ("import runpy, sys; sys.modules['codecarbon'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "train.py"),
                             "--data-dir", str(char_data), "--out-dir", str(tmp_path / "o"),
                             "--codecarbon-dir", str(tmp_path / "cc")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert_one_line_error(result, "pip install codecarbon")
    assert not (tmp_path / "o").exists() and not (tmp_path / "cc").exists()


# ----- mpirun -----

@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="no mpirun (.ci/run installs Debian's openmpi-bin)")
def test_mpirun_example_trains_tensor_parallel_and_saves(ds_ops, char_data, tmp_path):
    """examples/mpi-run-16B.sh at a tiny size: `mpirun -np 2 python train_ds.py`, ranks found by
    DeepSpeed's MPI discovery (mpi4py), 2-way AutoTP, energy recorded by rank 0 alone."""
    pytest.importorskip("mpi4py", reason="mpi4py not installed (requirements-test.txt)")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    env = {"NODES": "1", "GPUS_PER_NODE": "2", "HOSTFILE": str(hostfile),
           "MASTER_PORT": str(free_port()),
           "MPIRUN_ARGS": "--allow-run-as-root --oversubscribe "
                          "-x DS_ACCELERATOR -x OMP_NUM_THREADS",
           "DS_CONFIG": str(ROOT / "ds_config_zero1.json"), "DATA_PATH": str(char_data),
           "CHECKPOINT_PATH": str(tmp_path / "ckpt"),
           "MODEL": "--num-layers 1 --hidden-size 32 --num-attention-heads 2",
           "SEQ_LEN": "32", "TP_SIZE": "2", "MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8",
           "TRAIN_SAMPLES": "24", "EVAL_ITERS": "2"}
    if importlib.util.find_spec("codecarbon"):
        env["CODECARBON_PATH"] = str(tmp_path / "cc")
    result = run_example("mpi-run-16B.sh", env, "--device", "cpu", "--dtype", "float32",
                         "--log-interval", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 tensor-parallel x 1 data-parallel" in result.stdout
    state = ds_state(tmp_path / "ckpt")
    assert state["iter_num"] == 3 and state["world_size"] == 2 and state["tp_size"] == 2
    if "CODECARBON_PATH" in env:
        # header + rank 0's row
        assert len((tmp_path / "cc" / "emissions.csv").read_text().splitlines()) == 2
