"""A linear expression of CP-SAT variables kept as its terms, so that the model can both post it and
evaluate it on a hint (Note [tight objective] in partitioner/solver/model.py)."""

from __future__ import annotations

from partitioner.solver.cp_sat import cp_model  # Note [the solver loads OR-Tools on demand]


class Terms:
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
