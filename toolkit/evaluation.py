"""Scoring a GPT: the language-model loss of windows of a token corpus, also in bits per byte
(window_losses: the trainers' evaluations, eval.py --data-dir); and multiple-choice tasks:
log-likelihoods of continuations in length-sorted batches, and files in HellaSwag's format scored as
lm-evaluation-harness's `hellaswag` task scores its data (eval.py, and the trainers' --eval-tasks).
The harness itself, for its own tasks, is toolkit/harness.py.

Bits per byte compare models whatever their tokenizers (nanochat reports them): the summed loss of
the tokens in nats, over ln 2, over the UTF-8 bytes those tokens stand for (end-of-text and special
tokens stand for none).

The rules are the harness's (lm_eval/api/model.py, TemplateLM, and its `hf` model), so both give the
same numbers: a context's trailing spaces move to the front of the continuation; context and
continuation are tokenized together and split where the context's own tokens end, after the
tokenizer's BOS if it has one (Llama 3's); an empty context is conditioned on the BOS, else the
end-of-text token; a pair longer than the block size loses tokens from the
left of the context. A choice's query is preprocess(activity_label + ": " + ctx_a + " " +
ctx_b.capitalize()), each ending is preprocess(ending), and the continuation scored is " " + ending;
acc takes the ending of the highest summed log-likelihood, acc_norm the highest log-likelihood per
character of the ending (lm_eval/tasks/hellaswag). Two departures, where the harness's rules give no
meaningful score: text in a script written without spaces (Chinese, Japanese, Thai) is continued
without the space, as lm-eval's zhoblimp sets target_delimiter ""; and a continuation that the
context's last token swallows whole (a BPE trained on unspaced text merges across the join) is
encoded apart, not scored as nothing.
"""
import math
import os
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import yaml
from tqdm import tqdm

from model import GPT
from toolkit import cli, distributed
from toolkit.batches import get_batch
from toolkit.cli import CLIError
from toolkit.device import autocast
from toolkit.records import json_lines
from toolkit.textfiles import read_text
from toolkit.tokenizers import Tokenizer

# logits_at(idx (B, T), rows, cols) -> the (n, V) logits at positions (rows[i], cols[i]) of
# the batch
LogitsAt = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# the Unicode names of scripts written without spaces between words, and of their punctuation
UNSPACED = ("CJK", "IDEOGRAPHIC", "HIRAGANA", "KATAKANA", "FULLWIDTH", "HALFWIDTH KATAKANA", "THAI",
            "LAO", "KHMER", "MYANMAR", "TIBETAN")


@torch.no_grad()
def loss_metrics(loss_sum: float, tokens: int, nbytes: int) -> dict[str, float]:
    """The loss in nats per token, its perplexity, and bits per UTF-8 byte of the text (which
    compares models of different tokenizers: docs/data.md)."""
    loss = loss_sum / tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 50)),
            "bpb": loss_sum / math.log(2) / max(nbytes, 1)}


def window_losses(eval_loss: Callable, tokens: np.ndarray, offsets: np.ndarray, block_size: int,
                  batch_size: int, device: torch.device, token_bytes: torch.Tensor,
                  shard: tuple[int, int] | None = None) -> tuple[float, float, float]:
    """(summed loss in nats, tokens scored, UTF-8 bytes they stand for) of the windows at offsets,
    over all ranks. The batches are shared out over the ranks (shard: this one's index and their
    count; default every process); every rank runs the same number of forwards (one short of batches
    repeats one, uncounted), so an engine whose forward is collective (ZeRO-3) stays in step."""
    rank, world = shard or (distributed.rank(), distributed.world_size())
    batches = math.ceil(len(offsets) / batch_size)
    loss_sum, count, nbytes = 0.0, 0, 0
    for i in range(rank, math.ceil(batches / world) * world, world):
        x, y = get_batch(tokens, offsets[(i if i < batches else 0) * batch_size:][:batch_size],
                         block_size, device)
        loss = eval_loss(x, y)
        if i < batches:
            loss_sum, count = loss_sum + loss.item() * y.numel(), count + y.numel()
            nbytes += int(token_bytes[y].sum())
    return tuple(distributed.all_reduce_sum([loss_sum, count, nbytes], device))


@dataclass
class Choice:
    query: str
    choices: list[str]
    label: int


def preprocess(text: str) -> str:
    """lm-eval's hellaswag preprocessing: brackets are artifacts of HellaSwag's WikiHow part."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def choice_item(record, where: str) -> Choice:
    """One line of a HellaSwag-format file: `ctx` (or HellaSwag's `activity_label`, `ctx_a`,
    `ctx_b`), `endings` and `label` (an index into endings, as an int or a string of one)."""
    if not isinstance(record, dict):
        raise CLIError(f"{where}: not a JSON object with ctx, endings and label")
    endings = record.get("endings")
    good_endings = isinstance(endings, list) and len(endings) >= 2 and \
        all(isinstance(e, str) for e in endings)
    if not good_endings:
        raise CLIError(f"{where}: 'endings' must be a list of at least two strings")
    if isinstance(record.get("ctx_a"), str):
        parts = (record.get("activity_label", ""), record["ctx_a"], record.get("ctx_b", ""))
        if not all(isinstance(p, str) for p in parts):
            raise CLIError(f"{where}: activity_label, ctx_a and ctx_b must be strings")
        query = preprocess(parts[0] + ": " + parts[1] + " " + parts[2].capitalize())
    elif isinstance(record.get("ctx"), str):
        query = preprocess(record["ctx"])
    else:
        raise CLIError(f"{where}: no string 'ctx' (or HellaSwag's 'ctx_a')")
    label = record.get("label")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if type(label) is not int or not 0 <= label < len(endings):
        raise CLIError(f"{where}: label must be the index of the right ending (0 to "
                       f"{len(endings) - 1}), got {record.get('label')!r}")
    endings = [preprocess(e) for e in endings]
    if not all(endings):  # acc_norm divides by an ending's length
        raise CLIError(f"{where}: ending {endings.index('')} is empty (after HellaSwag's "
                       "preprocessing)")
    return Choice(query, endings, label)


def read_choices(path: str, limit: int | None = None, progress: bool = False) -> list[Choice]:
    """The items of a HellaSwag-format JSON-lines file (the first `limit` of them); progress: a bar
    of the lines read, on stderr."""
    items = []
    lines = tqdm(json_lines(path), desc=f"{os.path.basename(path)}: reading", unit="line",
                 delay=cli.PROGRESS_DELAY, disable=not progress)
    for number, record in lines:
        items.append(choice_item(record, f"{path} line {number}"))
        if limit is not None and len(items) == limit:
            break
    if not items:
        raise CLIError(f"{path} has no items")
    return items


def encode_pair(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context, continuation) tokens as the harness makes them (see the module's docstring)."""
    if not context:
        ids = tok.encode(continuation)
        start = tok.bos_id if tok.bos_id is not None else \
            tok.eot_id if tok.eot_id is not None else tok.encode("\n")[0]
        return ([start], ids) if ids[:1] != [start] else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = (tok.with_bos(tok.encode(text)) for text in (context + continuation, context))
    # where the context's last token swallowed all of it, it is encoded apart
    return head, whole[len(head):] or tok.encode(continuation)


def target_delimiter(context: str, ending: str) -> str:
    """What joins a context and an ending: HellaSwag's space, or none where either side is text of
    a script written without spaces (or its full-width punctuation)."""
    return "" if any(unicodedata.name(char, "").startswith(UNSPACED)
                     for char in context[-1:] + ending[:1]) else " "


def gpt_logits_at(model: GPT, device: torch.device, dtype: torch.dtype) -> LogitsAt:
    """LogitsAt of a plain GPT: the LM head on the chosen positions only, not on the whole batch."""
    def logits_at(idx: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        with autocast(device, dtype):
            return model.lm_head(model.hidden_states(idx)[rows, cols]).float()
    return logits_at


@torch.no_grad()
def loglikelihoods(logits_at: LogitsAt, requests: list[tuple[list[int], list[int]]],
                   block_size: int, batch_size: int, device: torch.device,
                   shard: tuple[int, int] | None = None,
                   progress: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(log-likelihood, greedy) of each continuation given its context: the summed log-probabilities
    of its tokens, and whether each was the likeliest. In a process group every data-parallel rank
    (shard: its index and the count; default every process) scores an equal share, so engines whose
    forward is collective stay in step, and the shares are summed into the whole. progress names a
    bar of the requests scored, on stderr (eval.py's)."""
    rank, world = shard or (distributed.rank(), distributed.world_size())
    for _, continuation in requests:
        if len(continuation) > block_size:
            raise CLIError(f"a continuation of {len(continuation)} tokens is longer than the block "
                           f"size {block_size}")
    share = math.ceil(len(requests) / world)
    # the last shares repeat a few
    mine = [i % len(requests) for i in range(rank * share, (rank + 1) * share)]
    counted = set(range(rank * share, min((rank + 1) * share, len(requests))))
    inputs = []
    for i in mine:
        context, continuation = requests[i]
        whole = (context + continuation)[-(block_size + 1):][:-1]  # the last token is only a target
        inputs.append((i, whole, continuation))
    inputs.sort(key=lambda item: -len(item[1]))  # long first: similar lengths share a batch
    scores = torch.zeros(2, len(requests), dtype=torch.float64)
    bar = tqdm(total=len(inputs), desc=progress, unit="req", delay=cli.PROGRESS_DELAY,
               disable=progress is None or rank > 0)
    for start in range(0, len(inputs), batch_size):
        batch = inputs[start:start + batch_size]
        idx = torch.zeros(len(batch), len(batch[0][1]), dtype=torch.long)
        rows, cols, targets = [], [], []
        for row, (_, whole, continuation) in enumerate(batch):
            idx[row, :len(whole)] = torch.tensor(whole)
            n = len(continuation)
            rows += [row] * n
            cols += range(len(whole) - n, len(whole))
            targets += continuation
        rows, cols, targets = (torch.tensor(x, dtype=torch.long, device=device)
                               for x in (rows, cols, targets))  # (long even when empty)
        logits = logits_at(idx.to(device), rows, cols)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token_scores = logprobs.gather(1, targets[:, None])[:, 0].double().cpu()
        token_greedy = (logprobs.argmax(dim=-1) == targets).cpu()
        offset = 0
        for i, _, continuation in batch:
            n = len(continuation)
            if i in counted:
                scores[0, i] = token_scores[offset:offset + n].sum()
                scores[1, i] = float(token_greedy[offset:offset + n].all())
            offset += n
        bar.update(len(batch))
    bar.close()
    # model-parallel ranks of one replica hold the same share: count it once
    if distributed.world_size() > 1:
        replicas = distributed.world_size() // world
        scores = torch.tensor(distributed.all_reduce_sum(scores.flatten().tolist(), device),
                              dtype=torch.float64).view(2, -1) / replicas
    return scores[0].numpy(), scores[1].numpy() > 0.5


def file_task_name(path: str) -> str:
    """A task file's name in the results: hellaswag_zh.jsonl is hellaswag_zh."""
    return os.path.splitext(os.path.basename(path))[0]


def refuse_same_names(specs: list[str], names: list[str], flag: str) -> None:
    """Two tasks (specs) of one name in the results: the second's scores would replace the
    first's."""
    for i, name in enumerate(names):
        if name in names[:i]:
            raise CLIError(f"{flag} {specs[names.index(name)]} and {specs[i]} are both named "
                           f"{name}, and the second's scores would replace the first's; rename "
                           "one")


def is_local_task(spec: str) -> bool:
    """A --tasks entry eval.py scores itself: a file in HellaSwag's format."""
    return spec.endswith((".jsonl", ".json"))


def task_name(spec: str) -> tuple[str, str | None]:
    """(task name, folder to include) of a --tasks entry: a local file (its name), a task YAML (its
    `task:` key), or a harness name."""
    if is_local_task(spec):
        return file_task_name(spec), None
    if spec.endswith(".yml"):  # the harness indexes a folder's *.yaml only
        raise CLIError(f"{spec}: lm-evaluation-harness reads task YAMLs named *.yaml; rename it")
    if not spec.endswith(".yaml"):
        return spec, None
    text = read_text(spec, "task YAML")
    try:  # the harness's own loader would end in a RecursionError on nesting too deep to read
        yaml.compose(text)
    except RecursionError:
        raise CLIError(f"{spec}: invalid YAML (nested too deeply to read)") from None
    except yaml.YAMLError as e:
        raise CLIError(f"{spec}: invalid YAML ({' '.join(str(e).split())})") from None
    for line in text.splitlines():
        if line.startswith("task:"):
            return (line.split(":", 1)[1].strip().strip("'\""),
                    os.path.dirname(os.path.abspath(spec)))
    raise CLIError(f"{spec} has no `task:` line: not an lm-eval task YAML")


class ChoiceTask:
    """A HellaSwag-format file, tokenized once, scored on demand (the trainers' --eval-tasks)."""

    def __init__(self, path: str, tok: Tokenizer, block_size: int, limit: int | None = None,
                 progress: bool = False):
        self.name = file_task_name(path)
        self.items = read_choices(path, limit, progress)
        self.block_size = block_size
        self.progress = self.name if progress else None  # eval.py's bars, on stderr
        try:
            items = tqdm(self.items, desc=f"{self.name}: tokenizing", unit="item",
                         delay=cli.PROGRESS_DELAY, disable=not progress)
            self.requests = [encode_pair(tok, item.query,
                                         target_delimiter(item.query, choice) + choice)
                             for item in items for choice in item.choices]
        except ValueError as e:  # a character outside a char vocabulary
            raise CLIError(f"{path}: {e}") from None
        self.check_lengths(path)

    def check_lengths(self, path: str) -> None:
        """Every ending fits the block (its context is cut from the left to fit), found before a
        trainer's first evaluation, not at it."""
        requests = iter(self.requests)
        for number, item in enumerate(self.items, start=1):
            for ending in range(1, len(item.choices) + 1):
                length = len(next(requests)[1])
                if length > self.block_size:
                    raise CLIError(f"{path} item {number}, ending {ending}: its {length} tokens "
                                   f"are more than the block size {self.block_size}")

    def score(self, logits_at: LogitsAt, batch_size: int, device: torch.device,
              shard: tuple[int, int] | None = None) -> dict:
        """acc and acc_norm: items whose likeliest ending (per character for acc_norm) is right."""
        lls, _ = loglikelihoods(logits_at, self.requests, self.block_size, batch_size, device,
                                shard, self.progress)
        right = right_norm = offset = 0
        for item in self.items:
            scores = lls[offset:offset + len(item.choices)]
            lengths = np.array([len(choice) for choice in item.choices], dtype=np.float64)
            right += int(np.argmax(scores)) == item.label
            right_norm += int(np.argmax(scores / lengths)) == item.label
            offset += len(item.choices)
        return {"acc": right / len(self.items), "acc_norm": right_norm / len(self.items)}
