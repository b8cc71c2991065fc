"""The partition problem as plain numbers (no torch), and the assignment that answers it.

Note [region accounting]
    Regions are listed in a topological order; every edge goes from a lower to a higher index.
    All per-sample quantities scale linearly with the microbatch size b.
    A parameter shared by several regions (a tied embedding) is counted once, in the
    ``param_bytes``/``grad_bytes``/``optimizer_bytes`` of the first region that uses it, and is
    described again by a ``SharedParam``. When the tie's regions land on different stages, every other
    stage that holds one of them keeps a replica (memory) and the replicas' gradients are summed
    once per step (time); see ``evaluate`` in evaluate.py.

Note [whole-step terms]): ``microbatch_overhead_s`` and ``core_sharing_factor``.

Note [whole-step terms]
    Two costs the regions alone miss (measured on the whole step, benchmarks/step_time_accuracy.py),
    applied identically by ``evaluate``, the ILP and the chain DP: ``microbatch_overhead_s``, what a
    stage pays per microbatch besides its regions (the schedule's Python, the loss, the send and
    receive calls), from the preset, the machine profile or a calibrated one; and
    ``core_sharing_factor`` (Note [core sharing] in cluster.py): R ranks on C < R cores of a node
    make every time term R/C times longer, the worst node setting the candidate's factor (the
    pipeline runs at its slowest stage's pace). One scalar per candidate: it changes which
    candidate wins, not the best split of one, and the ILP applies it as a finer time unit (Note
    [ILP scaling]). It ignores that ranks idle in the bubble leave their core to others: a small
    over-prediction when the bubble is large.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping

from partitioner.config.cluster import DEVICE_PRESETS, ClusterSpec, DeviceSpec
from runtime.program.schedules import SCHEDULES, PipelineSchedule

__all__ = [
    "RegionCost",
    "TensorParallelCost",
    "Edge",
    "SharedParam",
    "PartitionProblem",
    "Assignment",
    "region_times_s",
    "microbatch_overhead_s",
    "region_step_s",
    "core_sharing_factor",
]

# Note [only runnable plans]: every constraint the runtime's schedules impose is a constraint of
# the solver, so a plan never dies at the first step: each schedule's ``refusal`` (runtime/
# program/schedules.py, Note [one class per schedule]) is torch 2.13's rule, and the candidates,
# the request check, the independent checker and the runtime's own start-up check (runtime/
# program.py) all ask it. ``Schedule1F1B`` raises when ``n_microbatches < num_stages`` (its warm-up
# sends one microbatch per later stage); ``ScheduleGPipe`` takes any count;
# ``ScheduleInterleaved1F1B`` (v >= 2 stages per rank) needs the microbatches to be a multiple of
# its rounds and the stages to divide over the ranks.


def _check_nonneg(owner: str, name: str, value, *, integer: bool) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not value >= 0:
        kind = "an int" if integer else "a number"
        raise ValueError(f"{owner}.{name}={value!r} must be {kind} >= 0")


@dataclass(frozen=True)
class TensorParallelCost:
    """What a tensor group of tp > 1 ranks changes of one region (Note [tensor-parallel traffic] in
    passes/tp_roles.py, Note [tensor-parallel pricing] in partitioner/solver/tensor_groups.py).
    Per sample: the payload one member all-reduces in forward (``comm_bytes``) and in backward
    (``comm_bwd_bytes``), and the whole output it all-gathers in forward (``gather_bytes``, a
    vocab-split head's logits); per step: the gradient bytes it all-gathers after the schedule
    (``step_gather_bytes``); the parameter bytes the group divides."""

    comm_bytes: int = 0
    sharded_param_bytes: int = 0
    comm_bwd_bytes: int = 0
    gather_bytes: int = 0
    step_gather_bytes: int = 0
    # Of comm_bytes, the vocab lookups' all-reduce: the embedding's dtype under autocast too.
    lookup_bytes: int = 0
    # How many collectives those are: per microbatch forward, backward, and per step.
    fwd_collectives: int = 0
    bwd_collectives: int = 0
    step_collectives: int = 0
    # Saved activation / backward transient bytes per sample the group splits (Notes [sharded activations],
    # [sharded transients] in passes/tp_activations.py): parts of the region's figures of those names.
    sharded_activation_bytes_per_sample: int = 0
    sharded_transient_bytes_per_sample: int = 0
    # Forward + backward FLOPs per sample the group divides (passes/tp_activations.py
    # ``sharded_flops``: the column/row/vocab matmuls and the attention between them); None (a
    # problem built by hand) takes the region's sharded parameter share as its FLOP share.
    sharded_flops_per_sample: float | None = None
    # Of the region's measured seconds on a kind (RegionCost's *_by_kind fields), the fraction its split
    # nodes take (passes/tp_activations.py): what the group divides by tp there; None: the FLOP share.
    split_fraction_by_kind: Mapping[str, float] | None = field(default=None, compare=False)

    def check(self, owner: str) -> None:
        for name in ("comm_bytes", "sharded_param_bytes", "comm_bwd_bytes", "gather_bytes", "step_gather_bytes",
                     "lookup_bytes", "fwd_collectives", "bwd_collectives", "step_collectives",
                     "sharded_activation_bytes_per_sample", "sharded_transient_bytes_per_sample"):
            _check_nonneg(owner, name, getattr(self, name), integer=True)
        if self.sharded_flops_per_sample is not None:
            _check_nonneg(owner, "sharded_flops_per_sample", self.sharded_flops_per_sample, integer=False)


@dataclass(frozen=True)
class RegionCost:
    """A group of graph nodes; all figures are per sample of the microbatch."""

    name: str
    fwd_flops_per_sample: float
    bwd_flops_per_sample: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_sample: int
    recompute_activation_bytes_per_sample: int
    layer: int | None = None
    # Gradient bytes alive at once during this region's backward, beyond saved activations and
    # model state (Note [memory model] in evaluate.py): per sample (activation gradients) and fixed
    # (fresh parameter gradients, whatever the microbatch size); a recomputed region adds its
    # rerun forward's saved activations (activation_bytes_per_sample) to it.
    transient_bytes_per_sample: int = 0
    transient_fixed_bytes: int = 0
    # What a tensor group changes of the region (at tp > 1): one seam for the axis.
    tp: TensorParallelCost = field(default_factory=TensorParallelCost)
    # Measured seconds per sample by device kind; overrides flops / flops_per_s (Note [per sample]).
    fwd_s_per_sample_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    bwd_s_per_sample_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    # Measured fixed seconds per microbatch by device kind, added to the per-sample part.
    fwd_s_per_microbatch_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    bwd_s_per_microbatch_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    # Seconds by device kind the region's stage pays once per step, after the schedule, beside
    # the data-parallel all-reduce (tensor parallelism's gradient collectives: Note
    # [tensor-parallel pricing] in partitioner/solver/tensor_groups.py); None: nothing.
    step_s_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    # Ops the region runs per microbatch, forward and backward (calibrate's num_ops feature):
    # what a tensor group's DTensors dispatch one by one (Note [tensor-parallel overheads]).
    fwd_ops: int = 0
    bwd_ops: int = 0
    # the part of bwd_flops_per_sample that produces parameter gradients (Note [weight-gradient
    # flops] in partitioner/solver/zero_bubble.py): the zero-bubble schedules' W actions
    bwd_weight_flops_per_sample: float = 0.0

    def __post_init__(self) -> None:
        owner = f"RegionCost({self.name!r})"
        for name in ("fwd_flops_per_sample", "bwd_flops_per_sample", "bwd_weight_flops_per_sample"):
            _check_nonneg(owner, name, getattr(self, name), integer=False)
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes_per_sample",
                     "recompute_activation_bytes_per_sample", "transient_bytes_per_sample",
                     "transient_fixed_bytes", "fwd_ops", "bwd_ops"):
            _check_nonneg(owner, name, getattr(self, name), integer=True)
        self.tp.check(f"{owner}.tp")
        if self.layer is not None and (isinstance(self.layer, bool) or not isinstance(self.layer, int)):
            raise ValueError(f"{owner}.layer={self.layer!r} must be an int block index or None")

    @property
    def tp_param_share(self) -> float:
        """The fraction of the region's parameter bytes a tensor group divides (Note [tensor groups])."""
        return min(1.0, self.tp.sharded_param_bytes / self.param_bytes) if self.param_bytes else 0.0

    @property
    def tp_flop_share(self) -> float:
        """The fraction of the region's FLOPs a tensor group divides (Note [tensor-parallel pricing])."""
        if self.tp.sharded_flops_per_sample is None:
            return self.tp_param_share
        total = self.fwd_flops_per_sample + self.bwd_flops_per_sample
        return min(1.0, self.tp.sharded_flops_per_sample / total) if total else 0.0

    @property
    def weight_fraction(self) -> float:
        """The share of the backward that is weight gradients (Note [weight-gradient flops])."""
        if self.bwd_flops_per_sample <= 0:
            return 0.0
        return min(1.0, self.bwd_weight_flops_per_sample / self.bwd_flops_per_sample)

    @property
    def static_bytes(self) -> int:
        """Weights + gradients + optimizer state: memory held regardless of the schedule."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def transient_bytes(self, microbatch_size: int, recompute: bool) -> int:
        """The backward transient of one microbatch, with the rerun forward's activations if
        recomputed."""
        per_sample = self.transient_bytes_per_sample + (self.activation_bytes_per_sample if recompute else 0)
        return microbatch_size * per_sample + self.transient_fixed_bytes


@dataclass(frozen=True)
class Edge:
    """Activation bytes per sample flowing from region ``src`` to region ``dst`` (src < dst)."""

    src: int
    dst: int
    bytes_per_sample: int

    def __post_init__(self) -> None:
        _check_nonneg(f"Edge({self.src}->{self.dst})", "bytes_per_sample", self.bytes_per_sample, integer=True)
        if not self.src < self.dst:
            raise ValueError(
                f"Edge(src={self.src}, dst={self.dst}): src must be < dst (regions are listed in "
                "topological order); reorder the regions"
            )


@dataclass(frozen=True)
class SharedParam:
    """A parameter shared by ``regions`` (counted in the first one's bytes; Note [region accounting]).

    ``grad_bytes`` / ``optimizer_bytes`` default (None) to param_bytes scaled by the first
    region's grad/param and optimizer/param ratios.
    """

    regions: tuple[int, ...]
    param_bytes: int
    grad_bytes: int | None = None
    optimizer_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.regions, tuple):
            object.__setattr__(self, "regions", tuple(self.regions))
        if len(self.regions) < 2 or len(set(self.regions)) != len(self.regions):
            raise ValueError(f"SharedParam.regions={self.regions!r} must name at least two distinct regions")
        if list(self.regions) != sorted(self.regions):
            object.__setattr__(self, "regions", tuple(sorted(self.regions)))
        _check_nonneg("SharedParam", "param_bytes", self.param_bytes, integer=True)


# runtime/parallel/grad_sync.py ``allreduce_flat_`` concatenates gradients into buckets of up to 2**25
# elements (one tensor larger than that is a bucket of its own): 128 MiB of fp32.
ALLREDUCE_BUCKET_ELEMS = 1 << 25


@dataclass(frozen=True)
class PartitionProblem:
    """``input_bytes_per_sample`` / ``target_bytes_per_sample``: one sample of the model inputs
    and of the loss target (every rank builds the whole global batch; Note [memory model] in
    evaluate.py). ``allreduce_bucket_bytes``: the largest flat buffer the data-parallel gradient
    all-reduce builds, max(2**25 elements, the largest gradient tensor) in bytes."""

    regions: tuple[RegionCost, ...]
    edges: tuple[Edge, ...]
    ties: tuple[SharedParam, ...] = ()
    input_bytes_per_sample: int = 0
    target_bytes_per_sample: int = 0
    allreduce_bucket_bytes: int = 4 * ALLREDUCE_BUCKET_ELEMS
    # Measured per-microbatch stage overhead by device kind; else the preset's (Note [whole-step terms]).
    microbatch_overhead_s_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    # Measured tensor-parallel overheads by device kind, else the preset's (Note [tensor-parallel overheads] in
    # partitioner/solver/tensor_groups.py): seconds per DTensor op, per collective, members' wait per second computed.
    dtensor_op_s_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    tp_collective_s_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    tp_skew_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    # Measured seconds a recomputed region costs a microbatch beyond its forward, by device kind;
    # else the preset's (Note [recompute fixed cost] in partitioner/solver/recompute_cost.py).
    recompute_fixed_s_by_kind: Mapping[str, float] | None = field(default=None, compare=False)
    boundary_holders: int = 1  # devices of a planned device holding each boundary tensor (Note [boundary holders])

    def __post_init__(self) -> None:
        for name in ("regions", "edges", "ties"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.regions:
            raise ValueError("PartitionProblem.regions=() is empty: a model has at least one region")
        n = len(self.regions)
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n):
                raise ValueError(f"Edge({e.src}->{e.dst}) names a region outside 0..{n - 1}")
        for t in self.ties:
            bad = [r for r in t.regions if not 0 <= r < n]
            if bad:
                raise ValueError(f"SharedParam.regions={t.regions} names regions {bad} outside 0..{n - 1}")
        for name in ("input_bytes_per_sample", "target_bytes_per_sample", "allreduce_bucket_bytes", "boundary_holders"):
            _check_nonneg("PartitionProblem", name, getattr(self, name), integer=True)

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    def is_chain(self) -> bool:
        """True when every edge joins consecutive regions (r -> r+1)."""
        return all(e.dst == e.src + 1 for e in self.edges)

    def tie_bytes(self, tie: SharedParam) -> tuple[float, float, float]:
        """(param, grad, optimizer) bytes of one replica of a tie (Note [region accounting])."""
        first = self.regions[tie.regions[0]]
        ratio_grad = first.grad_bytes / first.param_bytes if first.param_bytes else 1.0
        ratio_opt = first.optimizer_bytes / first.param_bytes if first.param_bytes else 2.0
        grad = tie.grad_bytes if tie.grad_bytes is not None else tie.param_bytes * ratio_grad
        opt = tie.optimizer_bytes if tie.optimizer_bytes is not None else tie.param_bytes * ratio_opt
        return float(tie.param_bytes), float(grad), float(opt)


def region_times_s(region: RegionCost, device: DeviceSpec, microbatch_size: int) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch of ``region`` on ``device``: measured by kind
    (Note [per sample] in partitioner/calibrate/__init__.py), else flops / flops_per_s."""
    fwd_override = (region.fwd_s_per_sample_by_kind or {}).get(device.kind)
    bwd_override = (region.bwd_s_per_sample_by_kind or {}).get(device.kind)
    fwd = fwd_override if fwd_override is not None else region.fwd_flops_per_sample / device.flops_per_s
    bwd = bwd_override if bwd_override is not None else region.bwd_flops_per_sample / device.flops_per_s
    fwd_fixed = (region.fwd_s_per_microbatch_by_kind or {}).get(device.kind, 0.0) if fwd_override is not None else 0.0
    bwd_fixed = (region.bwd_s_per_microbatch_by_kind or {}).get(device.kind, 0.0) if bwd_override is not None else 0.0
    return fwd_fixed + fwd * microbatch_size, bwd_fixed + bwd * microbatch_size


def region_step_s(region: RegionCost, device: DeviceSpec) -> float:
    """Seconds ``region``'s stage on ``device`` pays once per step after the schedule (0: none)."""
    return (region.step_s_by_kind or {}).get(device.kind, 0.0)


def microbatch_overhead_s(problem: PartitionProblem, device: DeviceSpec) -> float:
    """Seconds a stage on ``device`` pays per microbatch beyond its regions (Note [whole-step
    terms]): the problem's measured figure for the device's kind, else the kind's preset, else 0."""
    return measured_or_preset(problem.microbatch_overhead_s_by_kind, device.kind, "microbatch_overhead_s")


def measured_or_preset(measured: Mapping[str, float] | None, kind: str, preset_field: str) -> float:
    """A device kind's fixed cost: the problem's measured figure for ``kind``, else the kind's
    preset ``DevicePreset.<preset_field>``, else 0."""
    if measured and measured.get(kind) is not None:
        return float(measured[kind])
    preset = DEVICE_PRESETS.get(kind)
    return float(getattr(preset, preset_field)) if preset is not None else 0.0


def core_sharing_factor(
    cluster: ClusterSpec,
    placement: tuple[tuple[int, ...], ...] | None = None,
    *,
    num_ranks: int | None = None,
) -> float:
    """How many times longer every time term of a candidate takes because its ranks share CPU
    cores (Note [whole-step terms] above, Note [core sharing] in cluster.py):
    max over nodes of max(1, ranks placed on the node's core-bound devices / its cores).

    Without ``placement`` (devices are chosen after solving, Note [heterogeneous devices] in
    model.py): the worst any placement of ``num_ranks`` ranks can do, min(num_ranks, core-bound
    devices of the node) on each node; exact on one node whose devices are all core-bound."""
    # Note [cluster queries are cached] in partitioner/config/cluster.py: a pass over every rank
    key = ("core_sharing_factor", None if placement is None else tuple(map(tuple, placement)), num_ranks)
    known = cluster.memo.get(key)
    if known is None:
        known = cluster.memo[key] = _core_sharing_factor(cluster, placement, num_ranks)
    return known


def _core_sharing_factor(cluster: ClusterSpec, placement, num_ranks: int | None) -> float:
    if placement is None and num_ranks is None:
        raise ValueError("core_sharing_factor needs a placement or num_ranks")
    if ("core_bound_nodes",) not in cluster.memo:  # accelerators share no cores: no pass over the ranks
        cluster.memo[("core_bound_nodes",)] = {d.node: d.cores for d in cluster.devices if d.cores is not None}
    cores_of_node = cluster.memo[("core_bound_nodes",)]
    if not cores_of_node:
        return 1.0
    ranks_on_node: dict[int, int] = {}
    if placement is not None:
        for i in sorted({i for row in placement for i in row}):  # interleaved rows repeat a rank's devices
            device = cluster.devices[i]
            if device.cores is not None:
                ranks_on_node[device.node] = ranks_on_node.get(device.node, 0) + 1
    else:
        for device in cluster.devices:
            if device.cores is not None:
                ranks_on_node[device.node] = ranks_on_node.get(device.node, 0) + 1
        ranks_on_node = {node: min(count, num_ranks) for node, count in ranks_on_node.items()}
    return max([1.0] + [count / cores_of_node[node] for node, count in ranks_on_node.items()])


@dataclass(frozen=True)
class Assignment:
    """A candidate answer: where every region runs and on which devices.

    Rank layout (Note [rank layout]): rank = stage * dp + replica, so a stage's data-parallel
    replicas are consecutive ranks (usually one node) and pipeline neighbours are dp ranks apart.
    ``device_of_stage_replica[stage][replica]`` is the index in ``ClusterSpec.devices`` that
    rank ``stage * dp + replica`` runs on.
    """

    stage_of_region: tuple[int, ...]
    recompute: tuple[bool, ...]
    device_of_stage_replica: tuple[tuple[int, ...], ...]
    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    schedule: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_of_region", tuple(self.stage_of_region))
        object.__setattr__(self, "recompute", tuple(bool(x) for x in self.recompute))
        object.__setattr__(self, "device_of_stage_replica", tuple(tuple(row) for row in self.device_of_stage_replica))

    # Note [assignment layout is cached]: local_stages hashes every row of device_of_stage_replica (all the
    # ranks), asked with each stage's position millions of times at 16,384 ranks: computed once per (frozen)
    # assignment into its __dict__ (cached_property), leaving fields, equality and the serialized form as were.
    @functools.cached_property
    def pipeline_schedule(self) -> PipelineSchedule:
        """``schedule`` (the name a plan writes) as its object (Note [one class per schedule]); an
        unknown name places as the base class does (s % pp, one stage per rank): the checker names it."""
        kind = SCHEDULES.get(self.schedule, PipelineSchedule)
        return kind(self.num_stages // len(set(self.device_of_stage_replica))) if kind.several_per_rank else kind()

    @functools.cached_property
    def local_stages(self) -> int:
        """Stages per rank: 1, or v under interleaved (rows of a rank's stages repeat its devices)."""
        return self.pipeline_schedule.local_stages

    @functools.cached_property
    def pipeline_ranks(self) -> int:
        return self.num_stages // self.local_stages

    @functools.cached_property
    def _positions(self) -> tuple[int, ...]:
        """Each stage's pipeline position (Note [assignment layout is cached])."""
        return tuple(self.pipeline_schedule.position_of(s, self.pipeline_ranks) for s in range(self.num_stages))

    @functools.cached_property
    def _stages_at(self) -> tuple[tuple[int, ...], ...]:
        at: list[list[int]] = [[] for _ in range(max(self._positions, default=-1) + 1)]
        for s, pos in enumerate(self._positions):  # one pass: stages x positions was 16,384 steps at 128 stages
            at[pos].append(s)
        return tuple(map(tuple, at))

    def rank_of(self, stage: int, replica: int) -> int:
        """Stage s runs on its schedule's pipeline position: s % pp, or the V schedules'
        (runtime/program/layout.py, Note [one class per schedule])."""
        return self.position_of(stage) * self.dp + replica

    def position_of(self, stage: int) -> int:
        if 0 <= stage < self.num_stages:
            return self._positions[stage]
        return self.pipeline_schedule.position_of(stage, self.pipeline_ranks)  # outside the stages: its own answer

    def stages_at(self, position: int) -> tuple[int, ...]:
        """The stages the rank at pipeline ``position`` holds."""
        return self._stages_at[position] if 0 <= position < len(self._stages_at) else ()

    def stage_replica_of_rank(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.dp)
