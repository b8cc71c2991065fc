"""Constraint families of the CandidateModel that price time: stage times, the bottleneck, the
prefix-work cuts (Note [search help] in model.py), data-parallel all-reduce, ties, and the objective
(Note [cost model] in partitioner/solver/evaluate.py, in integer units: Note [ILP scaling] in model.py)."""

from __future__ import annotations

from partitioner.solver.cp_sat import cp_model  # Note [the solver loads OR-Tools on demand]

from partitioner.solver.problem import microbatch_overhead_s, region_step_s
from partitioner.solver.terms import Terms


class TimeConstraints:
    """``stage_time[s]``, ``bottleneck``, ``dp_allreduce`` and the objective. A mixin of
    CandidateModel, which owns the variables."""

    def _stage_time_expr(self, s: int, device_class) -> Terms:
        unit, p = self.coef_unit_s, self.p
        expr = Terms(round(microbatch_overhead_s(self.problem, self.class_device[device_class]) / unit))
        for r in range(self.problem.num_regions):
            expr.add(self.work_u[device_class][r], self.in_stage[r][s])
            if (r, s) in self.rec:
                expr.add(self.rec_u[device_class][r], self.rec[(r, s)])
        for k in ([s - 1] if s > 0 else []) + ([s] if s < p - 1 else []):
            link = self.boundary_links[k]
            expr.const += round(link.latency_s / unit)
            for e in self.problem.edges:
                coef = round(self._comm_seconds(link, e.bytes_per_sample) / unit)
                for sign, var in self._cross(e, k):
                    expr.add(sign * coef, var)
        return expr

    def _add_stage_time(self) -> None:
        """stage_time[s] = overhead + sum_r work[r]·in_stage[r, s] + sum_r recompute_s[r]·recompute[r, s]
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

    def _dp_allreduce_expr(self, s: int, device_class=None) -> Terms:
        """Stage s's all-reduce and per-step seconds on ``device_class`` (None: its placed class)."""
        link, d, unit = self.dp_links[s], self.d, self.coef_unit_s
        device = self.class_device[self.classes[s] if device_class is None else device_class]
        expr = Terms()
        # per-step seconds of the stage's regions (tensor parallelism's gradient all-gathers) on its
        # class: with classes chosen, priced under on_class[s, c] like the stage time, since the most
        # of any class would lift the relaxation above the plans it bounds (Note [heterogeneous devices])
        for r, region in enumerate(self.problem.regions):
            expr.add(round(region_step_s(region, device) / unit), self.in_stage[r][s])
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

    def _add_dp_allreduce(self, exprs=None) -> None:
        """dp_allreduce >= 2 (d-1)/d · grad_bytes[s] / bw + 2 (d-1) · latency + sum_r step[r]·in_stage[r, s]
        for every stage s, with classes chosen under on_class[s, c] (step[r] is the class's); or for every
        expression of ``exprs`` (interleaved passes one per rank). Kept as (expression, enforcing literal)."""
        if exprs is not None or self.on_class is None:
            exprs = exprs if exprs is not None else [self._dp_allreduce_expr(s) for s in range(self.p)]
            self.dp_allreduce_exprs = [(expr, None) for expr in exprs]
        else:
            self.dp_allreduce_exprs = [(self._dp_allreduce_expr(s, c), self.on_class[s][c])
                                       for s in range(self.p) for c in self.classes]
        for expr, literal in self.dp_allreduce_exprs:
            if expr.vars or expr.const:
                bound = self.model.add(self.dp_allreduce >= expr.expr())
                if literal is not None:
                    bound.only_enforce_if(literal)

    def _tie_cost_expr(self) -> Terms:
        """sum_t (latency + tie grad bytes / bw) · (sum_s holds[t, s] - 1)."""
        expr = Terms()
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

    def _objective_expr(self) -> Terms:
        """(m - 1)·bottleneck + sum_s stage_time[s] + dp_allreduce + tie costs."""
        expr = self._tie_cost_expr()
        expr.add(self.m - 1, self.bottleneck)
        for s in range(self.p):
            expr.add(1, self.stage_time[s])
        expr.add(1, self.dp_allreduce)
        return expr
