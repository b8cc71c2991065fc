"""Constraint families of the CandidateModel that place regions: stages, recompute, ties, device
classes. Each is one ``_add_*`` method whose docstring states its inequality; the variables
(``upto``, ``in_stage``, ``rec``, ``holds``, ``on_class``) are made in partitioner/solver/model.py."""

from __future__ import annotations


class PlacementConstraints:
    """Where regions go: ``upto[r, s]``, ``in_stage[r, s]``, ``recompute[r, s]``, ``holds[tie, s]``,
    ``on_class[s, c]``. A mixin of CandidateModel, which owns the variables."""

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
        """recompute[r, s] <= in_stage[r, s]: a region recomputes on the stage that holds it; pinned
        "full": recompute[r, s] = in_stage[r, s] (Note [recompute a user pins] in solver/recompute_cost.py)."""
        for (r, s), var in self.rec.items():
            if self.recompute_pinned:
                self.model.add(var == self.in_stage[r][s])
            else:
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
