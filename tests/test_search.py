"""Search beyond the vectors: the terms and BM25 of toolkit/lexical.py (against bm25s), the three
modes of embed.py search/eval and their fusion, --append, and the HNSW graph of a large index
(toolkit/ann.py). The encoder is test_embed.py's tiny byte-level GPT with random weights."""
import json
import shutil

import bm25s
import numpy as np
import pytest
import torch

from conftest import assert_one_line_error
from test_embed import BYTES, DEVICE, embed_py, write_jsonl, write_model
from toolkit import index as index_module
from toolkit.contrastive import Contrastive, TuneConfig
from toolkit.embedding import load_encoder
from toolkit.index import Index, fuse
from toolkit.lexical import B, K1, Lexical, Postings, terms
from toolkit.tokenizers import load_tokenizer

# everyday Chinese (reviews of hotels, books and shops), English prose and code
REVIEWS = ["酒店的位置很好，离地铁站很近，房间也很干净。", "这本书写得非常好，我已经看了三遍了。",
           "快递很快，包装也很结实，下次还会再买。", "房间太小了，隔音很差，晚上睡不好。",
           "服务员的态度很热情，早餐的种类也很多。", "手机的电池不太耐用，一天要充两次电。",
           "价格便宜，质量不错，推荐大家购买。", "这家餐厅的菜味道一般，服务态度还可以。"]
ENGLISH = ["The with statement wraps a block in a context manager.",
           "A file object is returned by open() and read with read().",
           "def read_file(path):\n    with open(path) as f:\n        return f.read()",
           "Exceptions are raised with raise and caught with try and except."]


def documents(n: int = 40) -> list[dict]:
    """n documents of two sentences each, every one its own pair (ids d0, d1, ...)."""
    texts = REVIEWS + ENGLISH
    return [{"id": f"d{i}", "text": texts[i % len(texts)] + " " + texts[(i * 5 + 3) % len(texts)]}
            for i in range(n)]


def build(folder, docs: list[dict], *args) -> None:
    write_jsonl(folder.parent / f"{folder.name}.jsonl", docs)
    result = embed_py("index", "--ckpt", folder.parent / "ckpt.pt", "--input",
                      folder.parent / f"{folder.name}.jsonl", "--out", folder, *args, *DEVICE)
    assert result.returncode == 0, result.stderr


def search(folder, query: str, *args) -> list[dict]:
    return search_json(folder, query, *args)["results"]


def search_json(folder, query: str, *args) -> dict:
    result = embed_py("search", "--index", folder, "--query", query, "--json", *args, *DEVICE)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("search")
    write_model(folder / "ckpt.pt", block_size=16)  # chunks of 16 bytes: several per document
    return folder


# ----- terms and BM25 -----

def test_terms_cut_every_script_into_words_or_characters_and_bigrams():
    # words of two characters or more, as bm25s and scikit-learn cut English; identifiers whole
    assert terms("Read_File() reads a FILE, the file x") == ["read_file", "reads", "file", "file"]
    assert terms("酒店很好") == ["酒", "店", "很", "好", "酒店", "店很", "很好"]
    assert terms("カタカナ") == ["カ", "タ", "カ", "ナ", "カタ", "タカ", "カナ"]
    assert terms("한국어") == ["한", "국", "어", "한국", "국어"]
    assert terms("ＡＢＣ１２３ 中") == ["abc123", "中"]  # full-width forms fold (NFKC)
    assert terms("the of and, to be") == []


def test_bm25_scores_equal_bm25s_before_and_after_an_append():
    """Lucene's BM25 as bm25s computes it, on every text for each query (a repeated term and an
    unknown one included); an append changes N, df and avgdl for all, and the counts kept give the
    new scores."""
    texts = [d["text"] for d in documents(30)]
    queries = ["房间很干净", "read the file with open", "价格 价格 price", "nothing matches: zzz"]

    def check(lexical: Lexical, texts: list[str]) -> None:
        reference = bm25s.BM25(k1=K1, b=B, method="lucene")
        reference.index([terms(t) for t in texts], show_progress=False)
        for query in queries:
            found, scores = lexical.scores(query)
            ours = np.zeros(len(texts))
            ours[found] = scores
            np.testing.assert_allclose(ours, reference.get_scores(terms(query)), atol=1e-5)

    postings = Postings()
    postings.add(texts[:7])  # batches numbered on
    postings.add(texts[7:20])
    check(Lexical(postings.arrays()), texts[:20])
    appended = Postings(Lexical(postings.arrays()))
    appended.add(texts[20:])
    check(Lexical(appended.arrays()), texts)
    again = Postings(Lexical(appended.arrays()))
    again.add(texts[:1])  # no term it has not seen
    check(Lexical(again.arrays()), texts + texts[:1])


def test_fusion_adds_the_halves_scaled_scores_and_keeps_dense_chunks():
    dense = [(1, 0.9, 10), (2, 0.8, 20), (3, 0.5, 30)]  # scaled: 1, 0.75, 0
    lexical = [(3, 5.0, -1), (4, 3.0, -1), (5, 1.0, -1)]  # scaled: 1, 0.5, 0
    w = index_module.DENSE_WEIGHT
    fused = dict((n, (score, chunk)) for n, score, chunk in fuse(dense, lexical, 5))
    assert fused == {1: (pytest.approx(w), 10), 2: (pytest.approx(0.75 * w), 20),
                     3: (pytest.approx(1 - w), 30), 4: (pytest.approx(0.5 * (1 - w)), -1),
                     5: (0.0, -1)}
    best_two = sorted(fused, key=lambda n: -fused[n][0])[:2]
    assert [n for n, _, _ in fuse(dense, lexical, 2)] == best_two
    assert fuse([], [(7, 2.0, -1)], 3) == [(7, pytest.approx(1 - w), -1)]  # one hit: scaled to 1


# ----- the modes -----

def test_lexical_search_finds_chinese_and_shows_the_chunk_of_its_terms(model):
    folder = model / "zh"
    build(folder, [*documents(), {"id": "clean", "text": "这个房间干净得像新的一样。"}])
    hits = search(folder, "房间干净", "--mode", "lexical", "--top-k", "3")
    best = hits[0]
    # the only text with the bigram 间干; its first 16 bytes (这个房间干 and a byte of 净) hold the
    # most of the query's terms
    assert best["id"] == "clean" and best["passage"] == "这个房间干"
    assert best["score"] > hits[1]["score"] > 0
    hybrid = search_json(folder, "房间干净")  # the default: both, fused
    assert hybrid["mode"] == "hybrid" and len(hybrid["results"]) == 10


def test_an_index_of_one_mode_searches_in_it_and_refuses_the_other(model, tmp_path):
    shutil.copy(model / "ckpt.pt", tmp_path / "ckpt.pt")
    build(tmp_path / "lexical", documents(), "--mode", "lexical")
    assert not (tmp_path / "lexical" / "vectors.bin").exists()
    (tmp_path / "ckpt.pt").unlink()  # lexical search needs no encoder
    assert "酒店" in search(tmp_path / "lexical", "酒店 地铁")[0]["text"]
    result = embed_py("search", "--index", tmp_path / "lexical", "--query", "x", "--mode",
                      "dense", *DEVICE)
    assert_one_line_error(result, "has no dense part", "--mode lexical")
    write_jsonl(tmp_path / "pairs.jsonl", [{"query": "酒店 地铁", "id": "d0"}])
    result = embed_py("eval", "--index", tmp_path / "lexical", "--pairs", tmp_path / "pairs.jsonl")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split() == ["1", "queries", "lexical"]
    assert set(json.loads(result.stdout.splitlines()[-1])) == {"queries", "lexical"}


# ----- --append -----

def index_state(folder) -> dict:
    """What search reads: the raw arrays (to their recorded lengths), the documents' ids and
    texts, the lexical arrays; and the results of a few queries in each mode."""
    index = Index(str(folder))
    state = {"vectors": index.vectors.tobytes(), "chunks": index.chunks.tobytes(),
             "documents": [(d["id"], d["text"]) for d in map(index.document,
                                                             range(index.meta["documents"]))],
             **{name: np.asarray(array).tobytes() for name, array in vars(index.lexical).items()
                if isinstance(array, np.ndarray)}}
    for mode in ("hybrid", "dense", "lexical"):
        state[mode] = [[(hit["id"], hit["score"], hit["tokens"]) for hit in search(folder, q,
                                                                                   "--mode", mode)]
                       for q in ("房间 干净", "read a file")]
    return state


def test_append_gives_the_index_that_one_build_gives(model, tmp_path):
    shutil.copy(model / "ckpt.pt", tmp_path / "ckpt.pt")
    docs = documents(50)
    build(tmp_path / "whole", docs)
    build(tmp_path / "part", docs[:30])
    write_jsonl(tmp_path / "rest.jsonl", docs[30:])
    appended = embed_py("index", "--ckpt", tmp_path / "ckpt.pt", "--input", tmp_path / "rest.jsonl",
                        "--out", tmp_path / "part", "--append", *DEVICE)
    assert appended.returncode == 0, appended.stderr
    assert "added 20 documents" in appended.stdout
    assert index_state(tmp_path / "part") == index_state(tmp_path / "whole")
    assert sorted(p.name for p in (tmp_path / "part").glob("lexical-*")) == ["lexical-2"]


@pytest.mark.parametrize("flags, fragment", [
    (["--input", "{tmp}/again.jsonl"], "id 'd0' is already used by document 1 of the index"),
    (["--input", "{tmp}/rest.jsonl", "--pooling", "mean"],
     "was built with --pooling weighted-mean, not mean"),
    (["--input", "{tmp}/rest.jsonl", "--ckpt", "{tmp}/other.pt"], "is not the encoder"),
])
def test_a_refused_append_leaves_the_index_as_it_was(model, tmp_path, flags, fragment):
    shutil.copy(model / "ckpt.pt", tmp_path / "ckpt.pt")
    write_model(tmp_path / "other.pt", seed=1, block_size=16)
    docs = documents(300)  # more than a batch: the refusal comes after one is written
    build(tmp_path / "part", docs[:30])
    write_jsonl(tmp_path / "rest.jsonl", docs[30:])
    write_jsonl(tmp_path / "again.jsonl", docs[30:] + docs[:1])
    before = {p.name: p.read_bytes() for p in (tmp_path / "part").rglob("*") if p.is_file()}
    args = [a.format(tmp=tmp_path) for a in flags]
    result = embed_py("index", "--ckpt", tmp_path / "ckpt.pt", "--out", tmp_path / "part",
                      "--append", *args, *DEVICE)
    assert_one_line_error(result, fragment)
    assert {p.name: p.read_bytes() for p in (tmp_path / "part").rglob("*")
            if p.is_file()} == before


def test_an_append_cut_short_leaves_the_index_it_was_and_the_next_one_completes(model, tmp_path):
    """A process killed mid-append left bytes past what index.json counts: search ignores them,
    the next append writes over them."""
    shutil.copy(model / "ckpt.pt", tmp_path / "ckpt.pt")
    docs = documents(40)
    build(tmp_path / "whole", docs)
    build(tmp_path / "part", docs[:25])
    before = index_state(tmp_path / "part")
    for name in ("vectors.bin", "chunks.bin", "offsets.bin", "documents.jsonl"):
        with open(tmp_path / "part" / name, "ab") as f:
            f.write(b"\x07" * 100)
    assert index_state(tmp_path / "part") == before
    write_jsonl(tmp_path / "rest.jsonl", docs[25:])
    assert embed_py("index", "--ckpt", tmp_path / "ckpt.pt", "--input", tmp_path / "rest.jsonl",
                    "--out", tmp_path / "part", "--append", *DEVICE).returncode == 0
    assert index_state(tmp_path / "part") == index_state(tmp_path / "whole")


# ----- a large index: the graph -----

def test_a_large_index_searches_its_graph_and_finds_what_exact_search_finds(model, tmp_path,
                                                                            monkeypatch):
    shutil.copy(model / "ckpt.pt", tmp_path / "ckpt.pt")
    monkeypatch.setattr(index_module, "ANN_BYTES", 100 * 2 * 64)  # large from 100 chunks on
    build(tmp_path / "index", documents(60))
    index = Index(str(tmp_path / "index"))
    assert index.meta["chunks"] > 100 and index.graph is not None
    assert index.meta["ann"] == "ann-1.faiss"
    queries = torch.from_numpy(index.vectors[::37].astype(np.float32))
    through_graph = index.dense(queries, 10)
    index.graph = None
    exact = index.dense(queries, 10)
    for graph_hits, exact_hits in zip(through_graph, exact):  # (equal texts tie: any order)
        assert {n for n, _, _ in graph_hits} == {n for n, _, _ in exact_hits}
        assert [score for _, score, _ in graph_hits] == \
            pytest.approx([score for _, score, _ in exact_hits], abs=1e-4)
    graph = tmp_path / "index" / "ann-1.faiss"
    graph.write_bytes(graph.read_bytes()[:1000])
    result = embed_py("search", "--index", tmp_path / "index", "--query", "酒店", *DEVICE)
    assert_one_line_error(result, "cannot read the graph", "rebuild the index")


# ----- hard negatives for tune -----

def test_tune_mines_the_text_bm25_ranks_first_but_the_example_own(model):
    model_, tokenizer, facts = load_encoder(str(model / "ckpt.pt"), torch.device("cpu"))
    texts = ["apples and pears from the orchard", "pears and plums and apples in a bowl",
             "cars and trucks on the road"]
    examples = [tokenizer.encode(t) for t in texts]
    cfg = TuneConfig(ckpt="unused", out_dir="unused", val_fraction=0, batch_size=2)
    objective = Contrastive(cfg, model_, tokenizer, facts, examples, torch.float32)
    rng = np.random.default_rng(0)
    own = objective.examples.index(examples[0])
    (negative,) = objective.hard_negative(tokenizer.encode("apples pears"), own, rng)
    assert load_tokenizer(BYTES).decode(negative) in texts[1]
    assert objective.hard_negative(tokenizer.encode("zebra"), own, rng) == []
