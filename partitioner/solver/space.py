"""The space ``solve`` searches: (stages p, dp d, microbatches m) x a *variant* of the problem,
the tensor-parallel degree and whether the optimizer state is sharded over the replicas.

Note [one enumeration]
    A variant changes the problem and the cluster the ILP sees, never the ILP: tensor groups are
    planned as devices (Note [tensor groups]), sharding divides the optimizer state by d (Note
    [sharding as a candidate]). Every candidate is (p, d, m, variant) and all go through one
    priority queue (Note [candidate pruning] in solve.py): one incumbent prunes every variant, one
    time budget covers them all, and OPTIMAL is a proof over the whole product. (Separate searches
    per variant, each with its own budget and no shared incumbent, made the 70B compile slow.)
    Where sharding is a relaxation of replication (its state never larger on any stage,
    ``sharding_relaxes``, as AdamW's at every d >= 2, and no gloo all-gather), every unsharded plan
    with d > 1 is a sharded plan of the same step time, so those candidates are left out; the winner
    is stated unsharded when its assignment also fits unsharded (the tie-break of Note [sharding as
    a candidate]).
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.solver.candidates import enumerate_candidates
from partitioner.solver.evaluate import evaluate
from partitioner.solver.sdc_cost import default_every
from partitioner.solver.tensor_groups import group_cluster, tp_priced_problem
from partitioner.solver.zero_choice import SHARD_CHOICES, allgather_s, sharded_problem

__all__ = ["Variant", "SearchSpace", "StepTerms"]


# Note [terms outside the ILP]: the program's per-step terms that the ILP's objective leaves out,
# the global gradient norm (with clipping or fp16, partitioner/solver/grad_norm_cost.py) and the
# replica check (partitioner/solver/sdc_cost.py), depend on the stage holding the most gradient and
# state bytes and on the world size, so they can decide between candidates (2 stages x dp 4 against
# 3 x dp 2). The search adds them to every solved candidate's step time before it compares
# candidates (``SearchSpace.extra_s``), as it adds gloo's all-gather of sharded state, and the
# plan's predicted step is that same sum; pruning by a candidate's bound stays sound (the terms are
# >= 0). Within one candidate the split is the ILP's, optimal for the rest of the step: the
# statement of what OPTIMAL covers says so (``scope_words``).
@dataclass(frozen=True)
class StepTerms:
    """Per-step terms of the program beside the ILP's objective (Note [terms outside the ILP]):
    ``global_norm``: the program computes the global gradient norm; ``sdc_every``: the replica
    check interval, None for the default of the candidate's dp (sdc_cost.default_every)."""

    global_norm: bool = False
    sdc_every: int | None = 0

    def every(self, dp: int) -> int:
        if self.sdc_every is not None:
            return self.sdc_every

        return default_every(dp)

    @property
    def any(self) -> bool:
        return self.global_norm or self.sdc_every != 0


@dataclass(frozen=True, order=True)
class Variant:
    tp: int = 1
    sharded: bool = False

    def words(self) -> str:
        return ", ".join(([f"tp {self.tp}"] if self.tp > 1 else []) + (["sharded state"] if self.sharded else []))


class SearchSpace:
    """The variants of one request and their (problem, cluster), built once each.

    ``tp_degrees``: the tensor-parallel degrees to weigh (1 first); ``shard``: "off", "on" (only
    sharded plans, d > 1) or "auto"; ``tp_dp``: whether a tp > 1 plan may also have d > 1 and
    sharded state; ``tp_shard`` (default: ``tp_dp``): whether a tp > 1 plan may have sharded state
    (compile() passes False: the runtime refuses ZeRO-1 with tp, Note [what tensor parallelism runs
    with] in partitioner/frontend/tp_support.py)."""

    def __init__(self, problem, cluster, *, tp_degrees=(1,), shard: str = "off", tp_dp: bool = True,
                 tp_shard: bool | None = None, step_terms: StepTerms | None = None):
        if shard not in SHARD_CHOICES:
            raise ValueError(f"shard_optimizer {shard!r} is not one of {list(SHARD_CHOICES)}")
        degrees = sorted(set(tp_degrees))
        if not degrees or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in degrees):
            raise ValueError(f"tensor-parallel degrees {tuple(tp_degrees)!r} must be ints >= 1")
        self.problem, self.cluster, self.shard, self.tp_dp = problem, cluster, shard, tp_dp
        self.tp_shard = tp_dp if tp_shard is None else tp_shard
        self.tp_degrees = tuple(degrees)
        self.step_terms = step_terms or StepTerms()
        self._grouped: dict[int, tuple] = {}
        self._inputs: dict[tuple, tuple] = {}
        self._relaxes: dict[tuple, bool] = {}  # (tp, dp) -> sharding_relaxes: asked once per candidate

    def grouped(self, tp: int):
        """(problem, cluster) with tensor groups of ``tp`` as devices."""
        if tp not in self._grouped:
            self._grouped[tp] = ((self.problem, self.cluster) if tp == 1 else
                                 (tp_priced_problem(self.problem, self.cluster, tp), group_cluster(self.cluster, tp)))
        return self._grouped[tp]

    def inputs(self, variant: Variant, dp: int):
        """(problem, cluster) the ILP solves for ``variant`` at ``dp`` replicas."""
        key = (variant, dp if variant.sharded else 0)
        if key not in self._inputs:
            problem, cluster = self.grouped(variant.tp)
            self._inputs[key] = (sharded_problem(problem, dp) if variant.sharded else problem, cluster)
        return self._inputs[key]

    def extra_s(self, variant: Variant, assignment) -> float:
        """Step time the ILP does not see: gloo's all-gather of sharded state (zero_choice.allgather_s),
        the gradient norm and the replica check (Note [terms outside the ILP])."""
        problem, cluster = self.inputs(variant, assignment.dp)
        extra = 0.0
        if variant.sharded:
            extra += allgather_s(problem, cluster, assignment)
        if self.step_terms.any:
            # Note [no replica check on sharded state] in runtime/resilience/sdc.py: a sharded plan runs none
            every = 0 if variant.sharded else self.step_terms.every(assignment.dp)
            cost = evaluate(problem, cluster, assignment, sdc_every=every, global_norm=self.step_terms.global_norm)
            extra += cost.sdc_check_s + cost.grad_norm_s
        return extra

    def sharding_relaxes(self, tp: int, dp: int) -> bool:
        """Sharded plans at ``dp`` are never slower nor larger than unsharded ones (Note [one enumeration]).
        Memoized per (tp, dp): the enumeration asks it per candidate, and the device scan is O(ranks)."""
        if (tp, dp) not in self._relaxes:
            self._relaxes[(tp, dp)] = self._sharding_relaxes(tp, dp)
        return self._relaxes[(tp, dp)]

    def _sharding_relaxes(self, tp: int, dp: int) -> bool:
        problem, cluster = self.grouped(tp)
        if any(device.kind == "cpu" for device in cluster.devices):  # gloo's extra all-gather
            return False
        keep = (dp - 1) / dp
        if any(r.optimizer_bytes * keep < r.grad_bytes for r in problem.regions):
            return False
        return all(problem.tie_bytes(t)[2] * keep >= problem.tie_bytes(t)[1] for t in problem.ties)

    def variants(self, dp: int) -> list[Variant]:
        """The variants a candidate with ``dp`` replicas is searched in."""
        out = []
        for tp in self.tp_degrees:
            if tp > 1 and dp > 1 and not self.tp_dp:
                continue
            shard_ok = dp > 1 and (tp == 1 or (self.tp_dp and self.tp_shard))
            if self.shard == "on":
                out += [Variant(tp, True)] if shard_ok else []
            elif self.shard == "off" or not shard_ok:
                out.append(Variant(tp, False))
            elif self.sharding_relaxes(tp, dp):
                out.append(Variant(tp, True))
            else:
                out += [Variant(tp, False), Variant(tp, True)]
        return out

    def candidates(self, global_batch, num_stages, dp, microbatches, config, schedule):
        """Every (p, d, m, variant) the request allows (candidates.enumerate_candidates per degree)."""
        out = []
        for tp in self.tp_degrees:
            problem, cluster = self.grouped(tp)
            for p, d, m in enumerate_candidates(problem, cluster, global_batch, num_stages, dp, microbatches,
                                                config, schedule):
                out += [(p, d, m, v) for v in self.variants(d) if v.tp == tp]
        return out

    def unsharded_if_it_fits(self, variant: Variant, assignment) -> Variant:
        """The tie-break of Note [sharding as a candidate] for a relaxed winner (Note [one enumeration])."""
        if not variant.sharded or self.shard != "auto" or not self.sharding_relaxes(variant.tp, assignment.dp):
            return variant

        problem, cluster = self.grouped(variant.tp)
        return Variant(variant.tp, False) if evaluate(problem, cluster, assignment).fits_memory else variant

    def scope_words(self) -> str:
        """What the space adds to Note [honest optimality]'s statement of what OPTIMAL covers."""
        tp = ("tensor-parallel degree 1" if self.tp_degrees == (1,) else
              f"tensor-parallel degrees {', '.join(map(str, self.tp_degrees))}"
              + ("" if self.tp_dp and self.tp_shard else
                 " (tp > 1 with dp 1, unsharded: what the runtime runs)" if not self.tp_dp else
                 " (tp > 1 unsharded: what the runtime runs)"))
        shard = {"off": "optimizer state replicated", "on": "optimizer state sharded (dp > 1)",
                 "auto": "optimizer state replicated or sharded per dp"}[self.shard]
        terms = [name for name, on in (("the gradient norm", self.step_terms.global_norm),
                                       ("the replica check", self.step_terms.sdc_every != 0)) if on]
        outside = (f"; {' and '.join(terms)} weighed between candidates on each one's split, outside the ILP "
                   "(Note [terms outside the ILP])") if terms else ""
        return f"{tp}; {shard}{outside}"

