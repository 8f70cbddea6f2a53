"""Instruction tuning's objective (finetune.py --task sft): the LM loss on the assistant turns of
conversations, laid out by toolkit/chat.py's template and loss mask, one global batch split over the
processes; evaluated by the same loss on held-out conversations after each epoch."""
import torch

from model import GPT
from toolkit import distributed, lora
from toolkit.chat import (Conversation, encode_conversations, pad_conversations, read_conversations,
                          trained_tokens)
from toolkit.checkpoint import run_state
from toolkit.cli import CLIError
from toolkit.batches import epoch_batches, rank_share, step_batches, train_and_val
from toolkit.device import autocast, full_logits_fit
from toolkit.config import RunConfig
from toolkit.tokenizers import Tokenizer
from toolkit.training import Engine, Objective


class ChatObjective(Objective):
    """What the loop learns in instruction tuning: the LM loss on the assistant turns' tokens alone
    (toolkit/chat.py's mask), averaged over all of a global batch's learnt tokens; evaluated by the
    same loss on the held-out conversations. cfg: finetune.py's options (FinetuneConfig)."""

    def __init__(self, cfg: RunConfig, model: GPT, facts: dict, train_set: list[Conversation],
                 val_set: list[Conversation], device: torch.device, dtype: torch.dtype):
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


def chat_objective(cfg: RunConfig, body: GPT, facts: dict, tokenizer: Tokenizer,
                   device: torch.device, dtype: torch.dtype) -> ChatObjective:
    """Instruction tuning on cfg.train, evaluated on cfg.val (or a share held out of cfg.train):
    their conversations encoded and cut to the body's block size (toolkit/chat.py's rule)."""
    block_size = body.config.block_size
    train, val = train_and_val(cfg, read_conversations)
    sets = []
    for path, conversations in ((cfg.train, train), (cfg.val or cfg.train, val)):
        try:
            kept, left_out = encode_conversations(conversations, tokenizer, block_size)
        except ValueError as e:
            raise CLIError(f"{path} {e}") from None
        cut = sum(c.cut for c in kept)
        if (cut or left_out) and distributed.rank() == 0:  # (Qwen3's template gives one per answer)
            print(f"{path}: {cut} of {len(kept) + left_out} conversations cut at the block size of "
                  f"{block_size} tokens (their later tokens dropped), {left_out} left out (no "
                  f"assistant token within it)")
        if not kept:
            raise CLIError(f"{path}: no conversation has an assistant token within the block size "
                           f"of {block_size}; use shorter conversations or a model with a longer "
                           f"block")
        sets.append(kept)
    return ChatObjective(cfg, body, facts, *sets, device, dtype)
