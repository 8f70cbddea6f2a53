"""Text embeddings from a GPT: pooling of its last hidden states, the contrastive loss that tunes it, and exact
top-k search over the vectors. embed.py is the command line around it.

Pooling follows SGPT (Muennighoff 2022, arXiv:2202.08904). In a causal model only the last position has seen
the whole text, so SGPT's position-weighted mean gives position t (1..n) the weight t / sum(1..n): later
positions, which summarise more of the text, count more. "mean" (equal weights) and "last" (the last token's
state) are the usual alternatives. Texts of a batch are right-padded: the model is causal, so real positions
never see the padding, and pooling reads real positions only; a text's vector does not depend on its batch.
"""
import warnings

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from model import GPT
from toolkit.device import autocast

POOLINGS = ("weighted-mean", "mean", "last")
SEARCH_BLOCK_BYTES = 64 * 2**20  # vectors scored per matrix product: bounded memory whatever the index size


def pad(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids right-padded with token 0, and each text's length (B,)."""
    lengths = torch.tensor([len(ids) for ids in token_lists], device=device)
    if int(lengths.min()) < 1:
        raise ValueError("cannot embed an empty text (no tokens)")
    ids = torch.zeros(len(token_lists), int(lengths.max()), dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = torch.tensor(tokens)
    return ids.to(device), lengths


def pooling_weights(lengths: torch.Tensor, T: int, pooling: str) -> torch.Tensor:
    """(B, T) weights over positions, each row summing to 1; padding positions weigh 0."""
    position = torch.arange(1, T + 1, device=lengths.device, dtype=torch.float32).expand(len(lengths), T)
    real = position <= lengths[:, None]
    if pooling == "weighted-mean":
        weights = position * real
    elif pooling == "mean":
        weights = real.float()
    elif pooling == "last":
        weights = (position == lengths[:, None]).float()
    else:
        raise ValueError(f"unknown pooling {pooling!r}; choose from {', '.join(POOLINGS)}")
    return weights / weights.sum(dim=1, keepdim=True)


def embed(model: GPT, token_lists: list[list[int]], pooling: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, n_embd) float32 unit vectors of the texts, differentiable when autograd is on. The model runs under
    autocast in dtype; pooling and normalisation run in float32."""
    device = next(model.parameters()).device
    ids, lengths = pad(token_lists, device)
    with autocast(device, dtype):
        hidden = model.hidden_states(ids).float()
    with torch.autocast(device.type, enabled=False):  # also when the caller runs under autocast
        pooled = torch.einsum("bt,btc->bc", pooling_weights(lengths, ids.size(1), pooling), hidden)
        return F.normalize(pooled, dim=-1)


@torch.no_grad()
def encode(model: GPT, token_lists: list[list[int]], pooling: str, batch_size: int, dtype: torch.dtype = torch.float32,
           desc: str = "encoding") -> np.ndarray:
    """(N, n_embd) float32 unit vectors, in batches of similar lengths (less padding; the order of the result
    is the order of token_lists). The model's training mode is restored."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    vectors = np.empty((len(token_lists), model.config.n_embd), dtype=np.float32)
    try:
        for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch", disable=None, leave=False):
            rows = order[start:start + batch_size]
            vectors[rows] = embed(model, [token_lists[i] for i in rows], pooling, dtype).cpu().numpy()
    finally:
        model.train(was_training)
    return vectors


def info_nce(queries: torch.Tensor, documents: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE with in-batch negatives: documents[i] is the positive of queries[i]; every other document (the
    other queries' positives, and any hard negatives appended after them) is a negative."""
    logits = queries @ documents.T / temperature
    return F.cross_entropy(logits, torch.arange(len(queries), device=queries.device))


def top_k(vectors: np.ndarray, queries: torch.Tensor, k: int, block_rows: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k rows of vectors (N, C) by dot product with each query (Q, C): (scores, rows), each (Q, k),
    best first. The rows are scored a block at a time with a running top-k, so a memory-mapped array is read
    once and never copied whole (default block: SEARCH_BLOCK_BYTES of vectors)."""
    n, dim = vectors.shape
    block_rows = block_rows or max(1, SEARCH_BLOCK_BYTES // (4 * dim))
    best_scores = queries.new_empty(len(queries), 0)
    best_rows = torch.empty(len(queries), 0, dtype=torch.long)
    for start in range(0, n, block_rows):
        # (block @ queries.T) reads the row-major block as it lies, faster than queries @ block.T on CPU
        scores = (as_tensor(vectors[start:start + block_rows]) @ queries.T).T
        rows = torch.arange(start, start + scores.size(1)).expand(len(queries), -1)
        candidates = torch.cat([best_scores, scores], dim=1)
        best_scores, picked = candidates.topk(min(k, candidates.size(1)), dim=1)
        best_rows = torch.cat([best_rows, rows], dim=1).gather(1, picked)
    return best_scores, best_rows


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing the array's memory, also for a read-only memory map (it is only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the array is not writable
        return torch.from_numpy(array)
