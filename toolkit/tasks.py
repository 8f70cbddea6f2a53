"""Fine-tuning tasks: GPT-1's input layout for each task, and the linear head that reads it.

Every example becomes one or more token sequences framed by three special tokens, new rows of the token
embedding (GPT-1, Radford et al. 2018, section 3.3):

    classify     start text extract
    entail       start premise delimiter hypothesis extract  and  start hypothesis extract  (read: the first)
    similarity   start a delimiter b extract  and  start b delimiter a extract   (final states added)
    choice       start context delimiter answer extract, one per answer          (softmax over the answers)

A linear head (after dropout) reads the final hidden state at the extract token, and beside it what the body's own
likelihood already says (what lm-eval scores by, zero-shot), so fine-tuning starts from what the body knows: a
choice's score adds the log-likelihood of its answer; the classes' head also reads the text's mean log-likelihood
(classify) or the pointwise mutual information of the two texts (entail, similarity: how much more likely the second
text is after the first than alone, per token), and the same mean of the states that predicted the tokens, each
weighted by its token's log-likelihood, so that the head can learn which tokens' likelihood tells the classes apart
(a linear head on it is a sum over tokens of log p(token) times a learnt function of the state before it). A
sequence longer than the block size loses
tokens from the left of its context (text, premise, context; for similarity, the longer text), never from the
hypothesis or an answer. toolkit/finetuning.py trains and applies it; docs/finetune.md gives the file schemas.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from model import GPT, chunked_cross_entropy
from toolkit.cli import CLIError
from toolkit.documents import json_lines
from toolkit.tokenizers import Tokenizer, add_tokens

FIELDS = {"classify": ("text",), "entail": ("premise", "hypothesis"), "similarity": ("text_a", "text_b"),
          "choice": ("context", "choices")}
TASKS = tuple(FIELDS)
SPECIAL_TOKENS = ("start", "delimiter", "extract")


@dataclass
class Example:
    sequences: list[list[int]]  # token ids in the task's layout: one per ordering (similarity) or answer (choice)
    label: int | float | None  # class id, answer index or regression target; None when unlabelled
    truncated: bool  # the context was cut to fit the block size


def add_special_tokens(model: GPT, tokenizer: Tokenizer) -> dict[str, int]:
    """Start, delimiter and extract as new rows of the model's (tied) embedding and ids of the tokenizer."""
    return add_tokens(model, tokenizer, SPECIAL_TOKENS)


# ----- files -----

def read_records(path: str, task: str, labelled: bool) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank JSON line of path, checked against the task's schema."""
    records = []
    for number, record in json_lines(path):
        problem = schema_problem(task, record, labelled)
        if problem:
            raise CLIError(f"{path} line {number}: {problem}")
        records.append((number, record))
    if not records:
        raise CLIError(f"{path} has no examples")
    return records


def schema_problem(task: str, record, labelled: bool) -> str | None:
    """What is wrong with one line of a task's file, or None."""
    needed = FIELDS[task] + (("label",) if labelled else ())
    if not isinstance(record, dict):
        return f"not a JSON object with {', '.join(needed)}"
    missing = [name for name in needed if name not in record]
    if missing:
        return f"missing field {missing[0]!r} (a {task} line has {', '.join(needed)})"
    if not all(isinstance(record[name], str) for name in FIELDS[task] if name != "choices"):
        return f"{', '.join(n for n in FIELDS[task] if n != 'choices')} must be strings"
    if task == "choice":
        choices = record["choices"]
        if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) for c in choices)):
            return "'choices' must be a list of at least two strings"
    return None


def label_names(records: list[tuple[int, dict]], path: str) -> list:
    """The classes of a training file, sorted (numbers, then strings), so that ids do not depend on line order."""
    for number, record in records:
        if not isinstance(record["label"], (str, int, float)):  # bool is an int
            raise CLIError(f"{path} line {number}: label must be a string, number or boolean, got {record['label']!r}")
    names = sorted({record["label"] for _, record in records}, key=lambda v: (isinstance(v, str), v))
    if len(names) < 2:
        raise CLIError(f"{path} has a single label ({names[0]!r}); a classifier needs at least two")
    return names


def label_value(record: dict, task: str, names: list | None) -> int | float:
    """A line's label as the head's target: a class id, an answer index, or a float (names None: regression)."""
    label = record["label"]
    if task == "choice":
        if type(label) is not int or not 0 <= label < len(record["choices"]):
            raise ValueError(f"label must be the index of the right choice (0 to {len(record['choices']) - 1}), "
                             f"got {label!r}")
        return label
    if names is None:
        if type(label) not in (int, float):
            raise ValueError(f"label must be a number with --labels float, got {label!r}")
        return float(label)
    if label not in names:
        raise ValueError(f"label {label!r} never occurs in the training file (its labels: "
                         f"{', '.join(map(repr, names))})")
    return names.index(label)


# ----- layout -----

def layout(task: str, texts: list[list[int]], special: dict[str, int], block_size: int) -> tuple[list[list[int]], bool]:
    """The task's sequences for its tokenized texts (choice: the context, then each answer), and whether the
    context was cut from the left to fit block_size."""
    start, delimiter, extract = (special[name] for name in SPECIAL_TOKENS)
    if task == "classify":
        (text,) = texts
        kept = keep_last(text, block_size - 2)
        return [[start, *kept, extract]], len(kept) < len(text)
    if task == "similarity":
        a, b = texts
        cut = len(a) + len(b) > block_size - 3
        kept_a, kept_b = share(len(a), len(b), block_size - 3)
        a, b = keep_last(a, kept_a), keep_last(b, kept_b)
        return [[start, *a, delimiter, *b, extract], [start, *b, delimiter, *a, extract]], cut
    context, answers = texts[0], texts[1:]  # entail: the premise and the hypothesis
    room = block_size - 3 - max(map(len, answers))
    if room < 0:
        what = "the hypothesis" if task == "entail" else "the longest choice"
        raise ValueError(f"{what} alone takes {block_size - room} tokens with the special tokens, more than the "
                         f"block size {block_size}")
    kept = keep_last(context, room)
    sequences = [[start, *kept, delimiter, *answer, extract] for answer in answers]
    if task == "entail":  # the hypothesis alone: its likelihood without the premise
        sequences.append([start, *answers[0], extract])
    return sequences, len(kept) < len(context)


def keep_last(tokens: list[int], n: int) -> list[int]:
    return tokens[max(0, len(tokens) - n):]


def share(a: int, b: int, room: int) -> tuple[int, int]:
    """Lengths to keep of two texts that must fit in room together: the longer one gives way first."""
    if a + b <= room:
        return a, b
    if a <= b:
        kept_a = min(a, room // 2)
        return kept_a, room - kept_a
    kept_b = min(b, room // 2)
    return room - kept_b, kept_b


def encode_records(records: list[tuple[int, dict]], path: str, task: str, tokenizer: Tokenizer,
                   special: dict[str, int], block_size: int, names: list | None,
                   labelled: bool = True) -> list[Example]:
    """Examples of a file's records; a problem is an error naming the file and line. For choice, every line of
    a file must offer the same number of answers (one batch is one tensor of scores)."""
    examples = []
    for number, record in records:
        try:
            if task == "choice" and len(record["choices"]) != len(records[0][1]["choices"]):
                raise ValueError(f"{len(record['choices'])} choices, but line {records[0][0]} has "
                                 f"{len(records[0][1]['choices'])}; every line of a file needs the same number")
            texts = [record["context"], *record["choices"]] if task == "choice" else \
                [record[name] for name in FIELDS[task]]
            sequences, truncated = layout(task, [tokenizer.encode(t) for t in texts], special, block_size)
            label = label_value(record, task, names) if labelled else None
        except ValueError as e:
            raise CLIError(f"{path} line {number}: {e}") from None
        examples.append(Example(sequences, label, truncated))
    return examples


def pad_batch(examples: list[Example], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx, extract positions, LM targets) of the examples' sequences, right-padded to the longest. The model is
    causal, so padding after a sequence changes none of its states; each row is read at its own extract token,
    and padding is never a target (-1)."""
    sequences = [s for example in examples for s in example.sequences]
    idx = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    targets = torch.full_like(idx, -1)
    for row, sequence in enumerate(sequences):
        idx[row, : len(sequence)] = torch.tensor(sequence)
        targets[row, : len(sequence) - 1] = idx[row, 1 : len(sequence)]
    extract = torch.tensor([len(s) - 1 for s in sequences])
    return idx.to(device), extract.to(device), targets.to(device)


# ----- the head -----

class TaskModel(nn.Module):
    """The GPT body and a linear head on the final hidden state at the extract token. With the special token ids,
    the head also has the body's likelihood beside it: a choice's score adds its answer's log-likelihood, the
    classes' head reads the likelihood terms (module docstring: one input, or 1 + width with weighted_states);
    without them (checkpoints written before), the state alone."""

    def __init__(self, body: GPT, task: str, outputs: int, dropout: float, special: dict[str, int] | None = None,
                 weighted_states: bool = True):
        super().__init__()
        self.body, self.task, self.special, self.weighted_states = body, task, special, weighted_states
        self.dropout = nn.Dropout(dropout)
        extra = 0 if special is None or task == "choice" else 1 + body.config.n_embd * weighted_states
        self.head = nn.Linear(body.config.n_embd + extra, outputs)
        nn.init.zeros_(self.head.weight)  # fitted before the first step (finetuning.TaskObjective.fit_head)
        nn.init.zeros_(self.head.bias)

    def forward(self, idx: torch.Tensor, extract: torch.Tensor, per_example: int,
                lm_targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, outputs), or (B, answers) for choice, of the B examples whose per_example sequences each are
        the rows of idx; with lm_targets also the mean LM loss on the same inputs."""
        hidden = self.body.hidden_states(idx)
        inputs, offset = self.head_inputs(hidden, idx, extract, per_example)
        logits = self.scores(inputs, offset)
        lm_loss = None if lm_targets is None else chunked_cross_entropy(hidden, self.body.lm_head.weight, lm_targets)
        return logits.float(), lm_loss

    def scores(self, inputs: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        """The head's logits of its inputs, plus what they add to (a choice's log-likelihoods)."""
        logits = self.head(inputs)
        if self.task == "choice":
            logits = logits.squeeze(-1)  # one score per answer
        return logits if offset is None else logits + offset

    def head_inputs(self, hidden: torch.Tensor, idx: torch.Tensor, extract: torch.Tensor,
                    per_example: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what the head reads: (B, answers, width) for choice, else (B, width [+ 1 [+ width]]); the scores it adds
        to: a choice's summed answer log-likelihoods (B, answers), or None)."""
        final = hidden[torch.arange(idx.size(0), device=idx.device), extract]
        final = final.view(-1, per_example, final.size(-1))
        if self.task == "choice":
            offset = None
            if self.special is not None:
                offset = self.text_log_likelihoods(hidden, idx, extract)[0][:, 1].view(-1, per_example)
            return self.dropout(final), offset
        state = self.dropout(final[:, 0] if self.task == "entail" else final.sum(dim=1))  # similarity: both orders
        if self.special is None:
            return state, None
        total, count, weighted = self.text_log_likelihoods(hidden, idx, extract)
        per_text = torch.cat([total[..., None], weighted], dim=-1) if self.weighted_states else total[..., None]
        # per token, of the first and the second text of each sequence: (B, per_example, 2, 1 [+ width])
        mean = (per_text / count[..., None].clamp(min=1)).view(-1, per_example, 2, per_text.size(-1))
        if self.task == "classify":
            feature = mean[:, 0, 0]
        elif self.task == "entail":  # log p(hypothesis | premise) - log p(hypothesis)
            feature = mean[:, 0, 1] - mean[:, 1, 0]
        else:  # similarity: the same of b after a and of a after b
            feature = mean[:, 0, 1] - mean[:, 1, 0] + mean[:, 1, 1] - mean[:, 0, 0]
        return torch.cat([state, feature.to(state.dtype)], dim=1), None

    def text_log_likelihoods(self, hidden: torch.Tensor, idx: torch.Tensor,
                             extract: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, 2) summed log-probabilities and token counts of each row's first text (after start, up to the
        delimiter or extract) and second text (from the delimiter to extract), each token predicted by the state
        before it, and (rows, 2, width) the sums of those states each weighted by its token's log-probability. A
        choice needs only its answers: only the positions needed get logits."""
        position = torch.arange(idx.size(1), device=idx.device)
        is_delimiter = idx == self.special["delimiter"]
        delimiter = torch.where(is_delimiter.any(dim=1), is_delimiter.int().argmax(dim=1), extract)[:, None]
        wanted = (position < extract[:, None]) & (position != delimiter)
        wanted &= position > (delimiter if self.task == "choice" else 0)
        rows, cols = wanted.nonzero(as_tuple=True)
        before = hidden[rows, cols - 1]
        logits = before @ self.body.lm_head.weight.T
        log_p = -F.cross_entropy(logits.float(), idx[rows, cols], reduction="none")
        where = rows * 2 + (cols > delimiter[rows, 0])  # the row's column: 0 the first text, 1 the second
        total = torch.zeros(idx.size(0) * 2, device=idx.device).index_add(0, where, log_p)
        count = torch.zeros(idx.size(0) * 2, device=idx.device).index_add(0, where, torch.ones_like(log_p))
        weighted = torch.zeros(idx.size(0) * 2, before.size(-1), device=idx.device).index_add(
            0, where, log_p[:, None] * before.float())
        return total.view(-1, 2), count.view(-1, 2), weighted.view(-1, 2, before.size(-1))
