"""
Prepare token data for training: text in, token ids out (nanoGPT train.bin/val.bin, Megatron
.bin/.idx, or llm.c's shards), with GPT-2's BPE, a byte-level BPE trained here on the input, the
characters of the data, or bytes.

    python tokenizer.py                                  # default corpus: Python's pydoc topics, char-level
    python tokenizer.py --install-gpt2-vocab             # once: the GPT-2 vocabulary for offline use
    python tokenizer.py --input docs/ --glob '*.md' --tokenizer gpt2 --append-eod --output-dir data/docs
    python tokenizer.py --input reviews.jsonl --tokenizer bpe --vocab-size 16384 --append-eod \\
        --output-dir data/reviews                        # trains data/reviews/tokenizer.json, then encodes
    python tokenizer.py --input fineweb/ --glob '*.parquet' --format llmc --output-dir data/fineweb
    python tokenizer.py --input oscar-1GB.jsonl.xz --tokenizer gpt2 --append-eod --workers 4 \\
        --format megatron --output-prefix data/oscar     # -> data/oscar_text_document.bin/.idx/.json

A plain text file is one document; a JSON line, or a row of a parquet or arrow file, is one (the
text under --json-key). This is the command; the tokenizers are toolkit/tokenizers.py, the readers
toolkit/documents.py, the parallel encoder and the default corpus toolkit/prepare.py, the formats
toolkit/data.py (reading) and toolkit/writers.py. docs/data.md tells which tokenizer to pick.
"""
import argparse
import os
import sys
import time

from tqdm import tqdm

from toolkit import cli, gpt2_vocab
from toolkit.cli import CLIError
from toolkit.data import NANOGPT_FILES, megatron_document_prefix
from toolkit.documents import ReadStats, input_files, read_documents, read_text, without_compression
from toolkit.files import refuse_existing, write_error, write_text
from toolkit.prepare import (DEFAULT_CORPUS_DIR, chunks_of, describe_default_corpus, encode_in_order,
                             prepare_default_corpus)
from toolkit.tokenizers import Tokenizer, train_bpe
from toolkit.writers import LlmcWriter, MegatronWriter, NanoGPTWriter, llmc_shards, output_dtype


def texts(files: list[str], args: argparse.Namespace):
    """Every piece of text of the input, streaming: one extra pass for what the vocabulary needs."""
    return (text for pieces, _ in read_documents(files, args.json_key, args.errors, args.skip_bad_lines)
            for text in pieces)


def build_tokenizer(args: argparse.Namespace, files: list[str]) -> Tokenizer:
    if args.tokenizer_file:
        return Tokenizer("bpe", tokenizer_json=read_text(args.tokenizer_file, "--tokenizer-file"),
                         source=args.tokenizer_file)
    if args.tokenizer == "bpe":
        start = time.time()
        tokenizer = Tokenizer("bpe", tokenizer_json=train_bpe(texts(files, args), args.vocab_size))
        print(f"trained a byte-level BPE of {tokenizer.vocab_size:,} tokens on the input in "
              f"{time.time() - start:.1f} s", file=sys.stderr)
        return tokenizer
    if args.tokenizer != "char":
        return Tokenizer(args.tokenizer, vocab_file=args.vocab_file, merge_file=args.merge_file)
    chars = set()  # the char vocabulary is whatever the data holds
    for text in texts(files, args):
        chars.update(text)
    if not chars:
        raise CLIError(f"no text in the input ({len(files)} file(s)); nothing to tokenize")
    # llm.c's shards start each document with end-of-text: then the table has one
    return Tokenizer("char", chars="".join(sorted(chars)), char_eot=args.append_eod or args.format == "llmc")


def make_writer(args: argparse.Namespace, tokenizer: Tokenizer):
    """The writer of the chosen format, and where a trained tokenizer's tokenizer.json goes beside it."""
    if args.format == "megatron":
        prefix = megatron_document_prefix(args.output_prefix, args.json_key)
        dtype = output_dtype(tokenizer.vocab_size, args.dtype, args.format)
        return MegatronWriter(prefix, dtype), prefix + ".tokenizer.json"
    if args.format == "llmc":
        if tokenizer.vocab_size > 2**16:
            raise CLIError(f"llm.c's shards hold uint16 ids; a vocabulary of {tokenizer.vocab_size:,} does not fit: "
                           f"use --format nanogpt")
        return LlmcWriter(args.output_dir, args.shard_tokens, args.val_fraction), None
    dtype = output_dtype(tokenizer.vocab_size, args.dtype, args.format)
    return NanoGPTWriter(args.output_dir, dtype, args.val_fraction, args.seed), None


def prepare(args: argparse.Namespace) -> dict:
    """Tokenize args.input into the chosen format; returns the metadata written."""
    files = input_files(args.input, args.glob)
    tokenizer = build_tokenizer(args, files)
    writer, tokenizer_file = make_writer(args, tokenizer)
    tokenizer_file = tokenizer_file or os.path.join(args.output_dir, "tokenizer.json")
    eod = "prepend" if args.format == "llmc" else "append" if args.append_eod else None
    stats = ReadStats()
    start, documents, tokens, nbytes = time.time(), 0, 0, 0
    try:
        documents_read = read_documents(files, args.json_key, args.errors, args.skip_bad_lines, stats)
        quiet = args.quiet or not sys.stderr.isatty()
        known_size = not any(path != without_compression(path) for path in files)
        total = sum(os.path.getsize(path) for path in files) if known_size else None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet,
                  desc="tokenizing") as bar:
            chunks = chunks_of(documents_read, int(args.chunk_mb * 2**20))
            for arrays, lengths, size in encode_in_order(chunks, tokenizer, eod, writer.dtype, args.workers):
                writer.add(arrays, lengths)
                documents += int((lengths > 0).sum())
                tokens += int(lengths.sum())
                nbytes += size
                bar.update(size)
                bar.set_postfix_str(f"{documents / max(time.time() - start, 1e-9):,.0f} docs/s", refresh=False)
        if documents == 0:
            raise CLIError(f"no non-empty documents in the input ({len(files)} file(s)); nothing to write")
        if tokenizer.name == "bpe":  # beside the token files, for HF's tools (the facts hold it too)
            write_text(tokenizer_file, tokenizer.tokenizer_json)
        meta = writer.finish({**tokenizer.facts(), "append_eod": args.append_eod})
    except OSError as e:  # reading errors are CLIErrors already: this is the output failing
        writer.discard()
        raise write_error(writer.where, e) from None
    except BaseException:
        writer.discard()
        raise
    seconds = max(time.time() - start, 1e-9)
    print(f"{documents:,} documents, {tokens:,} tokens in {seconds:.1f} s ({nbytes / 2**20 / seconds:.1f} MB/s, "
          f"{tokens / seconds:,.0f} tokens/s)" + (f", {stats.bad_lines:,} bad lines skipped" if stats.bad_lines
                                                   else ""))
    return meta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.argument_parser(__doc__)
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="text files, JSON-lines files (.jsonl/.json), parquet or arrow files, folders (recursive, "
                        "see --glob) or a folder that HF datasets saved; .gz/.bz2/.xz/.zst are decompressed on "
                        "the fly. Without --input: the default pydoc corpus")
    p.add_argument("--glob", default="*.txt", help="file name pattern inside --input folders (default: %(default)s)")
    p.add_argument("--json-key", default="text",
                   help="the text's field in JSON lines, or its column in parquet and arrow (default: %(default)s)")
    p.add_argument("--tokenizer", choices=["gpt2", "bpe", "char", "byte"],
                   help="gpt2 = tiktoken r50k_base (default); bpe = a byte-level BPE trained on the input; "
                        "char = the characters of the data; byte = 256 bytes + EOT")
    p.add_argument("--vocab-size", type=int, default=16384,
                   help="entries of the BPE trained with --tokenizer bpe: the 256 bytes, the merges and "
                        "<|endoftext|> (default: %(default)s)")
    p.add_argument("--tokenizer-file", metavar="PATH",
                   help="encode with this tokenizer.json (a BPE model with <|endoftext|>: one trained here, or "
                        "an HF tokenizer's)")
    p.add_argument("--vocab-file", help="GPT-2 vocabulary: gpt2-vocab.json (with --merge-file) or a .tiktoken file")
    p.add_argument("--merge-file", help="gpt2-merges.txt, with a gpt2-vocab.json --vocab-file")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    p.add_argument("--format", choices=["nanogpt", "megatron", "llmc"],
                   help="nanogpt: DIR/train.bin, val.bin, meta.json; megatron: PREFIX_text_document.bin/.idx/"
                        ".json; llmc: llm.c's shards DIR/NAME_val_000000.bin, NAME_train_000001.bin, ... "
                        "(default: megatron with --output-prefix or --dataset-impl, else nanogpt)")
    p.add_argument("--output-dir", help=f"output folder (nanogpt, llmc; default corpus: {DEFAULT_CORPUS_DIR})")
    p.add_argument("--output-prefix", help="output path prefix (--format megatron)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="tokens of each llm.c shard (default: %(default)s, as llm.c's)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of documents for val.bin (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the train/val document split (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32", "int32"], default="auto",
                   help="token id type on disk; auto = uint16 when the vocabulary fits (default: %(default)s)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: %(default)s)")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="input MB per unit of work (default: %(default)s)")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="invalid UTF-8: stop (strict) or use U+FFFD (replace) (default: %(default)s)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) invalid JSON lines, or rows without text, instead of stopping")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--install-gpt2-vocab", action="store_true",
                   help=f"download GPT-2's vocabulary (from the {gpt2_vocab.WHISPER_SDIST} sdist on PyPI) "
                        f"into tiktoken's cache")
    megatron = p.add_argument_group("Megatron-LM's names", "its preprocess_data.py command runs as written")
    megatron.add_argument("--json-keys", dest="json_key", default=argparse.SUPPRESS, help="= --json-key")
    megatron.add_argument("--vocab", dest="vocab_file", default=argparse.SUPPRESS, help="= --vocab-file")
    megatron.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer"], help="= --tokenizer gpt2")
    megatron.add_argument("--dataset-impl", choices=["mmap"], help="= --format megatron (its mmap .bin/.idx)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    megatron_flags = args.dataset_impl or args.output_prefix
    if args.format in ("nanogpt", "llmc") and args.dataset_impl:
        raise CLIError(f"--dataset-impl mmap writes Megatron's format; it cannot be combined with --format "
                       f"{args.format}")
    args.format = args.format or ("megatron" if megatron_flags else "nanogpt")
    for flag, kind in (("--tokenizer-type", "gpt2"), ("--tokenizer-file", "bpe")):
        given = getattr(args, flag[2:].replace("-", "_"))
        if given and args.tokenizer not in (None, kind):
            raise CLIError(f"{flag} {given} is a {kind} tokenizer; it cannot be combined with --tokenizer "
                           f"{args.tokenizer}")
        if given:
            args.tokenizer = kind
    if not args.input:
        needs_input = {"--tokenizer": args.tokenizer not in (None, "char"), "--format": args.format != "nanogpt",
                       "--output-prefix": args.output_prefix, "--vocab-file": args.vocab_file,
                       "--merge-file": args.merge_file, "--append-eod": args.append_eod}
        for flag, given in needs_input.items():
            if given:
                raise CLIError(f"{flag} needs --input (without --input, tokenizer.py prepares the default char "
                               f"corpus)")
        return
    args.tokenizer = args.tokenizer or "gpt2"
    if args.format in ("nanogpt", "llmc") and not args.output_dir:
        raise CLIError(f"--output-dir is required with --input (--format {args.format})")
    if args.format == "megatron" and not args.output_prefix:
        raise CLIError("--output-prefix is required with --format megatron")
    if args.format == "llmc" and args.append_eod:
        raise CLIError("--format llmc starts every document with the end-of-text token, as llm.c's shards do; "
                       "drop --append-eod")
    if (args.vocab_file or args.merge_file) and args.tokenizer != "gpt2":
        raise CLIError("--vocab-file/--merge-file only apply to --tokenizer gpt2")
    if args.merge_file and not args.vocab_file:
        raise CLIError("--merge-file needs --vocab-file (gpt2-vocab.json)")
    if args.vocab_file and args.vocab_file.endswith(".json") and not args.merge_file:
        raise CLIError("a .json --vocab-file needs --merge-file (gpt2-merges.txt)")
    if not 0 < args.val_fraction < 1:
        raise CLIError(f"--val-fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    if args.workers < 1 or not 0 < args.chunk_mb <= 1024:
        raise CLIError(f"--workers must be >= 1 and --chunk-mb between 0 and 1024, got {args.workers} and "
                       f"{args.chunk_mb}")
    if args.shard_tokens < 1:
        raise CLIError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")


def outputs(args: argparse.Namespace) -> list[str]:
    """The files a run would write (or find, for llm.c's shards); only --overwrite replaces them."""
    trained = args.tokenizer == "bpe"
    if args.format == "megatron":
        prefix = megatron_document_prefix(args.output_prefix, args.json_key)
        return [prefix + ext for ext in (".bin", ".idx", ".json", *[".tokenizer.json"] * trained)]
    names = [*NANOGPT_FILES] if args.format == "nanogpt" else ["meta.json", *llmc_shards(args.output_dir)]
    return [os.path.join(args.output_dir, name) for name in (*names, *["tokenizer.json"] * trained)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.install_gpt2_vocab:
        print(f"GPT-2 vocabulary installed: {gpt2_vocab.install()}")
        if not args.input:
            return
    check_args(args)
    if not args.input:
        out_dir = args.output_dir or DEFAULT_CORPUS_DIR
        if os.path.exists(os.path.join(out_dir, "meta.json")) and not args.overwrite:
            print(f"{out_dir} is already prepared (use --overwrite to rebuild it)")
        else:
            print(describe_default_corpus(out_dir, prepare_default_corpus(out_dir)))
        return
    refuse_existing(outputs(args), args.overwrite)
    prepare(args)


if __name__ == "__main__":
    cli.run(main)
