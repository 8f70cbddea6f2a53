"""
Prepare token data for training: text in, token ids out (nanoGPT train.bin/val.bin, Megatron
.bin/.idx, or llm.c's shards), with GPT-2's BPE, a byte-level BPE trained here on the input, the
characters of the data, or bytes.

    python tokenizer.py                         # default corpus: Python's pydoc topics, char-level
    python tokenizer.py --install-gpt2-vocab    # once: the GPT-2 vocabulary for offline use
    python tokenizer.py --input docs/ --glob '*.md' --tokenizer gpt2 --append-eod \\
        --output-dir data/docs
    python tokenizer.py --input reviews.jsonl --tokenizer bpe --vocab-size 16384 --append-eod \\
        --output-dir data/reviews               # trains data/reviews/tokenizer.json, then encodes
    python tokenizer.py --input fineweb/ --glob '*.parquet' --format llmc --output-dir data/fineweb
    python tokenizer.py --input oscar-1GB.jsonl.xz --tokenizer gpt2 --append-eod --workers 4 \\
        --format megatron --output-prefix data/oscar  # -> data/oscar_text_document.bin/.idx/.json

A plain text file is one document; a JSON line, or a row of a parquet or arrow file, is one (the
text under --json-key). This is the command; the tokenizers are toolkit/tokenizers.py, the readers
toolkit/documents.py, the preparation (the parallel encoder, the default corpus) toolkit/prepare.py,
the formats toolkit/data.py (reading) and toolkit/writers.py. docs/data.md tells which tokenizer to
pick.
"""
import argparse

from toolkit import cli
from toolkit.cli import CLIError
from toolkit.data import DEFAULT_CORPUS_DIR
from toolkit.prepare import WHISPER_SDIST, install_gpt2_vocab, prepare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.argument_parser(__doc__)
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="text files, JSON-lines files (.jsonl/.json), parquet or arrow files, "
                        "folders (recursive, see --glob) or a folder that HF datasets saved; "
                        ".gz/.bz2/.xz/.zst are decompressed on the fly. Without --input: the "
                        "default pydoc corpus")
    p.add_argument("--glob", default="*.txt",
                   help="file name pattern inside --input folders (default: %(default)s)")
    p.add_argument("--json-key", default="text",
                   help="the text's field in JSON lines, or its column in parquet and arrow "
                        "(default: %(default)s)")
    p.add_argument("--tokenizer", choices=["gpt2", "bpe", "char", "byte"],
                   help="gpt2 = tiktoken r50k_base (default); bpe = a byte-level BPE trained on "
                        "the input; char = the characters of the data; byte = 256 bytes + EOT")
    p.add_argument("--vocab-size", type=int, default=16384,
                   help="entries of the BPE trained with --tokenizer bpe: the 256 bytes, the "
                        "merges and <|endoftext|> (default: %(default)s)")
    p.add_argument("--tokenizer-file", metavar="PATH",
                   help="encode with this tokenizer.json (a BPE model with <|endoftext|>: one "
                        "trained here, or an HF tokenizer's)")
    p.add_argument("--vocab-file",
                   help="GPT-2 vocabulary: gpt2-vocab.json (with --merge-file) or a .tiktoken file")
    p.add_argument("--merge-file", help="gpt2-merges.txt, with a gpt2-vocab.json --vocab-file")
    p.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to each document")
    p.add_argument("--format", choices=["nanogpt", "megatron", "llmc"],
                   help="nanogpt: DIR/train.bin, val.bin, meta.json; megatron: "
                        "PREFIX_text_document.bin/.idx/.json; llmc: llm.c's shards "
                        "DIR/NAME_val_000000.bin, NAME_train_000001.bin, ... "
                        "(default: megatron with --output-prefix or --dataset-impl, else nanogpt)")
    p.add_argument("--output-dir",
                   help=f"output folder (nanogpt, llmc; default corpus: {DEFAULT_CORPUS_DIR})")
    p.add_argument("--output-prefix", help="output path prefix (--format megatron)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="tokens of each llm.c shard (default: %(default)s, as llm.c's)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of documents for val.bin (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1337,
                   help="seed of the train/val document split (default: %(default)s)")
    p.add_argument("--token-dtype", choices=["auto", "uint16", "uint32", "int32"],
                   default="auto",
                   help="token id type on disk; auto = uint16 when the vocabulary fits "
                        "(default: %(default)s; the other scripts' --dtype is the compute "
                        "precision)")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes (default: %(default)s)")
    p.add_argument("--chunk-mb", type=float, default=4.0,
                   help="input MB per unit of work (default: %(default)s)")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="invalid UTF-8: stop (strict) or use U+FFFD (replace) "
                        "(default: %(default)s)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) invalid JSON lines, or rows without text, instead of "
                        "stopping")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--install-gpt2-vocab", action="store_true",
                   help=f"download GPT-2's vocabulary (from the {WHISPER_SDIST} sdist "
                        f"on PyPI) into tiktoken's cache")
    megatron = p.add_argument_group("Megatron-LM's names",
                                    "its preprocess_data.py command runs as written")
    megatron.add_argument("--json-keys", dest="json_key", default=argparse.SUPPRESS,
                          help="= --json-key")
    megatron.add_argument("--vocab", dest="vocab_file", default=argparse.SUPPRESS,
                          help="= --vocab-file")
    megatron.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer"],
                          help="= --tokenizer gpt2")
    megatron.add_argument("--dataset-impl", choices=["mmap"],
                          help="= --format megatron (its mmap .bin/.idx)")
    return p.parse_args(argv)


# the flags of tokenizing an input (the default corpus is always prepared the same way)
INPUT_ONLY = ("tokenizer_file", "tokenizer_type", "vocab_file", "merge_file", "glob", "json_key",
              "vocab_size", "append_eod", "output_prefix", "shard_tokens", "val_fraction", "seed",
              "token_dtype", "workers", "chunk_mb", "errors", "skip_bad_lines")


def check_args(args: argparse.Namespace) -> None:
    megatron_flags = args.dataset_impl or args.output_prefix
    if args.format in ("nanogpt", "llmc") and args.dataset_impl:
        raise CLIError(f"--dataset-impl mmap writes Megatron's format; it cannot be combined with "
                       f"--format {args.format}")
    args.format = args.format or ("megatron" if megatron_flags else "nanogpt")
    for flag, kind in (("--tokenizer-type", "gpt2"), ("--tokenizer-file", "bpe")):
        given = getattr(args, flag[2:].replace("-", "_"))
        if given and args.tokenizer not in (None, kind):
            raise CLIError(f"{flag} {given} is a {kind} tokenizer; it cannot be combined with "
                           f"--tokenizer {args.tokenizer}")
        if given:
            args.tokenizer = kind
    if not args.input:
        defaults = vars(parse_args([]))
        needs_input = [f"--{name.replace('_', '-')}" for name in INPUT_ONLY
                       if getattr(args, name) != defaults[name]]
        needs_input += ["--tokenizer"] * (args.tokenizer not in (None, "char"))
        needs_input += ["--format"] * (args.format != "nanogpt")
        if needs_input:
            raise CLIError(f"{needs_input[0]} needs --input (without --input, tokenizer.py "
                           "prepares the default char corpus, as it always is)")
        return
    args.tokenizer = args.tokenizer or "gpt2"
    if args.format in ("nanogpt", "llmc") and not args.output_dir:
        raise CLIError(f"--output-dir is required with --input (--format {args.format})")
    if args.format == "megatron" and not args.output_prefix:
        raise CLIError("--output-prefix is required with --format megatron")
    if args.format == "llmc" and args.append_eod:
        raise CLIError("--format llmc starts every document with the end-of-text token, as llm.c's "
                       "shards do; drop --append-eod")
    if (args.vocab_file or args.merge_file) and args.tokenizer != "gpt2":
        raise CLIError("--vocab-file/--merge-file only apply to --tokenizer gpt2")
    if args.merge_file and not args.vocab_file:
        raise CLIError("--merge-file needs --vocab-file (gpt2-vocab.json)")
    if args.vocab_file and args.vocab_file.endswith(".json") and not args.merge_file:
        raise CLIError("a .json --vocab-file needs --merge-file (gpt2-merges.txt)")
    if not 0 < args.val_fraction < 1:
        raise CLIError(f"--val-fraction must be between 0 and 1 (exclusive), got "
                       f"{args.val_fraction}")
    if args.workers < 1 or not 0 < args.chunk_mb <= 1024:
        raise CLIError(f"--workers must be >= 1 and --chunk-mb between 0 and 1024, got "
                       f"{args.workers} and {args.chunk_mb}")
    if args.shard_tokens < 1:
        raise CLIError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
    defaults = vars(parse_args([]))  # a flag that does nothing here is refused, not ignored
    if args.vocab_size != defaults["vocab_size"] and (args.tokenizer != "bpe" or
                                                      args.tokenizer_file):
        raise CLIError("--vocab-size is the size of the BPE that --tokenizer bpe trains; "
                       f"--tokenizer {args.tokenizer}"
                       f"{' with --tokenizer-file' if args.tokenizer_file else ''} has its own")
    if args.shard_tokens != defaults["shard_tokens"] and args.format != "llmc":
        raise CLIError(f"--shard-tokens sizes llm.c's shards (--format llmc); --format "
                       f"{args.format} writes none")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.install_gpt2_vocab:
        print(f"GPT-2 vocabulary installed: {install_gpt2_vocab()}")
        if not args.input:
            return
    check_args(args)
    prepare(args)


if __name__ == "__main__":
    cli.run(main)
