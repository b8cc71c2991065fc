"""Hints and search help for the CandidateModel (Note [search help] in partitioner/solver/model.py):
every variable's value for a given plan, the objective cap, and the stage fixings it implies."""

from __future__ import annotations

import math


class SearchHelp:
    """A mixin of CandidateModel: hint a plan, cap the objective by it, fix what the cap implies."""

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
        values[self.dp_allreduce.index] = max([0] + [e.value(values) for e, literal in self.dp_allreduce_exprs
                                                     if literal is None or values[literal.index]])
        if self.memory_constrained:
            bucket = math.ceil(self.problem.allreduce_bucket_bytes / self.mem_unit)
            for s in range(p):
                values[self.transient[s].index] = max(
                    [0] + [sum(c * values[v.index] for c, v in terms) for terms in self._transient_terms(s)])
                if self.bucket_whole:
                    values[self.bucket_whole[s].index] = int(self._grads_expr(s).value(values) <= bucket)
        if self.interleaved:  # Note [interleaved pricing]
            values[self.fwd_max.index] = max(e.value(values) for e in self.fwd_part_exprs)
            values[self.bwd_max.index] = max(values[self.stage_time[s].index] - self.fwd_part_exprs[s].value(values)
                                             - self.wgt_part_exprs[s].value(values) for s in range(p))
            if self.split:  # Note [zero-bubble pricing]
                values[self.wgt_max.index] = max(e.value(values) for e in self.wgt_part_exprs)
                values[self.pipe.index] = max(
                    nf * values[self.fwd_max.index] + nb * values[self.bwd_max.index] + nw * values[self.wgt_max.index]
                    for nf, nb, nw in self.pipeline_schedule.time_forms(self.pp, self.m))
            if self.memory_constrained:
                self._interleaved_peak_values(values)
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
            if not self.interleaved:  # the fixings assume the 1F1B/GPipe objective
                self._fix_by_bottleneck_cap(objective)
        return objective

    def cap_objective(self, cap_units: int) -> None:
        """objective <= cap_units, and the stage fixings it implies (Note [search help])."""
        if not self.minimize_memory:
            self.model.add(self.objective.expr() <= cap_units)
            if not self.interleaved:
                self._fix_by_bottleneck_cap(cap_units)

    def max_rounding_s(self) -> float:
        """An upper bound, in seconds, on ``_rounding_slack`` of any plan of this candidate."""
        pr, p, m = self.problem, self.p, self.m
        terms = 3 * pr.num_regions + 2 * (len(pr.edges) + 1) + 1
        if self.interleaved:  # slots * (worst forward's + worst backward's terms) <= slots * 2 terms
            from partitioner.solver.interleaved import pipeline_slots

            slots = pipeline_slots(self.pp, self.v, m)
            if self.split:  # each form's nF + nB + nW actions of <= 2 stage terms (Note [zero-bubble pricing])
                slots = max(sum(form) for form in self.pipeline_schedule.time_forms(self.pp, m))
            return (0.5 * (2 * slots * terms + terms + 1 + len(pr.ties) * (p + 1)) + 1) * self.time_unit_s
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
        if self.interleaved:
            yield self.fwd_max
            yield self.bwd_max
            if self.split:
                yield self.wgt_max
                yield self.pipe
            yield from self.peak

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
