"""Instruction tuning's objective (finetune.py --task sft): the LM loss on the assistant turns of
conversations, laid out by toolkit/chat.py's template and loss mask, one global batch split over the
processes; evaluated by the same loss on held-out conversations after each epoch. A file's
conversations are encoded as they are read and kept as flat token arrays (PackedConversations): the
data takes the memory of its tokens, not of Python objects."""
from array import array

import numpy as np
import torch

from model import GPT
from toolkit import distributed, lora
from toolkit.chat import Conversation, encode_conversation, messages_of, pad_conversations, \
    trained_tokens
from toolkit.checkpoint import run_state
from toolkit.cli import CLIError
from toolkit.batches import epoch_batches, held_out, rank_share, step_batches
from toolkit.records import json_lines
from toolkit.device import autocast, full_logits_fit
from toolkit.config import RunConfig
from toolkit.tokenizers import Tokenizer
from toolkit.training import Engine, Objective


class ChatObjective(Objective):
    """What the loop learns in instruction tuning: the LM loss on the assistant turns' tokens alone
    (toolkit/chat.py's mask), averaged over all of a global batch's learnt tokens; evaluated by the
    same loss on the held-out conversations. cfg: finetune.py's options (FinetuneConfig)."""

    def __init__(self, cfg: RunConfig, model: GPT, facts: dict, train_set: "ConversationSet",
                 val_set: "ConversationSet", device: torch.device, dtype: torch.dtype):
        self.cfg, self.model, self.facts, self.device, self.dtype = cfg, model, facts, device, dtype
        self.train_set, self.val_set = train_set, val_set
        self.global_batch = cfg.batch_size * cfg.grad_accum
        self.steps_per_epoch = len(epoch_batches(len(train_set), self.global_batch, cfg.grad_accum,
                                                 cfg.seed, 0))
        self.adapters = None  # LoRA's settings when the body trains adapters (finetuning.setup)

    def micro_batches(self, step: int) -> list[tuple[list[Conversation], float]]:
        """This rank's micro-batches, each weighted by its share of the step's learnt tokens."""
        batch, mine = step_batches(step, len(self.train_set), self.cfg, self.steps_per_epoch)
        total = trained_tokens([self.train_set[i] for i in batch])
        batches = [[self.train_set[i] for i in rows] for rows in mine]
        return [(batch, trained_tokens(batch) / total) for batch in batches]

    def loss(self, model: torch.nn.Module, conversations: list[Conversation]) -> torch.Tensor:
        idx, targets = pad_conversations(conversations, self.device)
        chunked = not full_logits_fit(self.device, idx.numel(), self.model.config.vocab_size)
        return model(idx, targets, chunked_loss=chunked)[1]

    def throughput(self) -> tuple[int, str, None]:
        return self.global_batch, "conversations", None

    @torch.no_grad()
    def evaluate(self, engine: Engine) -> dict[str, float]:
        """The mean loss per learnt token of the val conversations, each rank scoring its share."""
        was_training = self.model.training
        self.model.eval()
        mine = rank_share(len(self.val_set))
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # summed loss, tokens
        for start in range(0, len(mine), self.cfg.batch_size):
            batch = [self.val_set[i] for i in mine[start : start + self.cfg.batch_size]]
            with autocast(self.device, self.dtype):
                total[0] += self.loss(self.model, batch).double() * trained_tokens(batch)
            total[1] += trained_tokens(batch)
        if distributed.world_size() > 1:
            torch.distributed.all_reduce(total)
        self.model.train(was_training)
        return {"val_loss": round((total[0] / total[1]).item(), 4)}

    def checkpoint_state(self, best: dict | None) -> dict:
        task = {"task": "sft", "metrics": best, "init_from": self.cfg.init_from}
        return {**run_state(self.model, self.cfg, self.facts),
                **lora.checkpoint_entries(self.adapters, self.model), "finetune": task}

    def describe_data(self) -> str:
        return (f"{len(self.train_set)} train, {len(self.val_set)} val conversations, loss on "
                f"{trained_tokens(self.train_set):,} assistant tokens")


class PackedConversations:
    """A file's training sequences back to back: their tokens (int32) and whether each is learnt,
    where each sequence starts, whether it was cut, and the record (JSON line or array item) it
    came from; select() gives the sequences of some records as a list-like of Conversations."""

    def __init__(self):
        self.tokens, self.learnt = array("i"), bytearray()
        self.starts, self.cut, self.record = array("q", [0]), bytearray(), array("i")
        self.kept = bytearray()  # whether a sequence keeps a learnt token after its first
        self.records = 0

    def add(self, sequences: list[Conversation]) -> None:
        """The sequences of the next record."""
        for c in sequences:
            self.tokens.extend(c.ids)
            self.learnt.extend(c.trained)
            self.starts.append(len(self.tokens))
            self.cut.append(c.cut)
            self.kept.append(any(c.trained[1:]))  # (the first token is no target)
            self.record.append(self.records)
        self.records += 1

    def select(self, records: np.ndarray) -> tuple["ConversationSet", int, int]:
        """The sequences of the records chosen (a mask over them) that keep an assistant token
        after the cut, the number of those that do not, and the number of kept ones cut."""
        kept = np.frombuffer(self.kept, np.bool_)
        chosen = records[np.frombuffer(self.record, np.int32)]
        rows = np.flatnonzero(chosen & kept)
        cut = int(np.frombuffer(self.cut, np.bool_)[rows].sum())
        return ConversationSet(self, rows), int((chosen & ~kept).sum()), cut


class ConversationSet:
    """Some of a PackedConversations' sequences, each read as a Conversation of array views."""

    def __init__(self, packed: PackedConversations, rows: np.ndarray):
        self.tokens = np.frombuffer(packed.tokens, np.int32)
        self.learnt = np.frombuffer(packed.learnt, np.bool_)
        self.starts, self.rows = np.frombuffer(packed.starts, np.int64), rows
        self.cut = np.frombuffer(packed.cut, np.bool_)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Conversation:
        row = self.rows[i]
        start, end = self.starts[row], self.starts[row + 1]
        return Conversation(self.tokens[start:end], self.learnt[start:end], bool(self.cut[row]))


def read_packed(path: str, tokenizer: Tokenizer, block_size: int) -> PackedConversations:
    """The conversations of a file (toolkit/chat.py's schemas), each encoded as soon as it is read;
    a problem names the file and the line."""
    packed = PackedConversations()
    for number, record in json_lines(path):
        try:
            packed.add(encode_conversation(messages_of(record), tokenizer, block_size))
        except (ValueError, CLIError) as e:  # (a template's own error is a CLIError)
            raise CLIError(f"{path} line {number}: {e}") from None
    if not packed.records:
        raise CLIError(f"{path} has no conversations")
    return packed


def chat_objective(cfg: RunConfig, body: GPT, facts: dict, tokenizer: Tokenizer,
                   device: torch.device, dtype: torch.dtype) -> ChatObjective:
    """Instruction tuning on cfg.train, evaluated on cfg.val (or a share held out of cfg.train):
    their conversations encoded and cut to the body's block size (toolkit/chat.py's rule)."""
    block_size = body.config.block_size
    train = read_packed(cfg.train, tokenizer, block_size)
    if cfg.val:
        val = read_packed(cfg.val, tokenizer, block_size)
        chosen = [(cfg.train, train, np.ones(train.records, bool)),
                  (cfg.val, val, np.ones(val.records, bool))]
    else:
        is_val = held_out(cfg, train.records)
        chosen = [(cfg.train, train, ~is_val), (cfg.train, train, is_val)]
    sets = []
    for path, packed, records in chosen:
        kept, left_out, cut = packed.select(records)
        if (cut or left_out) and distributed.rank() == 0:  # (Qwen3's template gives one per answer)
            print(f"{path}: {cut} of {len(kept) + left_out} conversations cut at the block size of "
                  f"{block_size} tokens (their later tokens dropped), {left_out} left out (no "
                  f"assistant token within it)")
        if not len(kept):
            raise CLIError(f"{path}: no conversation has an assistant token within the block size "
                           f"of {block_size}; use shorter conversations or a model with a longer "
                           f"block")
        sets.append(kept)
    return ChatObjective(cfg, body, facts, *sets, device, dtype)
