"""embed.py, embedding.py and index.py: pooling, padding, chunks, the index, exact search,
contrastive tuning, the files written, bad input.

The encoder is a tiny byte-level GPT with random weights. The retrieval set is built from a synonym
map: the documents say "the cat eats the fish", the queries "a kitty devours some trout", so a query
shares meaning but few bytes with its document; tune learns the synonyms from 70 combinations and is
evaluated on 30 others.
"""
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, assert_one_line_error, run_main, tensorboard_scalars
from model import GPT, GPTConfig
from toolkit import files
from toolkit.checkpoint import load_checkpoint, save_checkpoint
from toolkit.embedding import POOLINGS, chunk_spans, encode, pooling_weights, top_k
from toolkit.index import Index, retrieval_metrics
from toolkit.prepare import default_corpus_documents

BYTES = {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}
# for a process of its own: tiny models run fastest on one thread
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
DEVICE = ["--device", "cpu"]
TUNE = ["--max-iters", "60", "--batch-size", "16", "--lr", "2e-3", "--dtype", "float32",
        "--log-interval", "20", *DEVICE]
SUBJECTS = {"cat": "kitty", "dog": "hound", "horse": "pony", "bird": "sparrow", "wolf": "lupine"}
VERBS = {"eats": "devours", "sees": "spots", "likes": "enjoys", "chases": "pursues"}
OBJECTS = {"apples": "fruit", "bread": "loaf", "fish": "trout", "grass": "hay", "meat": "steak"}


def embed_py(*args, **kwargs) -> subprocess.CompletedProcess:
    return run_main("embed.py", *args, **kwargs)


def write_model(path, seed: int = 0, facts: dict = BYTES, block_size: int = 64) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=facts["vocab_size"], n_layer=2,
                          n_head=2, n_embd=64))
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": facts}, str(path))
    return model.eval()


def write_jsonl(path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def metrics(result: subprocess.CompletedProcess, mode: str = "dense") -> dict:
    """One mode's figures from the JSON line eval prints last."""
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])[mode]


def write_retrieval_set(folder) -> None:
    """folder/ckpt.pt (the untuned encoder), docs.jsonl (100 documents), train.jsonl (70 pairs for
    tune) and heldout.jsonl (the queries of the other 30 documents, for eval).
    benchmarks/bench_embed.py uses it too."""
    write_model(folder / "ckpt.pt")
    combos = list(itertools.product(SUBJECTS, VERBS, OBJECTS))
    random.Random(0).shuffle(combos)
    documents = [{"id": f"d{i}", "text": f"the {s} {v} the {o}"}
                 for i, (s, v, o) in enumerate(combos)]
    queries = [f"a {SUBJECTS[s]} {VERBS[v]} some {OBJECTS[o]}" for s, v, o in combos]
    write_jsonl(folder / "docs.jsonl", documents)
    write_jsonl(folder / "train.jsonl",
                [{"query": q, "positive": d["text"]} for q, d in zip(queries[:70], documents)])
    write_jsonl(folder / "heldout.jsonl",
                [{"query": q, "id": d["id"]} for q, d in zip(queries, documents)][70:])


# a sentence: after another or a blank line, 40 to 250 characters
# (a "." inside a word does not end it)
SENTENCE = re.compile(r"(?<=[.!?:]\s|\n\n)[A-Z](?:[^.!?]|[.!?](?!\s)){40,250}?[.!?](?=\s)")


def write_pydoc_retrieval_set(folder, seed: int = 0) -> None:
    """A retrieval set from the embedded corpus (issue 47's): each Python documentation topic with
    two sentences cut out is a document (folder/docs.jsonl); the cut sentences are the queries. The
    topics are split in two: tune.jsonl holds the first half's queries as pairs with their
    documents, heldout.jsonl the second half's queries with their documents' ids, for eval. Tuning
    from the documents alone sees no query at all. benchmarks/bench_embed.py uses it too."""
    rng, documents, queries = random.Random(seed), [], []
    for number, text in enumerate(default_corpus_documents()):
        cut = sorted(rng.sample(list(SENTENCE.finditer(text)), 2)
                     if len(SENTENCE.findall(text)) >= 2 else [], key=lambda m: m.start())
        for m in reversed(cut):
            text = text[:m.start()] + text[m.end():]
        documents.append({"id": f"topic{number}", "text": text})
        queries += [(" ".join(m.group().split()), number) for m in cut]
    write_jsonl(folder / "docs.jsonl", documents)
    write_jsonl(folder / "tune.jsonl",
                [{"query": q, "positive": documents[n]["text"]} for q, n in queries if n % 2 == 0])
    write_jsonl(folder / "heldout.jsonl",
                [{"query": q, "id": documents[n]["id"]} for q, n in queries if n % 2])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The retrieval set and an index of it made with the untuned encoder."""
    folder = tmp_path_factory.mktemp("retrieval")
    write_retrieval_set(folder)
    result = embed_py("index", "--ckpt", folder / "ckpt.pt", "--input", folder / "docs.jsonl",
                      "--out", folder / "index", *DEVICE)
    assert result.returncode == 0, result.stderr
    return folder


# ----- pooling, padding, chunks -----

@pytest.mark.parametrize("pooling", POOLINGS)
def test_a_text_has_the_same_vector_alone_and_in_a_padded_batch(pooling):
    model = GPT(GPTConfig(block_size=64, vocab_size=257, n_layer=2, n_head=2, n_embd=64)).eval()
    texts = [list(b"short"), list(b"a much longer text than the others, padded to nothing"),
             list(b"x")]
    batched = encode(model, texts, pooling, batch_size=3)
    alone = np.stack([encode(model, [t], pooling, batch_size=1)[0] for t in texts])
    np.testing.assert_allclose(batched, alone, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1, atol=1e-6)
    assert np.array_equal(encode(model, texts, pooling, batch_size=2),
                          encode(model, texts, pooling, batch_size=2))
    assert not np.allclose(batched[0], batched[1], atol=1e-3)  # texts differ, so do their vectors


def test_poolings_weigh_positions_as_documented():
    lengths = torch.tensor([3, 1])
    assert pooling_weights(lengths, 4, "weighted-mean").tolist()[0] == \
        pytest.approx([1 / 6, 2 / 6, 3 / 6, 0])
    assert pooling_weights(lengths, 4, "mean").tolist()[0] == \
        pytest.approx([1 / 3, 1 / 3, 1 / 3, 0])
    assert pooling_weights(lengths, 4, "last").tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize("n, chunk, overlap, spans", [
    (10, 4, 1, [(0, 4), (3, 7), (6, 10)]), (4, 4, 1, [(0, 4)]), (5, 4, 1, [(0, 4), (3, 5)]),
    (3, 8, 0, [(0, 3)]),
])
def test_chunks_cover_the_text_with_the_overlap_asked(n, chunk, overlap, spans):
    assert chunk_spans(n, chunk, overlap) == spans


def test_encode_writes_unit_vectors_and_one_row_per_chunk_whatever_the_batch(tmp_path):
    model = write_model(tmp_path / "ckpt.pt")
    lines = ["first text", "", "a second, much longer text that needs three chunks of sixteen",
             "third"]
    (tmp_path / "texts.txt").write_text("\n".join(lines) + "\n")
    outputs = []
    for batch in ("16", "1"):
        out = tmp_path / f"vectors{batch}"
        # float32: padding and batching change no vector beyond rounding
        result = embed_py("encode", "--ckpt", tmp_path / "ckpt.pt", "--input",
                          tmp_path / "texts.txt", "--out", out, "--chunk-tokens", "24", "--overlap",
                          "4", "--batch-size", batch, "--dtype", "float32", *DEVICE)
        assert result.returncode == 0, result.stderr
        rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
        outputs.append((np.load(out.with_suffix(".npy")), rows))
    (vectors, rows), (vectors_one_by_one, rows_again) = outputs
    assert rows == rows_again
    np.testing.assert_allclose(vectors, vectors_one_by_one, atol=1e-5, rtol=0)
    assert vectors.dtype == np.float32 and vectors.shape == (5, 64)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-6)
    assert [(r["id"], r["chunk"], r["tokens"]) for r in rows] == [
        ("1", 0, [0, 10]), ("3", 0, [0, 24]), ("3", 1, [20, 44]), ("3", 2, [40, 61]),
        ("4", 0, [0, 5])]
    chunk = list(lines[2].encode())[20:44]
    np.testing.assert_allclose(vectors[2], encode(model, [chunk], "weighted-mean", 1)[0], atol=1e-5,
                               rtol=0)


# ----- the index and search -----

def test_every_document_retrieves_itself_first_from_its_own_text(corpus, tmp_path):
    documents = [json.loads(line) for line in (corpus / "docs.jsonl").read_text().splitlines()]
    write_jsonl(tmp_path / "self.jsonl", [{"query": d["text"], "id": d["id"]} for d in documents])
    result = embed_py("eval", "--index", corpus / "index", "--pairs", tmp_path / "self.jsonl",
                      *DEVICE)
    found = json.loads(result.stdout.splitlines()[-1])
    perfect = {"recall@1": 1.0, "recall@5": 1.0, "recall@10": 1.0, "mrr@10": 1.0, "ndcg@10": 1.0}
    assert found == {"queries": 100, "hybrid": perfect, "dense": perfect, "lexical": perfect}
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["100", "queries", "hybrid", "dense", "lexical"]
    assert lines[2].split() == ["recall@5", "1.0000", "1.0000", "1.0000"]


def test_a_reloaded_index_gives_identical_results(corpus, tmp_path):
    """Two processes, the second with a copy of the encoder elsewhere: the index knows it by its
    sha256."""
    shutil.copy(corpus / "ckpt.pt", tmp_path / "copy.pt")
    query = ["--query", "the cat eats the fish", "--query", "a pony enjoys some hay", "--top-k",
             "3"]
    runs = [embed_py("search", "--index", corpus / "index", *query, "--json", "--mode", "dense",
                     *ckpt, *DEVICE) for ckpt in ([], ["--ckpt", tmp_path / "copy.pt"])]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout
    first = [json.loads(line) for line in runs[0].stdout.splitlines()]
    assert [len(q["results"]) for q in first] == [3, 3]
    best = first[0]["results"][0]
    assert best["text"] == best["passage"] == "the cat eats the fish" and best["tokens"] == [0, 21]
    assert best["score"] > 0.9999 and first[0]["results"][1]["score"] < best["score"]
    table = embed_py("search", "--index", corpus / "index", *query, *DEVICE).stdout.splitlines()
    assert table[0] == "query: the cat eats the fish" and \
        table[1].split() == ["rank", "score", "id", "passage"]
    assert table[2].split()[0] == "1" and table[2].endswith("the cat eats the fish")


def test_a_passage_whose_chunk_starts_inside_a_character_shows_whole_characters(tmp_path):
    """Byte tokens cut Chinese characters (three bytes each): a hit's passage leaves out the bytes
    of a character it starts inside of."""
    from toolkit.tokenizers import load_tokenizer
    write_model(tmp_path / "ckpt.pt")
    text = "中文的句子在这里。" * 4
    (tmp_path / "zh.txt").write_text(text + "\n")
    assert embed_py("index", "--ckpt", tmp_path / "ckpt.pt", "--input", tmp_path / "zh.txt",
                    "--out", tmp_path / "index", "--chunk-tokens", "8", "--overlap", "0",
                    *DEVICE).returncode == 0
    index, tok = Index(str(tmp_path / "index")), load_tokenizer(BYTES)
    passages = [index.result(tok, "", 1, 0, 0.0, row)["passage"]
                for row in range(len(index.chunks))]
    assert len(passages) == 14 and all(p and "\ufffd" not in p and p in text for p in passages)


@pytest.mark.parametrize("block_rows", [1, 7, 64, 10_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_search_in_blocks_equals_the_whole_product(tmp_path, block_rows, dtype):
    vectors = torch.nn.functional.normalize(
        torch.randn(1000, 32, generator=torch.Generator().manual_seed(0)), dim=1).to(dtype)
    np.save(tmp_path / "v.npy", vectors.numpy())
    mapped = np.load(tmp_path / "v.npy", mmap_mode="r")
    vectors = vectors.float()
    queries = vectors[[3, 500, 999]] + 0.1
    scores, rows = top_k(mapped, queries, 10, block_rows)
    want_scores, want_rows = (queries @ vectors.T).topk(10, dim=1)
    assert torch.equal(rows, want_rows)
    torch.testing.assert_close(scores, want_scores, atol=1e-6, rtol=0)
    assert rows[:, 0].tolist() == [3, 500, 999]


def test_search_ranks_documents_not_chunks(tmp_path):
    write_model(tmp_path / "ckpt.pt", block_size=16)
    texts = ["the cat eats the fish " * 4, "the cat eats the fish " * 3 + "and more", "a dog",
             "bread and apples"]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    result = embed_py("index", "--ckpt", tmp_path / "ckpt.pt", "--input", tmp_path / "texts.txt",
                      "--out", tmp_path / "index", "--overlap", "0", *DEVICE)
    assert result.returncode == 0, result.stderr
    index = Index(str(tmp_path / "index"))
    assert index.meta["max_chunks"] == 6 and index.meta["chunks"] == 6 + 5 + 1 + 1
    query = torch.from_numpy(index.vectors[[0]].astype(np.float32))  # document 1's first chunk
    # documents 1 and 2 both begin with that chunk; their other chunks come next
    hits = index.dense(query, 3)[0]
    numbers = [number for number, _, _ in hits]
    assert sorted(numbers[:2]) == [0, 1] and numbers[2] in (2, 3)
    # float16 vectors: a cosine to 3 decimals
    assert hits[0][1] == pytest.approx(1, abs=1e-3) and hits[1][1] == pytest.approx(1, abs=1e-3)


def test_an_index_records_its_encoder_by_its_fingerprint(corpus):
    encoder = Index(str(corpus / "index")).meta["encoder"]
    assert encoder == {"path": str(corpus / "ckpt.pt"),
                       "sha256": files.fingerprint(str(corpus / "ckpt.pt"))}


def test_metrics_count_the_relevant_document_in_the_first_ten_hits():
    hits = [[(number, 1.0, number) for number in found]
            for found in ([7, 1, 2], [1, 7], range(20), [3])]
    metrics = retrieval_metrics(hits, [7, 7, 15, 7])  # ranks 1 and 2; then 16, past ten; then none
    assert metrics == pytest.approx({"recall@1": 0.25, "recall@5": 0.5, "recall@10": 0.5,
                                     "mrr@10": 1.5 / 4, "ndcg@10": (1 + 1 / np.log2(3)) / 4})


def test_json_lines_offsets_find_each_line_and_arrays_are_saved_whole(tmp_path):
    records = [{"id": "é", "text": "two\nlines"}, {}, {"n": 3}]
    offsets = files.write_jsonl(str(tmp_path / "records.jsonl"), records)
    data = (tmp_path / "records.jsonl").read_bytes()
    assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == len(data)
    assert [json.loads(data[start:end]) for start, end in zip(offsets[:-1], offsets[1:])] == records
    files.save_array(str(tmp_path / "offsets.npy"), offsets)
    assert np.array_equal(np.load(tmp_path / "offsets.npy", mmap_mode="r"), offsets)
    # no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offsets.npy", "records.jsonl"]


def test_a_json_array_corpus_numbers_its_items(tmp_path):
    """A compact array (alpaca_data.json's kind, all on one line) ids its items by position."""
    from toolkit.embedding import read_corpus
    rows = [{"text": "第一篇"}, {"text": "second"}, {"text": "third", "doc": "c"}]
    (tmp_path / "one_line.json").write_text(json.dumps(rows, ensure_ascii=False))
    documents = read_corpus(str(tmp_path / "one_line.json"), "text", "doc", "*.txt")
    assert [(d.id, d.text) for d in documents] == [("1", "第一篇"), ("2", "second"),
                                                   ("c", "third")]
    (tmp_path / "lines.jsonl").write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))
    assert [d.id for d in read_corpus(str(tmp_path / "lines.jsonl"), "text", "doc", "*.txt")] == \
        ["2", "3", "c"]


def test_every_command_that_encodes_offers_the_dtypes_of_the_other_scripts():
    for command in ("encode", "index", "tune"):
        help_text = embed_py(command, "--help")
        assert help_text.returncode == 0 and "{auto,float32,bfloat16,float16}" in help_text.stdout


# ----- contrastive tuning -----

def write_topic_set(folder) -> None:
    """60 documents, each 20 sentences of its own topic's invented words among common ones, and 120
    queries: new sentences of each topic, in no document. folder/ckpt.pt is the untuned (random)
    encoder."""
    rng = random.Random(0)
    common = ["the", "and", "of", "to", "is", "in", "with", "for", "on", "as"]
    topics = [["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 7)))
               for _ in range(8)]
              for _ in range(60)]

    def sentence(words: list[str]) -> str:
        return " ".join(rng.choice(words) if rng.random() < 0.5 else rng.choice(common)
                        for _ in range(8)) + "."

    write_model(folder / "ckpt.pt")
    write_jsonl(folder / "docs.jsonl",
                [{"id": f"t{i}", "text": " ".join(sentence(w) for _ in range(20))}
                 for i, w in enumerate(topics)])
    write_jsonl(folder / "queries.jsonl",
                [{"query": sentence(w), "id": f"t{i}"} for i, w in enumerate(topics)
                 for _ in range(2)])


def test_tune_from_documents_alone_raises_recall_of_unseen_queries_on_the_defaults(tmp_path):
    """Issue 47: no labels, two spans of a document as a pair; the queries are in no document tuned
    on."""
    write_topic_set(tmp_path)
    recall = {}
    for name, ckpt in (("untuned", tmp_path / "ckpt.pt"),
                       ("tuned", tmp_path / "tuned" / "ckpt.pt")):
        if name == "tuned":
            tuned = embed_py("tune", "--ckpt", tmp_path / "ckpt.pt", "--input",
                             tmp_path / "docs.jsonl", "--out-dir", tmp_path / "tuned", *DEVICE,
                             "--log-interval", "100")
            assert tuned.returncode == 0, tuned.stderr
            assert "on 0 pairs and 60 documents, 10 held out" in tuned.stdout
        made = embed_py("index", "--ckpt", ckpt, "--input", tmp_path / "docs.jsonl", "--out",
                        tmp_path / name, *DEVICE)
        assert made.returncode == 0, made.stderr
        recall[name] = metrics(embed_py("eval", "--index", tmp_path / name, "--pairs",
                                        tmp_path / "queries.jsonl"))
    before, after = recall["untuned"], recall["tuned"]
    assert after["recall@1"] >= 1.5 * before["recall@1"] and \
        after["recall@10"] > before["recall@10"], recall
    assert after["mrr@10"] > before["mrr@10"]


def test_tune_with_documents_and_pairs_holds_out_a_tenth_and_keeps_the_best(corpus, tmp_path):
    """--input and --pairs together: 100 documents + 70 pairs, 17 held out; the checkpoint is the
    best evaluation's (the untuned encoder's included), the run says so; neither input is one
    line."""
    result = embed_py("tune", "--ckpt", corpus / "ckpt.pt", "--input", corpus / "docs.jsonl",
                      "--pairs", corpus / "train.jsonl", "--out-dir", tmp_path / "both", *TUNE)
    assert result.returncode == 0, result.stderr
    assert "on 70 pairs and 100 documents, 17 held out for the best checkpoint" in result.stdout, \
        result.stdout
    saved = load_checkpoint(str(tmp_path / "both" / "ckpt.pt"))
    history = saved["history"]
    best = min(history["val"])
    assert saved["embedding"]["val"]["val_loss"] == best and saved["iter_num"] == \
        history["eval_iter"][history["val"].index(best)]
    assert "the best checkpoint is" in result.stdout
    assert_one_line_error(embed_py("tune", "--ckpt", corpus / "ckpt.pt", "--out-dir",
                                   tmp_path / "none", *DEVICE), "tune learns from --input")


def test_tune_raises_recall_on_held_out_queries(corpus, tmp_path):
    before = metrics(embed_py("eval", "--index", corpus / "index", "--pairs",
                              corpus / "heldout.jsonl", *DEVICE))
    # the defaults learn
    tuned = embed_py("tune", "--ckpt", corpus / "ckpt.pt", "--pairs", corpus / "train.jsonl",
                     "--out-dir", tmp_path / "tuned", *DEVICE, "--log-interval", "50", "--run-name",
                     "run")
    assert tuned.returncode == 0, tuned.stderr
    result = embed_py("index", "--ckpt", tmp_path / "tuned" / "ckpt.pt", "--input",
                      corpus / "docs.jsonl", "--out", tmp_path / "index", *DEVICE)
    assert result.returncode == 0, result.stderr
    after = metrics(embed_py("eval", "--index", tmp_path / "index", "--pairs",
                             corpus / "heldout.jsonl", *DEVICE))
    assert before["recall@1"] <= 0.2 and after["recall@1"] >= 0.6, (before, after)
    assert after["mrr@10"] > before["mrr@10"] + 0.4
    losses = tensorboard_scalars(tmp_path / "tuned" / "tensorboard")["loss/train"]
    assert [step for step, _ in losses] == [50, 100, 150, 200] and losses[-1][1] < losses[0][1]
    sampled = run_main("test.py", "--ckpt", tmp_path / "tuned" / "ckpt.pt", "--device", "cpu",
                       "--max-new-tokens", "5", "--num-samples", "1", "--prompt", "the cat")
    assert sampled.returncode == 0 and sampled.stdout.startswith("the cat"), sampled.stderr


def test_bias_only_tuning_changes_only_biases(corpus, tmp_path):
    result = embed_py("tune", "--ckpt", corpus / "ckpt.pt", "--pairs", corpus / "train.jsonl",
                      "--out-dir", tmp_path, "--bias-only", *TUNE, "--max-iters", "3")
    assert result.returncode == 0, result.stderr
    before, after = (load_checkpoint(str(corpus / "ckpt.pt"))["model"],
                     load_checkpoint(str(tmp_path / "ckpt.pt")))
    changed = {name for name, value in after["model"].items()
               if not torch.equal(value, before[name])}
    assert changed and all(name.endswith(".bias") for name in changed), changed
    assert after["iter_num"] == 3 and after["embedding"]["bias_only"] is True


def test_bias_only_on_the_llama_family_which_has_no_biases_is_one_line(corpus, tmp_path):
    checkpoint = load_checkpoint(str(corpus / "ckpt.pt"))
    config = GPTConfig(**{**checkpoint["model_config"], "arch": "llama", "bias": False})
    save_checkpoint({**checkpoint, "model": GPT(config).state_dict(),
                     "model_config": vars(config)}, str(tmp_path / "llama.pt"))
    result = embed_py("tune", "--ckpt", tmp_path / "llama.pt", "--pairs", corpus / "train.jsonl",
                      "--out-dir", tmp_path / "out", "--bias-only", *TUNE, "--max-iters", "3")
    assert_one_line_error(result, "--bias-only: this model has no bias parameters",
                          "--arch llama has none")
    assert not (tmp_path / "out").exists()


def test_sigterm_finishes_the_step_saves_and_exits_0(corpus, tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "embed.py"), "tune", "--ckpt",
                             str(corpus / "ckpt.pt"), "--pairs", str(corpus / "train.jsonl"),
                             "--out-dir", str(tmp_path), *TUNE, "--max-iters", "100000",
                             "--log-interval", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **ONE_THREAD})
    try:
        for line in proc.stdout:
            if line.startswith("iter 2:"):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    # 10 of the 70 pairs held out
    assert "stopped by signal" in out and "the best checkpoint is" in out
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] < 100000


def test_a_non_finite_loss_stops_without_saving(corpus, tmp_path):
    result = embed_py("tune", "--ckpt", corpus / "ckpt.pt", "--pairs", corpus / "train.jsonl",
                      "--out-dir", tmp_path, *TUNE, "--lr", "1e30", "--warmup-iters", "0",
                      "--max-iters", "5", "--val-fraction", "0")
    assert_one_line_error(result, "loss is nan", "stopped without saving", "--temperature")
    assert not (tmp_path / "ckpt.pt").exists()


# ----- bad input: one line, exit 1, nothing written -----

@pytest.fixture(scope="module")
def bad(corpus, tmp_path_factory):
    """Inputs that must be refused, next to the good corpus."""
    folder = tmp_path_factory.mktemp("bad")
    write_model(folder / "other.pt", seed=1)
    # every character of the documents
    chars = "".join(sorted(set((corpus / "docs.jsonl").read_text())))
    write_model(folder / "char.pt", facts={"tokenizer": "char", "chars": chars,
                                           "vocab_size": len(chars), "eot_id": None})
    (folder / "blank.txt").write_text("\n  \n\n")
    (folder / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "no end"\n')
    write_jsonl(folder / "content.jsonl", [{"content": "猫坐在垫子上"}])
    write_jsonl(folder / "unknown.jsonl",
                [{"query": "a kitty", "id": "d1"}, {"query": "a hound", "id": "d100"}])
    write_jsonl(folder / "no_positive.jsonl",
                [{"query": "a kitty", "positive": "the cat"}, {"query": "a hound"}])
    return folder


@pytest.mark.parametrize("command, fragments", [
    (["search", "--index", "{corpus}/index", "--query", "cat", "--ckpt", "{bad}/other.pt"],
     ["is not the encoder"]),
    (["search", "--index", "{corpus}/index", "--query", "cat", "--ckpt", "{bad}/char.pt"],
     ["is not the encoder"]),
    (["index", "--ckpt", "{corpus}/ckpt.pt", "--input", "{bad}/blank.txt", "--out", "{out}"],
     ["no texts"]),
    (["index", "--ckpt", "{corpus}/ckpt.pt", "--input", "{bad}/broken.jsonl", "--out", "{out}"],
     ["broken.jsonl line 2", "invalid JSON"]),
    (["index", "--ckpt", "{corpus}/ckpt.pt", "--input", "{bad}/content.jsonl", "--out", "{out}"],
     ["content.jsonl line 1", "(its string keys: content)", "with --json-key"]),
    (["eval", "--index", "{corpus}/index", "--pairs", "{bad}/unknown.jsonl"],
     ["unknown.jsonl line 2", "'d100'"]),
    (["tune", "--ckpt", "{corpus}/ckpt.pt", "--pairs", "{bad}/no_positive.jsonl", "--out-dir",
      "{out}"], ["no_positive.jsonl line 2", "'positive'"]),
    (["encode", "--ckpt", "{corpus}/ckpt.pt", "--input", "{corpus}/docs.jsonl", "--out",
      "{corpus}/docs"], ["would overwrite the input"]),
    (["encode", "--ckpt", "{corpus}/ckpt.pt", "--input", "{corpus}/docs.jsonl", "--out", "{out}",
      "--chunk-tokens", "8", "--overlap", "8"], ["--overlap"]),
    (["tune", "--ckpt", "{corpus}/ckpt.pt", "--pairs", "{corpus}/train.jsonl", "--out-dir", "{out}",
      "--temperature", "0"], ["--temperature"]),
    (["tune", "--ckpt", "{corpus}/ckpt.pt", "--pairs", "{corpus}/train.jsonl", "--out-dir", "{out}",
      "--batch-size", "1"], ["--batch-size must be at least 2 for tune"]),
    (["tune", "--ckpt", "{corpus}/ckpt.pt", "--pairs", "{corpus}/train.jsonl", "--out-dir", "{out}",
      "--seed", "-1"], ["--seed must be an integer from 0 to 2**63 - 1"]),
    (["encode", "--ckpt", "{corpus}/ckpt.pt", "--input", "{corpus}/docs.jsonl", "--out", "{out}",
      "--chunk-tokens", "0"], ["--chunk-tokens must be between 1"]),
])
def test_bad_input_is_one_line_and_writes_nothing(corpus, bad, tmp_path, command, fragments):
    out = tmp_path / "out"
    before = {p: p.stat().st_mtime_ns for p in corpus.rglob("*")}
    args = [a.format(corpus=corpus, bad=bad, out=out) for a in command]
    assert_one_line_error(embed_py(*args, *DEVICE), *fragments)
    assert not list(tmp_path.glob("out*"))
    assert {p: p.stat().st_mtime_ns for p in corpus.rglob("*")} == before


def damage_index(index, damage: str) -> None:
    facts = json.loads((index / "index.json").read_text())
    if damage == "empty vectors":
        (index / "vectors.bin").write_bytes(b"")
    elif damage == "counts of int64":
        counts = index / facts["lexical"] / "counts.npy"
        np.save(counts, np.load(counts).astype(np.int64))
    elif damage == "a chunk of no document":
        chunks = np.fromfile(index / "chunks.bin", dtype=np.int64)
        chunks[0] = facts["documents"]
        chunks.tofile(index / "chunks.bin")
    elif damage == "edited documents":  # as long as before, but other words: other tokens
        lines = (index / "documents.jsonl").read_text().splitlines()
        lines = [line.replace("the ", "") + " " * 4 * line.count("the ") for line in lines]
        (index / "documents.jsonl").write_text("".join(line + "\n" for line in lines))
    else:
        key, value = damage.split("=")
        if value == "-":
            del facts[key]
        else:
            facts[key] = json.loads(value)
        (index / "index.json").write_text(json.dumps(facts))


@pytest.mark.parametrize("damage, fragment", [
    ("empty vectors", "vectors.bin holds 0 bytes"), ("counts of int64", "holds int64"),
    ("a chunk of no document", "names documents the index does not hold"),
    ("edited documents", "documents.jsonl changed since the index was built"),
    ("encoder=-", "encoder missing or not as embed.py index writes them"),
    ('chunk_tokens="x"', "chunk_tokens missing"), ('dtype="int8"', "dtype missing"),
    ("max_chunks=0", "max_chunks missing"), ('modes=["sparse"]', "modes missing"),
    ("lexical=-", "lexical missing"), ('lexical="../elsewhere"', "lexical missing"),
    ("version=1", "written by another version of embed.py (index version 1"),
    ('ann="ann-1.faiss"', "cannot read the graph")])
def test_a_damaged_index_is_one_line(corpus, tmp_path, damage, fragment):
    shutil.copytree(corpus / "index", tmp_path / "index")
    damage_index(tmp_path / "index", damage)
    result = embed_py("search", "--index", tmp_path / "index", "--query", "the cat eats", *DEVICE)
    assert_one_line_error(result, fragment)
    assert "rebuild" in result.stderr or "encoder" in damage


def test_an_encoder_changed_since_indexing_is_refused(corpus, tmp_path):
    write_model(tmp_path / "ckpt.pt")
    result = embed_py("index", "--ckpt", tmp_path / "ckpt.pt", "--input", corpus / "docs.jsonl",
                      "--out", tmp_path / "index", *DEVICE)
    assert result.returncode == 0, result.stderr
    write_model(tmp_path / "ckpt.pt", seed=1)  # e.g. training went on in the same --out-dir
    result = embed_py("search", "--index", tmp_path / "index", "--query", "cat", *DEVICE)
    assert_one_line_error(result, "changed since the index", "rebuild the index")
    os.remove(tmp_path / "ckpt.pt")
    result = embed_py("search", "--index", tmp_path / "index", "--query", "cat", *DEVICE)
    assert_one_line_error(result, "ckpt.pt, is not there", "pass --ckpt")


# ----- a tokenizer with a BOS -----

def test_a_llama3_folder_encodes_each_text_after_its_bos_as_transformers_reads_it(tmp_path):
    """Chunks, queries and tuning texts start with <|begin_of_text|>, as AutoTokenizer(text) gives
    them: the vectors are SGPT's weighted mean of transformers' last hidden states of those ids, and
    a chunk holds the block size less one token."""
    import transformers

    from conftest import llama3_folder
    from toolkit.contrastive import read_tune_pairs
    from toolkit.embedding import load_encoder

    folder = llama3_folder(tmp_path / "hf")
    hf = transformers.AutoModel.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)

    def sgpt(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
        weights = torch.arange(1.0, len(ids) + 1)[:, None]
        return torch.nn.functional.normalize((weights * hidden).sum(0), dim=0).numpy()

    short, long = "中文的句子，hello world 12345", "def f(x):\n    return x + 1\n" * 30
    write_jsonl(tmp_path / "docs.jsonl", [{"text": short}, {"text": long}])
    out = tmp_path / "vectors"
    assert embed_py("encode", "--ckpt", folder, "--input", tmp_path / "docs.jsonl", "--out", out,
                    "--overlap", "0", "--dtype", "float32", *DEVICE).returncode == 0
    vectors = np.load(out.with_suffix(".npy"))
    rows = [json.loads(line)["tokens"]
            for line in out.with_suffix(".jsonl").read_text().splitlines()]
    ids = tok(short).input_ids
    bos, long_ids = ids[0], tok(long, add_special_tokens=False).input_ids
    assert bos == tok.bos_token_id and rows[:2] == [[0, len(ids) - 1], [0, 127]]  # block 128
    np.testing.assert_allclose(vectors[0], sgpt(ids), atol=1e-5, rtol=0)
    np.testing.assert_allclose(vectors[1], sgpt([bos, *long_ids[:127]]), atol=1e-5, rtol=0)

    assert embed_py("index", "--ckpt", folder, "--input", tmp_path / "docs.jsonl", "--out",
                    tmp_path / "index", "--dtype", "float32", *DEVICE).returncode == 0
    result = embed_py("search", "--index", tmp_path / "index", "--query", "hello 中文", "--json",
                      "--top-k", "1", "--mode", "dense", *DEVICE)
    assert result.returncode == 0, result.stderr
    hit = json.loads(result.stdout)["results"][0]
    # the index keeps float16 vectors: a cosine to 3 decimals
    assert hit["score"] == pytest.approx(float(sgpt(tok("hello 中文").input_ids) @ vectors[0]),
                                         abs=1e-3)
    write_jsonl(tmp_path / "pairs.jsonl", [{"query": short, "positive": long}])
    _, tokenizer, _ = load_encoder(folder, torch.device("cpu"))
    ((query, positive),) = read_tune_pairs(str(tmp_path / "pairs.jsonl"), tokenizer, 127)
    assert query == ids and positive == [bos, *long_ids[:127]]
