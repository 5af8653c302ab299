"""A deterministic synthetic token source keyed by (step, rank) (introduced in notebook 00).

Every step has one global batch, generated from ``(seed, step)`` alone; rank r of N takes rows
``[r*B/N, (r+1)*B/N)``. So a single process (N = 1) and any sharded run see exactly the same
samples per step, and a restarted run that redoes step k sees the same samples again.

The sequences are learnable, so losses fall visibly in a few steps: each row counts through
the vocabulary from a random start with a random stride (token t+1 = token t + stride mod V).
"""

from __future__ import annotations

import torch

from .errors import CourseInputError

STRIDES = (1, 2, 3, 5)


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """All ``batch`` sequences of ``seq + 1`` tokens for one step (notebook 00)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (batch, 1), generator=g)]
    return (start + stride * torch.arange(seq + 1)) % vocab


def batch_for_rank(
    step: int, rank: int, world_size: int, *, batch: int, seq: int, vocab: int, seed: int = 0, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and next-token targets for ``step`` (notebook 00).

    Args:
        step: the optimizer step (0-based).
        rank, world_size: this process's slice of the global batch.
        batch: the global batch size B (sequences per step, summed over ranks); must divide by N.
    """
    if batch % world_size:
        raise CourseInputError(
            f"global batch {batch} does not divide by {world_size} ranks; pick a batch that is a multiple of {world_size}"
        )
    per = batch // world_size
    tokens = global_batch(step, batch, seq, vocab, seed)[rank * per : (rank + 1) * per]
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]
