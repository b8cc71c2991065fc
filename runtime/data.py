"""Synthetic, deterministic data and losses for the built-in workloads.

Note [data is a function of the step]: every batch is a pure function of (seed, step), so a rank
can regenerate any step's batch without state; a resumed run, or a run on another partition, sees
exactly the data of the uninterrupted run. Every rank builds the whole global batch and keeps its
own data-parallel slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_batch(step: int, batch_size: int, *, vocab: int, seq: int, seed: int = 0):
    """Next-token data: ``(tokens,)`` and ``targets`` (tokens shifted by one), both [batch, seq]."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    stream = torch.randint(0, vocab, (batch_size, seq + 1), generator=gen)
    return (stream[:, :-1].contiguous(),), stream[:, 1:].contiguous()


def regression_batch(step: int, batch_size: int, *, features: int, outputs: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch_size, features, generator=gen)
    return (x,), torch.randn(batch_size, outputs, generator=gen)


def causal_lm_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy. Accepts a Hugging Face output (uses ``.logits``) or a tensor."""
    logits = getattr(logits, "logits", logits)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
