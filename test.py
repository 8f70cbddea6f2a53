"""Sample text from a trained GPT.

Reads a checkpoint of train.py or train_ddp.py (default ckpt/ckpt.pt; the tokenizer is stored in it)
or an HF GPT-2 directory. Prints samples as they are generated, writes Megatron-style JSONL with
--genfile, or chats with --interactive. test_ds.py reuses this for DeepSpeed checkpoints.
"""
import argparse
import json
import os
import sys

import torch

import cli
from checkpoint import load_model
from device import autocast, resolve_device, resolve_dtype
from files import check_output
from model import ATTN_KERNELS, GPT, check_sampling
from tokenizer import Tokenizer, load_tokenizer


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default="", help="start text, or FILE:path to read it from a file "
                        "(default: unconditional, starting from the end-of-text token)")
    parser.add_argument("--num-samples", type=int, default=3, help="samples to draw (default: 3)")
    parser.add_argument("--max-new-tokens", "--out-seq-length", dest="max_new_tokens", type=int, default=500,
                        help="tokens to generate per sample (default: 500)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=200, help="sample from the k likeliest tokens (default: 200)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold, e.g. 0.9")
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="samples generated together when not streaming (default: 1)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--attn-kernel", default="auto", choices=ATTN_KERNELS, help="attention implementation")
    parser.add_argument("--genfile", help="write samples as JSONL lines {text, length, finished} (Megatron)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --genfile")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="print tokens as they come (default: when stdout is a terminal)")
    parser.add_argument("--interactive", action="store_true", help="read prompts from stdin in a loop")


def read_prompt(prompt: str) -> str:
    if prompt.startswith("FILE:"):
        with open(prompt[len("FILE:"):], encoding="utf-8") as f:
            return f.read()
    return prompt


def prompt_ids(text: str, tok: Tokenizer) -> list[int]:
    """Unconditional generation starts from the end-of-text token (GPT-2's convention), or a newline."""
    if text:
        ids = tok.encode(text)
        if ids:
            return ids
    if tok.eot_id is not None:
        return [tok.eot_id]
    return tok.encode("\n") or [0]


class Sampler:
    """Draws samples from one model with fixed settings; streams, batches and records them."""

    def __init__(self, model: GPT, tok: Tokenizer, args: argparse.Namespace):
        self.model, self.tok, self.args = model, tok, args
        self.device = resolve_device(args.device)
        self.model.to(self.device).eval()
        self.ctx = autocast(self.device, resolve_dtype(args.dtype, self.device))
        self.stream = sys.stdout.isatty() if args.stream is None else args.stream
        self.genfile = open(args.genfile, "w", encoding="utf-8") if args.genfile else None

    def generation_kwargs(self) -> dict:
        a = self.args
        return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                    eos_token=self.tok.eot_id)

    def sample(self, text: str) -> None:
        """num_samples completions of text, printed (streamed or whole) and written to the genfile."""
        ids = prompt_ids(text, self.tok)
        done = 0
        while done < self.args.num_samples:
            n = 1 if self.stream else min(self.args.micro_batch_size, self.args.num_samples - done)
            idx = torch.tensor([ids] * n, dtype=torch.long, device=self.device)
            with torch.no_grad(), self.ctx:
                new = self.stream_one(idx, text) if self.stream else self.batch(idx, text)
            for tokens in new:
                self.record(text, tokens)
            done += n

    def stream_one(self, idx: torch.Tensor, text: str) -> list[list[int]]:
        """Typewriter output: print each piece of text as soon as it decodes to whole characters."""
        tokens, printed = [], ""
        print(text, end="", flush=True)
        for step in self.model.generate_stream(idx, **self.generation_kwargs()):
            token = step[0].item()
            if token == self.tok.eot_id:
                return [self.finish_line(tokens, printed) + [token]]
            tokens.append(token)
            decoded = self.tok.decode(tokens)
            if not decoded.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for the next token
                print(decoded[len(printed):], end="", flush=True)
                printed = decoded
        return [self.finish_line(tokens, printed)]

    def finish_line(self, tokens: list[int], printed: str) -> list[int]:
        print(self.tok.decode(tokens)[len(printed):] + "\n" + "-" * 40, flush=True)
        return tokens

    def batch(self, idx: torch.Tensor, text: str) -> list[list[int]]:
        out = self.model.generate(idx, **self.generation_kwargs())[:, idx.size(1):].tolist()
        for tokens in out:
            print(text + self.tok.decode(self.strip_eot(tokens)[0]) + "\n" + "-" * 40, flush=True)
        return out

    def strip_eot(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Tokens up to the first end-of-text token, and whether there was one."""
        if self.tok.eot_id is not None and self.tok.eot_id in tokens:
            return tokens[: tokens.index(self.tok.eot_id)], True
        return tokens, False

    def record(self, prompt: str, tokens: list[int]) -> None:
        if self.genfile:
            body, finished = self.strip_eot(tokens)
            line = {"text": prompt + self.tok.decode(body), "length": len(body), "finished": finished}
            self.genfile.write(json.dumps(line, ensure_ascii=False) + "\n")
            self.genfile.flush()

    def close(self) -> None:
        if self.genfile:
            self.genfile.close()


def check_sampling_args(args: argparse.Namespace, inputs: list[str]) -> None:
    """Every sampling option in range, and a --genfile that replaces neither an input nor, without --overwrite,
    an existing file: checked before anything is loaded or written."""
    for name in ("num_samples", "max_new_tokens", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise cli.CLIError(f"--{name.replace('_', '-')} must be at least 1")
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.genfile:
        prompt_file = [args.prompt[len("FILE:"):]] if args.prompt.startswith("FILE:") else []
        check_output(args.genfile, inputs + prompt_file, "--genfile")
        if os.path.exists(args.genfile) and not args.overwrite:
            raise cli.CLIError(f"--genfile {args.genfile} already exists; pass --overwrite to replace it")


def run_sampling(model: GPT, tok: Tokenizer, args: argparse.Namespace) -> None:
    """Sample once from --prompt, or in a loop over prompts typed on stdin with --interactive."""
    torch.manual_seed(args.seed)
    sampler = Sampler(model, tok, args)
    try:
        if not args.interactive:
            sampler.sample(read_prompt(args.prompt))
            return
        print("Type a prompt and press Enter (empty line or Ctrl-D to quit).", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            sampler.sample(line)
    finally:
        sampler.close()


def main() -> None:
    parser = cli.argument_parser(__doc__)
    parser.add_argument("--ckpt", default="ckpt/ckpt.pt",
                        help="checkpoint file, or an HF GPT-2 directory / cached name (default: ckpt/ckpt.pt)")
    add_sampling_arguments(parser)
    args = parser.parse_args()
    check_sampling_args(args, [args.ckpt])
    model, facts = load_model(args.ckpt, attn_kernel=args.attn_kernel)
    run_sampling(model, load_tokenizer(facts), args)


if __name__ == "__main__":
    cli.run(main)
