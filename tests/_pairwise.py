"""A small deterministic all-pairs (pairwise) covering-set generator, for combination matrices
(tests/e2e/test_combination_matrix.py).

``all_pairs(factors, valid=..., seed=...)`` returns rows (dicts factor -> value) such that every
pair of values of every two factors appears in some row, except the pairs no valid row can hold,
which it returns beside the rows. ``valid(row)`` is called on *partial* rows (a subset of the
factors, in the order they are filled) and must answer False only when no completion of that
row could be valid, so construction can prune early; a row is kept only if ``valid`` accepts it
whole.

The construction is AETG's greedy: every round builds a few candidate rows, each started from an
uncovered pair and completed factor by factor with the value that covers the most uncovered
pairs with the values already placed (ties broken by a seeded generator), backtracking when
``valid`` refuses a partial row; the candidate covering the most uncovered pairs is kept. A pair
whose every completion is refused is impossible: it is reported, not covered. Greedy rows picked
early are then thinned: a row goes when the pairs only it holds fit into other rows (``_absorbed``),
and so does every row whose pairs all others hold. Same factors, same filter, same seed: the same
rows, in the same order.
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, Hashable, Mapping, Sequence

Pair = tuple[tuple[str, Hashable], tuple[str, Hashable]]  # ((factor a, value), (factor b, value)), a before b


def _always(_row: Mapping) -> bool:
    return True


def pairs_of(factors: Mapping[str, Sequence]) -> list[Pair]:
    """Every pair of values of every two factors, in the factors' order."""
    names = list(factors)
    return [((a, x), (b, y)) for i, a in enumerate(names) for b in names[i + 1:]
            for x in factors[a] for y in factors[b]]


def pairs_in(row: Mapping, names: Sequence[str]) -> set[Pair]:
    present = [n for n in names if n in row]
    return {((a, row[a]), (b, row[b])) for i, a in enumerate(present) for b in present[i + 1:]}


def uncovered(rows: Sequence[Mapping], factors: Mapping[str, Sequence]) -> list[Pair]:
    """The pairs of ``factors`` that no row holds (a check independent of the generator)."""
    held = set()
    for row in rows:
        held |= pairs_in(row, list(factors))
    return [p for p in pairs_of(factors) if p not in held]


def all_pairs(factors: Mapping[str, Sequence], *, valid: Callable[[Mapping], bool] = _always, seed: int = 0,
              candidates: int = 12, cost: Callable[[Mapping], float] | None = None,
              ) -> tuple[list[dict], list[Pair]]:
    """(rows, impossible pairs): a covering set of every pair ``valid`` allows, and the pairs it
    does not (no valid row holds them). ``cost(row)``: what a full row costs to run (e.g. its
    world size); candidates are then ranked by uncovered pairs per unit of cost, so cheap rows
    cover what they can and dear ones only what needs them."""
    names = list(factors)
    if any(len(factors[n]) == 0 for n in names):
        raise ValueError(f"every factor needs at least one value: {[n for n in names if not factors[n]]}")
    rng = random.Random(seed)
    todo = pairs_of(factors)
    left = set(todo)
    rows: list[dict] = []
    impossible: list[Pair] = []
    while left:
        best, best_gain = None, 0
        order = [p for p in todo if p in left]  # deterministic: the factors' order
        starts = [order[0]] + [order[rng.randrange(len(order))] for _ in range(candidates - 1)]
        for start in dict.fromkeys(starts):
            if start not in left:
                continue
            row = _build(start, factors, names, left, valid, rng)
            if row is None:  # the search below is exhaustive: no valid row holds this pair
                impossible.append(start)
                left.discard(start)
                continue
            gain = len(pairs_in(row, names) & left) / (1.0 if cost is None else cost(row))
            if gain > best_gain:
                best, best_gain = row, gain
        if best is not None:
            rows.append(best)
            left -= pairs_in(best, names)
    rows = _without_redundant(_absorbed(rows, names, valid, cost), names, cost)
    return rows, sorted(impossible, key=todo.index)


def _without_redundant(rows: list[dict], names, cost) -> list[dict]:
    """Drop every row whose pairs the other rows all hold (dearest first): greedy rows picked
    early can be made redundant by later ones."""
    count: dict[Pair, int] = {}
    for row in rows:
        for pair in pairs_in(row, names):
            count[pair] = count.get(pair, 0) + 1
    keep = list(rows)
    for row in sorted(rows, key=lambda r: -(1.0 if cost is None else cost(r))):  # stable: later rows first on ties
        pairs = pairs_in(row, names)
        if all(count[p] > 1 for p in pairs):
            keep.remove(row)
            for p in pairs:
                count[p] -= 1
    return keep


def _absorbed(rows: list[dict], names, valid, cost) -> list[dict]:
    """Greedy rows, fewer: a row goes when every pair only it holds moves into another row by
    setting that row's two factors of the pair, the other row keeping every pair only it holds,
    staying valid, and the whole set costing no more. The rows whose pairs move most easily (the
    fewest held by them alone) are tried first; repeated until no row goes."""
    price = (lambda row: 1.0) if cost is None else cost
    rows = [dict(row) for row in rows]
    while True:
        count: dict[Pair, int] = {}
        for row in rows:
            for pair in pairs_in(row, names):
                count[pair] = count.get(pair, 0) + 1
        order = sorted(range(len(rows)), key=lambda i: sum(count[p] == 1 for p in pairs_in(rows[i], names)))
        for i in order:
            others = [dict(row) for k, row in enumerate(rows) if k != i]
            if _moved(rows[i], others, names, valid, dict(count)) and \
                    sum(map(price, others)) <= sum(map(price, rows)):
                rows = others
                break
        else:
            return rows


def _moved(row: dict, others: list[dict], names, valid, count: dict) -> bool:
    """Move every pair only ``row`` holds into one of ``others`` (changed in place); False when one
    finds no place."""
    mine = pairs_in(row, names)
    for pair in mine:
        count[pair] -= 1
    for pair in sorted(p for p in mine if count[p] == 0):
        if count[pair] > 0:  # an earlier move brought it in
            continue
        (a, x), (b, y) = pair
        for other in others:
            new = {**other, a: x, b: y}
            before, after = pairs_in(other, names), pairs_in(new, names)
            if not valid(new) or any(count[p] == 1 for p in before - after):
                continue
            for p in before - after:
                count[p] -= 1
            for p in after - before:
                count[p] = count.get(p, 0) + 1
            other.update(new)
            break
        else:
            return False
    return True


def _build(start: Pair, factors, names, left, valid, rng) -> dict | None:
    """A valid full row holding ``start``, greedy in uncovered pairs, or None if none exists."""
    (a, x), (b, y) = start
    row = {a: x, b: y}
    if not valid(row):
        return None
    rest = [n for n in names if n not in row]
    rng.shuffle(rest)
    return _complete(row, rest, factors, names, left, valid, rng)


def _complete(row, rest, factors, names, left, valid, rng):
    if not rest:
        return {n: row[n] for n in names} if valid(row) else None
    name, later = rest[0], rest[1:]

    def gain(value):
        return sum(((a, row[a]), (name, value)) in left if names.index(a) < names.index(name)
                   else ((name, value), (a, row[a])) in left for a in row)

    values = list(factors[name])
    ties = {v: rng.random() for v in values}
    for value in sorted(values, key=lambda v: (-gain(v), ties[v])):
        row[name] = value
        if valid(row):
            done = _complete(row, later, factors, names, left, valid, rng)
            if done is not None:
                return done
        del row[name]
    return None


def product_size(factors: Mapping[str, Sequence]) -> int:
    size = 1
    for values in factors.values():
        size *= len(values)
    return size


def impossible_by_brute_force(factors: Mapping[str, Sequence], valid: Callable[[Mapping], bool]) -> list[Pair]:
    """The pairs no valid full row holds, by trying every row of the product (for tests of
    ``all_pairs`` on small products)."""
    names = list(factors)
    possible = set()
    for values in itertools.product(*(factors[n] for n in names)):
        row = dict(zip(names, values))
        if valid(row):
            possible |= pairs_in(row, names)
    return [p for p in pairs_of(factors) if p not in possible]
