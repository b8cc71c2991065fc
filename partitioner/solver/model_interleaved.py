"""Constraint families of the CandidateModel for the interleaved schedule (Note [interleaved
pricing] in partitioner/solver/interleaved.py): the worst stage's forward and backward, the
objective over them, the all-reduce and the memory of each rank (v stages on one device)."""

from __future__ import annotations

import math

from partitioner.solver.interleaved import pipeline_slots
from partitioner.solver.terms import Terms


class InterleavedConstraints:
    """A mixin of CandidateModel, used when ``schedule == "interleaved"``; stage s is on pipeline
    position s % pp (``self.pp`` ranks, ``self.v`` stages each)."""

    def _fwd_part_expr(self, s: int) -> Terms:
        """f_s: the stage's forward work and its activation send over boundary s, in time units."""
        unit = self.coef_unit_s
        expr = Terms()
        for r in range(self.problem.num_regions):
            expr.add(self.fwd_u[self.classes[s]][r], self.in_stage[r][s])
        if s < self.p - 1:
            link = self.boundary_links[s]
            expr.const += round(link.latency_s / unit)
            for e in self.problem.edges:
                coef = round(self._comm_seconds(link, e.bytes_per_sample) / unit)
                for sign, var in self._cross(e, s):
                    expr.add(sign * coef, var)
        return expr

    def _wgt_part_expr(self, s: int) -> Terms:
        """w_s: the stage's weight-gradient work (Note [weight-gradient flops]), in time units."""
        expr = Terms()
        if self.split:
            for r in range(self.problem.num_regions):
                expr.add(self.wgt_u[self.classes[s]][r], self.in_stage[r][s])
        return expr

    def _add_worst_stage(self) -> None:
        """fwd_max >= f_s and bwd_max >= stage_time[s] - f_s - w_s for every stage s (b_s: the rest
        of T_s: backward, recompute, the gradient send, the overhead); under a split backward also
        wgt_max >= w_s (w_s = 0 otherwise: Note [zero-bubble pricing])."""
        self.fwd_part_exprs = [self._fwd_part_expr(s) for s in range(self.p)]
        self.wgt_part_exprs = [self._wgt_part_expr(s) for s in range(self.p)]
        for s, expr in enumerate(self.fwd_part_exprs):
            wgt = self.wgt_part_exprs[s]
            self.model.add(self.fwd_max >= expr.expr())
            self.model.add(self.bwd_max >= self.stage_time[s] - expr.expr() - wgt.expr())
            if self.split:
                self.model.add(self.wgt_max >= wgt.expr())

    def _rank_allreduce_expr(self, pos: int) -> Terms:
        """2 (d-1)/d · (gradients of the rank's stages) / bw + 2 (d-1) · latency (one flat all-reduce)."""
        expr = Terms()
        for s in self.pipeline_schedule.stages_at(pos, self.pp, self.p):
            part = self._dp_allreduce_expr(s)
            expr.vars += part.vars
            expr.coefs += part.coefs
            expr.const = part.const
        return expr

    def _add_rank_allreduce(self) -> None:
        """dp_allreduce >= the all-reduce of every rank (pipeline position)."""
        self._add_dp_allreduce([self._rank_allreduce_expr(pos) for pos in range(self.pp)])

    def _interleaved_objective_expr(self) -> Terms:
        """(max(m v + pp, pp v + m) - 1)·(fwd_max + bwd_max) + dp_allreduce + tie costs; under a
        split backward pipeline + dp_allreduce + tie costs, pipeline >= nF·fwd_max + nB·bwd_max +
        nW·wgt_max for every path form of torch's order (Note [zero-bubble pricing])."""
        expr = self._tie_cost_expr()
        if self.split:
            for nf, nb, nw in self.pipeline_schedule.time_forms(self.pp, self.m):
                self.model.add(self.pipe >= nf * self.fwd_max + nb * self.bwd_max + nw * self.wgt_max)
            expr.add(1, self.pipe)
            expr.add(1, self.dp_allreduce)
            return expr
        slots = pipeline_slots(self.pp, self.v, self.m)
        expr.add(slots, self.fwd_max)
        expr.add(slots, self.bwd_max)
        expr.add(1, self.dp_allreduce)
        return expr

    def _batch_units(self) -> int:
        pr = self.problem
        return math.ceil(self.d * self.m * self.b * (pr.input_bytes_per_sample + pr.target_bytes_per_sample)
                         / self.mem_unit)

    def _add_rank_memory(self, overflow=None) -> None:
        """peak[s] >= activations_s + transient[s] and peak[s] >= the step phase's tie copies + (grads_s
        when bucket_whole[s], else the bucket); per rank, sum over its stages of (static + buffers
        + peak[s]) - (v - 1)·global batch <= capacity (+ overflow when explaining infeasibility).
        peak[s] sits on the small side only, so the epigraph is exact for feasibility."""
        pr, unit = self.problem, self.mem_unit
        bucket = math.ceil(pr.allreduce_bucket_bytes / unit)
        self.memory_exprs, self.step_exprs = [], []
        for s in range(self.p):
            held = self._held_expr(s)
            activations = self._activation_expr(s)
            activations.add(1, self.transient[s])
            self.model.add(self.peak[s] >= activations.expr())
            step = Terms()
            for t, tie in enumerate(pr.ties):
                step.add(math.ceil(pr.tie_bytes(tie)[1] / unit), self.holds[t][s])
            if self.d == 1:
                self.model.add(self.peak[s] >= step.expr())
            else:
                grads = self._grads_expr(s)
                self.model.add(self.peak[s] >= step.expr() + grads.expr()).only_enforce_if(self.bucket_whole[s])
                self.model.add(self.peak[s] >= step.expr() + bucket).only_enforce_if(self.bucket_whole[s].Not())
            self.memory_exprs.append(held)
            self.step_exprs.append(step)
        self._add_transient()
        for pos in range(self.pp):
            rank = Terms(-(self.v - 1) * self._batch_units())
            for s in self.pipeline_schedule.stages_at(pos, self.pp, self.p):
                held = self.memory_exprs[s]
                rank.vars += held.vars
                rank.coefs += held.coefs
                rank.const += held.const
                rank.add(1, self.peak[s])
            self.model.add(rank.expr() <= self._capacity_rhs(pos, self.classes[pos], overflow))

    def _interleaved_peak_values(self, values: dict[int, int]) -> None:
        """The tight peak[s] of a plan's values (hint_values)."""
        bucket = math.ceil(self.problem.allreduce_bucket_bytes / self.mem_unit)
        for s in range(self.p):
            activations = self._activation_expr(s).value(values) + values[self.transient[s].index]
            step = sum(math.ceil(self.problem.tie_bytes(tie)[1] / self.mem_unit) * values[self.holds[t][s].index]
                       for t, tie in enumerate(self.problem.ties))
            if self.d > 1:
                step += min(self._grads_expr(s).value(values), bucket)
            values[self.peak[s].index] = max(activations, step)

    def _interleaved_memory_fits(self, values: dict[int, int]) -> bool:
        capacity = self.class_capacity[self.classes[0]] // self.mem_unit
        for pos in range(self.pp):
            stages = self.pipeline_schedule.stages_at(pos, self.pp, self.p)
            rank = sum(self.memory_exprs[s].value(values) + values[self.peak[s].index] for s in stages)
            if rank - (self.v - 1) * self._batch_units() > capacity:
                return False
        return True

    def _interleaved_slack_terms(self, stage_of_region, recompute) -> float:
        """Rounded terms of the objective (each off by <= half a unit): slots·(those of the worst
        forward part + those of the worst backward part) + the all-reduce's + the ties'."""
        p = self.p
        fwd = [1] * p
        bwd = [2] * p  # the gradient send's latency and the overhead
        for r, s in enumerate(stage_of_region):
            fwd[s] += 1
            bwd[s] += 1 + int(recompute[r])
        for k in range(p - 1):
            crossing = sum(1 for e in self.problem.edges if stage_of_region[e.src] <= k < stage_of_region[e.dst])
            fwd[k] += crossing
            bwd[k + 1] += crossing
        allreduce_terms = self.problem.num_regions + 2 * len(self.problem.ties) + 1
        if self.split:  # b_s - w_s has the terms of b_s and of w_s; w_s one per region
            wgt = [0] * p
            for s in stage_of_region:
                wgt[s] += 1
            worst = max(nf * max(fwd) + nb * max(b + w for b, w in zip(bwd, wgt)) + nw * max(wgt)
                        for nf, nb, nw in self.pipeline_schedule.time_forms(self.pp, self.m))
            return worst + allreduce_terms + len(self.problem.ties) * p
        slots = pipeline_slots(self.pp, self.v, self.m)
        return slots * (max(fwd) + max(bwd)) + allreduce_terms + len(self.problem.ties) * p
