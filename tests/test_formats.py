"""The containers text ships in (parquet, arrow, a `datasets` folder, zstd), llm.c's token shards,
and bits per byte: the same rows give the same ids whatever holds them, and shards train exactly
as nanoGPT's files."""
import bz2
import codecs
import gzip
import json
import math
import re
import tracemalloc

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch
import zstandard

from conftest import TINY_MODEL, assert_one_line_error, run_main, write_llmc_shard
from toolkit import documents, records, textfiles
from toolkit.checkpoint import load_checkpoint
from toolkit.documents import read_documents
from toolkit.model_sources import load_model
from toolkit.textfiles import ZstdReader
from toolkit.tokenizers import load_tokenizer

ROWS = [f"第{i}条评论：质量不错，价格也便宜 😀 row {i} of the table,\n"
        "with a second line. " * (1 + i % 5) for i in range(60)]


def write_inputs(folder) -> dict[str, object]:
    """ROWS (with an id column beside the text) in every container tokenizer.py reads."""
    table = pa.table({"id": list(range(len(ROWS))), "text": ROWS})
    inputs = {"jsonl": folder / "rows.jsonl", "parquet": folder / "rows.parquet",
              "arrow": folder / "rows.arrow", "arrow stream": folder / "stream.arrow",
              "datasets": folder / "saved", "zst": folder / "rows.jsonl.zst",
              "json array": folder / "rows.json", "jsonl with a BOM": folder / "bom.jsonl",
              "json array with a BOM": folder / "bom.json",
              "categorical parquet": folder / "categorical.parquet",
              "string views": folder / "views.arrow", "a linked folder": folder / "linked",
              "ndjson": folder / "rows.ndjson", "hidden files beside": folder / "hidden"}
    lines = "".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n"
                    for i, t in enumerate(ROWS))
    inputs["jsonl"].write_text(lines)
    inputs["ndjson"].write_text(lines)
    # Jupyter's checkpoint copies and macOS's AppleDouble files are no documents
    (inputs["hidden files beside"] / ".ipynb_checkpoints").mkdir(parents=True)
    for name in ("rows.jsonl", ".ipynb_checkpoints/rows-checkpoint.jsonl", "._rows.jsonl"):
        (inputs["hidden files beside"] / name).write_text(lines)
    # as alpaca_data.json is laid out
    array = json.dumps([{"id": i, "text": t} for i, t in enumerate(ROWS)], indent=1,
                       ensure_ascii=False)
    inputs["json array"].write_text(array)
    # as Windows editors save: a byte-order mark first, CRLF line ends
    inputs["jsonl with a BOM"].write_bytes(codecs.BOM_UTF8 + lines.replace("\n", "\r\n").encode())
    inputs["json array with a BOM"].write_bytes(codecs.BOM_UTF8 + array.encode())
    pq.write_table(table, inputs["parquet"], row_group_size=7)
    # several row groups, read one at a time
    assert pq.ParquetFile(inputs["parquet"]).num_row_groups == 9
    # a pandas categorical: a dictionary of strings, which parquet keeps
    pq.write_table(table.set_column(1, "text", table["text"].dictionary_encode()),
                   inputs["categorical parquet"])
    assert pa.types.is_dictionary(pq.read_schema(inputs["categorical parquet"]).field("text").type)
    views = table.set_column(1, "text", table["text"].cast(pa.string_view()))
    with pa.ipc.new_file(inputs["string views"], views.schema) as writer:
        writer.write_table(views)
    # a folder whose file lies behind a link to another folder, which links back up (no loop)
    (folder / "elsewhere").mkdir()
    (folder / "elsewhere" / "rows.jsonl").write_text(lines)
    (folder / "elsewhere" / "up").symlink_to(folder / "elsewhere")
    inputs["a linked folder"].mkdir()
    (inputs["a linked folder"] / "sub").symlink_to(folder / "elsewhere")
    with pa.ipc.new_file(inputs["arrow"], table.schema) as writer:
        writer.write_table(table, max_chunksize=11)
    with pa.ipc.new_stream(inputs["arrow stream"], table.schema) as writer:
        writer.write_table(table, max_chunksize=13)
    datasets.Dataset.from_dict({"id": list(range(len(ROWS))), "text": ROWS}).save_to_disk(
        inputs["datasets"], num_shards=3)
    inputs["zst"].write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return inputs


def bins(folder) -> tuple[bytes, bytes]:
    return (folder / "train.bin").read_bytes(), (folder / "val.bin").read_bytes()


def test_the_same_rows_give_the_same_bins_whatever_holds_them(tmp_path):
    inputs = write_inputs(tmp_path)
    results = {}
    for name, path in inputs.items():
        result = run_main("tokenizer.py", "--input", path, "--tokenizer", "gpt2", "--append-eod",
                          "--glob", "*.jsonl", "--output-dir", tmp_path / name.replace(" ", "-"))
        assert result.returncode == 0, (name, result.stderr)
        results[name] = bins(tmp_path / name.replace(" ", "-"))
    assert all(found == results["jsonl"] for found in results.values()), [n for n in results]
    train, val = (np.frombuffer(b, np.uint16) for b in results["jsonl"])
    assert len(train) + len(val) == sum(len(tiktoken.get_encoding("r50k_base").encode(r)) + 1
                                        for r in ROWS)
    # a plain text file compressed with zstd, or after a byte-order mark: the file's bins
    (tmp_path / "one.txt").write_text(ROWS[3])
    (tmp_path / "one.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(ROWS[3].encode()))
    (tmp_path / "bom.txt").write_bytes(codecs.BOM_UTF8 + ROWS[3].encode())
    for name in ("one.txt", "one.txt.zst", "bom.txt"):
        assert run_main("tokenizer.py", "--input", tmp_path / name, "--tokenizer", "byte",
                        "--output-dir", tmp_path / (name + "-out")).returncode == 0
    assert bins(tmp_path / "one.txt-out") == bins(tmp_path / "one.txt.zst-out") == \
        bins(tmp_path / "bom.txt-out")


def test_containers_that_cannot_be_read_are_one_line(tmp_path):
    inputs = write_inputs(tmp_path)
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    data = inputs["parquet"].read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    compressed = inputs["zst"].read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(compressed[: len(compressed) // 2])
    # an arrow stream cut where a record batch ends: what is left reads as a shorter stream
    stream = pa.BufferOutputStream()
    with pa.ipc.new_stream(stream, pa.schema([("text", pa.string())])) as writer:
        ends = []
        for row in ROWS[:4]:
            writer.write_batch(pa.record_batch([[row]], names=["text"]))
            ends.append(stream.tell())
    (tmp_path / "cut.arrow").write_bytes(stream.getvalue().to_pybytes()[: ends[1]])
    cases = {"missing column": (["--input", inputs["parquet"], "--json-key", "body"],
                                ["rows.parquet has no column 'body'", "its columns: id, text"]),
             "not text": (["--input", inputs["parquet"], "--json-key", "id"],
                          ["column 'id' holds int64, not text"]),
             "corrupt parquet": (["--input", tmp_path / "garbage.parquet"],
                                 ["cannot read", "garbage.parquet"]),
             "truncated parquet": (["--input", tmp_path / "cut.parquet"],
                                   ["cannot read", "cut.parquet"]),
             "truncated zst": (["--input", tmp_path / "cut.jsonl.zst"], ["cut.jsonl.zst"]),
             "arrow stream cut between batches": (["--input", tmp_path / "cut.arrow"],
                                                  ["cut.arrow", "cut short"]),
             "missing column in a datasets folder": (["--input", inputs["datasets"],
                                                      "--json-key", "body"],
                                                     ["has no column 'body'"]),
             "invalid UTF-8 in a parquet string": (["--input", tmp_path / "bad.parquet"],
                                                   ["bad.parquet row 2: invalid UTF-8 at byte 3",
                                                    "--errors replace"]),
             "a DatasetDict": (["--input", tmp_path / "dict"],
                               ["holds a DatasetDict", "splits: test, train",
                                f"--input {tmp_path / 'dict' / 'test'}"])}
    # arrow checks no UTF-8 when it writes: a writer of raw bytes can leave invalid text
    bad = pa.array([b"\xe4\xbd\xa0\xe5\xa5\xbd", b"ok \xff\xfe bad"], pa.binary())
    pq.write_table(pa.table({"text": bad.view(pa.string())}), tmp_path / "bad.parquet")
    replaced = run_main("tokenizer.py", "--input", tmp_path / "bad.parquet", "--tokenizer", "char",
                        "--errors", "replace", "--output-dir", tmp_path / "replaced")
    assert replaced.returncode == 0 and "\ufffd" in load_tokenizer(
        json.loads((tmp_path / "replaced" / "meta.json").read_text())).chars, replaced.stderr
    datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": ROWS[:5]})
                          for split in ("train", "test")}).save_to_disk(tmp_path / "dict")
    for name, (args, fragments) in cases.items():
        out = tmp_path / name.replace(" ", "-")
        result = run_main("tokenizer.py", *args, "--tokenizer", "byte", "--output-dir", out)
        assert_one_line_error(result, *fragments)
        assert not out.exists() or not any(out.iterdir()), name


def test_llmc_shards_written_here_hold_each_document_after_an_end_of_text_and_train(tmp_path):
    inputs = write_inputs(tmp_path)
    out = tmp_path / "fineweb"
    result = run_main("tokenizer.py", "--input", inputs["parquet"], "--format", "llmc",
                      "--shard-tokens", "1000", "--output-dir", out)
    assert result.returncode == 0, result.stderr
    # by shard number
    names = sorted((p.name for p in out.glob("*.bin")), key=lambda name: name[-10:])
    assert names[0] == "fineweb_val_000000.bin" and \
        names[1:] == [f"fineweb_train_{i:06d}.bin" for i in range(1, len(names))]
    assert len(names) > 3
    tokens = []
    for name in names:
        header = np.fromfile(out / name, np.int32, count=256)
        assert list(header[:2]) == [20240520, 1] and not header[3:].any()
        shard = np.fromfile(out / name, np.uint16, offset=1024)
        assert len(shard) == header[2] and (len(shard) == 1000 or name == names[-1])
        tokens += shard.tolist()
    enc = tiktoken.get_encoding("r50k_base")
    # llm.c: EOT, document
    assert tokens == [t for row in ROWS for t in [enc.eot_token, *enc.encode(row)]]
    trained = run_main("train.py", "--data-dir", out, "--out-dir", tmp_path / "ckpt", *TINY_MODEL,
                       "--max-iters", "2", "--eval-interval", "2")
    assert trained.returncode == 0, trained.stderr
    assert load_checkpoint(str(tmp_path / "ckpt" / "ckpt.pt"))["tokenizer"]["tokenizer"] == "gpt2"
    # a char vocabulary gets its end-of-text token for the shards even without --append-eod
    chars = run_main("tokenizer.py", "--input", inputs["jsonl"], "--tokenizer", "char",
                     "--format", "llmc", "--output-dir", tmp_path / "chars")
    assert chars.returncode == 0, chars.stderr
    meta = json.loads((tmp_path / "chars" / "meta.json").read_text())
    assert meta["eot_id"] == len(meta["chars"]) and \
        np.fromfile(tmp_path / "chars" / "chars_val_000000.bin", np.uint16,
                    offset=1024)[0] == meta["eot_id"]


def test_llmc_shards_without_a_description_are_gpt2_tokens(tmp_path):
    """A folder as llm.c's fineweb.py leaves it: shards only; GPT-2's vocabulary is assumed, and
    said."""
    ids = tiktoken.get_encoding("r50k_base").encode(" ".join(ROWS))
    write_llmc_shard(tmp_path / "fineweb_val_000000.bin", ids[:300])
    write_llmc_shard(tmp_path / "fineweb_train_000001.bin", ids[300:])
    result = run_main("train.py", "--data-dir", tmp_path, "--out-dir", tmp_path / "ckpt",
                      *TINY_MODEL, "--max-iters", "2", "--eval-interval", "2")
    assert result.returncode == 0, result.stderr
    assert "assuming the GPT-2 tokenizer" in result.stderr
    assert load_checkpoint(str(tmp_path / "ckpt" / "ckpt.pt"))["tokenizer"]["vocab_size"] == 50257


def test_llmc_shards_train_exactly_as_nanogpt_files_and_resume_exactly(char_data, llmc_data,
                                                                       tmp_path):
    common = [*TINY_MODEL, "--max-iters", "8", "--lr-decay-iters", "8", "--eval-interval", "4",
              "--dropout", "0.1"]

    def train(data, out, *extra) -> dict:
        result = run_main("train.py", "--data-dir", data, "--out-dir", tmp_path / out, *common,
                          *extra)
        assert result.returncode == 0, result.stderr
        return load_checkpoint(str(tmp_path / out / "ckpt.pt"))

    nanogpt, shards = train(char_data, "nanogpt"), train(llmc_data, "llmc")
    train(llmc_data, "split", "--max-iters", "4")
    resumed = train(llmc_data, "split", "--init-from", "resume")
    for run in (shards, resumed):
        assert run["history"]["loss"] == nanogpt["history"]["loss"] and \
            run["history"]["val"] == nanogpt["history"]["val"]
        assert all(torch.equal(value, run["model"][key]) for key, value in nanogpt["model"].items())


@pytest.mark.parametrize("fault, fragments", [
    ("magic", ["is not an llm.c shard", "x_train_000001.bin"]),
    ("version", ["llm.c shard version 3, expected 1", "x_train_000001.bin"]),
    ("length", ["x_train_000001.bin has 1,424 bytes but its header says 300 tokens, 1,624 bytes"])])
def test_a_broken_llmc_header_is_one_line_naming_the_file(tmp_path, fault, fragments):
    write_llmc_shard(tmp_path / "x_val_000000.bin", list(range(100)))
    write_llmc_shard(tmp_path / "x_train_000001.bin", list(range(200)))
    header = np.fromfile(tmp_path / "x_train_000001.bin", np.int32, count=256)
    header[{"magic": 0, "version": 1, "length": 2}[fault]] = \
        {"magic": 123, "version": 3, "length": 300}[fault]
    with open(tmp_path / "x_train_000001.bin", "r+b") as f:
        f.write(header.tobytes())
    result = run_main("train.py", "--data-dir", tmp_path, "--out-dir", tmp_path / "ckpt",
                      *TINY_MODEL, "--max-iters", "1")
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "ckpt" / "ckpt.pt").exists()


def test_bits_per_byte_is_the_loss_in_bits_over_the_bytes_of_the_targets(char_data, tmp_path):
    """eval.py --data-dir against a hand computation: every non-overlapping window of the val
    split, the summed cross-entropy of its targets in bits, over the UTF-8 bytes those target
    characters take."""
    assert run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path, *TINY_MODEL,
                    "--max-iters", "20").returncode == 0
    # float32: --dtype auto is bfloat16 on an AVX512-BF16 CPU, 1e-5 off the reference below
    result = run_main("eval.py", "--ckpt", tmp_path / "ckpt.pt", "--data-dir", char_data,
                      "--device", "cpu", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    val = json.loads(result.stdout.splitlines()[-1])["val"]

    model, facts = load_model(str(tmp_path / "ckpt.pt"))
    chars = load_tokenizer(facts).chars
    tokens = np.fromfile(char_data / "val.bin", np.uint16).astype(np.int64)
    block = model.config.block_size
    nats, text = 0.0, ""
    with torch.no_grad():
        for start in range(0, (len(tokens) - 1) // block * block, block):
            x, y = (torch.from_numpy(tokens[start:start + block]),
                    tokens[start + 1:start + block + 1])
            log_p = torch.log_softmax(model.eval()(x[None])[0][0].double(), -1)
            nats -= log_p[torch.arange(block), torch.from_numpy(y)].sum().item()
            text += "".join(chars[i] for i in y)
    assert any(ord(c) > 127 for c in text)  # multi-byte characters count their bytes
    assert val["bytes"] == len(text.encode("utf-8")) and val["tokens"] == len(text)
    assert val["bpb"] == pytest.approx(nats / math.log(2) / len(text.encode("utf-8")), rel=1e-5)


def test_a_checkpoint_and_data_of_other_tokenizers_are_refused(char_data, tmp_path):
    (tmp_path / "rows.txt").write_text("\n".join(ROWS))
    assert run_main("tokenizer.py", "--input", tmp_path / "rows.txt", "--tokenizer", "byte",
                    "--output-dir", tmp_path / "bytes").returncode == 0
    assert run_main("train.py", "--data-dir", char_data, "--out-dir", tmp_path / "ckpt",
                    *TINY_MODEL, "--max-iters", "2").returncode == 0
    scored = run_main("eval.py", "--ckpt", tmp_path / "ckpt" / "ckpt.pt",
                      "--data-dir", tmp_path / "bytes")
    assert_one_line_error(scored, "uses tokenizer byte")
    before = (tmp_path / "ckpt" / "ckpt.pt").read_bytes()
    resumed = run_main("train.py", "--data-dir", tmp_path / "bytes", "--out-dir", tmp_path / "ckpt",
                       *TINY_MODEL, "--init-from", "resume", "--max-iters", "4")
    assert_one_line_error(resumed, "tokenizer")
    assert (tmp_path / "ckpt" / "ckpt.pt").read_bytes() == before


# ----------------------------------------------------------------------------- bombs (issue 49)

def test_a_parquet_row_group_that_expands_far_is_read_a_few_rows_at_a_time(tmp_path):
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"text": ["x" * 10_000] * 4000}), path, row_group_size=4000,
                   compression="zstd")
    # 40 MB of text
    assert pq.ParquetFile(path).num_row_groups == 1 and path.stat().st_size < 1 << 20
    rows, peak = 0, 0
    for text, _, ends in read_documents([str(path)]):
        rows, peak = rows + 1, max(peak, pa.total_allocated_bytes())
        assert text == "x" * 10_000 and ends
    assert rows == 4000 and peak < 12 << 20, peak  # the whole group would be 40 MB


def zst_reads(path) -> tuple[int, int]:
    """(bytes, the most held decompressed at once) of reading path through the .zst reader."""
    reader, total, most = ZstdReader(str(path)), 0, 0
    buffer = bytearray(1 << 20)
    while n := reader.readinto(buffer):
        total, most = total + n, max(most, len(reader.pending))
    reader.close()
    return total, most


def test_zstd_streams_with_bounded_memory_and_reads_frames_that_meet_a_step(tmp_path, monkeypatch):
    bomb = tmp_path / "zeros.txt.zst"
    # 256 MiB of zeros
    bomb.write_bytes(zstandard.ZstdCompressor(level=3).compress(bytes(256 << 20)))
    assert bomb.stat().st_size < 64 << 10
    total, most = zst_reads(bomb)
    assert total == 256 << 20 and most <= 40 << 20, most  # the old reader held all 256 MiB at once
    # a first frame that ends exactly where a read step does, then a second: read whole
    step, lines = ZstdReader.STEP, ""
    while True:
        lines += json.dumps({"text": f"row {len(lines)} {hash(len(lines)) % 9973}"}) + "\n"
        first = zstandard.ZstdCompressor(level=1).compress(lines.encode())
        if len(first) % step == 0 and len(first) >= 2 * step:
            break
    two = tmp_path / "two.jsonl.zst"
    two.write_bytes(first + zstandard.ZstdCompressor().compress(b'{"text": "second frame"}\n'))
    assert zst_reads(two)[0] == len(lines) + len('{"text": "second frame"}\n')
    out = tmp_path / "two-out"
    result = run_main("tokenizer.py", "--input", two, "--tokenizer", "byte", "--output-dir", out)
    assert result.returncode == 0, result.stderr
    # zeros without a line break: text with no place to split, a JSON line past the limit: one
    # line each
    monkeypatch.setattr(documents, "UNCUT_LIMIT", 1 << 20)
    monkeypatch.setattr(documents, "RECORD_LIMIT", 1 << 20)
    (tmp_path / "zeros.jsonl.zst").write_bytes(bomb.read_bytes())
    for name, fragment in (("zeros.txt.zst", "without a space or a line break"),
                           ("zeros.jsonl.zst", "line 1 is longer than 1 MiB")):
        result = run_main("tokenizer.py", "--input", tmp_path / name, "--tokenizer", "byte",
                          "--output-dir", tmp_path / f"{name}-out")
        assert_one_line_error(result, fragment)


@pytest.mark.parametrize("data_files", [["data-00000-of-00001.arrow"], {"filename": "x.arrow"},
                                        "x.arrow", [None], 7, [{"filename": 7}]])
def test_a_datasets_state_json_of_another_shape_is_one_line(tmp_path, data_files):
    folder = write_inputs(tmp_path)["datasets"]
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, "_data_files": data_files}))
    result = run_main("tokenizer.py", "--input", folder, "--tokenizer", "byte",
                      "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "state.json lists no arrow files")


@pytest.mark.parametrize("name, damage", [
    ("cut.txt.gz", lambda data: gzip.compress(data)[:100]),
    ("cut.jsonl.bz2", lambda data: bz2.compress(data)[:100]),
    ("garbage.jsonl.xz", lambda data: b"not xz at all" * 8),
    ("garbage.txt.gz", lambda data: b"not gzip"),
    ("cut.jsonl.zst", lambda data: zstandard.ZstdCompressor().compress(data)[:100]),
])
def test_line_readers_name_a_compressed_file_that_is_cut_or_corrupt(tmp_path, name, damage):
    """finetune.py's, eval.py's and embed.py's inputs (textfiles.read_lines, records.json_lines)."""
    path = tmp_path / name
    path.write_bytes(damage(b"".join(b'{"text": "line %d"}\n' % i for i in range(3000))))
    reader = records.json_lines if ".jsonl" in name else textfiles.read_lines
    with pytest.raises(documents.CLIError, match=f"cannot read .*{name}"):
        list(reader(str(path)))


def test_line_readers_say_a_table_is_one(tmp_path):
    """finetune.py's and embed.py's inputs are JSON lines: a parquet file is said to be a table,
    not 'line 1: invalid UTF-8'."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "label": [0, 1]}), path)
    with pytest.raises(documents.CLIError, match="t.parquet is a table: this reads JSON lines"):
        list(records.json_lines(str(path)))


def test_a_json_array_is_read_an_item_at_a_time_wherever_a_read_ends(tmp_path, monkeypatch):
    """alpaca_data.json's layout, read 7 bytes at a time here (a megabyte in use): every item as
    json.loads gives it, on the line it starts on, whatever a read cuts (a number, an escape, a
    character of three bytes); memory holds an item, not the file."""
    monkeypatch.setattr(records, "ARRAY_READ", 7)
    items = [{"text": "数据 \"quoted\" \\u00e9"}, 12345, -1.5e3, "a string", [1, [2, {}]], None,
             True, {"n": 10**20, "e": "\u00e9😀"}, []]
    path = tmp_path / "a.json"
    path.write_text(codecs.BOM_UTF8.decode() + "[\n" + ",\n".join(
        json.dumps(item, ensure_ascii=i % 2 == 0) for i, item in enumerate(items)) + "\n]\n")
    assert list(records.json_array(str(path))) == [(i + 2, item) for i, item in enumerate(items)]
    path.write_text("[ ]")
    assert list(records.json_array(str(path))) == []
    for text, fragment in (('[1, 2,]', "line 1: invalid JSON (Expecting value"),
                           ('[{"a": 1}\n{"b": 2}]', "line 2: invalid JSON (expected ']')"),
                           ('[1]\nx', "line 2: invalid JSON (extra data after the array)"),
                           ('[1,\n\n{"a": tru}]', "line 3: invalid JSON (Expecting value"),
                           ('[1, "never ends', "line 1: invalid JSON (Unterminated string"),
                           ('[', "line 1: invalid JSON (Expecting value")):
        path.write_text(text)
        with pytest.raises(documents.CLIError, match=re.escape(f"{path} {fragment}")):
            list(records.json_array(str(path)))
    # a megabyte read at a time: 8 MB of items never sit in memory together
    monkeypatch.setattr(records, "ARRAY_READ", 1 << 20)
    path.write_text(json.dumps([{"text": "x" * 1000}] * 8000))
    tracemalloc.start()
    assert sum(1 for _ in records.json_array(str(path))) == 8000
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak
