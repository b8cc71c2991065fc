"""``checkpointed(fn, *args)``: what a generated stage calls for a region the plan recomputes.

Note [recompute draws the same randomness]: a recomputed region runs its forward twice, once in
the forward pass (its activations are dropped) and once in backward (to rebuild them). Both runs
must draw the same dropout masks, or the gradient belongs to a different forward than the loss.
Every random op of a stage file is a keyed draw of ``runtime.execute.randomness`` (the compiler lowers
them all and refuses one it does not know: Note [randomness keyed by meaning]), whose masks depend
only on the randomness context (seed, step, sample, op), never on the global RNG state. So the
forward captures the context as it starts and the recompute runs under that same context
(``_replay``), even when under 1F1B the context already names a later microbatch. The global RNG
is drawn from by nothing in a stage, so its state is not saved and restored
(``preserve_rng_state=False``: that save/restore, a CPU RNG state copy per region per microbatch,
would buy nothing).

Note [cheap checkpointing]: torch's reentrant checkpoint (an autograd Function per region: the
forward runs under no_grad and saves the region's inputs, the backward reruns it with grad and
backpropagates through the rerun) is used rather than the non-reentrant one, which runs a Python
pack hook for every tensor autograd saves in the forward and an unpack hook plus a recompute hook
for each in backward (and checks each rerun tensor's metadata): about 24 saved tensors per GPT
block, which measured 0.4 to 1.1 ms per region per microbatch more than the reentrant form on
this CPU at microbatch 2 (benchmarks/recompute_overhead.py). Both save exactly the region's inputs (Note
[recompute keeps a region's inputs]) and give the same gradients. The reentrant form needs
``torch.autograd.backward`` without ``inputs=`` (what torch.distributed.pipelining's full backward
calls) and an input that requires grad: a region none of whose inputs do (one reading only the
batch) takes the non-reentrant form, whose parameters still get their gradients. What the
reentrant form still costs beyond the rerun forward (the Function, a nested backward per region)
is priced as ``recompute_fixed_s`` (Note [recompute fixed cost] in
partitioner/solver/recompute_cost.py).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from runtime.execute import randomness

# Note [recompute under a split backward]: the zero-bubble schedules (zb, zbv) run a stage's
# backward as torch's ``stage_backward_input`` (``torch.autograd.grad`` with ``inputs=`` the stage's
# inputs, the graph retained) and later ``stage_backward_weight`` (gradients into the parameters
# from the retained graph). The reentrant checkpoint refuses ``inputs=`` (it runs its own nested
# backward to every leaf), so under a split backward every recomputed region takes the
# non-reentrant form: its pack/unpack hooks rerun the region's forward when the input-gradient
# pass first needs a saved tensor, and the rerun's graph serves the weight pass. The randomness is
# replayed as in Note [recompute draws the same randomness]. The rank sets this once, before its
# first step (``set_split_backward``); a process runs one schedule.
_SPLIT_BACKWARD = [False]


def set_split_backward(split: bool) -> None:
    """Whether this process's schedule splits backward into input- and weight-gradient passes."""
    _SPLIT_BACKWARD[0] = bool(split)


def _replay(fn, context, *args):
    """``fn(*args)`` under the randomness context its first forward ran under."""
    with randomness.restored(context):
        return fn(*args)


def _needs_grad(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def checkpointed(fn, *args):
    """``fn(*args)`` whose intermediate activations are freed after the forward and recomputed in
    backward (Note [cheap checkpointing]), with the same random draws both times."""
    if not torch.is_grad_enabled():
        return fn(*args)  # nothing is saved without autograd: nothing to recompute
    context = randomness.capture()
    if _needs_grad(args) and not _SPLIT_BACKWARD[0]:
        return checkpoint(_replay, fn, context, *args, use_reentrant=True, preserve_rng_state=False)
    return checkpoint(_replay, fn, context, *args, use_reentrant=False, preserve_rng_state=False)
