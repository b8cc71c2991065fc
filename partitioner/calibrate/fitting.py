"""Fit a profile to measured seconds: non-negative least squares in relative error (Note [the fitted
time model] in partitioner/calibrate/__init__.py)."""

from __future__ import annotations

import itertools
import platform
import statistics
from typing import Sequence

import numpy as np
import torch

from partitioner.calibrate.features import Features
from partitioner.calibrate.profiles import DeviceProfile, DirectionFit


REGION_WEIGHT = 3.0
# ---- the fit -------------------------------------------------------------------------------------

def nnls_relative(rows: Sequence[Sequence[float]], seconds: Sequence[float],
                  weights: Sequence[float] | None = None) -> list[float]:
    """Non-negative least squares of ``rows @ x ≈ seconds`` in relative error (each row weighted by
    1/seconds). Few columns, so every subset of columns is solved and the best non-negative one
    kept (exact NNLS for this size; no scipy)."""
    a = np.asarray(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if a.ndim != 2 or len(a) != len(y) or len(y) == 0:
        raise ValueError(f"fit needs as many measurements as rows, got {a.shape} and {y.shape}")
    if (y <= 0).any():
        raise ValueError("measured seconds must be positive")
    w = 1.0 / y * (np.sqrt(np.asarray(weights, dtype=float)) if weights is not None else 1.0)
    aw, yw = a * w[:, None], y * w
    scale = np.where(aw.max(axis=0) > 0, aw.max(axis=0), 1.0)  # columns differ by 1e12: condition them
    aws = aw / scale
    num_cols = a.shape[1]
    best, best_res = np.zeros(num_cols), float(np.sum(yw ** 2))
    for k in range(1, num_cols + 1):
        for cols in itertools.combinations(range(num_cols), k):
            sub = aws[:, cols]
            if not sub.any():
                continue
            x, *_ = np.linalg.lstsq(sub, yw, rcond=None)
            if (x < 0).any():
                continue
            res = float(np.sum((sub @ x - yw) ** 2))
            if res < best_res - 1e-15:
                full = np.zeros(num_cols)
                full[list(cols)] = x
                best, best_res = full, res
    return list(best / scale)


def fit_direction(rows: Sequence[tuple[Features, float]], *, call_overhead: bool = True,
                  weights: Sequence[float] | None = None) -> DirectionFit:
    """Fit one direction from (features of a measured group, its measured seconds)."""
    matrix = [f.vector() + ([1.0] if call_overhead else []) for f, _ in rows]
    coeffs = nnls_relative(matrix, [s for _, s in rows], weights)
    return DirectionFit(*coeffs[:4], call_overhead_s=coeffs[4] if call_overhead else 0.0)


def relative_errors(fit: DirectionFit, rows: Sequence[tuple[Features, float]]) -> list[float]:
    return [abs(fit.seconds(f) + fit.call_overhead_s - s) / s for f, s in rows]


def fit_profile(measurements: Sequence[dict], *, kind: str, meta: dict | None = None) -> DeviceProfile:
    """Fit both directions from ``measure``'s rows (groups with no backward are left out of that fit)."""
    fwd = [m for m in measurements if m["fwd_s"] > 0]
    bwd = [m for m in measurements if m["bwd_s"] > 0 and any(Features(**m["bwd_features"]).vector())]
    fwd_rows = [(Features(**m["fwd_features"]), m["fwd_s"]) for m in fwd]
    bwd_rows = [(Features(**m["bwd_features"]), m["bwd_s"]) for m in bwd]
    if len(fwd_rows) < 2 or len(bwd_rows) < 2:
        raise ValueError(f"calibration measured too little to fit ({len(fwd_rows)} forward, "
                         f"{len(bwd_rows)} backward groups): use a model with trainable ops")

    def weights(ms):
        # Single ops are there to tell the terms apart; regions are what gets predicted: all the
        # regions together weigh REGION_WEIGHT times all the single ops together.
        num_regions = sum(m.get("kind") == "region" for m in ms) or 1
        num_ops = sum(m.get("kind") != "region" for m in ms) or 1
        return [REGION_WEIGHT * num_ops / num_regions if m.get("kind") == "region" else 1.0 for m in ms]

    forward = fit_direction(fwd_rows, weights=weights(fwd))
    backward = fit_direction(bwd_rows, weights=weights(bwd))

    def quality(fit, rows, which):
        errs = relative_errors(fit, rows)
        return {f"{which}_median_rel_error": statistics.median(errs), f"{which}_worst_rel_error": max(errs),
                f"{which}_rows": len(rows)}

    info = {"torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor() or None,
            "threads": torch.get_num_threads(), **(meta or {}),
            **quality(forward, fwd_rows, "forward"), **quality(backward, bwd_rows, "backward")}
    return DeviceProfile(kind=kind, forward=forward, backward=backward, meta=info, measurements=tuple(measurements))
