"""``checkpointed(fn, *args)``: what a generated stage calls for a region the plan recomputes.

Note [recompute draws the same randomness]: a recomputed region runs its forward twice, once in
the forward pass (its activations are dropped) and once in backward (to rebuild them). Both runs
must draw the same dropout masks, or the gradient belongs to a different forward than the loss.
Two kinds of randomness are covered:
  * the global RNG (today's ``aten.dropout``, seeded per microbatch by runtime/train.py, Note
    [randomness per microbatch]): ``preserve_rng_state=True`` stashes its state at the checkpoint and
    restores it, on a fork, for the recompute;
  * keyed randomness (``runtime.randomness``, where a random op's draws are keyed by step,
    sample and op name): its current context is captured as the checkpoint's forward starts and
    made current again for the recompute (``context_fn``). Until that module exists on a branch
    the import fails and the first kind is all there is.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

try:
    from runtime import randomness as _randomness
except ImportError:  # keyed randomness not built yet: the global RNG is the only source
    _randomness = None


def _randomness_contexts():
    """(forward context, recompute context): the recompute runs under the keyed-randomness context
    that was current when the forward ran."""
    captured = _randomness.capture()
    return contextlib.nullcontext(), _randomness.restored(captured)


def checkpointed(fn, *args):
    """``fn(*args)`` whose intermediate activations are freed after the forward and recomputed in
    backward (non-reentrant activation checkpointing), with the same random draws both times."""
    if not torch.is_grad_enabled():
        return fn(*args)  # nothing is saved without autograd: nothing to recompute
    if _randomness is not None and hasattr(_randomness, "capture"):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=_randomness_contexts)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
