"""Constraint families of the CandidateModel that bound memory per stage (Note [memory model] in
partitioner/solver/evaluate.py): every coefficient that adds memory rounded up (Note [ILP scaling] in
model.py)."""

from __future__ import annotations

import math

from partitioner.solver.terms import Terms


class MemoryConstraints:
    """Each stage's peak memory within its device class's capacity. A mixin of CandidateModel,
    which owns the variables."""

    def _grads_expr(self, s: int) -> Terms:
        """Gradient bytes of stage s (tie replicas included), in memory units rounded up."""
        pr, unit = self.problem, self.mem_unit
        expr = Terms()
        for r, region in enumerate(pr.regions):
            expr.add(math.ceil(region.grad_bytes / unit), self.in_stage[r][s])
        for t, tie in enumerate(pr.ties):
            coef = math.ceil(pr.tie_bytes(tie)[1] / unit)
            expr.add(coef, self.holds[t][s])
            expr.add(-coef, self.in_stage[tie.regions[0]][s])
        return expr

    def _held_expr(self, s: int) -> Terms:
        """static + buffers of stage s: what it holds in both phases, in memory units."""
        pr, b, m, d, unit = self.problem, self.b, self.m, self.d, self.mem_unit
        h = pr.boundary_holders  # Note [boundary holders] in tensor_groups.py
        expr = Terms()
        for r, region in enumerate(pr.regions):
            expr.add(math.ceil(region.static_bytes / unit), self.in_stage[r][s])
        for t, tie in enumerate(pr.ties):
            coef = math.ceil(sum(pr.tie_bytes(tie)) / unit)
            expr.add(coef, self.holds[t][s])
            expr.add(-coef, self.in_stage[tie.regions[0]][s])
        # receive buffers in flight: 2·b·(cut_in + cut_out); every rank holds the global batch
        for e in pr.edges:
            for k, coef in ((s - 1, math.ceil(2 * b * h * e.bytes_per_sample / unit)),
                            (s, math.ceil(2 * b * h * e.bytes_per_sample / unit))):
                if 0 <= k < self.p - 1:
                    for sign, var in self._cross(e, k):
                        expr.add(sign * coef, var)
        expr.const += math.ceil(d * m * b * (pr.input_bytes_per_sample + pr.target_bytes_per_sample) / unit)
        return expr

    def _activation_expr(self, s: int) -> Terms:
        """k_s·b·(saved activations + cut_out + cut_in) - recompute savings, in memory units."""
        pr, b, unit = self.problem, self.b, self.mem_unit
        in_flight = self.pipeline_schedule.in_flight(s, self.p, self.m)
        expr = Terms()
        for r, region in enumerate(pr.regions):
            expr.add(math.ceil(in_flight * b * region.activation_bytes_per_sample / unit), self.in_stage[r][s])
            if (r, s) in self.rec:
                saved = region.activation_bytes_per_sample - region.recompute_activation_bytes_per_sample
                expr.add(-math.floor(in_flight * b * saved / unit), self.rec[(r, s)])
        for e in pr.edges:  # held outputs (cut_out) and received inputs (cut_in) of the microbatches in flight
            coef = math.ceil(in_flight * b * pr.boundary_holders * e.bytes_per_sample / unit)
            for k in (s - 1, s):
                if 0 <= k < self.p - 1:
                    for sign, var in self._cross(e, k):
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
        if self.interleaved:
            return self._interleaved_memory_fits(values)
        bucket = math.ceil(self.problem.allreduce_bucket_bytes / self.mem_unit)
        for s in range(self.p):
            capacity = self.class_capacity[stage_classes[s]] // self.mem_unit
            step = self.step_exprs[s].value(values)
            if self.d > 1:
                step += min(self._grads_expr(s).value(values), bucket)
            if self.memory_exprs[s].value(values) > capacity or step > capacity:
                return False
        return True
