"""Calibration: measure regions on this machine, fit the time model, apply it to a problem.

    partitioner compile gpt -o out --calibrate --profile-out cpu.profile.json   # measure + fit + use
    partitioner compile gpt -o out --profile cpu.profile.json                    # reuse the fit

Note [the fitted time model]
    The datasheet model (``flops / device.flops_per_s``) misprices small models and CPUs, whose
    time goes to memory-bound ops and a fixed cost per op. So a region's time, per direction and
    device kind, is a linear model of four terms (``features.py``: matmul FLOPs, other FLOPs,
    bytes of the other ops, op count; plus the harness's per-call cost, fitted, never predicted),
    its coefficients fitted by non-negative least squares weighted by 1/measured (relative error).
    The rows are the model's regions plus every distinct op run alone (deduplicated by target and
    input shapes): single ops separate the terms, which identical transformer blocks would not.

Note [measuring a region]
    The traced graph runs once on a real batch (``make_batch``, else the example inputs) and
    every node's value is kept. A region's nodes become a GraphModule whose inputs are the values
    it reads from other regions and whose outputs are the values other regions read. Each
    repeat runs the forward (grad enabled), then backward from the outputs with fixed random
    output gradients; times are medians after warm-up. One more run, untimed, counts the peak of
    live tensor bytes (``LiveBytes``). On CPU the measurement runs with the thread count the
    generated programs get (one, ``OMP_NUM_THREADS=1`` from ``partitioner run``) unless told.

Note [per sample]
    Region times are given to the problem in two parts: the per-op term, which a microbatch pays
    whatever its size (``fwd_s_per_microbatch_by_kind``), and the rest (FLOPs and bytes, which
    grow with the batch) divided by the traced example batch (``fwd_s_per_sample_by_kind``). So a
    plan with microbatches of 1 pays the per-op overhead once per microbatch, not 1/b of it.

The room (``calibrate`` is measure + fit):
    priced_problem.py  the annotated graph as the solver's PartitionProblem, priced per device kind
    features.py        a graph's terms of the fitted time model: FLOPs by kind, bytes, ops
    measure.py         every region and every distinct op timed here (Note [measuring a region])
    fitting.py         the non-negative least-squares fit of a profile to measured seconds
    profiles.py        DeviceProfile, its file, and how it prices a problem (Note [per sample])
    datasheet.py       an accelerator's profile from published rates (Note [accelerator roofline])
    recompute_cost.py  the recompute fixed cost, measured (Note [recompute fixed cost])
    tp_overheads.py    tensor parallelism's fixed costs measured here: DTensor dispatch, gloo calls
    machine.py         this machine's cpu profile, measured once and cached (Note [machine profile])
    machine_profile.py what the profile is: its key, its measured figures, refits, what it prices
    machine_measure.py measuring it: the reference model's fit, AdamW's step, two gloo processes
    machine_worker.py  one of the two gloo processes of the machine profile's measurements
    refit.py           `calibrate --from-run`: the machine profile refit to a run (Note [refit from a run])
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.fx as fx

from partitioner.calibrate.features import Features, group_features, node_features, region_features
from partitioner.calibrate.fitting import fit_direction, fit_profile, nnls_relative, relative_errors
from partitioner.calibrate.measure import _example_inputs, local_device_kind, measure
from partitioner.calibrate.profiles import DeviceProfile, DirectionFit, apply_profiles
from partitioner.calibrate.recompute_cost import fit_recompute_fixed_s
from runtime.program.parts import Precision
from partitioner.calibrate.tp_overheads import measure_collectives, measure_dtensor_op_s
from runtime.observe.memory import LiveBytes  # in the runtime: it measures a training rank's peak too

__all__ = ["CalibrationConfig", "DeviceProfile", "DirectionFit", "Features", "LiveBytes", "apply_profiles",
           "calibrate", "fit_direction", "fit_profile", "fit_recompute_fixed_s", "group_features", "local_device_kind", "measure",
           "nnls_relative", "node_features", "region_features", "relative_errors"]


def calibrate(workload, gm: fx.GraphModule, *, kind: str | None = None, warmup: int = 3, repeats: int = 10,
              threads: int | None = 1, progress: Callable[[str], None] | None = None,
              precision: Precision = Precision.FP32, tp_overheads: bool = False, compiled: bool = False) -> DeviceProfile:
    """Measure ``gm``'s regions and ops here and fit a profile for this device kind, under the
    precision policy the program will train in (its meta records it: a profile fits one policy).
    ``tp_overheads``: measure tensor parallelism's fixed costs too (cpu only; Note
    [tensor-parallel overheads], partitioner/calibrate/tp_overheads.py). ``compiled``: the regions
    through torch.compile (Note [compiled regions priced] in partitioner/calibrate/measure.py)."""
    kind = kind or local_device_kind()
    precision = Precision.of(precision)
    rows = measure(workload, gm, warmup=warmup, repeats=repeats, threads=threads, progress=progress,
                   precision=precision, compiled=compiled)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        profile = fit_profile(rows, kind=kind, meta={"workload": workload.name, "warmup": warmup, "repeats": repeats,
                                                     "threads": threads or old, "precision": precision.value,
                                                     "compiled": compiled})
        profile = replace(profile, recompute_fixed_s=fit_recompute_fixed_s(rows, profile.forward))
        if tp_overheads and kind == "cpu":
            # a compiled stage has no DTensor dispatch per op (Note [compiled regions priced])
            profile = replace(profile, dtensor_op_s=0.0 if compiled else measure_dtensor_op_s(gm, _example_inputs(workload)),
                              **(measure_collectives() or {}))
            if progress:
                progress(f"calibrate: tensor parallelism's overheads: DTensor {profile.dtensor_op_s} s/op, "
                         f"{profile.tp_collective_s} s/collective, skew {profile.tp_skew}")
        return profile
    finally:
        torch.set_num_threads(old)


@dataclass(frozen=True)
class CalibrationConfig:
    """What ``compile(..., calibrate=CalibrationConfig(...))`` measures, and where it saves the fit."""

    warmup: int = 3
    repeats: int = 10
    threads: int | None = 1
    kind: str | None = None  # default: this machine's device (local_device_kind)
    profile_out: str | None = None
    tp_overheads: bool = True  # when the compile weighs tensor parallelism (Note [tensor-parallel overheads])

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"calibration repeats={self.repeats} must be >= 1 and warmup={self.warmup} >= 0")

    def run(self, workload, gm: fx.GraphModule, *, progress: Callable[[str], None] | None = None,
            precision: Precision = Precision.FP32, tensor_parallel: bool = False,
            compiled: bool = False) -> DeviceProfile:
        profile = calibrate(workload, gm, kind=self.kind, warmup=self.warmup, repeats=self.repeats,
                            threads=self.threads, progress=progress, precision=precision,
                            tp_overheads=self.tp_overheads and tensor_parallel, compiled=compiled)
        if self.profile_out:
            profile.save(self.profile_out)
            if progress:
                fwd, bwd = profile.meta["forward_median_rel_error"], profile.meta["backward_median_rel_error"]
                progress(f"calibrate: wrote {self.profile_out} (kind {profile.kind}; fit median error "
                         f"forward {fwd:.0%}, backward {bwd:.0%})")
        return profile
