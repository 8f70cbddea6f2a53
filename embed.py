"""Search with a GPT: SGPT's pooling of its last hidden states as text vectors, BM25 beside them,
and the two fused.

    python embed.py encode --ckpt ckpt/ckpt.pt --input texts.txt --out vectors  # .npy + .jsonl
    python embed.py index --ckpt ckpt/ckpt.pt --input docs.jsonl --out my_index  # vectors + BM25
    python embed.py index --ckpt ckpt/ckpt.pt --input more.jsonl --out my_index --append
    python embed.py search --index my_index --query "how do I read a file" --top-k 5  # hybrid
    python embed.py tune --ckpt ckpt/ckpt.pt --input docs.jsonl --out-dir ckpt/tuned
        # contrastive, no labels
    python embed.py eval --index my_index --pairs queries.jsonl  # hybrid, dense and lexical

Texts: a text file holds one text per line, a .jsonl/.json file one per JSON line (--json-key; ids
from --id-key, else the line number), a folder one per file (--glob). Texts longer than
--chunk-tokens are cut into chunks with --overlap tokens in common, one vector each. An index
records its encoder (path and sha256), tokenizer, pooling and dtype, so queries are always encoded
the same way. File formats: docs/embed.md.
"""
import argparse
import json
import os
import sys
import time

from tqdm import tqdm

from toolkit import cli, flags
from toolkit.cli import CLIError
from toolkit.device import DTYPES, describe, resolve_device, resolve_dtype
from toolkit.contrastive import TuneConfig, setup_tune
from toolkit.embedding import (POOLINGS, batches, chunk_documents, chunk_records,
                               corpus_documents, encode, encoder_identity, load_encoder,
                               read_corpus, settle_chunking, text_room)
from toolkit.files import check_new_outputs, save_array, write_jsonl
from toolkit.index import (INDEX_FILE, METRIC_KS, MODES, Index, IndexWriter, encode_queries,
                           open_encoder, read_eval_pairs, retrieval_metrics)
from toolkit.lora import lora_base
from toolkit.tokenizers import load_tokenizer

INDEX_BATCH = 256  # documents read, chunked, encoded and written at a time
MODE_PARTS = {"hybrid": ["dense", "lexical"], "dense": ["dense"], "lexical": ["lexical"]}


def encode_command(args: argparse.Namespace) -> None:
    outputs = [args.out + ".npy", args.out + ".jsonl"]
    check_new_outputs(outputs, [args.input, args.ckpt, *lora_base(args.ckpt)], args.overwrite)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    pooling = args.pooling or POOLINGS[0]
    model, tokenizer, _ = load_encoder(args.ckpt, device)
    chunk_tokens, overlap = settle_chunking(args.chunk_tokens, args.overlap,
                                            text_room(model, tokenizer))
    documents = read_corpus(args.input, args.json_key, args.id_key, args.glob)
    chunks, rows = chunk_documents(documents, tokenizer, chunk_tokens, overlap)
    start = time.perf_counter()
    vectors = encode(model, chunks, pooling, args.batch_size, dtype)
    seconds = time.perf_counter() - start
    print(f"encoded {len(documents):,} texts as {len(chunks):,} vectors of {vectors.shape[1]} in "
          f"{seconds:.1f} s ({len(documents) / seconds:,.0f} texts/s; {describe(device)}, "
          f"{pooling} pooling)", file=sys.stderr)
    save_array(outputs[0], vectors)
    write_jsonl(outputs[1], chunk_records(documents, rows))
    count, dim = vectors.shape
    print(f"wrote {outputs[0]} ({count:,} x {dim} float32) and {outputs[1]}")


def index_command(args: argparse.Namespace) -> None:
    previous = Index(args.out) if args.append else None
    if previous is None:
        check_new_outputs([os.path.join(args.out, INDEX_FILE)],
                      [args.input, args.ckpt, *lora_base(args.ckpt)], args.overwrite)
    device = resolve_device(args.device)
    model, tokenizer, facts = load_encoder(args.ckpt, device)
    encoding = (appended_encoding(previous, args) if previous else
                new_encoding(args, model, tokenizer, facts, device))
    dtype = resolve_dtype(encoding["dtype"], device)
    dense, lexical = "dense" in encoding["modes"], "lexical" in encoding["modes"]
    writer = IndexWriter(args.out, encoding, previous)
    start = time.perf_counter()
    try:
        add_documents(writer, args, model, tokenizer, encoding, dtype)
        meta = writer.finish()
    except BaseException:  # bad input, Ctrl-C: the index stays as it was
        writer.abort()
        raise
    added = meta["documents"] - (previous.meta["documents"] if previous else 0)
    parts = [f"vectors of {meta['dim']} (float16)" if dense else "",
             "a lexical index" if lexical else "", "an HNSW graph" if "ann" in meta else ""]
    print(f"{'added' if previous else 'indexed'} {added:,} documents in "
          f"{time.perf_counter() - start:.1f} s ({describe(device)}); wrote index {args.out}: "
          f"{meta['documents']:,} documents, {meta['chunks']:,} chunks; "
          f"{', '.join(p for p in parts if p)}")


def add_documents(writer: IndexWriter, args: argparse.Namespace, model, tokenizer,
                  encoding: dict, dtype) -> None:
    """--input's documents read, chunked, encoded and written INDEX_BATCH at a time."""
    documents = corpus_documents(args.input, args.json_key, args.id_key, args.glob)
    dense = "dense" in encoding["modes"]
    with tqdm(desc="indexing", unit=" documents", disable=None, leave=False) as bar:
        for batch in batches(documents, INDEX_BATCH):
            chunks, rows = chunk_documents(batch, tokenizer, encoding["chunk_tokens"],
                                           encoding["overlap"])
            vectors = (encode(model, chunks, encoding["pooling"], args.batch_size, dtype,
                              desc=None) if dense else None)
            writer.add(batch, rows, vectors)
            bar.update(len(batch))


def new_encoding(args: argparse.Namespace, model, tokenizer, facts: dict, device) -> dict:
    """What index.json records of how the chunks were cut and encoded, from the flags."""
    chunk_tokens, overlap = settle_chunking(args.chunk_tokens, args.overlap,
                                            text_room(model, tokenizer))
    dtype = resolve_dtype(args.dtype, device)
    return {"encoder": encoder_identity(args.ckpt), "tokenizer": facts,
            "pooling": args.pooling or POOLINGS[0], "dtype": str(dtype).removeprefix("torch."),
            "chunk_tokens": chunk_tokens, "overlap": overlap, "dim": model.config.n_embd,
            "modes": MODE_PARTS[args.mode or "hybrid"], "input": os.path.abspath(args.input),
            "json_key": args.json_key, "id_key": args.id_key, "glob": args.glob}


def appended_encoding(index: Index, args: argparse.Namespace) -> dict:
    """--append: the index's own encoding, which the flags may repeat but not change."""
    meta = index.meta
    if encoder_identity(args.ckpt)["sha256"] != meta["encoder"]["sha256"]:
        raise CLIError(f"--append: --ckpt {args.ckpt} is not the encoder of the index {args.out} "
                       f"({meta['encoder']['path']}, sha256 differs); its vectors would not "
                       "compare")
    given = {"pooling": args.pooling, "chunk_tokens": args.chunk_tokens,
             "overlap": args.overlap, "modes": args.mode and MODE_PARTS[args.mode],
             "dtype": None if args.dtype == "auto" else args.dtype}
    for key, value in given.items():
        if value is not None and value != meta[key]:
            flag = "--mode" if key == "modes" else "--" + key.replace("_", "-")
            raise CLIError(f"--append: the index {args.out} was built with {flag} "
                           f"{meta[key]}, not {value}; leave {flag} out to use the index's")
    keys = ("encoder", "tokenizer", "pooling", "dtype", "chunk_tokens", "overlap", "dim", "modes",
            "input", "json_key", "id_key", "glob")
    return {key: meta[key] for key in keys}


def search_command(args: argparse.Namespace) -> None:
    if args.top_k < 1:
        raise CLIError(f"--top-k must be at least 1, got {args.top_k}")
    for query in args.query:
        if not query.strip():
            raise CLIError("--query is empty")
    index = Index(args.index)
    mode = args.mode or index.mode
    index.check_mode(mode)
    places = [f"--query {q!r}" for q in args.query]
    tokenizer, vectors = query_vectors(index, mode, args, args.query, places)
    for query, hits in zip(args.query, index.search(args.query, vectors, args.top_k, mode)):
        results = [index.result(tokenizer, query, rank, *hit) for rank, hit in enumerate(hits, 1)]
        if args.json:
            print(json.dumps({"query": query, "mode": mode, "results": results},
                             ensure_ascii=False))
        else:
            print_results(query, results)


def query_vectors(index: Index, mode: str, args: argparse.Namespace, queries: list[str],
                  places: list[str]):
    """(the index's tokenizer, the queries' vectors, or None where mode needs none)."""
    if mode == "lexical":
        return load_tokenizer(index.meta["tokenizer"]), None
    device = resolve_device(args.device)
    model, tokenizer = open_encoder(index, args.ckpt, device)
    return tokenizer, encode_queries(model, tokenizer, index, queries, places, args.batch_size,
                                     device)


def print_results(query: str, results: list[dict]) -> None:
    """A query's results as a table: rank, score, id and the passage's start."""
    print(f"query: {query}")
    width = max(len("id"), *(len(r["id"]) for r in results))
    print(f"{'rank':>4}  {'score':>7}  {'id':<{width}}  passage")
    for r in results:
        text = " ".join(r["passage"].split())
        text = text[:70] + "..." if len(text) > 73 else text
        print(f"{r['rank']:>4}  {r['score']:7.4f}  {r['id']:<{width}}  {text}")
    print()


def eval_command(args: argparse.Namespace) -> None:
    index = Index(args.index)
    modes = [args.mode] if args.mode else [m for m in MODES if m == index.mode or
                                           index.mode == "hybrid"]
    for mode in modes:
        index.check_mode(mode)
    queries, places, relevant = read_eval_pairs(args.pairs, index.document_numbers(), args.index)
    _, vectors = query_vectors(index, "lexical" if modes == ["lexical"] else "dense", args,
                               queries, places)
    results = {mode: retrieval_metrics(index.search(queries, vectors, max(METRIC_KS), mode),
                                       relevant) for mode in modes}
    print(f"{len(queries):,} queries" + "".join(f"  {mode:>8}" for mode in modes))
    for name in results[modes[0]]:
        print(f"{name:10s}" + "".join(f"  {results[mode][name]:8.4f}" for mode in modes))
    print(json.dumps({"queries": len(queries), **results}))


def tune_command(args: argparse.Namespace) -> None:
    setup_tune(TuneConfig(**flags.values(args, TuneConfig))).fit()


# ----- the command line -----

def add_encoding_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True,
                   help="the encoder: a ckpt.pt, or an HF GPT-2, Llama or Qwen3 folder / "
                        "cached name")
    p.add_argument("--input", required=True,
                   help="a text file (one text per line), a .jsonl/.json file (one text per JSON "
                        "line) or a folder (one text per file); .gz/.bz2/.xz read")
    p.add_argument("--json-key", default="text",
                   help="field holding the text in JSON lines (default: %(default)s)")
    p.add_argument("--id-key", default="id",
                   help="field holding a JSON line's id; a line without it is named by its line "
                        "number (default: %(default)s)")
    p.add_argument("--glob", default="*.txt",
                   help="file name pattern inside an --input folder (default: %(default)s)")
    p.add_argument("--pooling", choices=POOLINGS,
                   help="weighted-mean: SGPT's position-weighted mean of the last hidden states "
                        "(default; --append: the index's); mean; last: the last token's state")
    p.add_argument("--chunk-tokens", type=int,
                   help="longer texts are cut into chunks of this many tokens, one vector each "
                        "(default: the model's block size, less a BOS)")
    p.add_argument("--overlap", type=int,
                   help="tokens each chunk shares with the one before (default: an eighth of "
                        "--chunk-tokens)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="autocast dtype; auto = bfloat16 where the hardware computes it natively, "
                        "else float32; an index records it for its queries (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")


def add_runtime_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=16,
                   help="texts per forward pass, in each process (default: %(default)s)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda, cuda:N or mps (default: %(default)s)")


def add_index_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--index", required=True, help="an index folder written by `embed.py index`")
    p.add_argument("--ckpt", help="the index's encoder at another path (default: the path it "
                                  "records); refused unless its sha256 is the one recorded")


def add_mode_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--mode", choices=MODES,
                   help=f"{what}: hybrid, the dense and lexical scores fused (the default "
                        "where the index has both); dense, the cosine of the vectors; lexical, "
                        "BM25")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.argument_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run, description: str) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=description, description=description, allow_abbrev=False)
        p.set_defaults(run=run)
        return p

    p = command("encode", encode_command, "texts -> PREFIX.npy (float32 unit vectors) + "
                                          "PREFIX.jsonl (one line per vector: id, source, chunk)")
    add_encoding_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--out", required=True, metavar="PREFIX",
                   help="writes PREFIX.npy and PREFIX.jsonl")

    p = command("index", index_command, "a corpus -> an index folder: vectors and a lexical "
                                        "(BM25) index of its chunks, ids, texts and the encoder's "
                                        "identity")
    add_encoding_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the index folder")
    p.add_argument("--mode", choices=MODES,
                   help="what to build: hybrid, both parts (default); dense, the vectors only; "
                        "lexical, BM25 only (nothing encoded, the encoder's tokenizer cuts the "
                        "chunks)")
    p.add_argument("--append", action="store_true",
                   help="add --input's documents to the existing index --out, encoding only "
                        "them (its encoder, pooling, dtype and chunking)")

    p = command("search", search_command,
                "the top-k documents of each query: by cosine, BM25, or both fused")
    add_index_arguments(p)
    add_runtime_arguments(p)
    add_mode_argument(p, "how to rank")
    p.add_argument("--query", action="append", required=True, help="a query; repeat for several")
    p.add_argument("--top-k", type=int, default=10,
                   help="documents per query (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON line per query instead of a table")

    p = command("eval", eval_command, 'recall@1/5/10, MRR@10 and nDCG@10 of {"query", "id"} '
                                      "lines against an index, in each mode side by side; the "
                                      "last line printed is JSON")
    add_index_arguments(p)
    add_runtime_arguments(p)
    add_mode_argument(p, "one mode to measure (default: every mode the index has)")
    p.add_argument("--pairs", required=True,
                   help='JSON lines {"query": ..., "id": the relevant document\'s id}')

    p = command("tune", tune_command, "contrastive fine-tuning from documents or pairs (InfoNCE, "
                                      "in-batch negatives) -> OUT_DIR/ckpt.pt, still a GPT")
    flags.add_flags(p, TuneConfig)

    args = parser.parse_args(argv)
    if getattr(args, "batch_size", 1) < 1:
        raise CLIError(f"--batch-size must be at least 1, got {args.batch_size}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    cli.run(main)
