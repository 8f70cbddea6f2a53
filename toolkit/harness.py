"""EleutherAI's lm-evaluation-harness on this toolkit's GPT: an `LM` of its API, and its tasks run
by name or from a task YAML (eval.py). Only imported when a harness task is asked for: `pip install
lm_eval` is optional.

GPTHarness answers the harness's three request kinds with the model's own tokenizer: loglikelihood
(through TemplateLM, so contexts and continuations are split as the harness's `hf` model splits
them, then scored by toolkit/evaluation.py in length-sorted batches), loglikelihood_rolling (the
harness's rolling windows of the block size) and generate_until (greedy or sampled, with the KV
cache, stopping at any `until` string or where a reply ends). With --apply-chat-template, the
harness lays out its prompts in the model's chat template (this toolkit's after instruction tuning,
or a downloaded folder's own), rendered as test.py --chat renders it, and special-token text in them
is that token, as transformers' tokenizers read it.
"""
import functools
import os
import traceback

import jinja2
import torch
from lm_eval import simple_evaluate, utils
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from model import GPT
from toolkit.chat import export_template, render, stop_ids
from toolkit.cli import CLIError, first_line
from toolkit.device import autocast
from toolkit.evaluation import gpt_logits_at, loglikelihoods, task_name
from toolkit.tokenizers import Tokenizer

# marks where the last message of a history stops, to leave it open
OPEN_END = "<|toolkit-open-end|>"
TOOLKIT_DIR = os.path.dirname(os.path.abspath(__file__))


class GPTHarness(TemplateLM):
    def __init__(self, model: GPT, tok: Tokenizer, batch_size: int, device: torch.device,
                 dtype: torch.dtype, chat: bool = False, variables: dict | None = None,
                 think_end: str | int | None = None):
        super().__init__()
        self.model, self.tok, self.batch_size, self.where, self.dtype = \
            model.eval(), tok, batch_size, device, dtype
        self.logits_at = gpt_logits_at(model, device, dtype)
        # (model_scores checked it has one)
        self.template = export_template(tok.facts()) if chat else None
        # the template's further ones (lm-eval's hf model: chat_template_args)
        self.variables = variables
        self.stops = stop_ids(tok)  # (an instruction-tuned model's reply ends at its turn's end)
        self.think_end = think_end  # where a reply's reasoning ends (lm-eval's think_end_token)

    @property
    def device(self) -> torch.device:
        return self.where

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id if self.tok.eot_id is not None else self.tok.encode("\n")[0]

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    # what an empty context is (lm-eval's hf model: BOS, else EOS)
    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        tok = self.tok
        ids = tok.encode_with_special_tokens(string) if self.template else tok.encode(string)
        # a text starts after the BOS (Llama 3's) unless it begins with it or the harness asks for
        # no special tokens (a continuation after an empty context), as the hf model encodes
        return ids if add_special_tokens is False else self.tok.with_bos(ids)

    @property
    def tokenizer_name(self) -> str:
        return f"{self.tok.name}-{self.tok.vocab_size}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template["jinja"] if self.template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The history in the model's template. Without a generation prompt, the last message is
        left open for the continuation, as lm-eval's hf model asks transformers
        (continue_final_message): rendered with a mark after its content, and cut at the mark."""
        if add_generation_prompt:
            return render(self.template, chat_history, variables=self.variables)
        last = {**chat_history[-1], "content": chat_history[-1]["content"] + OPEN_END}
        text = render(self.template, [*chat_history[:-1], last], prompt=False,
                      variables=self.variables)
        if OPEN_END not in text:
            raise CLIError("the model's chat template drops the end of the last message, so it "
                           "cannot be continued (a task's gen_prefix)")
        return text[: text.rindex(OPEN_END)]

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        lls, greedy = loglikelihoods(self.logits_at, [(context, continuation)
                                                      for _, context, continuation in requests],
                                     self.max_length, self.batch_size, self.where)
        return list(zip(lls.tolist(), greedy.tolist()))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for number, (text,) in enumerate(request.args for request in requests):
            for window in utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                          prefix_token=self.prefix_token_id,
                                                          max_seq_len=self.max_length,
                                                          context_len=1):
                windows.append(utils.make_disjoint_window(window))
                owners.append(number)
        lls, _ = loglikelihoods(self.logits_at, windows, self.max_length, self.batch_size,
                                self.where)
        totals = [0.0] * len(requests)
        for owner, ll in zip(owners, lls.tolist()):
            totals[owner] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests of the same options decoded together, --batch-size at a time, the longest
        contexts first (as lm-eval's hf model batches them), each left-padded."""
        jobs = []
        for context, options in (request.args for request in requests):
            until = options.get("until") or []
            until = tuple(stop for stop in ([until] if isinstance(until, str) else until) if stop)
            temperature = options.get("temperature", 0.0) if options.get("do_sample") else 0.0
            ids = (self.tok_encode(context) or [self.eot_token_id])[-(self.max_length - 1):]
            jobs.append((until, options.get("max_gen_toks", 256), temperature, ids))
        out = [""] * len(jobs)
        order = sorted(range(len(jobs)), key=lambda i: (*jobs[i][:3], -len(jobs[i][3])))
        with tqdm(total=len(jobs), desc="generating", disable=disable_tqdm) as progress:
            while order:
                batch = [i for i in order[: self.batch_size] if jobs[i][:3] == jobs[order[0]][:3]]
                order = order[len(batch):]
                replies = self.generate_batch([jobs[i][3] for i in batch], *jobs[batch[0]][:3])
                for i, reply in zip(batch, replies):
                    out[i] = reply
                progress.update(len(batch))
        return out

    @torch.no_grad()
    def generate_batch(self, prompts: list[list[int]], until: tuple[str, ...], new_tokens: int,
                       temperature: float) -> list[str]:
        """The replies to prompts, decoded as one batch: a row leaves at a stop token, and the batch
        ends when every row has met one or an `until` string (as transformers' stopping
        criteria)."""
        width = max(map(len, prompts))
        idx = torch.tensor([[ids[0]] * (width - len(ids)) + ids for ids in prompts],
                           device=self.where)  # (the padding's ids are never attended to)
        pad = torch.tensor([width - len(ids) for ids in prompts], device=self.where)
        pad = pad if pad.any() else None  # (prompts of one length need no mask)
        tokens, done = [[] for _ in prompts], [False] * len(prompts)
        with autocast(self.where, self.dtype):
            for step in self.model.generate_stream(idx, new_tokens, temperature=temperature,
                                                   eos_token=self.stops or None, pad=pad):
                for row, token in enumerate(step.tolist()):
                    if done[row]:
                        continue
                    done[row] = token in self.stops
                    if not done[row]:
                        tokens[row].append(token)
                        done[row] = any(stop in self.tok_decode(tokens[row]) for stop in until)
                if all(done):
                    break
        return [self.reply(row, until) for row in tokens]

    def reply(self, tokens: list[int], until: list[str]) -> str:
        """The text of generated tokens as lm-eval's hf model returns it: from after the last end
        of reasoning (think_end: a token id, or its text) on, cut at the first stop string."""
        think = self.think_end
        if isinstance(think, int) and think in tokens:
            tokens = tokens[len(tokens) - tokens[::-1].index(think):]
        text = self.tok_decode(tokens)
        if think is not None:
            text = text.split(think)[-1].lstrip() if isinstance(think, str) else text.lstrip()
        for stop in until:
            text = text.split(stop)[0]
        return text


@functools.cache
def task_manager(folders: tuple[str, ...], defaults: bool) -> TaskManager:
    """The harness's index of tasks: its own 10,000+ (seconds to build: only when a task is named)
    and the folders of the task YAMLs given."""
    return TaskManager(include_path=list(folders) or None, include_defaults=defaults)


def run(specs: list[str], lm: GPTHarness, limit: int | None,
        system_instruction: str | None = None) -> dict:
    """lm_eval.simple_evaluate on the tasks (in the model's chat template where lm has one, after
    system_instruction's system turn); a name the harness does not know, or data it cannot reach
    (offline), is one line."""
    names, folders = zip(*map(task_name, specs))
    local = tuple(f for f in folders if f)
    manager = task_manager(local, len(local) < len(names))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        close = [t for t in manager.all_tasks if unknown[0].split("_")[0] in t][:5]
        raise CLIError(f"unknown task {unknown[0]!r} for lm-evaluation-harness" +
                       (f"; similar: {', '.join(close)}" if close else "") +
                       "; a local file is a .jsonl (or .json) in HellaSwag's format or a task "
                       ".yaml")
    try:
        return simple_evaluate(model=lm, tasks=list(names), task_manager=manager, limit=limit,
                               log_samples=True, bootstrap_iters=0,
                               apply_chat_template=lm.template is not None,
                               system_instruction=system_instruction)
    except (OSError, ValueError, ImportError, AttributeError, jinja2.TemplateError) as e:
        raise CLIError(harness_failure(e, names)) from None
    except (TypeError, KeyError, IndexError, SyntaxError) as e:
        # a task YAML the harness reads but cannot run (no doc_to_text, an unknown metric, a target
        # outside the choices); raised in this toolkit's code, it is a bug, shown whole
        if os.path.dirname(traceback.extract_tb(e.__traceback__)[-1].filename) == TOOLKIT_DIR:
            raise
        raise CLIError(harness_failure(e, names)) from None


def harness_failure(error: Exception, names: tuple[str, ...]) -> str:
    """What stopped a harness run, in one line: its data out of reach (ConnectionError and
    FileNotFoundError are OSErrors; the data libraries raise ValueErrors too), or a task's YAML
    (a template that names no field, a !function that is not there, an unknown output_type) or an
    item the model cannot take (a character a char vocabulary lacks)."""
    frames = traceback.extract_tb(error.__traceback__)
    loading = isinstance(error, OSError) or any(
        f"{os.sep}{package}{os.sep}" in frame.filename
        for frame in frames for package in ("datasets", "huggingface_hub", "fsspec"))
    if loading:
        return (f"lm-evaluation-harness cannot load the data of {', '.join(names)} "
                f"({first_line(error)[:200]}); without internet, score a local file instead: "
                "--tasks FILE.jsonl (HellaSwag's format) or a task YAML over local data "
                "(docs/eval.md)")
    return (f"lm-evaluation-harness cannot run {', '.join(names)}: {type(error).__name__}: "
            f"{first_line(error)[:300]}")
