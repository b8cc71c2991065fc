"""The CP-SAT model of one candidate: fixed stages p, replicas d, microbatches m, schedule, b.

The model transcribes ``evaluate`` (Note [cost model] in check.py) into integers. Every
constraint family is one ``_add_*`` method whose docstring states its inequality.

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
    (rank = stage * dp + replica) and links are exact. With several classes, ``on_class[s, c]``
    chooses the class of stage s (all its d replicas), at most count_c // d stages per class;
    stage time and memory constraints are enforced only under the chosen class (no big-M).
    Links are then taken as the slowest link in the cluster, conservatively; devices are placed
    after solving (``place_stages``) and the plan is costed exactly by ``evaluate``.

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

from ortools.sat.python import cp_model

from partitioner.cluster import ClusterSpec, LinkSpec
from partitioner.solver.check import plan_links
from partitioner.solver.problem import (
    SCHEDULES,
    PartitionProblem,
    core_sharing_factor,
    in_flight_microbatches,
    microbatch_overhead_s,
    region_times_s,
)

__all__ = ["SolverConfig", "CandidateModel", "CandidateResult"]


@dataclass(frozen=True)
class SolverConfig:
    time_limit_s: float = 10.0          # per candidate (p, d, m)
    num_workers: int = 2
    allow_recompute: bool = True
    time_unit_s: float | None = None    # None: automatic (Note [ILP scaling])
    memory_unit_bytes: int = 1024
    random_seed: int = 0
    deterministic: bool = True
    use_hint: bool = True
    max_microbatches: int | None = None  # cap on m when solve() enumerates it
    total_time_limit_s: float | None = 30.0  # whole enumeration (Note [candidate pruning]); None: none
    log_search: bool = False

    def __post_init__(self) -> None:
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
        if self.max_microbatches is not None and not (isinstance(self.max_microbatches, int) and self.max_microbatches >= 1):
            raise ValueError(f"SolverConfig.max_microbatches={self.max_microbatches!r} must be an int >= 1 or None")


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


class _Expr:
    """A linear expression kept as terms so it can be both posted and evaluated on a hint."""

    def __init__(self, const: int = 0):
        self.vars: list[cp_model.IntVar] = []
        self.coefs: list[int] = []
        self.const = const

    def add(self, coef: int, var) -> None:
        if coef:
            self.vars.append(var)
            self.coefs.append(int(coef))

    def expr(self):
        return cp_model.LinearExpr.weighted_sum(self.vars, self.coefs) + self.const

    def value(self, values: dict[int, int]) -> int:
        return self.const + sum(c * values[v.index] for v, c in zip(self.vars, self.coefs))


class CandidateModel:
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
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
        self.problem, self.cluster, self.config = problem, cluster, config
        self.p, self.d, self.m, self.b = num_stages, dp, num_microbatches, microbatch_size
        self.schedule = schedule
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
            worst = cluster.slowest_link(list(range(cluster.num_devices))) or cluster.intra_node_link
            self.boundary_links = [worst] * (p - 1)
            self.dp_links = [worst if dp > 1 else None] * p
            self.tie_link = worst if p > 1 else None
            # One node whose devices are all core-bound, or none: the core-sharing factor of
            # p * d ranks there is exact too (Note [whole-step terms]).
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
        self.core_sharing = (core_sharing_factor(cluster, placement) if placement is not None
                             else core_sharing_factor(cluster, num_ranks=num_stages * dp))
        self.coef_unit_s = self.time_unit_s / self.core_sharing  # Note [ILP scaling]
        self.mem_unit = config.memory_unit_bytes
        unit = self.coef_unit_s
        self.fwd_u = {c: [round(f / unit) for f, _ in self.region_s[c]] for c in used_classes}
        self.work_u = {c: [round(f / unit) + round(w / unit) for f, w in self.region_s[c]] for c in used_classes}
        self.work_min_u = [min(self.work_u[c][r] for c in used_classes) for r in range(n)]

        # ---- variables ------------------------------------------------------------------------
        model = self.model
        one = model.new_constant(1)
        self.one = one
        self.upto = [[model.new_bool_var(f"upto[r{r},s{s}]") if s < p - 1 else one for s in range(p)] for r in range(n)]
        self.in_stage = [[model.new_bool_var(f"in_stage[r{r},s{s}]") if p > 1 else one for s in range(p)] for r in range(n)]
        self.memory_binds = self._memory_can_bind()
        self.recompute_candidates = [
            r for r, region in enumerate(problem.regions)
            if config.allow_recompute and self.memory_binds
            and region.activation_bytes_per_sample > region.recompute_activation_bytes_per_sample
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
        self._add_dp_allreduce()
        self.objective = self._objective_expr()
        if minimize_memory:
            self.overflow = model.new_int_var(-(2**50), 2**50, "memory_overflow")
            self._add_memory(overflow=self.overflow)
            model.minimize(self.overflow)
        else:
            if self.memory_binds:
                self._add_memory()
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
        phases summed instead of maxed."""
        pr, p, m, b, d = self.problem, self.p, self.m, self.b, self.d
        k_max = max(in_flight_microbatches(self.schedule, s, p, self.m) for s in range(p))
        ties = sum(sum(pr.tie_bytes(t)) for t in pr.ties) * p
        edges = sum(e.bytes_per_sample for e in pr.edges)
        worst = (sum(r.static_bytes for r in pr.regions) + 2 * ties
                 + k_max * b * (sum(r.activation_bytes_per_sample for r in pr.regions) + edges)
                 + max(r.transient_bytes(b, True) for r in pr.regions)
                 + (2 * m + 1) * b * edges + d * m * b * (pr.input_bytes_per_sample + pr.target_bytes_per_sample)
                 + (pr.allreduce_bucket_bytes if d > 1 else 0))
        return worst > min(self.class_capacity.values())

    # ---- constraint families ------------------------------------------------------------------

    def _add_monotone_upto(self) -> None:
        """upto[r, s] <= upto[r, s + 1]: a region in a stage <= s is in a stage <= s + 1."""
        for row in self.upto:
            for s in range(self.p - 2):
                self.model.add_implication(row[s], row[s + 1])

    def _add_dependencies(self) -> None:
        """upto[v, s] <= upto[u, s] for every edge u -> v: data never flows to an earlier stage."""
        for e in self.problem.edges:
            for s in range(self.p - 1):
                self.model.add_implication(self.upto[e.dst][s], self.upto[e.src][s])

    def _add_stage_membership(self) -> None:
        """in_stage[r, s] = upto[r, s] - upto[r, s - 1] (upto[r, -1] = 0)."""
        if self.p == 1:
            return
        for r in range(self.problem.num_regions):
            for s in range(self.p):
                previous = self.upto[r][s - 1] if s > 0 else 0
                self.model.add(self.in_stage[r][s] == self.upto[r][s] - previous)

    def _add_nonempty_stages(self) -> None:
        """sum_r in_stage[r, s] >= 1: every stage runs something."""
        for s in range(self.p):
            self.model.add_bool_or([self.in_stage[r][s] for r in range(self.problem.num_regions)])

    def _add_recompute_choice(self) -> None:
        """recompute[r, s] <= in_stage[r, s]: a region recomputes on the stage that holds it."""
        for (r, s), var in self.rec.items():
            self.model.add_implication(var, self.in_stage[r][s])
        self._add_recompute_symmetry_breaking()

    def _add_recompute_symmetry_breaking(self) -> None:
        """recompute[r2, s] and in_stage[r1, s] => recompute[r1, s] for identical regions r1 < r2
        (consecutive among their kind): which of a stage's identical layers recompute does not
        change any cost, so the earliest ones do. Keeps one optimum out of many symmetric ones."""
        groups: dict[tuple, list[int]] = {}
        for r in self.recompute_candidates:
            region = self.problem.regions[r]
            signature = (region.fwd_flops_per_sample, region.bwd_flops_per_sample, region.static_bytes,
                         region.activation_bytes_per_sample, region.recompute_activation_bytes_per_sample,
                         tuple(sorted((region.fwd_s_per_sample_by_kind or {}).items())),
                         tuple(sorted((region.bwd_s_per_sample_by_kind or {}).items())),
                         tuple(sorted((region.fwd_s_per_microbatch_by_kind or {}).items())),
                         tuple(sorted((region.bwd_s_per_microbatch_by_kind or {}).items())))
            groups.setdefault(signature, []).append(r)
        tied = {r for tie in self.problem.ties for r in tie.regions}
        for members in groups.values():
            members = [r for r in members if r not in tied]  # a tie makes a region unique
            for r1, r2 in zip(members, members[1:]):
                for s in range(self.p):
                    self.model.add_bool_or([self.rec[(r1, s)], ~self.rec[(r2, s)], ~self.in_stage[r1][s]])

    def _add_tie_holding(self) -> None:
        """holds[t, s] = OR_{r in tie t} in_stage[r, s]: stage s keeps a copy of the tie."""
        for t, tie in enumerate(self.problem.ties):
            for s in range(self.p):
                members = [self.in_stage[r][s] for r in tie.regions]
                self.model.add_max_equality(self.holds[t][s], members)

    def _add_class_choice(self) -> None:
        """sum_c on_class[s, c] = 1; sum_s on_class[s, c] <= count_c // dp."""
        for s in range(self.p):
            self.model.add_exactly_one(self.on_class[s].values())
        for c in self.classes:
            self.model.add(sum(self.on_class[s][c] for s in range(self.p)) <= self.class_slots[c])

    def _stage_time_expr(self, s: int, device_class) -> _Expr:
        unit, p = self.coef_unit_s, self.p
        expr = _Expr(round(microbatch_overhead_s(self.problem, self.class_device[device_class]) / unit))
        for r in range(self.problem.num_regions):
            expr.add(self.work_u[device_class][r], self.in_stage[r][s])
            if (r, s) in self.rec:
                expr.add(self.fwd_u[device_class][r], self.rec[(r, s)])
        for k in ([s - 1] if s > 0 else []) + ([s] if s < p - 1 else []):
            link = self.boundary_links[k]
            expr.const += round(link.latency_s / unit)
            for e in self.problem.edges:
                coef = round(self._comm_seconds(link, e.bytes_per_sample) / unit)
                for sign, var in self._cross(e, k):
                    expr.add(sign * coef, var)
        return expr

    def _add_stage_time(self) -> None:
        """stage_time[s] = overhead + sum_r work[r]·in_stage[r, s] + sum_r fwd[r]·recompute[r, s]
        + sends over the adjacent boundaries (latency + b·cut bytes / bandwidth); with device
        classes, >= that expression under on_class[s, c]."""
        self.stage_time_exprs: list[dict] = []
        for s in range(self.p):
            if self.on_class is None:
                expr = self._stage_time_expr(s, self.classes[s])
                self.model.add(self.stage_time[s] == expr.expr())
                self.stage_time_exprs.append({self.classes[s]: expr})
            else:
                exprs = {}
                for c in self.classes:
                    exprs[c] = self._stage_time_expr(s, c)
                    self.model.add(self.stage_time[s] >= exprs[c].expr()).only_enforce_if(self.on_class[s][c])
                self.stage_time_exprs.append(exprs)

    def _add_bottleneck(self) -> None:
        """bottleneck >= stage_time[s] for every s; bottleneck >= the largest region's work and,
        with identical stages, >= ceil(total work / p)."""
        for s in range(self.p):
            self.model.add(self.bottleneck >= self.stage_time[s])
        self.model.add(self.bottleneck >= max(self.work_min_u))
        if self.on_class is None and len(set(self.classes)) == 1:
            self.model.add(self.bottleneck * self.p >= sum(self.work_min_u))

    def _add_prefix_work(self) -> None:
        """Redundant: sum_r work[r]·upto[r, k] <= (k + 1)·bottleneck and
        sum_r work[r]·(1 - upto[r, k]) <= (p - 1 - k)·bottleneck for each boundary k."""
        total = sum(self.work_min_u)
        for k in range(self.p - 1):
            prefix = cp_model.LinearExpr.weighted_sum([row[k] for row in self.upto], self.work_min_u)
            self.model.add(prefix <= (k + 1) * self.bottleneck)
            self.model.add(total - prefix <= (self.p - 1 - k) * self.bottleneck)

    def _dp_allreduce_expr(self, s: int) -> _Expr:
        link, d, unit = self.dp_links[s], self.d, self.coef_unit_s
        expr = _Expr()
        if link is None or d == 1:
            return expr
        per_byte = 2 * (d - 1) / d / link.bandwidth_bytes_per_s / unit
        expr.const = round(2 * (d - 1) * link.latency_s / unit)
        for r, region in enumerate(self.problem.regions):
            expr.add(round(region.grad_bytes * per_byte), self.in_stage[r][s])
        for t, tie in enumerate(self.problem.ties):
            coef = round(self.problem.tie_bytes(tie)[1] * per_byte)
            expr.add(coef, self.holds[t][s])
            expr.add(-coef, self.in_stage[tie.regions[0]][s])
        return expr

    def _add_dp_allreduce(self) -> None:
        """dp_allreduce >= 2 (d-1)/d · grad_bytes[s] / bw + 2 (d-1) · latency for every stage s."""
        self.dp_allreduce_exprs = [self._dp_allreduce_expr(s) for s in range(self.p)]
        for expr in self.dp_allreduce_exprs:
            if expr.vars or expr.const:
                self.model.add(self.dp_allreduce >= expr.expr())

    def _tie_cost_expr(self) -> _Expr:
        """sum_t (latency + tie grad bytes / bw) · (sum_s holds[t, s] - 1)."""
        expr = _Expr()
        if self.tie_link is None:
            return expr
        for t, tie in enumerate(self.problem.ties):
            if self.problem.tie_bytes(tie)[1] == 0:
                continue  # a held buffer: no gradient, nothing to sum
            coef = round(self.tie_link.transfer_s(self.problem.tie_bytes(tie)[1]) / self.coef_unit_s)
            expr.const -= coef
            for s in range(self.p):
                expr.add(coef, self.holds[t][s])
        return expr

    def _objective_expr(self) -> _Expr:
        """(m - 1)·bottleneck + sum_s stage_time[s] + dp_allreduce + tie costs."""
        expr = self._tie_cost_expr()
        expr.add(self.m - 1, self.bottleneck)
        for s in range(self.p):
            expr.add(1, self.stage_time[s])
        expr.add(1, self.dp_allreduce)
        return expr

    # ---- memory (Note [memory model] in check.py) ----------------------------------------------

    def _grads_expr(self, s: int) -> _Expr:
        """Gradient bytes of stage s (tie replicas included), in memory units rounded up."""
        pr, unit = self.problem, self.mem_unit
        expr = _Expr()
        for r, region in enumerate(pr.regions):
            expr.add(math.ceil(region.grad_bytes / unit), self.in_stage[r][s])
        for t, tie in enumerate(pr.ties):
            coef = math.ceil(pr.tie_bytes(tie)[1] / unit)
            expr.add(coef, self.holds[t][s])
            expr.add(-coef, self.in_stage[tie.regions[0]][s])
        return expr

    def _held_expr(self, s: int) -> _Expr:
        """static + buffers of stage s: what it holds in both phases, in memory units."""
        pr, b, m, d, unit = self.problem, self.b, self.m, self.d, self.mem_unit
        expr = _Expr()
        for r, region in enumerate(pr.regions):
            expr.add(math.ceil(region.static_bytes / unit), self.in_stage[r][s])
        for t, tie in enumerate(pr.ties):
            coef = math.ceil(sum(pr.tie_bytes(tie)) / unit)
            expr.add(coef, self.holds[t][s])
            expr.add(-coef, self.in_stage[tie.regions[0]][s])
        # receive buffers: m·b·(cut_in + cut_out) + b·cut_in; every rank holds the global batch
        for e in pr.edges:
            for k, coef in ((s - 1, math.ceil((m + 1) * b * e.bytes_per_sample / unit)),
                            (s, math.ceil(m * b * e.bytes_per_sample / unit))):
                if 0 <= k < self.p - 1:
                    for sign, var in self._cross(e, k):
                        expr.add(sign * coef, var)
        expr.const += math.ceil(d * m * b * (pr.input_bytes_per_sample + pr.target_bytes_per_sample) / unit)
        return expr

    def _activation_expr(self, s: int) -> _Expr:
        """k_s·b·(saved activations + cut_out) - recompute savings, in memory units."""
        pr, b, unit = self.problem, self.b, self.mem_unit
        in_flight = in_flight_microbatches(self.schedule, s, self.p, self.m)
        expr = _Expr()
        for r, region in enumerate(pr.regions):
            expr.add(math.ceil(in_flight * b * region.activation_bytes_per_sample / unit), self.in_stage[r][s])
            if (r, s) in self.rec:
                saved = region.activation_bytes_per_sample - region.recompute_activation_bytes_per_sample
                expr.add(-math.floor(in_flight * b * saved / unit), self.rec[(r, s)])
        if s < self.p - 1:
            for e in pr.edges:
                coef = math.ceil(in_flight * b * e.bytes_per_sample / unit)
                for sign, var in self._cross(e, s):
                    expr.add(sign * coef, var)
        return expr

    def _transient_terms(self, s: int) -> list[list[tuple[int, object]]]:
        """Per region r: the terms of transient_r(b)·in_stage[r, s] + b·activations_r·recompute[r, s]."""
        b, unit = self.b, self.mem_unit
        out = []
        for r, region in enumerate(self.problem.regions):
            terms = []
            coef = math.ceil(region.transient_bytes(b, False) / unit)
            if coef:
                terms.append((coef, self.in_stage[r][s]))
            if (r, s) in self.rec:
                terms.append((math.ceil(b * region.activation_bytes_per_sample / unit), self.rec[(r, s)]))
            if terms:
                out.append(terms)
        return out

    def _add_transient(self) -> None:
        """transient[s] >= transient_r(b)·in_stage[r, s] + b·activations_r·recompute[r, s] for every
        region r: the epigraph of the per-stage maximum (one region runs backward at a time).
        transient[s] only appears on the small side of memory <= capacity, so any feasible plan
        can lower it to the maximum itself: the epigraph is exact for feasibility."""
        for s in range(self.p):
            for terms in self._transient_terms(s):
                self.model.add(self.transient[s] >= sum(c * v for c, v in terms))

    def _capacity_rhs(self, s: int, c, overflow):
        capacity = self.class_capacity[c] // self.mem_unit
        return capacity if overflow is None else capacity + overflow

    def _enforce_per_class(self, s: int, lhs, overflow, extra_literal=None) -> None:
        """lhs <= capacity of stage s's device class (under on_class[s, c] when classes are chosen)."""
        for c in (self.classes[s:s + 1] if self.on_class is None else self.classes):
            literals = ([self.on_class[s][c]] if self.on_class is not None else []) + (
                [extra_literal] if extra_literal is not None else [])
            constraint = self.model.add(lhs <= self._capacity_rhs(s, c, overflow))
            if literals:
                constraint.only_enforce_if(literals)

    def _add_memory(self, overflow=None) -> None:
        """Backward phase: static + buffers + activations + transient[s] <= capacity of the stage's
        device (<= capacity + overflow when explaining infeasibility). Note [memory model]."""
        self.memory_exprs = []
        for s in range(self.p):
            expr = self._held_expr(s)
            activations = self._activation_expr(s)
            expr.vars += activations.vars
            expr.coefs += activations.coefs
            expr.const += activations.const
            expr.add(1, self.transient[s])
            self.memory_exprs.append(expr)
            self._enforce_per_class(s, expr.expr(), overflow)
        self._add_transient()
        self._add_step_memory(overflow)

    def _add_step_memory(self, overflow=None) -> None:
        """Step phase: static + buffers + tie gradient copies + min(grads[s], bucket) <= capacity,
        the min (d > 1 only) as a disjunction: bucket_whole[s] => (... + grads[s] <= capacity),
        not bucket_whole[s] => (... + bucket <= capacity). Note [memory model]."""
        pr, unit = self.problem, self.mem_unit
        self.step_exprs = []
        for s in range(self.p):
            expr = self._held_expr(s)
            for t, tie in enumerate(pr.ties):
                expr.add(math.ceil(pr.tie_bytes(tie)[1] / unit), self.holds[t][s])
            self.step_exprs.append(expr)
            if self.d == 1:
                self._enforce_per_class(s, expr.expr(), overflow)
                continue
            grads = self._grads_expr(s)
            self._enforce_per_class(s, expr.expr() + grads.expr(), overflow, self.bucket_whole[s])
            self._enforce_per_class(s, expr.expr() + math.ceil(pr.allreduce_bucket_bytes / unit), overflow,
                                    self.bucket_whole[s].Not())

    def memory_fits(self, values: dict[int, int], stage_classes) -> bool:
        """Whether a plan's variable values (``hint_values``) satisfy every memory constraint."""
        if not self.memory_binds:
            return True
        bucket = math.ceil(self.problem.allreduce_bucket_bytes / self.mem_unit)
        for s in range(self.p):
            capacity = self.class_capacity[stage_classes[s]] // self.mem_unit
            step = self.step_exprs[s].value(values)
            if self.d > 1:
                step += min(self._grads_expr(s).value(values), bucket)
            if self.memory_exprs[s].value(values) > capacity or step > capacity:
                return False
        return True

    # ---- hints and search help (Note [search help]) -------------------------------------------

    def hint_values(self, stage_of_region, recompute, stage_classes=None) -> dict[int, int]:
        """Values of every variable for a given plan (for AddHint and its objective)."""
        values: dict[int, int] = {self.one.index: 1}
        p = self.p
        for r, s_r in enumerate(stage_of_region):
            for s in range(p):
                values[self.upto[r][s].index] = int(s_r <= s)
                values[self.in_stage[r][s].index] = int(s_r == s)
                if (r, s) in self.rec:
                    values[self.rec[(r, s)].index] = int(bool(recompute[r]) and s_r == s)
        for t, tie in enumerate(self.problem.ties):
            held = {stage_of_region[r] for r in tie.regions}
            for s in range(p):
                values[self.holds[t][s].index] = int(s in held)
        classes = list(stage_classes) if stage_classes is not None else list(self.classes)
        if self.on_class is not None:
            for s in range(p):
                for c in self.classes:
                    values[self.on_class[s][c].index] = int(classes[s] == c)
        for s in range(p):
            values[self.stage_time[s].index] = self.stage_time_exprs[s][classes[s]].value(values)
        values[self.bottleneck.index] = max(values[self.stage_time[s].index] for s in range(p))
        values[self.dp_allreduce.index] = max([0] + [e.value(values) for e in self.dp_allreduce_exprs])
        if self.memory_constrained:
            bucket = math.ceil(self.problem.allreduce_bucket_bytes / self.mem_unit)
            for s in range(p):
                values[self.transient[s].index] = max(
                    [0] + [sum(c * values[v.index] for c, v in terms) for terms in self._transient_terms(s)])
                if self.bucket_whole:
                    values[self.bucket_whole[s].index] = int(self._grads_expr(s).value(values) <= bucket)
        return values

    def add_hint(self, values: dict[int, int], *, cap_objective: bool = True) -> int:
        """Hint every variable; with ``cap_objective`` also require objective <= the hint's and
        fix what that implies (Note [search help]). Returns the hint's objective."""
        model = self.model
        for var in self._all_vars():
            model.add_hint(var, values[var.index])
        objective = self.objective.value(values)
        if cap_objective and not self.minimize_memory:
            model.add(self.objective.expr() <= objective)
            self._fix_by_bottleneck_cap(objective)
        return objective

    def cap_objective(self, cap_units: int) -> None:
        """objective <= cap_units, and the stage fixings it implies (Note [search help])."""
        if not self.minimize_memory:
            self.model.add(self.objective.expr() <= cap_units)
            self._fix_by_bottleneck_cap(cap_units)

    def max_rounding_s(self) -> float:
        """An upper bound, in seconds, on ``_rounding_slack`` of any plan of this candidate."""
        pr, p, m = self.problem, self.p, self.m
        terms = 3 * pr.num_regions + 2 * (len(pr.edges) + 1) + 1
        return (0.5 * ((m - 1) * terms + p * terms + terms + 1 + len(pr.ties) * (p + 1)) + 1) * self.time_unit_s

    def _all_vars(self):
        for row in self.upto:
            yield from (v for v in row if v is not self.one)
        if self.p > 1:
            for row in self.in_stage:
                yield from row
        yield from self.rec.values()
        for row in self.holds:
            yield from row
        if self.on_class is not None:
            for row in self.on_class:
                yield from row.values()
        yield from self.stage_time
        yield self.bottleneck
        yield self.dp_allreduce
        yield from self.transient
        yield from self.bucket_whole

    def _fix_by_bottleneck_cap(self, objective_cap: int) -> None:
        n, p, m = self.problem.num_regions, self.p, self.m
        if p == 1:
            return
        work = self.work_min_u
        total = sum(work)
        # (m - 1)·B + sum_s T_s <= cap and sum_s T_s >= total work; with m = 1 only B <= cap.
        b_max = objective_cap if m == 1 else (objective_cap - total) // (m - 1)
        self.model.add(self.bottleneck <= max(b_max, 0))
        if b_max <= 0:
            return
        ancestors = [0] * n
        for e in sorted(self.problem.edges, key=lambda e: e.dst):
            ancestors[e.dst] |= ancestors[e.src] | (1 << e.src)
        descendants = [0] * n
        for e in sorted(self.problem.edges, key=lambda e: -e.src):
            descendants[e.src] |= descendants[e.dst] | (1 << e.dst)

        def bits_work(mask: int) -> int:
            total_work, r = 0, 0
            while mask:
                if mask & 1:
                    total_work += work[r]
                mask >>= 1
                r += 1
            return total_work

        for r in range(n):
            earliest = math.ceil((bits_work(ancestors[r]) + work[r]) / b_max) - 1
            latest = p - math.ceil((bits_work(descendants[r]) + work[r]) / b_max)
            for s in range(p - 1):
                if s < earliest:
                    self.model.add(self.upto[r][s] == 0)
                elif s >= latest:
                    self.model.add(self.upto[r][s] == 1)

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
        # Note [tight objective]: report the plan's own objective, not CP-SAT's variable values.
        objective = self.objective.value(self.hint_values(stage_of_region, recompute, stage_classes))
        bound = min(round(solver.best_objective_bound), objective)
        if objective <= bound:
            name = "OPTIMAL"
        slack = self._rounding_slack(stage_of_region, recompute)
        return CandidateResult(name, stage_of_region, recompute, stage_classes, objective, bound, elapsed, slack)

    def _rounding_slack(self, stage_of_region, recompute) -> float:
        """Half a unit per rounded term of the objective (Note [ILP scaling])."""
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
