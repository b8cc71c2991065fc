"""Calibrating the recompute fixed cost (Note [recompute fixed cost] in
partitioner/solver/recompute_cost.py): each region measured once more under the runtime's
checkpoint, and the fixed term that leaves beyond the fitted forward.

``time_checkpointed`` times a region's forward + backward plain and under
``runtime.execute.recompute.checkpointed`` in alternation (the same inputs, the same output gradients;
the median of the paired differences, which a loaded machine shifts less than two separate
medians). ``fit_recompute_fixed_s`` takes, over the regions, the median of

    (checkpointed - plain) - the profile's fitted forward of the region

floored at 0: the part of a recompute that the forward the cost model already charges does not
explain (the fitted forward includes the rerun's per-op dispatch, so it is not counted twice).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils._pytree import tree_flatten

from partitioner.calibrate.features import Features
from runtime.execute.precision import Precision, autocast
from runtime.execute.recompute import checkpointed


def _forward_backward_s(module, inputs, grads_out, *, checkpoint: bool, precision: Precision, device: str):
    """(seconds of one forward + backward, output gradients used) of ``module`` on ``inputs``."""
    start = time.perf_counter()
    with autocast(precision, device):
        outs = checkpointed(module, *inputs) if checkpoint else module(*inputs)
    flat = [o for o in tree_flatten(outs)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if grads_out is None:
        generator = torch.Generator().manual_seed(0)
        grads_out = [torch.randn(o.shape, generator=generator, dtype=o.dtype).to(o.device) for o in flat]
    if flat:
        torch.autograd.backward(flat, grads_out)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, grads_out


def time_checkpointed(module, fresh_inputs, *, warmup: int, repeats: int, params, precision: Precision = Precision.FP32,
                      device: str = "cpu") -> dict:
    """{"plain_s", "checkpointed_s"}: medians of one forward + backward of a region's ``module``
    on ``fresh_inputs()`` (new leaf copies each call), plain and checkpointed, measured in
    alternation; "recompute_extra_s": the median of their paired differences."""
    grads_out = None
    plain, checked, extra = [], [], []
    for i in range(warmup + repeats):
        pair = []
        for checkpoint in (False, True):
            seconds, grads_out = _forward_backward_s(module, fresh_inputs(), grads_out, checkpoint=checkpoint,
                                                     precision=precision, device=device)
            pair.append(seconds)
            for p in params:
                p.grad = None
        if i >= warmup:
            plain.append(pair[0])
            checked.append(pair[1])
            extra.append(pair[1] - pair[0])
    return {"plain_s": statistics.median(plain), "checkpointed_s": statistics.median(checked),
            "recompute_extra_s": statistics.median(extra)}


def fit_recompute_fixed_s(measurements, forward_fit) -> float | None:
    """The median over measured regions of max(0, recompute extra - fitted forward seconds), or
    None when no region was measured under the checkpoint."""
    rows = [m for m in measurements if m.get("kind") == "region" and "recompute_extra_s" in m]
    if not rows:
        return None
    return statistics.median(max(0.0, m["recompute_extra_s"] - forward_fit.seconds(Features(**m["fwd_features"])))
                             for m in rows)
