"""The global gradient norm (one number over every stage and replica), clipping by it, and which
parameters get no weight decay. Shared with the one-process oracle (runtime/execute/reference.py).

Note [global gradient norm]: the norm clipping uses is the one-process model's, the 2-norm over
every trained parameter once. After gradient synchronization every copy of a parameter holds the
same gradient, so each rank adds the squares of the parameters it *owns* (a tied parameter: its
lowest stage; a replicated one: replica 0; a sharded one: each replica its slice) and one
all-reduce over the world sums them. It is computed only when the program uses it (clipping, or
fp16's overflow test: Note [loss scaling] in runtime/execute/precision.py), and then priced
(partitioner/solver/grad_norm_cost.py); otherwise there is no pass and no collective: the plan
does not price work the program does not need, and on a small model the two cost about as much
as the fused AdamW step. Each tensor's norm is taken in its own dtype by one foreach kernel (as
clip_grad_norm_ does; a float64 copy cost ~4x more), their squares summed in float64 so a large
model's sum does not round.

Note [no weight decay]: AdamW's decay pulls weights towards zero; on a norm's scale and shift, a
bias or an embedding table it only hurts (the usual GPT/BERT recipe), so by default those
parameters go into a second parameter group with weight_decay 0. The compiler decides by module
type and shape on the user's model (``no_decay_names``: a parameter of a norm or embedding
module, or of fewer than 2 dimensions) and writes the names into the program's optimizer
settings (``no_decay``), because the stage modules no longer know which module a weight came
from. ``no_weight_decay`` in the training settings overrides it: "default", "none" (decay
every parameter) or a list of fnmatch patterns over original names.
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.distributed as dist

from runtime.execute.precision import clip_coefficient

NORM_TYPES = ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
              "LlamaRMSNorm", "T5LayerNorm", "InstanceNorm1d", "InstanceNorm2d")


def no_decay_names(model: torch.nn.Module, setting="default") -> list[str]:
    """Original parameter names (every alias of a tied one) that get no weight decay (Note [no
    weight decay]). ``setting``: "default", "none", or a list of fnmatch patterns."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if setting in (None, "none"):
        return []
    if isinstance(setting, (list, tuple)):
        bad = [p for p in setting if not isinstance(p, str)]
        if bad:
            raise ValueError(f"no_weight_decay patterns must be strings, got {bad!r}: pass a list like "
                             "[\"*.bias\", \"*norm*\"], \"default\" or \"none\"")
        return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in setting)]
    if setting != "default":
        raise ValueError(f"no_weight_decay {setting!r} is not \"default\", \"none\" or a list of "
                         "fnmatch patterns over parameter names")
    exempt_ids = set()
    for _prefix, module in model.named_modules(remove_duplicate=False):
        kind = type(module).__name__
        if isinstance(module, torch.nn.Embedding) or "Norm" in kind or kind in NORM_TYPES:
            exempt_ids.update(id(p) for p in module.parameters(recurse=False))
    return [n for n, p in model.named_parameters(remove_duplicate=False)
            if id(p) in exempt_ids or p.ndim < 2]


def param_groups(named: list[tuple[str, torch.nn.Parameter]], weight_decay: float, no_decay) -> list[dict]:
    """AdamW parameter groups: decayed first, then the no-decay ones (a group only if not empty).
    A parameter is exempt when any of its names is in ``no_decay``."""
    exempt = set(no_decay)
    by_id: dict[int, tuple[torch.nn.Parameter, bool]] = {}
    for name, p in named:
        prev = by_id.get(id(p), (p, False))
        by_id[id(p)] = (p, prev[1] or name in exempt)
    decay = [p for p, ex in by_id.values() if not ex]
    keep = [p for p, ex in by_id.values() if ex]
    groups = []
    if decay or not keep:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if keep:
        groups.append({"params": keep, "weight_decay": 0.0})
    return groups


def squares_sum(grads) -> torch.Tensor:
    """Σ g² over ``grads``: each tensor's 2-norm in its dtype (one foreach kernel), their squares
    summed in float64 (a 0-d tensor on the first gradient's device, or cpu)."""
    grads = [g.detach() for g in grads if g is not None and g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(grads, 2.0)).to(torch.float64)
    return (norms * norms).sum()


def needs_global_norm(program, scaler) -> bool:
    """Whether a step computes the global norm (Note [global gradient norm]): clipping, or fp16's
    overflow test."""
    return program.clip_grad_norm is not None or scaler.enabled


def owned_names(trainer) -> set[str]:
    """The parameters whose gradient this rank's stages count (Note [global gradient norm]):
    those that no lower stage also holds."""
    first_stage: dict[str, int] = {}
    for st in trainer.program.stages:
        for name in st.params:
            first_stage.setdefault(name, st.index)
    return {name for s, m in zip(trainer.stage_ids, trainer.modules) for name in m.parameter_names
            if first_stage.get(name, s) == s}


def owned_gradients(trainer) -> list[torch.Tensor]:
    """The full gradients this rank counts: its owned parameters once, on replica 0 only."""
    if trainer.replica != 0:
        return []
    owned = owned_names(trainer)
    out, seen = [], set()
    for m in trainer.modules:
        for name in m.parameter_names:
            if name in owned and name not in seen:
                seen.add(name)
                out.append(m.get_parameter(name).grad)
    from runtime.parallel.tensor_parallel import local_owned  # a shard once per tensor group, a replica once

    return local_owned(out, getattr(trainer, "tp_index", 0))


def scale_(grads, factor: float) -> None:
    if factor != 1.0:
        for g in grads:
            if g is not None:
                g.mul_(factor)


def as_norm(total_sq: float) -> float:
    return math.sqrt(total_sq) if math.isfinite(total_sq) and total_sq >= 0 else float("inf")


def finish_step(trainer, sync_gradients) -> tuple[float | None, bool]:
    """A step after its backward: sync the gradients (``sync_gradients``: runtime/parallel/grad_sync.py's),
    unscale (fp16), the global norm where the program uses it, clip, then the optimizer step or,
    on an fp16 overflow, the skip: Notes [global gradient norm], [loss scaling], [sharded optimizer
    state]. Every rank runs the same collectives in the same order (``needs_global_norm`` is the
    program's, alike everywhere). Returns (norm, or None when not computed; skipped)."""
    program, zero, scaler = trainer.program, trainer.zero, trainer.scaler
    if zero is None:
        sync_gradients(trainer.modules, program, trainer.groups)
        grads = [p.grad for m in trainer.modules for p in m.parameters() if p.grad is not None]
    else:
        sync_gradients(trainer.modules, program, trainer.groups, data_parallel=False)
        grads = zero.reduce_scatter_grads()
    if scaler.enabled:
        scale_(grads, 1.0 / scaler.scale)
    norm = None
    if needs_global_norm(program, scaler):
        owned = owned_gradients(trainer) if zero is None else zero.owned_grads(owned_names(trainer),
                                                                                   getattr(trainer, "tp_index", 0))
        total = squares_sum(owned).to(trainer.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        norm = as_norm(float(total))
    take = scaler.update(norm is None or math.isfinite(norm))
    if take and norm is not None:
        scale_(grads, clip_coefficient(norm, program.clip_grad_norm))
    if zero is None:
        if take:
            trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    else:
        zero.step(take)
    trainer.lr_scheduler.step()
    return norm, not take
