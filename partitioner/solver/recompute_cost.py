"""What recomputing a region costs a microbatch: the one place that prices it (Note [recompute fixed cost]).

Note [recompute fixed cost]
    A recomputed region runs its forward once more in backward, and the checkpoint that reruns
    it costs something of its own, nearly whatever the region's size (runtime/execute/recompute.py, Note
    [cheap checkpointing]): the autograd Function per region, the nested backward through the
    rerun, the autocast and randomness contexts, ~0.37 ms per region per microbatch for GPT
    blocks of width 32 and 128 alike on this CPU (benchmarks/recompute_overhead.py: extra over
    plain - the rerun forward alone). On small microbatches the rerun's per-op dispatch adds as
    much again, which the FLOP-priced forward does not see (a width-32 block at microbatch 2:
    priced 0.08 ms, reruns in ~0.3 ms). So

        recompute_s(region) = forward_s(region) + recompute_fixed_s(device)

    seconds per recomputed region per microbatch, where ``recompute_fixed_s`` is what the
    device's time model leaves unpriced: the problem's measured figure for the device's kind (a
    calibrated profile, partitioner/calibrate/recompute_cost.py: a checkpointed region's extra
    over plain beyond its *fitted* forward, which prices the rerun's dispatch per op), else the
    kind's preset (``DevicePreset.recompute_fixed_s``: the extra beyond the *FLOP-priced*
    forward on the small GPT, dispatch included, as the preset's ``microbatch_overhead_s``
    covers the plain ops' dispatch), else 0. On larger regions, whose FLOPs price their forward
    well, the preset over-prices a recompute by about the dispatch (~0.3 ms a region).
    ``evaluate``, the ILP (its recompute coefficients), the chain DP (its recompute tables,
    greedy order and lower bound), the candidate bounds and the fair baselines (through
    ``evaluate``) all price recompute through ``recompute_s``, so a term that makes a recomputed
    region dearer makes the solver recompute fewer regions (or none) where memory allows.

Note [recompute a user pins]
    ``--recompute`` (plan.json's training "recompute", SolverConfig.recompute) says who decides:
    "auto" (the default): the solver, per region, where memory binds; "none": no region is
    recomputed (a plan that does not fit without it is refused, the error naming --recompute);
    "full": every region whose recompute saves memory is recomputed, as Megatron's full activation
    recomputation checkpoints every layer, and the solver chooses the rest (stages, microbatches,
    layout) with that recompute priced: its forward again in backward, its activations dropped.
    "full" leaves out only the regions recomputing cannot help (``saves_memory`` false): one that
    updates a buffer (Note [recompute never updates twice] in partitioner/codegen/split.py: it is
    never checkpointed, so pinning it would price what the program does not run) and one whose
    inputs, kept for the rerun, are as large as what it saves. The pin is honoured everywhere a
    plan is made: the ILP fixes recompute[r, s] = in_stage[r, s] for those regions (model.py), its
    hints and the chain DP's are given the same recompute (placed.py), and the fair baselines
    are priced with it (fair_baselines.py, like for like). The lower bounds (bounds.py, the chain
    DP's) stay those of "auto": the pinned plans are a subset, so they remain bounds. "selective"
    (the attention core only) is refused (settings.check_recompute): the region is the finest
    unit the solver recomputes.
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
