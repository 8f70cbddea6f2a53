"""Text embeddings and semantic search with a GPT: SGPT's pooling of its last hidden states.

    python embed.py encode --ckpt ckpt/ckpt.pt --input texts.txt --out vectors  # .npy + .jsonl
    python embed.py index --ckpt ckpt/ckpt.pt --input docs.jsonl --out my_index  # for search
    python embed.py search --index my_index --query "how do I read a file" --top-k 5
    python embed.py tune --ckpt ckpt/ckpt.pt --input docs.jsonl --out-dir ckpt/tuned
        # contrastive, no labels
    python embed.py eval --index my_index --pairs queries.jsonl  # recall@1/5/10, MRR@10

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

import numpy as np

from toolkit import cli, flags
from toolkit.cli import CLIError
from toolkit.device import DTYPES, describe, resolve_device, resolve_dtype
from toolkit.embedding import (POOLINGS, Document, TuneConfig, chunk_documents, chunk_records,
                               encode, encoder_identity, load_encoder, read_corpus,
                               settle_chunking, setup_tune, text_room)
from toolkit.files import check_output, refuse_existing, save_array, write_jsonl
from toolkit.lora import lora_base
from toolkit.index import (INDEX_FILES, METRIC_KS, Index, encode_queries, open_encoder,
                           read_eval_pairs, retrieval_metrics, write_index)


def check_outputs(outputs: list[str], inputs: list[str], overwrite: bool) -> None:
    for path in outputs:
        check_output(path, inputs, "--out")
    refuse_existing(outputs, overwrite)


def encode_input(args: argparse.Namespace) -> tuple[list[Document], np.ndarray, np.ndarray, dict]:
    """Read, chunk and encode --input with --ckpt: (documents, rows, vectors, their encoding)."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer, facts = load_encoder(args.ckpt, device)
    chunk_tokens, overlap = settle_chunking(args.chunk_tokens, args.overlap,
                                            text_room(model, tokenizer))
    documents = read_corpus(args.input, args.json_key, args.id_key, args.glob)
    chunks, rows = chunk_documents(documents, tokenizer, chunk_tokens, overlap)
    start = time.perf_counter()
    vectors = encode(model, chunks, args.pooling, args.batch_size, dtype)
    seconds = time.perf_counter() - start
    print(f"encoded {len(documents):,} texts as {len(chunks):,} vectors of {vectors.shape[1]} in "
          f"{seconds:.1f} s ({len(documents) / seconds:,.0f} texts/s; {describe(device)}, "
          f"{args.pooling} pooling)", file=sys.stderr)
    encoding = {"tokenizer": facts, "pooling": args.pooling,
                "dtype": str(dtype).removeprefix("torch."), "chunk_tokens": chunk_tokens,
                "overlap": overlap}
    return documents, rows, vectors, encoding


def encode_command(args: argparse.Namespace) -> None:
    outputs = [args.out + ".npy", args.out + ".jsonl"]
    check_outputs(outputs, [args.input, args.ckpt, *lora_base(args.ckpt)], args.overwrite)
    documents, rows, vectors, _ = encode_input(args)
    save_array(outputs[0], vectors)
    write_jsonl(outputs[1], chunk_records(documents, rows))
    count, dim = vectors.shape
    print(f"wrote {outputs[0]} ({count:,} x {dim} float32) and {outputs[1]}")


def index_command(args: argparse.Namespace) -> None:
    check_outputs([os.path.join(args.out, name) for name in INDEX_FILES],
                  [args.input, args.ckpt, *lora_base(args.ckpt)],
                  args.overwrite)
    documents, rows, vectors, encoding = encode_input(args)
    encoding = {"encoder": encoder_identity(args.ckpt), **encoding}
    corpus = {"input": os.path.abspath(args.input), "json_key": args.json_key,
              "id_key": args.id_key, "glob": args.glob}
    write_index(args.out, documents, rows, vectors, encoding, corpus)
    print(f"wrote index {args.out}: {len(documents):,} documents, {len(rows):,} vectors of "
          f"{vectors.shape[1]}")


def search_command(args: argparse.Namespace) -> None:
    if args.top_k < 1:
        raise CLIError(f"--top-k must be at least 1, got {args.top_k}")
    for query in args.query:
        if not query.strip():
            raise CLIError("--query is empty")
    index = Index(args.index)
    device = resolve_device(args.device)
    model, tokenizer = open_encoder(index, args.ckpt, device)
    places = [f"--query {q!r}" for q in args.query]
    queries = encode_queries(model, tokenizer, index, args.query, places, args.batch_size, device)
    for query, hits in zip(args.query, index.search(queries, args.top_k)):
        results = [index.result(tokenizer, rank, *hit) for rank, hit in enumerate(hits, 1)]
        if args.json:
            print(json.dumps({"query": query, "results": results}, ensure_ascii=False))
        else:
            print_table(query, results)


def print_table(query: str, results: list[dict]) -> None:
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
    queries, places, relevant = read_eval_pairs(args.pairs, index.document_numbers(), args.index)
    device = resolve_device(args.device)
    model, tokenizer = open_encoder(index, args.ckpt, device)
    vectors = encode_queries(model, tokenizer, index, queries, places, args.batch_size, device)
    metrics = retrieval_metrics(index.search(vectors, max(METRIC_KS)), relevant)
    for name, value in metrics.items():
        print(f"{name:10s} {value}" if name == "queries" else f"{name:10s} {value:.4f}")
    print(json.dumps(metrics))


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
    p.add_argument("--pooling", choices=POOLINGS, default="weighted-mean",
                   help="weighted-mean: SGPT's position-weighted mean of the last hidden states "
                        "(default); mean; last: the last token's state")
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

    p = command("index", index_command, "a corpus -> an index folder: vectors, ids, texts and the "
                                        "encoder's identity")
    add_encoding_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the index folder")

    p = command("search", search_command,
                "the top-k documents of each query by cosine score, exact")
    add_index_arguments(p)
    add_runtime_arguments(p)
    p.add_argument("--query", action="append", required=True, help="a query; repeat for several")
    p.add_argument("--top-k", type=int, default=10,
                   help="documents per query (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON line per query instead of a table")

    p = command("eval", eval_command, 'recall@1/5/10 and MRR@10 of {"query", "id"} lines against '
                                      "an index; the last line printed is JSON")
    add_index_arguments(p)
    add_runtime_arguments(p)
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
