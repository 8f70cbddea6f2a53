"""Sampling from a GPT on the command line, as test.py and test_ds.py do: the options, prompts,
printing samples as they stream, Megatron-style JSONL files (--genfile), written atomically, and the
chat loop (--chat) of an instruction-tuned model, whose template (toolkit/chat.py) also frames a
--prompt, or of a downloaded HF folder in the chat template it ships.

    add_sampling_arguments(parser); args = parser.parse_args()
    check_sampling_args(args, inputs=[args.ckpt])
    run_sampling(model, tokenizer, args, source="ckpt/ckpt.pt")
"""
import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from typing import IO

import torch
from tqdm import tqdm

from model import ATTN_KERNELS, GPT, check_sampling
from toolkit.chat import (can_chat, chat_prompt, fit_history, is_chat_tokenizer, stop_ids,
                          template_variables)
from toolkit import cli, flags
from toolkit.cli import CLIError
from toolkit.device import (autocast, check_attn_kernel, compile_decoding, generation_linears,
                            resolve_device, resolve_dtype)
from toolkit.textfiles import read_text
from toolkit.files import atomic_open, check_output, refuse_special
from toolkit.quantize import add_quantize_argument, check_quantize, quantize_model
from toolkit.signals import StopRequest
from toolkit.tokenizers import Tokenizer

PROMPT_FILE = "FILE:"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", "--start", default="",
                        help=f"start text, or {PROMPT_FILE}path to read it from a file (--start: "
                             "nanoGPT's sample.py name; default: unconditional, starting from the "
                             "end-of-text token)")
    parser.add_argument("--num-samples", type=int, default=3, help="samples to draw (default: 3)")
    parser.add_argument("--max-new-tokens", type=int, default=500,
                        help="tokens to generate per sample (default: 500)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=200,
                        help="sample from the k likeliest tokens (default: 200)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus sampling threshold, e.g. 0.9")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="samples generated together in each process, when not streaming "
                             "(default: 1)")
    parser.add_argument("--seed", type=int, default=1337, help="seed of the draws (default: 1337)")
    parser.add_argument("--device", default="auto",
                        help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="autocast dtype; auto = bfloat16 where the hardware computes it "
                             "natively, else float32 (default: auto)")
    parser.add_argument("--attn-kernel", default="auto", choices=ATTN_KERNELS,
                        help="attention implementation")
    add_quantize_argument(parser)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the one-token decoding step: some 5 s of compiling "
                             "first (30 s on a machine's first run), then faster decoding of "
                             "one sequence (docs/performance.md)")
    parser.add_argument("--genfile",
                        help="write samples as JSONL lines {text, length, finished} (Megatron)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --genfile or export")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="print tokens as they come (default: when stdout is a terminal)")
    parser.add_argument("--interactive", action="store_true",
                        help="read prompts from stdin in a loop")
    parser.add_argument("--chat", action="store_true",
                        help="talk to an instruction-tuned model turn by turn (finetune.py --task "
                             "sft's, or an HF folder in the chat template it ships)")
    parser.add_argument("--system",
                        help="with an instruction-tuned model: the system turn that opens the talk")
    parser.add_argument("--chat-template-kwargs", metavar="JSON",
                        help="further variables for an HF folder's own chat template, as "
                             "llama-server takes them: '{\"enable_thinking\": false}' answers at "
                             "once with Qwen3")
    megatron = parser.add_argument_group("Megatron-LM's names",
                                         "its spellings of the options above")
    megatron.add_argument("--out-seq-length", dest="max_new_tokens", type=int,
                          default=argparse.SUPPRESS, help="= --max-new-tokens")
    megatron.add_argument("--micro-batch-size", dest="batch_size", type=int,
                          default=argparse.SUPPRESS, help="= --batch-size")


def prompt_ids(text: str, tok: Tokenizer) -> list[int]:
    """The prompt's ids after the tokenizer's BOS if it has one (Llama 3's); unconditional
    generation starts from the BOS, else the end-of-text token (GPT-2's convention), else a newline,
    else token 0."""
    ids = tok.with_bos(tok.encode(text) if text else [])
    if ids:
        return ids
    if tok.eot_id is not None:
        return [tok.eot_id]
    try:
        return tok.encode("\n") or [0]
    except ValueError:  # a char vocabulary without a newline: token 0, as documented
        return [0]


class Sampler:
    """Draws samples from one model with fixed settings; streams, batches and records them."""

    def __init__(self, model: GPT, tok: Tokenizer, args: argparse.Namespace, genfile: IO | None):
        self.model, self.tok, self.args, self.genfile = model, tok, args, genfile
        self.device = resolve_device(args.device)
        self.model.to(self.device).eval()
        dtype = resolve_dtype(args.dtype, self.device)
        check_attn_kernel(model, self.device, dtype)
        self.ctx = autocast(self.device, dtype)
        self.stream = sys.stdout.isatty() if args.stream is None else args.stream
        # instruction-tuned here: a --prompt is the user's turn
        self.template = is_chat_tokenizer(tok)
        self.variables = template_variables(args.chat_template_kwargs)
        # samples printed whole (not streamed) show the tokens so far, their rate and the time left
        # on stderr, terminal or not, from the first tokens on: a request of a billion tokens is
        # seen to be one
        total = args.num_samples * args.max_new_tokens
        terminal = sys.stderr.isatty()  # (in a log: every 5 s, from cli.PROGRESS_DELAY on)
        self.progress = tqdm(total=total, unit="tok", desc="sampling", disable=self.stream,
                             dynamic_ncols=True, mininterval=0.5 if terminal else 5.0,
                             delay=0 if terminal else cli.PROGRESS_DELAY)
        self.stops = stop_ids(tok)  # (a downloaded chat model may list several, as Qwen3's does)

    def generation_kwargs(self, max_new_tokens: int | None = None) -> dict:
        a = self.args
        return dict(max_new_tokens=max_new_tokens or a.max_new_tokens, temperature=a.temperature,
                    top_k=a.top_k, top_p=a.top_p, eos_token=self.stops or None)

    def prompt(self, text: str) -> tuple[list[int], str]:
        """The tokens of a prompt, and the text printed before a sample: an instruction-tuned model
        answers text as the user's turn (after the --system turn), and only its answer is printed.
        """
        if self.template and text:
            history = [{"role": "system", "content": self.args.system}] if self.args.system else []
            return chat_prompt(history + [{"role": "user", "content": text}], self.tok,
                               self.variables), ""
        return prompt_ids(text, self.tok), text

    def sample(self, text: str) -> None:
        """num_samples completions of text, printed (streamed or whole), written to the genfile."""
        ids, shown = self.prompt(text)
        done = 0
        # a signal sets a flag that steps() checks: the KeyboardInterrupt Python's own handler
        # raises is lost when it lands in a finalizer
        with StopRequest() as self.stop:
            while done < self.args.num_samples:
                n = 1 if self.stream else min(self.args.batch_size, self.args.num_samples - done)
                idx = torch.tensor([ids] * n, dtype=torch.long, device=self.device)
                with torch.no_grad(), self.ctx:
                    new = [self.stream_one(idx, shown)] if self.stream else self.batch(idx, shown)
                for tokens in new:
                    # an instruction-tuned model's answer alone, as printed
                    self.record(shown, tokens)
                done += n
                if self.stream:
                    print("-" * 40, flush=True)

    def steps(self, idx: torch.Tensor, max_new_tokens: int | None = None) -> Iterator[torch.Tensor]:
        """The model's new tokens, one step at a time, until Ctrl-C (SIGINT or SIGTERM, self.stop's
        flag) raises KeyboardInterrupt before the next."""
        for step in self.model.generate_stream(idx, **self.generation_kwargs(max_new_tokens)):
            if self.stop.requested:
                raise KeyboardInterrupt
            yield step

    def stream_one(self, idx: torch.Tensor, text: str,
                   max_new_tokens: int | None = None) -> list[int]:
        """Typewriter output: print each piece of text as soon as it decodes to whole characters."""
        tokens, printed = [], ""
        print(text, end="", flush=True)
        for step in self.steps(idx, max_new_tokens):
            tokens.append(step[0].item())
            if tokens[-1] in self.stops:
                break
            decoded = self.tok.decode(tokens)  # whole characters: one cut waits for its next token
            print(decoded[len(printed):], end="", flush=True)
            printed = decoded
        print(self.tok.decode(self.strip_eot(tokens)[0])[len(printed):], flush=True)
        return tokens

    def batch(self, idx: torch.Tensor, text: str) -> list[list[int]]:
        steps, generated = [], 0
        running = torch.ones(len(idx), dtype=torch.bool, device=idx.device)
        stops = torch.tensor(self.stops, dtype=torch.long, device=idx.device)
        for step in self.steps(idx):
            steps.append(step)
            made = int(running.sum())  # the tokens of samples not yet ended
            self.progress.update(made)
            generated += made
            running &= ~torch.isin(step, stops)
        # what ended samples did not generate leaves the total: the time left is then the longest
        # the rest can take, and the rate counts generated tokens only
        self.progress.total -= self.args.max_new_tokens * len(idx) - generated
        out = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(len(idx))]
        for tokens in out:
            print(text + self.tok.decode(self.strip_eot(tokens)[0]) + "\n" + "-" * 40, flush=True)
        return out

    def strip_eot(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Tokens up to the first end-of-text (or a reply's end), and whether there was one."""
        end = next((i for i, token in enumerate(tokens) if token in self.stops), None)
        return (tokens, False) if end is None else (tokens[:end], True)

    def reply(self, history: list[dict]) -> str:
        """The model's next turn after the history, streamed as it comes; generation stops at the
        turn's end, at --max-new-tokens, or where the context is full."""
        ids = chat_prompt(history, self.tok, self.variables)[-(self.model.config.block_size - 1):]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        room = self.model.config.block_size - len(ids)
        with torch.no_grad(), self.ctx, StopRequest() as self.stop:
            tokens = self.stream_one(idx, "", min(self.args.max_new_tokens, room))
        return self.tok.decode(self.strip_eot(tokens)[0])

    def record(self, prompt: str, tokens: list[int]) -> None:
        if self.genfile:
            body, finished = self.strip_eot(tokens)
            line = {"text": prompt + self.tok.decode(body), "length": len(body),
                    "finished": finished}
            self.genfile.write(json.dumps(line, ensure_ascii=False) + "\n")


def check_sampling_args(args: argparse.Namespace, inputs: list[str]) -> None:
    """Every sampling option in range, and a --genfile that replaces neither an input nor, without
    --overwrite, an existing file: checked before anything is loaded or written."""
    for name in ("num_samples", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1")
    seed_ok, wanted = flags.CHECKS["seed"]
    if not seed_ok(args.seed):
        raise CLIError(f"--seed must be {wanted}, got {args.seed}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:  # model.py's words name its arguments; here they are flags
        raise CLIError("--" + str(e).replace("_", "-")) from None
    template_variables(args.chat_template_kwargs)
    check_quantize(args.quantize, resolve_device(args.device))
    if args.chat and (args.prompt or args.genfile):  # (neither would be used)
        raise CLIError("--chat talks turn by turn on stdin; --prompt and --genfile are for "
                       "sampling: drop them")
    if args.interactive and args.prompt:
        raise CLIError("--interactive reads its prompts from stdin: drop --prompt")
    if args.genfile:
        prompt_file = ([args.prompt[len(PROMPT_FILE):]] if args.prompt.startswith(PROMPT_FILE)
                       else [])
        check_output(args.genfile, inputs + prompt_file, "--genfile")
        refuse_special(args.genfile, "--genfile")
        if os.path.exists(args.genfile) and not args.overwrite:
            raise CLIError(f"--genfile {args.genfile} already exists; pass --overwrite to replace "
                           "it")


def run_sampling(model: GPT, tok: Tokenizer, args: argparse.Namespace, source: str) -> None:
    """Sample once from --prompt, over prompts typed on stdin with --interactive, or talk with
    --chat. The genfile appears when sampling ends, or at Ctrl-C with the samples finished by then;
    a failure leaves none."""
    if (args.chat or args.system) and not can_chat(tok):
        raise CLIError(f"{source} was never instruction-tuned, so it has no chat template for "
                       f"{'--chat' if args.chat else '--system'}; continue text with --prompt, or "
                       "instruction-tune it first (finetune.py --task sft)")
    if args.system and not args.chat and not is_chat_tokenizer(tok):
        raise CLIError(f"{source} chats in its own template, which frames --system only in a chat: "
                       "add --chat (a --prompt continues text as it is)")
    if args.chat_template_kwargs and not (args.chat and tok.chat_template):
        raise CLIError("--chat-template-kwargs sets variables of an HF folder's own chat template, "
                       "in a --chat" if tok.chat_template else
                       f"{source} has no chat template of its own that takes variables"
                       " (--chat-template-kwargs)")
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.quantize:
        model = quantize_model(model, args.quantize)
    elif not args.compile:  # (oneDNN's linears are opaque to the compiler)
        model = generation_linears(model, device, dtype)
    if args.compile:
        compile_decoding(model, dtype)
    if args.chat:
        chat(Sampler(model, tok, args, None))
        return
    prompt = None if args.interactive else args.prompt
    if prompt and prompt.startswith(PROMPT_FILE):  # FILE:path: the file's text
        prompt = read_text(prompt[len(PROMPT_FILE):], f"--prompt {PROMPT_FILE}")
    interrupted = False
    with atomic_open(args.genfile) if args.genfile else nullcontext() as genfile:
        sampler = Sampler(model, tok, args, genfile)
        try:
            sample_prompts(sampler, prompt)
        except KeyboardInterrupt:  # Ctrl-C: the genfile keeps the samples finished so far
            interrupted = True
        sampler.progress.close()
    if interrupted:
        if args.genfile:
            print(f"{args.genfile} holds the samples finished before the interrupt",
                  file=sys.stderr)
        raise KeyboardInterrupt


def chat(sampler: Sampler) -> None:
    """A conversation on stdin and stdout: the history, within the block size (the oldest turns
    dropped, said once), is the prompt of each reply. Ctrl-D or Ctrl-C ends it."""
    args, block_size = sampler.args, sampler.model.config.block_size
    history = [{"role": "system", "content": args.system}] if args.system else []
    # the prompt leaves the reply this much
    room = block_size - min(args.max_new_tokens, block_size // 2)
    told = False
    # (fails now, or never)
    chat_prompt(history + [{"role": "user", "content": "?"}], sampler.tok, sampler.variables)
    print("Chat: type a message and press Enter (Ctrl-D or Ctrl-C to leave).", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> ").removesuffix("\r")  # a CRLF line end
            except EOFError:
                break
            if not line.strip():
                continue
            try:
                history, dropped = fit_history(history + [{"role": "user", "content": line}],
                                               sampler.tok, room, sampler.variables)
            except ValueError as e:  # a message the vocabulary cannot spell: said, the chat goes on
                print(f"error: {e}", file=sys.stderr)
                continue
            if dropped and not told:
                print(f"(the oldest turns no longer fit the model's {block_size}-token context and "
                      "are dropped)", file=sys.stderr)
                told = True
            print("model> ", end="", flush=True)
            history.append({"role": "assistant", "content": sampler.reply(history)})
    except KeyboardInterrupt:
        pass
    print(file=sys.stderr)


def sample_prompts(sampler: Sampler, prompt: str | None) -> None:
    if prompt is not None:
        sampler.sample(prompt)
        return
    print("Type a prompt and press Enter (empty line or Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            line = input("> ").removesuffix("\r")
        except EOFError:
            break
        if not line.strip():
            break
        try:
            sampler.prompt(line)
        except ValueError as e:  # a prompt the vocabulary cannot spell: said, the session goes on
            print(f"error: {e}", file=sys.stderr)
            continue
        sampler.sample(line)
