"""tests/_pairwise.py: the all-pairs covering sets the combination matrix is built from
(tests/e2e/test_combination_matrix.py). Coverage is checked by brute force over every pair, and
the pairs a filter rules out by brute force over the whole product, independently of the
generator; the matrix's own cells (tests/_matrix_cells.py) hold every pair of its factors but
those it names a reason for."""

from __future__ import annotations

import itertools

import pytest

import _matrix_cells as matrix
from _pairwise import all_pairs, impossible_by_brute_force, pairs_in, pairs_of, product_size, uncovered

THREE_BY_FOUR = {name: [0, 1, 2] for name in "abcd"}
MIXED = {"stages": [1, 2, 3], "dp": [1, 2, 3], "tp": [1, 2], "precision": ["fp32", "bf16", "fp16"],
         "zero": [False, True], "schedule": ["gpipe", "1f1b", "interleaved"], "clip": [False, True],
         "sdc": [False, True]}


def capped(row) -> bool:
    """A filter of the matrix's kind, on partial rows: a world cap and two exclusions."""
    if row.get("stages", 1) * row.get("dp", 1) * row.get("tp", 1) > 6:
        return False
    if row.get("zero") and row.get("sdc"):
        return False
    return not (row.get("schedule") == "interleaved" and row.get("stages") == 1)


def test_every_pair_of_every_two_factors_is_covered():
    rows, impossible = all_pairs(THREE_BY_FOUR, seed=0)
    assert impossible == []
    assert uncovered(rows, THREE_BY_FOUR) == []
    assert len(pairs_of(THREE_BY_FOUR)) == 6 * 9
    assert 9 <= len(rows) <= 12  # 9 is the optimum (an orthogonal array); far fewer than the 81 of the product


def test_the_check_fails_when_any_row_is_dropped():
    """Redundant rows are pruned: every row kept holds a pair no other row does."""
    for factors, valid in ((THREE_BY_FOUR, lambda row: True), (MIXED, capped)):
        rows, impossible = all_pairs(factors, valid=valid, seed=3, cost=lambda row: row.get("stages", 1))
        assert uncovered(rows, factors) == impossible
        for i in range(len(rows)):
            missing = uncovered(rows[:i] + rows[i + 1:], factors)
            assert set(missing) > set(impossible), f"dropping row {i} must leave a pair uncovered"


def test_a_filter_is_obeyed_and_only_impossible_pairs_are_left_out():
    rows, impossible = all_pairs(MIXED, valid=capped, seed=0)
    assert all(capped(row) for row in rows)
    assert all(list(row) == list(MIXED) for row in rows)  # every factor, in the factors' order
    assert impossible == impossible_by_brute_force(MIXED, capped)
    assert set(impossible) == {(("stages", 3), ("dp", 3)), (("stages", 1), ("schedule", "interleaved")),
                               (("zero", True), ("sdc", True))}
    assert uncovered(rows, MIXED) == impossible
    assert len(rows) < product_size(MIXED) / 20


def test_same_seed_same_rows_and_another_seed_still_covers():
    first, _ = all_pairs(MIXED, valid=capped, seed=7)
    assert all_pairs(MIXED, valid=capped, seed=7)[0] == first
    for seed in range(4):
        rows, impossible = all_pairs(MIXED, valid=capped, seed=seed)
        assert uncovered(rows, MIXED) == impossible


def test_uncovered_is_a_real_check():
    """The checker itself: a hand-made set that misses exactly one pair is caught."""
    factors = {"x": [0, 1], "y": [0, 1], "z": [0, 1]}
    full = [dict(zip("xyz", v)) for v in itertools.product([0, 1], repeat=3)]
    assert uncovered(full, factors) == []
    without = [row for row in full if not (row["x"] == 1 and row["y"] == 1)]
    assert uncovered(without, factors) == [(("x", 1), ("y", 1))]
    assert pairs_in({"x": 0, "z": 1}, list(factors)) == {(("x", 0), ("z", 1))}


def test_a_factor_without_values_is_refused():
    with pytest.raises(ValueError, match="at least one value"):
        all_pairs({"a": [1], "b": []})


# The matrix's pairs no cell holds, each with its reason (tests/_matrix_cells.py REFUSED, RUN_REFUSED, INERT)
EXPECTED_NOT_COVERED = [
    (("stages", 3), ("dp", 3)),                      # 9 ranks: over the cap
    *((("stages", 1), ("schedule", s)) for s in ("interleaved", "zb", "zbv")),  # refused
    (("dp", 1), ("zero", True)),                     # refused
    (("dp", 1), ("sdc", True)),                      # inert
    (("dp", 1), ("canary", True)),                   # refused
    (("tp", 2), ("memtier", True)),                  # refused
    (("tp", 2), ("canary", True)),                   # refused
    (("zero", True), ("sdc", True)),                 # refused
    (("zero", True), ("canary", True)),              # refused
    (("schedule", "zb"), ("compiled", True)),        # refused
    (("schedule", "zbv"), ("compiled", True)),       # refused
    *((("schedule", s), ("canary", True)) for s in ("interleaved", "zb", "zbv")),  # refused
    (("eval", True), ("corpus", False)),             # refused by run
]


def test_the_matrix_cells_cover_every_pair_that_can_run_here():
    assert matrix.NOT_COVERED == EXPECTED_NOT_COVERED
    assert uncovered(matrix.ROWS, matrix.FACTORS) == EXPECTED_NOT_COVERED  # the checker, not the generator
    assert all(matrix.runnable(row) and matrix.world(row) <= matrix.MAX_WORLD for row in matrix.ROWS)
    for pair in (dict(p) for p in EXPECTED_NOT_COVERED):  # each has its reason, and only one
        assert (pair in matrix.EXCLUDED) != (matrix.world({**matrix.DEFAULTS, **pair}) > matrix.MAX_WORLD), pair
    assert len(matrix.ROWS) <= 17  # the seed's cover: a new factor or filter that grows it is seen here
