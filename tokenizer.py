"""
Prepare token data for training: text in, token ids out (nanoGPT train.bin/val.bin or Megatron
.bin/.idx).

    python tokenizer.py                                  # default corpus: Python's pydoc topics, char-level
    python tokenizer.py --install-gpt2-vocab             # once: the GPT-2 vocabulary for offline use
    python tokenizer.py --input docs/ --glob '*.md' --tokenizer gpt2 --append-eod --output-dir data/docs
    python tokenizer.py --input oscar-1GB.jsonl.xz --tokenizer gpt2 --append-eod --workers 4 \\
        --format megatron --output-prefix data/oscar     # -> data/oscar_text_document.bin/.idx/.json

One plain text file is one document, one JSON line is one document. This is the command; the
tokenizers are toolkit/tokenizers.py, the readers toolkit/documents.py, the parallel encoder and the
default corpus toolkit/prepare.py, the on-disk formats toolkit/data.py.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from toolkit import cli, gpt2_vocab
from toolkit.cli import CLIError
from toolkit.data import NANOGPT_FILES, megatron_document_prefix
from toolkit.documents import ReadStats, input_files, read_documents, without_compression
from toolkit.files import refuse_existing, write_error
from toolkit.prepare import (DEFAULT_CORPUS_DIR, chunks_of, describe_default_corpus,
                             encode_in_order, prepare_default_corpus)
from toolkit.tokenizers import Tokenizer
from toolkit.writers import MegatronWriter, NanoGPTWriter, output_dtype


@dataclass
class Summary:
    documents: int
    tokens: int
    seconds: float
    megabytes: float
    bad_lines: int

    def __str__(self) -> str:
        s = max(self.seconds, 1e-9)
        line = (f"{self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s "
                f"({self.megabytes / s:.1f} MB/s, {self.tokens / s:,.0f} tokens/s)")
        return line + (f", {self.bad_lines:,} bad lines skipped" if self.bad_lines else "")


def build_tokenizer(args: argparse.Namespace, files: list[str]) -> Tokenizer:
    if args.tokenizer != "char":
        return Tokenizer(args.tokenizer, vocab_file=args.vocab_file, merge_file=args.merge_file)
    chars = set()  # the char vocabulary is whatever the data holds: one extra pass over the input
    for text, _ in read_documents(files, args.json_key, args.errors, args.skip_bad_lines):
        chars.update(text)
    if not chars:
        raise CLIError(f"no text in the input ({len(files)} file(s)); nothing to tokenize")
    return Tokenizer("char", chars="".join(sorted(chars)), char_eot=args.append_eod)


def prepare(args: argparse.Namespace) -> dict:
    """Tokenize args.input into the chosen format; returns the metadata written."""
    files = input_files(args.input, args.glob)
    tokenizer = build_tokenizer(args, files)
    dtype = output_dtype(tokenizer.vocab_size, args.dtype, args.format)
    if args.format == "nanogpt":
        writer = NanoGPTWriter(args.output_dir, dtype, args.val_fraction, args.seed)
    else:
        writer = MegatronWriter(megatron_document_prefix(args.output_prefix, args.json_key), dtype)
    stats = ReadStats()
    start, documents, tokens, nbytes = time.time(), 0, 0, 0
    try:
        chunks = chunks_of(read_documents(files, args.json_key, args.errors, args.skip_bad_lines, stats),
                           int(args.chunk_mb * 2**20))
        quiet = args.quiet or not sys.stderr.isatty()
        known_size = not any(path != without_compression(path) for path in files)
        total = sum(os.path.getsize(path) for path in files) if known_size else None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=quiet, desc="tokenizing") as bar:
            for chunk_tokens, lengths, size in encode_in_order(chunks, tokenizer, args.append_eod, dtype, args.workers):
                writer.add(chunk_tokens, lengths)
                documents += int((lengths > 0).sum())
                tokens += len(chunk_tokens)
                nbytes += size
                bar.update(size)
                bar.set_postfix_str(f"{documents / max(time.time() - start, 1e-9):,.0f} "
                                    "docs/s", refresh=False)
        if documents == 0:
            raise CLIError(f"no non-empty documents in the input ({len(files)} file(s)); nothing to write")
        meta = writer.finish({**tokenizer.facts(), "append_eod": args.append_eod})
    except OSError as e:  # reading errors are CLIErrors already: this is the output failing
        writer.discard()
        raise write_error(writer.where, e) from None
    except BaseException:
        writer.discard()
        raise
    print(Summary(documents, tokens, time.time() - start, nbytes / 2**20, stats.bad_lines))
    return meta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.argument_parser(__doc__)
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="text files, folders (recursive, see --glob) or JSON-lines files (.jsonl/.json); "
                        ".gz/.bz2/.xz are decompressed on the fly. Without --input: the default pydoc corpus")
    p.add_argument("--glob", default="*.txt", help="file name pattern inside --input folders (default: %(default)s)")
    p.add_argument("--json-key", default="text", help="field holding the text in JSON lines (default: %(default)s)")
    p.add_argument("--tokenizer", choices=["gpt2", "char", "byte"],
                   help="gpt2 = tiktoken r50k_base (default); char = the characters of the data; "
                        "byte = 256 bytes + EOT")
    p.add_argument("--vocab-file", help="GPT-2 vocabulary: gpt2-vocab.json (with --merge-file) or a .tiktoken file")
    p.add_argument("--merge-file", help="gpt2-merges.txt, with a gpt2-vocab.json --vocab-file")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    p.add_argument("--format", choices=["nanogpt", "megatron"],
                   help="nanogpt: DIR/train.bin, val.bin, meta.json; megatron: "
                        "PREFIX_text_document.bin/.idx/.json (default: megatron with "
                        "--output-prefix or --dataset-impl, else nanogpt)")
    p.add_argument("--output-dir", help=f"output folder (--format nanogpt; default corpus: {DEFAULT_CORPUS_DIR})")
    p.add_argument("--output-prefix", help="output path prefix (--format megatron)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of documents for val.bin (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the train/val document split (default: %(default)s)")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32", "int32"], default="auto",
                   help="token id type on disk; auto = uint16 when the vocabulary fits (default: "
                        "%(default)s)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: %(default)s)")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="input MB per unit of work (default: %(default)s)")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="invalid UTF-8: stop (strict) or use U+FFFD (replace) (default: "
                        "%(default)s)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) invalid JSON lines instead of stopping")
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
    if args.format == "nanogpt" and args.dataset_impl:
        raise CLIError("--dataset-impl mmap writes Megatron's format; it cannot be combined with "
                       "--format nanogpt")
    args.format = args.format or ("megatron" if megatron_flags else "nanogpt")
    if args.tokenizer_type:
        if args.tokenizer not in (None, "gpt2"):
            raise CLIError(f"--tokenizer-type {args.tokenizer_type} is GPT-2's BPE; it cannot be "
                           f"combined with --tokenizer {args.tokenizer}")
        args.tokenizer = "gpt2"
    if not args.input:
        needs_input = {"--tokenizer": args.tokenizer not in (None, "char"), "--format": args.format != "nanogpt",
                       "--output-prefix": args.output_prefix, "--vocab-file": args.vocab_file,
                       "--merge-file": args.merge_file, "--append-eod": args.append_eod}
        for flag, given in needs_input.items():
            if given:
                raise CLIError(f"{flag} needs --input (without --input, tokenizer.py prepares the "
                               "default char corpus)")
        return
    args.tokenizer = args.tokenizer or "gpt2"
    if args.format == "nanogpt" and not args.output_dir:
        raise CLIError("--output-dir is required with --input (--format nanogpt)")
    if args.format == "megatron" and not args.output_prefix:
        raise CLIError("--output-prefix is required with --format megatron")
    if (args.vocab_file or args.merge_file) and args.tokenizer != "gpt2":
        raise CLIError("--vocab-file/--merge-file only apply to --tokenizer gpt2")
    if args.merge_file and not args.vocab_file:
        raise CLIError("--merge-file needs --vocab-file (gpt2-vocab.json)")
    if args.vocab_file and args.vocab_file.endswith(".json") and not args.merge_file:
        raise CLIError("a .json --vocab-file needs --merge-file (gpt2-merges.txt)")
    if not 0 < args.val_fraction < 1:
        raise CLIError("--val-fraction must be between 0 and 1 (exclusive), got "
                       f"{args.val_fraction}")
    if args.workers < 1 or not 0 < args.chunk_mb <= 1024:
        raise CLIError("--workers must be >= 1 and --chunk-mb between 0 and 1024, got "
                       f"{args.workers} and {args.chunk_mb}")


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
    if args.format == "nanogpt":
        outputs = [os.path.join(args.output_dir, n) for n in NANOGPT_FILES]
    else:
        prefix = megatron_document_prefix(args.output_prefix, args.json_key)
        outputs = [prefix + ext for ext in (".bin", ".idx", ".json")]
    refuse_existing(outputs, args.overwrite)
    prepare(args)


if __name__ == "__main__":
    cli.run(main)
