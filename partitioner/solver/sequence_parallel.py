"""Sequence parallelism in the cost model, and the compiler's choice of it.

Note [sequence parallelism as a decision]: a tensor-parallel plan runs with sequence parallelism
(Note [sequence parallelism] in runtime/parallel/tensor_parallel.py) when ``--sequence-parallel``
says on, or auto and the layout the solver chose is priced no slower with it (``choose`` runs after
the solve: the search prices tp plans without it, so a layout that fits only with it is not found
yet). Priced on top of ``tp_priced_problem``: each all-reduce becomes a reduce-scatter plus an
all-gather, the same bytes and link latencies (``sent_bytes``) in twice the calls, so only a call's
fixed cost (gloo on cpu; 0 on accelerators) can make it slower; what a member held whole, except
the column linears' gathered inputs, is held as a 1/tp sequence slice (``sliced_bytes``, Korthikanti
et al. 2022's sbh/t), a recomputed region's input too. A stage's first norm on the whole boundary
tensor is not counted (a slight under-count).
"""

from __future__ import annotations

import dataclasses

from partitioner.solver.evaluate import evaluate
from partitioner.solver.tensor_groups import collective_fixed_s

MODES = ("auto", "on", "off")


def sliced_bytes(region) -> int:
    """Saved activation bytes per sample that sequence parallelism holds as a 1/tp slice (Note
    [sequence parallelism as a decision]): the whole ones less the column groups' gathered inputs."""
    split = min(region.tp.sharded_activation_bytes_per_sample, region.activation_bytes_per_sample)
    return max(0, region.activation_bytes_per_sample - split - region.tp.comm_bwd_bytes)


def sent_bytes(region, tp: int, sequence_parallel: bool) -> tuple[float, float]:
    """(forward, backward) bytes per sample one member sends for the region's row linears and
    column-group inputs (a vocab lookup's all-reduce and a head's gather are the same either way)."""
    if tp == 1:
        return 0.0, 0.0
    rows, columns = region.tp.comm_bytes - region.tp.lookup_bytes, region.tp.comm_bwd_bytes
    step = (tp - 1) / tp
    if not sequence_parallel:
        return 2 * step * rows, 2 * step * columns
    return step * (rows + columns), step * (rows + columns)


def sp_priced_problem(problem, cluster, tp: int):
    """``problem`` (priced by ``tp_priced_problem`` for ``tp``) with sequence parallelism's bytes,
    collectives and activations (Note [sequence parallelism as a decision])."""
    if tp == 1:
        return problem
    link = cluster.intra_node_link
    regions = []
    for r in problem.regions:
        sliced = sliced_bytes(_member(r, tp))
        before, after = sent_bytes(r, tp, False), sent_bytes(r, tp, True)
        extra = r.tp.bwd_collectives  # an all-gather more per column group (forward) and per row linear (backward)
        fwd, bwd, fwd_fixed, bwd_fixed = (dict(d or {}) for d in (
            r.fwd_s_per_sample_by_kind, r.bwd_s_per_sample_by_kind, r.fwd_s_per_microbatch_by_kind,
            r.bwd_s_per_microbatch_by_kind))
        for kind in fwd:
            # a ring all-reduce is a reduce-scatter then an all-gather: the same link latencies in
            # all, each extra call its fixed cost
            per_collective = collective_fixed_s(problem, kind)
            fwd[kind] += (after[0] - before[0]) / link.bandwidth_bytes_per_s
            bwd[kind] = bwd.get(kind, 0.0) + (after[1] - before[1]) / link.bandwidth_bytes_per_s
            fwd_fixed[kind] = fwd_fixed.get(kind, 0.0) + extra * per_collective
            bwd_fixed[kind] = bwd_fixed.get(kind, 0.0) + extra * per_collective
        recompute = r.recompute_activation_bytes_per_sample
        regions.append(dataclasses.replace(
            r, activation_bytes_per_sample=r.activation_bytes_per_sample - sliced * (tp - 1),
            recompute_activation_bytes_per_sample=recompute - (recompute // tp) * (tp - 1) if sliced else recompute,
            fwd_s_per_sample_by_kind=fwd or None, bwd_s_per_sample_by_kind=bwd or None,
            fwd_s_per_microbatch_by_kind=fwd_fixed or None, bwd_s_per_microbatch_by_kind=bwd_fixed or None))
    return dataclasses.replace(problem, regions=tuple(regions))


def _member(grouped_region, tp: int):
    """One member's figures of a region ``tp_priced_problem`` restated per group: its whole
    activations counted tp times there, the split ones once."""
    split = min(grouped_region.tp.sharded_activation_bytes_per_sample, grouped_region.activation_bytes_per_sample)
    whole = (grouped_region.activation_bytes_per_sample - split) // tp
    return dataclasses.replace(grouped_region, activation_bytes_per_sample=whole + split)


def refusal(mode: str, tp: int, *, compile_stages: bool, scatters: bool) -> str | None:
    """Why ``--sequence-parallel on`` cannot run this plan, in one line with the fix; None if it can."""
    if mode != "on":
        return None
    if tp == 1:
        return ("--sequence-parallel on: the plan has no tensor parallelism (tp 1); sequence parallelism slices "
                "what a tensor group holds whole: pass --tp 2 or more, or --sequence-parallel auto")
    if compile_stages:
        return ("--sequence-parallel on with --compile-stages: compiled stages do not run sequence parallelism yet "
                "(not verified); pass --sequence-parallel off, or leave --compile-stages out")
    if not scatters:
        return (f"--sequence-parallel on: no row-parallel linear's sequence divides into tp={tp} slices; "
                f"pass --sequence-parallel off, or a sequence length that is a multiple of {tp}")
    return None


def choose(mode: str, scatters, problem, cluster, solution, *, compile_stages: bool):
    """(on, problem): whether ``solution``'s plan runs sequence parallelism (Note [sequence
    parallelism as a decision]) and the problem that prices it; ValueError for an ``on`` it cannot run.
    ``scatters(tp)``: whether a row linear's sequence divides by tp (passes/tp_activations.py)."""
    tp = solution.tensor_parallel
    scatter = tp > 1 and scatters(tp)
    why = refusal(mode, tp, compile_stages=compile_stages, scatters=scatter)
    if why:
        raise ValueError(why)
    if mode == "off" or tp == 1 or compile_stages or not scatter:
        return False, problem
    sliced = sp_priced_problem(problem, cluster, tp)
    if mode == "on":
        return True, sliced
    with_sp, without = (evaluate(p, cluster, solution.assignment) for p in (sliced, problem))
    if with_sp.step_time_s <= without.step_time_s or (with_sp.fits_memory and not without.fits_memory):
        return True, sliced
    return False, problem
