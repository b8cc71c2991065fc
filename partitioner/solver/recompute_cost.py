"""What recomputing a region costs a microbatch: the one place that prices it (Note [recompute fixed cost]).

Note [recompute fixed cost]
    A recomputed region costs its forward again plus a checkpoint cost nearly independent of its
    size (Note [cheap checkpointing] in runtime/execute/recompute.py: ~0.37 ms per region per
    microbatch for GPT blocks of width 32 and 128 alike here, benchmarks/recompute_overhead.py),
    and on small microbatches the rerun's per-op dispatch adds as much again, which a FLOP-priced
    forward does not see. So recompute_s = forward_s + ``recompute_fixed_s(device)``: what the
    device's time model leaves unpriced, from a calibrated profile (beyond its fitted forward) or
    the kind's preset (beyond the FLOP-priced forward, dispatch included; it over-prices large
    regions by about the dispatch, ~0.3 ms), else 0. Every pricer (``evaluate``, the ILP, the
    chain DP, the bounds, the fair baselines) goes through ``recompute_s``, so a dearer recompute
    makes the solver recompute fewer regions where memory allows.

Note [recompute a user pins]
    ``--recompute`` says who decides: "auto" (the solver, where memory binds); "none" (a plan that
    does not fit without it is refused, naming --recompute); "full" (every region whose recompute
    saves memory, as Megatron's full activation recomputation; the solver chooses the rest with
    that priced). "full" leaves out the regions recomputing cannot help: one that updates a buffer
    (Note [recompute never updates twice] in partitioner/codegen/split.py: never checkpointed, so
    pinning it would price what the program does not run) and one whose kept inputs are as large
    as what it saves. The pin holds everywhere a plan is made (the ILP, its hints, the chain DP,
    the fair baselines: like for like); the lower bounds stay those of "auto", since the pinned
    plans are a subset. "selective" is refused: the region is the finest unit the solver recomputes.
"""

from __future__ import annotations

from partitioner.config.cluster import DeviceSpec
from partitioner.solver.problem import PartitionProblem, RegionCost, measured_or_preset, region_times_s


def saves_memory(region: RegionCost) -> bool:
    """Whether recomputing ``region`` frees memory: what "full" recomputes (Note [recompute a user pins])."""
    return region.activation_bytes_per_sample > region.recompute_activation_bytes_per_sample


def pinned_recompute(problem: PartitionProblem, mode: str) -> tuple[bool, ...] | None:
    """The recompute ``mode`` fixes for every region, or None where the solver chooses ("auto")
    (Note [recompute a user pins])."""
    if mode == "auto":
        return None
    return tuple(mode == "full" and saves_memory(r) for r in problem.regions)


def recompute_fixed_s(problem: PartitionProblem, device: DeviceSpec) -> float:
    """Seconds a recomputed region costs a microbatch on ``device`` beyond its forward: the
    problem's measured figure for the kind, else the kind's preset, else 0."""
    return measured_or_preset(problem.recompute_fixed_s_by_kind, device.kind, "recompute_fixed_s")


def recompute_s(problem: PartitionProblem, region: RegionCost, device: DeviceSpec, microbatch_size: int) -> float:
    """Seconds recomputing ``region`` adds to one microbatch on ``device``: its forward again plus
    the checkpoint's fixed cost (Note [recompute fixed cost])."""
    return region_times_s(region, device, microbatch_size)[0] + recompute_fixed_s(problem, device)
