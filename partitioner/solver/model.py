"""The CP-SAT model of one candidate: fixed stages p, replicas d, microbatches m, schedule, b.

The model transcribes ``evaluate`` (Note [cost model] in evaluate.py) into integers. Every
constraint family is one ``_add_*`` method whose docstring states its inequality. This module makes
the variables and solves; the families live beside it, one mixin a concern:
  model_placement.py  upto, in_stage, recompute, tie holding, device classes
  model_time.py       stage times, bottleneck, prefix work, all-reduce, ties, the objective
  model_memory.py     every stage's memory within its capacity
  model_hints.py      hints, the objective cap and the stage fixings it implies (Note [search help])

Note [no clamped bound]
    CP-SAT's bound is a bound on the model's optimum, and the plan's own objective (re-evaluated at
    tight values, Note [tight objective]) is the objective of a feasible assignment of the same
    model, so bound <= objective always holds for a sound model. A bound above it means the tight
    values of the plan violate some constraint (a family that does not transcribe ``evaluate``,
    or an epigraph variable forced above its terms): ``solve`` raises InconsistentBoundError
    instead of lowering the bound to the objective and calling the plan OPTIMAL.

Note [ILP scaling]
    Time is counted in integer units of ``time_unit_s`` (1 us, or finer for models whose whole
    microbatch takes under a second: the unit is chosen so that it is >= 1e6 units). Each time
    coefficient is rounded to the nearest unit; the checker allows 0.5 unit per rounded term.
    Memory is counted in ``memory_unit_bytes`` (KiB): every coefficient that adds memory is
    rounded up, every saving (recompute) and the capacity rounded down, so a plan the ILP accepts
    always fits when recomputed in floats (at the price of rejecting plans within a few KiB of
    full).

Note [heterogeneous devices]
    With one device class (kind, memory, speed) the placement is fixed before the model is built
    (rank = stage * dp + replica) and links are exact. On several nodes with several classes,
    ``solve_candidate`` enumerates the placements (Note [exact placements] in placements.py) and
    builds one model per placement, again with exact links. Without a placement,
    ``on_class[s, c]`` chooses the class of stage s (all its d replicas), at most count_c // d
    stages per class; stage time, per-step seconds and memory constraints are enforced only
    under the chosen class (no big-M; never the most of any class, which would lift the bound).
    That model is exact on one node (every link intra-node); on several it is a relaxation:
    every link is priced at the fastest bandwidth and latency the cluster has and the
    core-sharing factor at 1, so its optimum is a lower bound on every plan of every
    placement, and the plan it finds is placed (``place_stages``) and costed by ``evaluate``
    (placed.solve_relaxed). It is used when a candidate has too many placements to enumerate.

Note [tight objective]
    ``bottleneck`` and ``dp_allreduce`` are epigraph variables (>= every stage's term), tight only
    at an optimum. A solution returned at the time limit (FEASIBLE) may leave them above the max
    they bound (seen on Llama-70B, 30 stages x dp 2 x 256 microbatches: the bottleneck kept the
    hint's value, 4.3 ms above the new plan's slowest stage, times m - 1 = 255: +1.09 s), so
    ``solver.objective_value`` overstates the plan's cost. ``solve`` re-evaluates the objective
    expression at the plan's tight values (``hint_values``), which the checker's rounding slack
    is sized for; CP-SAT's bound stays a bound on it.

Note [search help]
    A hint (the best baseline or chain-DP split) gives an incumbent objective U. Then
    (m - 1) * B + sum_s T_s <= U and sum_s T_s >= W bound the bottleneck, B <= (U - W) / (m - 1),
    and with it every region's earliest and latest stage: all its ancestors (and itself) fit in
    stages 0..s only if their work <= (s + 1) * B; its descendants fit after it likewise. These
    fixings and the redundant prefix-work constraints (``_add_prefix_work``) are what make
    96 layers x 16 stages provable in seconds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from partitioner.solver.cp_sat import cp_model  # Note [the solver loads OR-Tools on demand]

from partitioner.config.cluster import ClusterSpec, LinkSpec
from partitioner.solver.model_hints import SearchHelp
from partitioner.solver.model_interleaved import InterleavedConstraints
from partitioner.solver.model_memory import MemoryConstraints
from partitioner.solver.model_placement import PlacementConstraints
from partitioner.solver.model_time import TimeConstraints
from partitioner.solver.placements import fastest_link
from partitioner.solver.problem import (
    PartitionProblem,
    core_sharing_factor,
    region_times_s,
)
from partitioner.solver.device_layout import plan_links
from partitioner.config.settings import check_recompute
from partitioner.solver.recompute_cost import recompute_s, saves_memory
from partitioner.solver.schedules import priced_schedule

__all__ = ["SolverConfig", "CandidateModel", "CandidateResult", "InconsistentBoundError"]


@dataclass(frozen=True)
class SolverConfig:
    time_limit_s: float = 10.0          # per candidate (p, d, m)
    num_workers: int = 2
    allow_recompute: bool = True        # False: recompute "none" (kept in step with ``recompute``)
    time_unit_s: float | None = None    # None: automatic (Note [ILP scaling])
    memory_unit_bytes: int = 1024
    random_seed: int = 0
    deterministic: bool = True
    use_hint: bool = True
    max_microbatches: int | None = None  # cap on m when solve() enumerates it
    total_time_limit_s: float | None = 30.0  # whole enumeration (Note [candidate pruning]); None: none
    log_search: bool = False
    max_placements: int = 64  # per candidate on a multi-node heterogeneous cluster (Note [exact placements])
    local_stages: int | None = None  # interleaved: stages per rank (None: each of LOCAL_STAGE_OPTIONS)
    recompute: str = "auto"  # auto | none | full | selective (Note [recompute a user pins] in solver/recompute_cost.py)

    def __post_init__(self) -> None:
        check_recompute(self.recompute, "SolverConfig.recompute")
        if not self.allow_recompute and self.recompute != "selective":  # the older switch: one setting, two spellings
            if self.recompute == "full":
                raise ValueError("SolverConfig(allow_recompute=False, recompute='full') asks for no recompute and "
                                 "for every region recomputed: give recompute='none' or 'full'")
            object.__setattr__(self, "recompute", "none")
        object.__setattr__(self, "allow_recompute", self.recompute not in ("none", "selective"))  # selective: cores only
        if not self.time_limit_s > 0:
            raise ValueError(f"SolverConfig.time_limit_s={self.time_limit_s!r} must be > 0 seconds")
        if not (isinstance(self.num_workers, int) and self.num_workers >= 1):
            raise ValueError(f"SolverConfig.num_workers={self.num_workers!r} must be an int >= 1 (e.g. 2)")
        if self.time_unit_s is not None and not self.time_unit_s > 0:
            raise ValueError(f"SolverConfig.time_unit_s={self.time_unit_s!r} must be > 0 or None (automatic)")
        if not (isinstance(self.memory_unit_bytes, int) and self.memory_unit_bytes >= 1):
            raise ValueError(f"SolverConfig.memory_unit_bytes={self.memory_unit_bytes!r} must be an int >= 1")
        if self.total_time_limit_s is not None and not self.total_time_limit_s > 0:
            raise ValueError(f"SolverConfig.total_time_limit_s={self.total_time_limit_s!r} must be > 0 or None")
        if isinstance(self.max_placements, bool) or not isinstance(self.max_placements, int) or self.max_placements < 1:
            raise ValueError(f"SolverConfig.max_placements={self.max_placements!r} must be an int >= 1 (e.g. 64)")
        if self.max_microbatches is not None and not (isinstance(self.max_microbatches, int) and self.max_microbatches >= 1):
            raise ValueError(f"SolverConfig.max_microbatches={self.max_microbatches!r} must be an int >= 1 or None")


class InconsistentBoundError(AssertionError):
    """CP-SAT proved a bound above the objective of a plan it returned (Note [no clamped bound]):
    a bug in the model, not in the user's input."""

    def __init__(self, objective: int, bound: int, cp_sat_objective: float, status: str,
                 stage_of_region: tuple[int, ...] | None = None, time_unit_s: float | None = None):
        self.objective, self.bound, self.cp_sat_objective, self.status = objective, bound, cp_sat_objective, status
        self.stage_of_region, self.time_unit_s = stage_of_region, time_unit_s
        super().__init__(
            f"solver model inconsistent: CP-SAT ({status}) proved a bound of {bound} units but returned a plan "
            f"whose own objective is {objective} units (CP-SAT's value of it: {cp_sat_objective:.0f}); the tight "
            "values of that plan violate a constraint of the model (Note [no clamped bound] in "
            "partitioner/solver/model.py). Please report it with the model and cluster.")


@dataclass(frozen=True)
class CandidateResult:
    status: str                      # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN
    stage_of_region: tuple[int, ...] | None
    recompute: tuple[bool, ...] | None
    stage_classes: tuple[tuple, ...] | None  # device class per stage
    objective: int | None
    bound: int | None
    solve_time_s: float
    rounding_slack_units: float

class CandidateModel(PlacementConstraints, TimeConstraints, MemoryConstraints, InterleavedConstraints, SearchHelp):
    """CP-SAT variables and constraints for one candidate; ``solve`` returns a CandidateResult.

    ``placement`` fixes every stage's devices (one device class); without it the cluster's
    classes are chosen per stage (Note [heterogeneous devices]). ``minimize_memory`` replaces the
    time objective by the largest memory overflow over the stages (used to explain infeasibility).
    """

    def __init__(
        self,
        problem: PartitionProblem,
        cluster: ClusterSpec,
        *,
        num_stages: int,
        dp: int,
        num_microbatches: int,
        microbatch_size: int,
        schedule: str,
        config: SolverConfig,
        placement: tuple[tuple[int, ...], ...] | None = None,
        minimize_memory: bool = False,
    ):
        self.problem, self.cluster, self.config = problem, cluster, config
        self.p, self.d, self.m, self.b = num_stages, dp, num_microbatches, microbatch_size
        self.schedule = schedule
        # Note [one class per schedule] in runtime/program/schedules.py
        self.pipeline_schedule = priced_schedule(schedule, config.local_stages)
        self.v = self.pipeline_schedule.local_stages
        self.interleaved = self.v > 1  # several stages per rank: memory per rank (Note [interleaved pricing])
        if self.interleaved and (placement is None or self.v < 2 or num_stages % self.v):
            raise ValueError(f"interleaved needs a placement and local_stages >= 2 dividing {num_stages} stages "
                             f"(got local_stages={config.local_stages})")
        self.pp = num_stages // self.v
        self.placement = placement
        self.minimize_memory = minimize_memory
        self.model = cp_model.CpModel()
        n, p = problem.num_regions, num_stages

        # ---- device classes and links (Note [heterogeneous devices]) --------------------------
        if placement is not None:
            self.classes = [cluster.devices[placement[s][0]].device_class for s in range(p)]
            self.class_device = {c: cluster.devices[placement[s][0]] for s, c in enumerate(self.classes)}
            self.class_capacity = {c: min(cluster.devices[i].usable_memory_bytes for s in range(p) if self.classes[s] == c
                                          for i in placement[s]) for c in set(self.classes)}
            self.boundary_links, self.dp_links, self.tie_link = plan_links(cluster, placement)
            self.exact_links = True
        else:
            counts: dict[tuple, int] = {}
            self.class_device = {}
            for device in cluster.devices:
                counts[device.device_class] = counts.get(device.device_class, 0) + 1
                self.class_device.setdefault(device.device_class, device)
            self.class_slots = {c: k // dp for c, k in counts.items() if k // dp > 0}
            self.classes = sorted(self.class_slots, key=lambda c: -c[2])  # candidates, fastest first
            self.class_capacity = {c: c[1] for c in self.classes}
            fastest = fastest_link(cluster)
            self.boundary_links = [fastest] * (p - 1)
            lanes = cluster.collective_lanes  # Note [collectives as NCCL runs them]
            self.dp_links = [LinkSpec(fastest.bandwidth_bytes_per_s * lanes, fastest.latency_s) if dp > 1
                             else None] * p
            self.tie_link = fastest if p > 1 else None
            # One node whose devices are all core-bound, or none: every link is the intra-node
            # one and the core-sharing factor of p * d ranks there is exact too (Note [whole-step
            # terms]); else this model is a relaxation (Note [heterogeneous devices]).
            self.exact_links = (len({d.node for d in cluster.devices}) == 1
                                and len({d.cores is None for d in cluster.devices}) == 1)

        # ---- scaling (Note [ILP scaling]) -----------------------------------------------------
        b = microbatch_size
        self.region_s = {c: [region_times_s(r, dev, b) for r in problem.regions] for c, dev in self.class_device.items()}
        used_classes = set(self.classes)
        work_s = min(sum(f + w for f, w in self.region_s[c]) for c in used_classes)
        if config.time_unit_s is not None:
            self.time_unit_s = config.time_unit_s
        elif work_s > 0:
            self.time_unit_s = min(1e-6, 10.0 ** math.floor(math.log10(work_s / 1e6)))
        else:
            self.time_unit_s = 1e-6
        if placement is not None:
            self.core_sharing = core_sharing_factor(cluster, placement)
        elif self.exact_links:
            self.core_sharing = core_sharing_factor(cluster, num_ranks=num_stages * dp)
        else:
            self.core_sharing = 1.0  # no placement shares cores less (a relaxation)
        self.coef_unit_s = self.time_unit_s / self.core_sharing  # Note [ILP scaling]
        self.mem_unit = config.memory_unit_bytes
        unit = self.coef_unit_s
        self.fwd_u = {c: [round(f / unit) for f, _ in self.region_s[c]] for c in used_classes}
        self.work_u = {c: [round(f / unit) + round(w / unit) for f, w in self.region_s[c]] for c in used_classes}
        # What recomputing costs (Note [recompute fixed cost]): one rounded term, like fwd_u.
        self.rec_u = {c: [round(recompute_s(problem, r, self.class_device[c], b) / unit) for r in problem.regions]
                      for c in used_classes}
        self.wgt_u = {c: [round(w * region.weight_fraction / unit) for (_, w), region in zip(self.region_s[c], problem.regions)]
                      for c in used_classes}  # Note [weight-gradient flops]
        self.work_min_u = [min(self.work_u[c][r] for c in used_classes) for r in range(n)]

        # ---- variables ------------------------------------------------------------------------
        model = self.model
        one = model.new_constant(1)
        self.one = one
        self.upto = [[model.new_bool_var(f"upto[r{r},s{s}]") if s < p - 1 else one for s in range(p)] for r in range(n)]
        self.in_stage = [[model.new_bool_var(f"in_stage[r{r},s{s}]") if p > 1 else one for s in range(p)] for r in range(n)]
        self.memory_binds = self._memory_can_bind()
        # pinned "full" recomputes even where memory does not bind (Note [recompute a user pins])
        self.recompute_pinned = config.recompute == "full"
        self.recompute_candidates = [
            r for r, region in enumerate(problem.regions)
            if config.allow_recompute and (self.memory_binds or self.recompute_pinned) and saves_memory(region)
        ]
        self.rec = {(r, s): model.new_bool_var(f"recompute[r{r},s{s}]") for r in self.recompute_candidates for s in range(p)}
        self.holds = [[model.new_bool_var(f"holds[tie{t},s{s}]") for s in range(p)] for t in range(len(problem.ties))]
        self.memory_constrained = self.memory_binds or minimize_memory
        self.transient = [model.new_int_var(0, 2**50, f"transient[s{s}]") for s in range(p)] \
            if self.memory_constrained else []
        self.bucket_whole = [model.new_bool_var(f"bucket_whole[s{s}]") for s in range(p)] \
            if self.memory_constrained and dp > 1 else []
        self.on_class = None
        if placement is None:
            self.on_class = [{c: model.new_bool_var(f"on_class[s{s},{c[0]}]") for c in self.classes} for s in range(p)]
        self.stage_time = [model.new_int_var(0, 2**40, f"stage_time[s{s}]") for s in range(p)]
        self.bottleneck = model.new_int_var(0, 2**40, "bottleneck")
        self.dp_allreduce = model.new_int_var(0, 2**40, "dp_allreduce")
        if self.interleaved:
            self.fwd_max = model.new_int_var(0, 2**40, "fwd_max")
            self.bwd_max = model.new_int_var(0, 2**40, "bwd_max")
            self.split = self.pipeline_schedule.split_backward  # Note [zero-bubble pricing]
            self.wgt_max = model.new_int_var(0, 2**40, "wgt_max") if self.split else None
            self.pipe = model.new_int_var(0, 2**50, "pipeline") if self.split else None
            self.peak = [model.new_int_var(0, 2**50, f"peak[s{s}]") for s in range(p)] \
                if self.memory_constrained else []

        # ---- constraints (each family states its inequality) ----------------------------------
        self._add_monotone_upto()
        self._add_dependencies()
        self._add_stage_membership()
        self._add_nonempty_stages()
        self._add_recompute_choice()
        self._add_tie_holding()
        if self.on_class is not None:
            self._add_class_choice()
        self._add_stage_time()
        self._add_bottleneck()
        self._add_prefix_work()
        if self.interleaved:
            self._add_worst_stage()
            self._add_rank_allreduce()
            self.objective = self._interleaved_objective_expr()
        else:
            self._add_dp_allreduce()
            self.objective = self._objective_expr()
        add_memory = self._add_rank_memory if self.interleaved else self._add_memory
        if minimize_memory:
            self.overflow = model.new_int_var(-(2**50), 2**50, "memory_overflow")
            add_memory(overflow=self.overflow)
            model.minimize(self.overflow)
        else:
            if self.memory_binds:
                add_memory()
            model.minimize(self.objective.expr())

    # ---- helpers ------------------------------------------------------------------------------

    def _cross(self, edge, k):
        """Terms of (upto[u, k] - upto[v, k]): 1 exactly when the edge crosses boundary k."""
        return [(1, self.upto[edge.src][k]), (-1, self.upto[edge.dst][k])]

    def _comm_seconds(self, link: LinkSpec, bytes_per_sample: float) -> float:
        return self.b * bytes_per_sample / link.bandwidth_bytes_per_s

    def _memory_can_bind(self) -> bool:
        """False when even one stage holding everything at its peak fits the smallest device: every
        term of Note [memory model] at its largest (each boundary's cut <= the sum of all edges),
        phases summed instead of maxed. Interleaved: always (a rank holds v stages' terms)."""
        if self.interleaved:
            return True
        pr, p, m, b, d = self.problem, self.p, self.m, self.b, self.d
        k_max = max(self.pipeline_schedule.in_flight(s, p, self.m) for s in range(p))
        ties = sum(sum(pr.tie_bytes(t)) for t in pr.ties) * p
        edges = pr.boundary_holders * sum(e.bytes_per_sample for e in pr.edges)
        worst = (sum(r.static_bytes for r in pr.regions) + 2 * ties
                 + k_max * b * (sum(r.activation_bytes_per_sample for r in pr.regions) + 2 * edges)
                 + max(r.transient_bytes(b, True) for r in pr.regions)
                 + 4 * b * edges + d * m * b * (pr.input_bytes_per_sample + pr.target_bytes_per_sample)
                 + (pr.allreduce_bucket_bytes if d > 1 else 0))
        return worst > min(self.class_capacity.values())

    # ---- solving ------------------------------------------------------------------------------

    def solve(self, time_limit_s: float | None = None) -> CandidateResult:
        solver = cp_model.CpSolver()
        params = solver.parameters
        params.max_time_in_seconds = time_limit_s or self.config.time_limit_s
        params.num_workers = self.config.num_workers
        params.random_seed = self.config.random_seed
        # Same inputs must give the same plan (and the same program folder, byte for byte):
        # interleaved search makes the parallel workers' result independent of thread timing.
        params.interleave_search = self.config.deterministic
        params.log_search_progress = self.config.log_search
        start = time.perf_counter()
        status = solver.solve(self.model)
        elapsed = time.perf_counter() - start
        name = solver.status_name(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return CandidateResult(name, None, None, None, None, None, elapsed, 0.0)
        n, p = self.problem.num_regions, self.p
        stage_of_region = tuple(
            next(s for s in range(p) if self.upto[r][s] is self.one or solver.value(self.upto[r][s]))
            for r in range(n)
        )
        recompute = tuple(any(solver.value(self.rec[(r, s)]) for s in range(p) if (r, s) in self.rec) for r in range(n))
        if self.on_class is None:
            stage_classes = tuple(self.classes)
        else:
            stage_classes = tuple(next(c for c in self.classes if solver.value(self.on_class[s][c])) for s in range(p))
        # report the plan's own objective, not CP-SAT's variable values (Note [tight objective])
        objective = self.objective.value(self.hint_values(stage_of_region, recompute, stage_classes))
        slack = self._rounding_slack(stage_of_region, recompute)
        if self.minimize_memory:  # CP-SAT's objective is the overflow there: no bound on time
            return CandidateResult(name, stage_of_region, recompute, stage_classes, objective, None, elapsed, slack)
        bound = math.ceil(solver.best_objective_bound - 1e-6)  # integer objective: integer bound
        if bound > objective:  # Note [no clamped bound]
            raise InconsistentBoundError(objective, bound, solver.objective_value, name, stage_of_region,
                                         self.time_unit_s)
        if objective <= bound:
            name = "OPTIMAL"
        return CandidateResult(name, stage_of_region, recompute, stage_classes, objective, bound, elapsed, slack)

    def _rounding_slack(self, stage_of_region, recompute) -> float:
        """Half a unit per rounded term of the objective (Note [ILP scaling])."""
        if self.interleaved:
            return 0.5 * self._interleaved_slack_terms(stage_of_region, recompute) + 1
        p, m = self.p, self.m
        terms = [1] * p  # the per-microbatch overhead (Note [whole-step terms])
        for r, s in enumerate(stage_of_region):
            terms[s] += 2 + int(recompute[r])
        for k in range(p - 1):
            crossing = sum(1 for e in self.problem.edges if stage_of_region[e.src] <= k < stage_of_region[e.dst])
            terms[k] += crossing + 1
            terms[k + 1] += crossing + 1
        allreduce_terms = max(terms) + len(self.problem.ties) + 1
        tie_terms = len(self.problem.ties) * p
        return 0.5 * ((m - 1) * max(terms) + sum(terms) + allreduce_terms + tie_terms) + 1
