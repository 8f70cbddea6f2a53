"""Fine-tuning tasks: GPT-1's input layout for each task, the linear head that reads it, the scoring
of examples by it, the validation metrics and the lines --predict writes.

Every example becomes one or more token sequences framed by three special tokens, new rows of the
token embedding (GPT-1, Radford et al. 2018, section 3.3), each after the tokenizer's BOS where it
puts one before every text (Llama 3's):

    classify     start text extract
    entail       start premise delimiter hypothesis extract  and  start hypothesis extract
    similarity   start a delimiter b extract  and  start b delimiter a extract  (final states added)
    choice       start context delimiter answer extract, one per answer  (softmax over the answers)

(entail's head reads the first sequence's state.) A linear head (after dropout) reads the final
hidden state at the extract token, and beside it what the body's own likelihood already says (what
lm-eval scores by, zero-shot), so fine-tuning starts from what the body knows: a choice's score adds
the log-likelihood of its answer; the classes' head also reads the text's mean log-likelihood
(classify) or the pointwise mutual information of the two texts (entail, similarity: how much more
likely the second text is after the first than alone, per token), and the same mean of the states
that predicted the tokens, each weighted by its token's log-likelihood, so that the head can learn
which tokens' likelihood tells the classes apart (a linear head on it is a sum over tokens of
log p(token) times a learnt function of the state before it). A sequence longer than the block size
loses tokens from the left of its context (text, premise, context; for similarity, the longer
text), never from the hypothesis or an answer. Classes are scored by loss, accuracy and (two
classes) F1, a regression by loss and Pearson's and Spearman's correlations. toolkit/finetuning.py
trains and applies the head; docs/finetune.md gives the file schemas.
"""
import json
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

from model import GPT, chunked_cross_entropy
from toolkit import distributed
from toolkit.cli import CLIError
from toolkit.batches import rank_share
from toolkit.device import autocast
from toolkit.records import json_lines
from toolkit.tokenizers import Tokenizer, add_tokens

FIELDS = {"classify": ("text",), "entail": ("premise", "hypothesis"),
          "similarity": ("text_a", "text_b"), "choice": ("context", "choices")}
TASKS = tuple(FIELDS)
SPECIAL_TOKENS = ("start", "delimiter", "extract")
MAX_SCORE = 1e18  # a similarity score whose square float32 holds


@dataclass
class Example:
    sequences: list[list[int]]  # the layout: one per ordering (similarity) or answer (choice)
    label: int | float | None  # class id, answer index or regression target; None when unlabelled
    truncated: bool  # the context was cut to fit the block size


def add_special_tokens(model: GPT, tokenizer: Tokenizer) -> dict[str, int]:
    """Start, delimiter and extract as new rows of the (tied) embedding and ids of the tokenizer."""
    return add_tokens(model, tokenizer, SPECIAL_TOKENS)


# ----- files -----

def read_records(path: str, task: str, labelled: bool) -> list[tuple[int, dict]]:
    """(line number, object) per non-blank JSON line of path, checked against the task's schema.
    For choice, every line must offer as many answers as the first (a batch is one tensor of
    scores)."""
    records = []
    for number, record in json_lines(path):
        problem = schema_problem(task, record, labelled)
        if not problem and task == "choice" and records and \
                len(record["choices"]) != len(records[0][1]["choices"]):
            problem = (f"{len(record['choices'])} choices, but line {records[0][0]} has "
                       f"{len(records[0][1]['choices'])}; every line of a file needs the same "
                       "number")
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
    texts = [name for name in FIELDS[task] if name != "choices"]
    if not all(isinstance(record[name], str) for name in texts):
        return f"{', '.join(texts)} must be strings"
    if task == "choice":
        choices = record["choices"]
        strings = isinstance(choices, list) and all(isinstance(c, str) for c in choices)
        if not (strings and len(choices) >= 2):
            return "'choices' must be a list of at least two strings"
    return None


def label_names(records: list[tuple[int, dict]], path: str) -> list:
    """A training file's classes, sorted (numbers, booleans, then strings) so that ids ignore line
    order."""
    for number, record in records:
        label = record["label"]
        if not isinstance(label, (str, int, float)) or label != label:  # bool is an int; nan
            raise CLIError(f"{path} line {number}: label must be a string, number or boolean, got "
                           f"{label!r}")
    unique = {}  # 1 and 1.0 are one class, named as first written
    for _, record in records:
        unique.setdefault(label_key(record["label"]), record["label"])
    names = sorted(unique.values(), key=lambda v: (isinstance(v, str), isinstance(v, bool), v))
    if len(names) < 2:
        raise CLIError(f"{path} has a single label ({names[0]!r}); a classifier needs at least two")
    return names


def label_key(label) -> tuple:
    """A class's identity: true and false are classes apart from the 1 and 0 Python equals them
    to."""
    return isinstance(label, bool), label


def label_value(record: dict, task: str, names: list | None) -> int | float:
    """A line's target: a class id, an answer index, or a float (names None: regression)."""
    label = record["label"]
    if task == "choice":
        answers = len(record["choices"])
        is_index = type(label) is int and 0 <= label < answers
        if not is_index:
            raise ValueError(f"label must be the index of the right choice (0 to {answers - 1}), "
                             f"got {label!r}")
        return label
    if names is None:
        # its squared error is float32's: 1e39 overflows to inf, 1e308 cannot be held at all
        finite = type(label) in (int, float) and abs(label) <= MAX_SCORE
        if not finite:  # (nan fails the comparison)
            raise ValueError(f"label must be a finite number from -1e18 to 1e18 with --labels "
                             f"float, got {str(label)[:40]}")
        return float(label)
    keys = [label_key(name) for name in names]
    if label_key(label) not in keys:
        raise ValueError(f"label {label!r} never occurs in the training file (its labels: "
                         f"{', '.join(map(repr, names))})")
    return keys.index(label_key(label))


# ----- layout -----

def layout(task: str, texts: list[list[int]], special: dict[str, int], block_size: int,
           bos: int | None = None) -> tuple[list[list[int]], bool]:
    """The task's sequences for its tokenized texts (choice: the context, then each answer), each
    after the tokenizer's BOS where it puts one before every text (Llama 3's), and whether the
    context was cut from the left to fit block_size."""
    start = [special["start"]] if bos is None else [bos, special["start"]]
    delimiter, extract = special["delimiter"], special["extract"]
    frame = len(start) + 1  # the tokens around a text: start (after the BOS) and extract
    if task == "classify":
        (text,) = texts
        kept = keep_last(text, block_size - frame)
        return [[*start, *kept, extract]], len(kept) < len(text)
    if task == "similarity":
        a, b = texts
        room = block_size - frame - 1
        cut = len(a) + len(b) > room
        if cut:  # the longer text gives way first
            short = min(len(a), len(b), room // 2)
            kept_a, kept_b = (short, room - short) if len(a) <= len(b) else (room - short, short)
            a, b = keep_last(a, kept_a), keep_last(b, kept_b)
        return [[*start, *a, delimiter, *b, extract], [*start, *b, delimiter, *a, extract]], cut
    context, answers = texts[0], texts[1:]  # entail: the premise and the hypothesis
    room = block_size - frame - 1 - max(map(len, answers))
    if room < 0:
        what = "the hypothesis" if task == "entail" else "the longest choice"
        raise ValueError(f"{what} alone takes {block_size - room} tokens with the special tokens, "
                         f"more than the block size {block_size}")
    kept = keep_last(context, room)
    sequences = [[*start, *kept, delimiter, *answer, extract] for answer in answers]
    if task == "entail":  # the hypothesis alone: its likelihood without the premise
        sequences.append([*start, *answers[0], extract])
    return sequences, len(kept) < len(context)


def keep_last(tokens: list[int], n: int) -> list[int]:
    return tokens[max(0, len(tokens) - n):]


def encode_records(records: list[tuple[int, dict]], path: str, task: str, tokenizer: Tokenizer,
                   special: dict[str, int], block_size: int, names: list | None,
                   labelled: bool = True) -> list[Example]:
    """Examples of a file's records (read_records'); errors name the file and line."""
    examples = []
    for number, record in records:
        try:
            if task == "choice":
                texts = [record["context"], *record["choices"]]
            else:
                texts = [record[name] for name in FIELDS[task]]
            sequences, truncated = layout(task, [tokenizer.encode(t) for t in texts], special,
                                          block_size, tokenizer.bos_id)
            label = label_value(record, task, names) if labelled else None
        except ValueError as e:
            raise CLIError(f"{path} line {number}: {e}") from None
        examples.append(Example(sequences, label, truncated))
    return examples


def pad_batch(examples: list[Example],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(idx, extract positions, LM targets) of the examples' sequences, right-padded to the longest.
    The model is causal, so padding after a sequence changes none of its states; each row is read at
    its own extract token, and padding is never a target (-1)."""
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
    """The GPT body and a linear head on the final hidden state at the extract token, with the
    body's likelihood beside it: a choice's score adds its answer's log-likelihood, the classes'
    head also reads the likelihood terms and the likelihood-weighted states (module docstring)."""

    def __init__(self, body: GPT, task: str, outputs: int, dropout: float,
                 special: dict[str, int]):
        super().__init__()
        self.body, self.task, self.special = body, task, special
        self.dropout = nn.Dropout(dropout)
        width = body.config.n_embd
        self.head = nn.Linear(width if task == "choice" else 2 * width + 1, outputs)
        nn.init.zeros_(self.head.weight)  # fitted before the first step (TaskObjective.fit_head)
        nn.init.zeros_(self.head.bias)

    def forward(self, idx: torch.Tensor, extract: torch.Tensor, per_example: int,
                lm_targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, outputs), or (B, answers) for choice, of the B examples whose per_example
        sequences each are the rows of idx; with lm_targets, also their mean LM loss."""
        hidden = self.body.hidden_states(idx)
        inputs, offset = self.head_inputs(hidden, idx, extract, per_example)
        logits = self.scores(inputs, offset)
        if lm_targets is None:
            return logits.float(), None
        return logits.float(), chunked_cross_entropy(hidden, self.body.lm_head.weight, lm_targets)

    def scores(self, inputs: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        """The head's logits of its inputs, plus what they add to (a choice's log-likelihoods)."""
        logits = self.head(inputs)
        if self.task == "choice":
            logits = logits.squeeze(-1)  # one score per answer
        return logits if offset is None else logits + offset

    def head_inputs(self, hidden: torch.Tensor, idx: torch.Tensor, extract: torch.Tensor,
                    per_example: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what the head reads: (B, answers, width) for choice, else (B, 2 width + 1); the scores
        it adds to: a choice's summed answer log-likelihoods (B, answers), or None)."""
        final = hidden[torch.arange(idx.size(0), device=idx.device), extract]
        final = final.view(-1, per_example, final.size(-1))
        total, count, weighted = self.text_log_likelihoods(hidden, idx, extract)
        if self.task == "choice":
            return self.dropout(final), total[:, 1].view(-1, per_example)
        # similarity: the states of both orders added
        state = self.dropout(final[:, 0] if self.task == "entail" else final.sum(dim=1))
        per_text = torch.cat([total[..., None], weighted], dim=-1)
        # per token, of each sequence's first and second text: (B, per_example, 2, 1 + width)
        mean = per_text / count[..., None].clamp(min=1)
        mean = mean.view(-1, per_example, 2, per_text.size(-1))
        if self.task == "classify":
            feature = mean[:, 0, 0]
        elif self.task == "entail":  # log p(hypothesis | premise) - log p(hypothesis)
            feature = mean[:, 0, 1] - mean[:, 1, 0]
        else:  # similarity: the same of b after a and of a after b
            feature = mean[:, 0, 1] - mean[:, 1, 0] + mean[:, 1, 1] - mean[:, 0, 0]
        return torch.cat([state, feature.to(state.dtype)], dim=1), None

    def text_log_likelihoods(self, hidden: torch.Tensor, idx: torch.Tensor,
                             extract: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(rows, 2) summed log-probabilities and token counts of each row's first text (after
        start, up to the delimiter or extract) and second text (from the delimiter to extract), each
        token predicted by the state before it, and (rows, 2, width) the sums of those states each
        weighted by its token's log-probability. A choice needs only its answers: only the positions
        needed get logits."""
        position = torch.arange(idx.size(1), device=idx.device)
        start = (idx == self.special["start"]).int().argmax(dim=1)[:, None]  # 1 after a BOS
        is_delimiter = idx == self.special["delimiter"]
        first_delimiter = is_delimiter.int().argmax(dim=1)
        delimiter = torch.where(is_delimiter.any(dim=1), first_delimiter, extract)[:, None]
        wanted = (position < extract[:, None]) & (position != delimiter)
        wanted &= position > (delimiter if self.task == "choice" else start)
        rows, cols = wanted.nonzero(as_tuple=True)
        before = hidden[rows, cols - 1]
        logits = before @ self.body.lm_head.weight.T
        log_p = -F.cross_entropy(logits.float(), idx[rows, cols], reduction="none")
        where = rows * 2 + (cols > delimiter[rows, 0])  # the row's column: 0 first text, 1 second
        size = idx.size(0) * 2
        total = torch.zeros(size, device=idx.device).index_add(0, where, log_p)
        count = torch.zeros(size, device=idx.device).index_add(0, where, torch.ones_like(log_p))
        weighted = torch.zeros(size, before.size(-1), device=idx.device).index_add(
            0, where, log_p[:, None] * before.float())
        return total.view(-1, 2), count.view(-1, 2), weighted.view(-1, 2, before.size(-1))


# ----- scoring, shared over the processes -----

def score(model: TaskModel, examples: list[Example], batch_size: int, device: torch.device,
          dtype: torch.dtype) -> torch.Tensor:
    """The head's logits for every example (N, outputs or answers), in eval mode."""
    columns = len(examples[0].sequences) if model.task == "choice" else model.head.out_features
    logits = lambda idx, extract, per_example: [model(idx, extract, per_example)[0]]
    (scores,) = over_examples(model, examples, batch_size, device, dtype, [(columns,)], logits)
    return scores.cpu()


@torch.no_grad()
def over_examples(model: TaskModel, examples: list[Example], batch_size: int,
                  device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, ...]],
                  compute) -> list[torch.Tensor]:
    """compute(idx, extract, per_example) -> one tensor per shape, (batch, *shape), for every
    example in batches, in eval mode. In a process group each rank computes its share and the
    shares are summed into the whole (a rank's rows are zeros elsewhere)."""
    was_training = model.training
    model.eval()
    outputs = [torch.zeros(len(examples), *shape, device=device) for shape in shapes]
    mine = rank_share(len(examples))
    for start in range(0, len(mine), batch_size):
        rows = mine[start : start + batch_size]
        batch = [examples[i] for i in rows]
        idx, extract, _ = pad_batch(batch, device)
        with autocast(device, dtype):
            results = compute(idx, extract, len(batch[0].sequences))
        for output, result in zip(outputs, results):
            output[torch.from_numpy(rows).to(device)] = result.float()
    if distributed.world_size() > 1:
        for output in outputs:
            torch.distributed.all_reduce(output)
    model.train(was_training)
    return outputs


# ----- metrics and predictions -----

def classification_metrics(logits: torch.Tensor, labels: torch.Tensor,
                           binary: bool) -> dict[str, float]:
    """Validation loss and accuracy; with two classes also the F1 score of class 1 (the second label
    in sorted order: 1, true, "yes" ...)."""
    predicted = logits.argmax(dim=1)
    metrics = {"val_loss": F.cross_entropy(logits, labels).item(),
               "val_accuracy": (predicted == labels).float().mean().item()}
    if binary:
        true_positives = ((predicted == 1) & (labels == 1)).sum().item()
        errors = (predicted != labels).sum().item()  # false positives + false negatives
        f1 = 2 * true_positives / (2 * true_positives + errors) if true_positives else 0.0
        metrics["val_f1"] = f1
    return metrics


def regression_metrics(predicted: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {"val_loss": F.mse_loss(predicted, targets).item(),
            "val_pearson": pearson(predicted, targets),
            "val_spearman": pearson(ranks(predicted), ranks(targets))}


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson's correlation; 0 when either side is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    norm = (x.norm() * y.norm()).item()
    return (x @ y).item() / norm if norm else 0.0


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks of x (0 = smallest), ties sharing their mean rank, for Spearman's correlation."""
    _, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    first = counts.cumsum(0) - counts
    return (first + (counts - 1) / 2)[inverse].double()


def prediction(logits: torch.Tensor, task: dict) -> dict:
    """One line of --predict's output: the predicted label and the probabilities of all (a
    regression: the score alone); task: a fine-tuned checkpoint's `finetune` facts."""
    if task["labels"] == "float":
        return {"label": round(logits.item(), 6)}
    probabilities = [round(p, 6) for p in logits.softmax(dim=0).tolist()]
    best = int(logits.argmax())
    if task["task"] == "choice":
        return {"label": best, "probabilities": probabilities}
    names = task["label_names"]
    keys = [name if isinstance(name, str) else json.dumps(name) for name in names]  # JSON: strings
    return {"label": names[best], "probabilities": dict(zip(keys, probabilities))}
