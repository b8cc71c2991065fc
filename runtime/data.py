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


# Note [keyword inputs]: make_batch may return its inputs as a tuple (the forward's positional
# inputs) or as a dict of keyword inputs ({"input_ids": ..., "attention_mask": ...}). torch.export
# makes each keyword input a placeholder of the graph, in the order of the example's dict, and
# stage 0 receives the placeholders in graph order; the program records that order as
# ``data.keywords``, and every consumer (the ranks' stage 0, the one-process oracle, the stage
# chain) turns the dict into that one positional order with ``batch_inputs``. Only the original
# nn.Module, called by the oracle, takes them back as keywords.


def batch_inputs(inputs, keywords=()) -> tuple:
    """make_batch's inputs as the positional tuple stage 0 takes (Note [keyword inputs])."""
    if isinstance(inputs, dict):
        if not keywords:
            raise ValueError(f"make_batch returned a dict of inputs {sorted(inputs)} but the program was "
                             "compiled for positional inputs: return a tuple, or recompile with this make_batch")
        missing = [k for k in keywords if k not in inputs]
        extra = sorted(set(inputs) - set(keywords))
        if missing or extra:
            raise ValueError(f"make_batch returned inputs {sorted(inputs)} but the program takes {list(keywords)}"
                             f"{f' (missing {missing})' if missing else ''}{f' (unexpected {extra})' if extra else ''}: "
                             "return the keys of the example inputs the program was compiled with")
        return tuple(inputs[k] for k in keywords)
    if keywords:
        raise ValueError(f"make_batch returned {type(inputs).__name__} inputs but the program takes the keyword "
                         f"inputs {list(keywords)}: return a dict with those keys")
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    return tuple(inputs)
