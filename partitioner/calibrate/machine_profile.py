"""What the machine profile is (Note [machine profile] in partitioner/calibrate/machine.py): the
key that makes figures this machine's, the figures as measured, the refits a run made of them, and
what they price (the cpu kind's DeviceProfile, the cluster with the preset's figures replaced).
Plain data and its file format; measuring is machine_measure.py, the cache machine.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from partitioner.calibrate.profiles import DeviceProfile, DirectionFit
from partitioner.config.cluster import DEFAULT_LINKS, DEVICE_PRESETS, ClusterSpec, LinkSpec

FORMAT = "partitioner.machine/1"
KIND = "cpu"  # the device kind this machine's processes are (Note [core sharing] in cluster.py)

# Note [machine figures are bounded]
#     Every figure of a machine profile is checked against a range no real machine is outside of,
#     wherever a profile is made (measured, refit, read from the cache; a file outside is measured
#     again, said in one line naming the file and the figure). Without it a run folder with a NaN
#     step time wrote NaN into the profile and every later compile failed on it, and a cached file
#     with contention 1e6 or zero coefficients priced plans silently. The ranges are wide (the
#     comments below say why); only the matmul coefficient may not be 0 (the reference model is
#     mostly matmuls; NNLS may put any other term at 0). A measurement outside is no profile
#     either: the compile prices with the preset and says why, so a bound never makes it measure
#     forever.
_SECONDS_PER_OP = (0.0, 0.1)   # an eager op's fixed cost is microseconds
_SECONDS_FIXED = (0.0, 10.0)   # a schedule's, a send's or a collective's fixed cost is under a millisecond
_PER_UNIT = (0.0, 1e-6)  # seconds per FLOP or byte: more than 1 MB/s, 1 MFLOP/s (slower than any CPU since the 1980s)
# A matmul FLOP of one thread: between 1 MFLOP/s and 1 PFLOP/s (over a thousand times any core's fp32 peak).
_FIT_BOUNDS = {"s_per_matmul_flop": (1e-15, 1e-6), "s_per_other_flop": _PER_UNIT, "s_per_byte": _PER_UNIT,
               "op_overhead_s": _SECONDS_PER_OP, "call_overhead_s": _SECONDS_PER_OP}
STEP_S_BOUNDS = (1e-6, 86400.0)  # a run's step, and a stage's seconds per microbatch at most a day
SCALE_BOUNDS = (1e-3, 1e3)       # a refit's region scales: 3-20x on a busy machine; past 1000x it was no run here
_BOUNDS = {
    "forward_fit_median_rel_error": (0.0, 1e3), "backward_fit_median_rel_error": (0.0, 1e3),
    "microbatch_overhead_s": _SECONDS_FIXED, "pipeline_slot_s": _SECONDS_FIXED, "link_latency_s": _SECONDS_FIXED,
    "link_bandwidth_bytes_per_s": (1e6, 1e13),  # loopback gloo: 1 MB/s to more than any memory bus
    "allreduce_latency_s": _SECONDS_FIXED,
    "p2p_latency_s": _SECONDS_FIXED, "recompute_fixed_s": _SECONDS_FIXED, "dtensor_op_s": _SECONDS_PER_OP,
    "tp_collective_s": _SECONDS_FIXED, "tp_skew": (0.0, 100.0),
    "contention": (1.0, 100.0),  # two ranks on one core slow each other about twice: 100 is a burst or a hand edit
    "optimizer_s_per_param_byte": _PER_UNIT, "threads": (1, 1 << 16), "load_average_1m": (0.0, 1e6),
    "other_runnable": (0.0, 1e6), "measure_s": (0.0, 7 * 86400.0), "time_unix": (0.0, 1e11),
    "forward_scale": SCALE_BOUNDS, "backward_scale": SCALE_BOUNDS, "measured_step_s": STEP_S_BOUNDS,
    "predicted_before_s": (0.0, 1e9), "predicted_after_s": (0.0, 1e9),
}


def outside(value, bounds: tuple[float, float]) -> bool:
    """``value`` is not a number in ``bounds`` (NaN, inf, a bool, a string are never inside)."""
    return (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not bounds[0] <= value <= bounds[1])


def _check_figures(owner, what: str) -> None:
    """ValueError naming the first figure of ``owner`` (a dataclass) outside its bounds (Note
    [machine figures are bounded]); None stands for "not measured" and passes."""
    for f in dataclasses.fields(owner):
        value = getattr(owner, f.name)
        if isinstance(value, DirectionFit):
            checks = [(f"{f.name}.{name}", getattr(value, name), bounds) for name, bounds in _FIT_BOUNDS.items()]
        elif f.name in _BOUNDS:
            checks = [(f.name, value, _BOUNDS[f.name])]
        else:
            continue
        for name, v, bounds in checks:
            if v is not None and outside(v, bounds):
                raise ValueError(f"{what} {name}={v!r} is outside [{bounds[0]:g}, {bounds[1]:g}], where no machine is "
                                 "(Note [machine figures are bounded] in partitioner/calibrate/machine_profile.py)")


def busy_threads_above(cores: int) -> float:
    """Other runnable threads above which a measurement on ``cores`` is a busy one (Note [a busy
    measurement is provisional]): half the cores, and on 2 cores half a thread (the two ranks
    measured at once need both)."""
    return min(0.5 * cores, max(cores - 1.5, 0.0))


@dataclass(frozen=True)
class MachineKey:
    """What makes measured figures this machine's (Note [machine profile cache])."""

    cpu_model: str
    cores: int
    torch_version: str
    python_version: str

    @classmethod
    def here(cls) -> "MachineKey":
        return cls(cpu_model=_cpu_model(), cores=os.cpu_count() or 1, torch_version=str(torch.__version__),
                   python_version=platform.python_version())

    @property
    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MachineMeasurements:
    """The figures as measured (a refit never changes them; Note [machine profile])."""

    forward: DirectionFit                      # the reference model's fit, seconds per term
    backward: DirectionFit
    forward_fit_median_rel_error: float        # of the fit over the reference's regions and ops
    backward_fit_median_rel_error: float
    microbatch_overhead_s: float | None        # one-stage schedule, per microbatch (None: not measured)
    pipeline_slot_s: float | None              # two-stage schedule of computing stages, per microbatch slot
    link_latency_s: float | None               # a stage's seconds per send in a pipeline, beyond the bytes
    link_bandwidth_bytes_per_s: float | None   # a two-rank all-reduce's slope
    allreduce_latency_s: float | None          # its intercept, per message (what its latency terms pay)
    p2p_latency_s: float | None                # a blocking send/recv of 128 bytes, one way
    recompute_fixed_s: float | None            # Note [recompute fixed cost]
    dtensor_op_s: float | None                 # Note [tensor-parallel overheads]
    tp_collective_s: float | None
    tp_skew: float | None
    contention: float                          # a rank computes this many times slower beside another (>= 1)
    optimizer_s_per_param_byte: float | None   # AdamW's step as the runtime makes it, per parameter byte
    threads: int
    load_average_1m: float                     # os.getloadavg() when the measurement started
    other_runnable: float                      # other threads running or waiting for a core (the most seen)
    measure_s: float                           # how long measuring took
    time_unix: float

    def __post_init__(self) -> None:
        _check_figures(self, "measured")

    @property
    def matmul_flops_per_s(self) -> float | None:
        return 1.0 / self.forward.s_per_matmul_flop if self.forward.s_per_matmul_flop > 0 else None


@dataclass(frozen=True)
class CompiledFit:
    """The reference model's regions measured through torch.compile, fitted (Note [compiled machine
    fit] in partitioner/calibrate/machine.py): measured apart from ``MachineMeasurements``, the
    first time a compile asks for compiled stages, and added to the same cached profile."""

    forward: DirectionFit
    backward: DirectionFit
    forward_fit_median_rel_error: float
    backward_fit_median_rel_error: float
    other_runnable: float                      # as MachineMeasurements': the most seen while measuring
    measure_s: float                           # compiles included
    time_unix: float

    def __post_init__(self) -> None:
        _check_figures(self, "compiled")

    @classmethod
    def from_dict(cls, data: dict) -> "CompiledFit":
        data = dict(data)
        return cls(**{**data, "forward": DirectionFit(**data["forward"]), "backward": DirectionFit(**data["backward"])})


@dataclass(frozen=True)
class Refit:
    """One ``calibrate --from-run``: what the run measured and what the profile became."""

    run_dir: str
    plan_hash: str
    measured_step_s: float
    predicted_before_s: float
    predicted_after_s: float
    forward_scale: float           # the profile's, after this refit (of the measured fit)
    backward_scale: float
    microbatch_overhead_s: float
    time_unix: float
    link_latency_s: float | None = None  # the pipeline latency after this refit (None: as measured)

    def __post_init__(self) -> None:
        _check_figures(self, "refit")


@dataclass(frozen=True)
class MachineProfile:
    """This machine's measured CPU figures, with what refits from runs made of them."""

    key: MachineKey
    measured: MachineMeasurements
    forward_scale: float = 1.0              # region seconds: the measured fit times this (refit)
    backward_scale: float = 1.0
    microbatch_overhead_s: float | None = None  # refit from a run; None: measured
    link_latency_s: float | None = None         # refit from a run; None: measured
    refits: tuple[Refit, ...] = ()
    compiled: CompiledFit | None = None         # Note [compiled machine fit]; None: not measured yet

    def __post_init__(self) -> None:
        _check_figures(self, "profile")

    # --- identity -----------------------------------------------------------------------------
    @property
    def measurement_id(self) -> str:
        """The measurement's digest: the same through refits, new on --refresh."""
        text = json.dumps(_plain(self.measured), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    # --- effective figures --------------------------------------------------------------------
    @property
    def effective_microbatch_overhead_s(self) -> float | None:
        return self.microbatch_overhead_s if self.microbatch_overhead_s is not None \
            else self.measured.microbatch_overhead_s

    def link(self) -> LinkSpec | None:
        """The intra-node link: a pipeline send's latency, the all-reduce's bandwidth (the
        larger of the two latencies: the cost model has one link for both)."""
        m = self.measured
        if m.link_bandwidth_bytes_per_s is None or m.link_latency_s is None:
            return None
        latency = self.link_latency_s if self.link_latency_s is not None else \
            max(m.link_latency_s, m.allreduce_latency_s or 0.0)
        return LinkSpec(bandwidth_bytes_per_s=m.link_bandwidth_bytes_per_s, latency_s=latency)

    @property
    def region_scales(self) -> tuple[float, float]:
        """What the measured fit's seconds are multiplied by, forward and backward: the ranks'
        contention (Note [machine profile]) times the refit's scales."""
        return self.measured.contention * self.forward_scale, self.measured.contention * self.backward_scale

    def device_profile(self, compiled: bool = False) -> DeviceProfile:
        """The profile a compile prices the ``cpu`` kind with (Note [machine profile]); ``compiled``:
        for compiled stages, from the compiled fit (Note [compiled machine fit])."""
        m = self.measured
        forward_scale, backward_scale = self.region_scales
        forward, backward = m.forward, m.backward
        if compiled:
            if self.compiled is None:
                raise ValueError("this machine profile has no compiled fit: a compile with --compile-stages "
                                 "measures it (Note [compiled machine fit])")
            # a refit's scales are of the eager fit: the compiled one keeps the contention alone
            forward, backward = self.compiled.forward, self.compiled.backward
            forward_scale = backward_scale = m.contention
        return DeviceProfile(
            kind=KIND, forward=_scaled(forward, forward_scale), backward=_scaled(backward, backward_scale),
            meta={"precision": "fp32", "source": "machine", "threads": m.threads, "compiled": compiled},
            microbatch_overhead_s=self.effective_microbatch_overhead_s,
            dtensor_op_s=0.0 if compiled else m.dtensor_op_s,
            tp_collective_s=m.tp_collective_s, tp_skew=m.tp_skew, recompute_fixed_s=m.recompute_fixed_s,
            optimizer_s_per_param_byte=m.optimizer_s_per_param_byte)

    def cluster_for(self, cluster: ClusterSpec) -> ClusterSpec:
        """``cluster`` with the preset's cpu figures replaced by this machine's (Note [what the
        machine profile replaces])."""
        preset_rate = DEVICE_PRESETS[KIND].flops_per_s
        rate = self.measured.matmul_flops_per_s
        devices = tuple(dataclasses.replace(d, flops_per_s=rate / self.region_scales[0])
                        if d.kind == KIND and d.flops_per_s == preset_rate and rate else d
                        for d in cluster.devices)
        intra = cluster.intra_node_link
        link = self.link()
        if link is not None and all(d.kind == KIND for d in cluster.devices) and intra == DEFAULT_LINKS[KIND][0]:
            intra = link
        return dataclasses.replace(cluster, devices=devices, intra_node_link=intra)

    def plan_record(self, *, regions: bool, path: Path | None = None, compiled: bool = False) -> dict:
        """What plan.json's ``predicted.cpu_time_model`` says priced it (Note [refit from a run] reads it:
        a refit rescales the regions of a plan whose ``regions`` is "machine", the eager fit's, only)."""
        return {"source": "machine profile", "file": path.name if path else None, "key": self.key.digest,
                "measurement_id": self.measurement_id,
                "regions": ("machine compiled" if compiled else "machine") if regions else "profile",
                "forward_scale": self.forward_scale, "backward_scale": self.backward_scale,
                "microbatch_overhead_s": self.effective_microbatch_overhead_s, "refits": len(self.refits),
                "link_latency_s": self.link().latency_s if self.link() else None}

    def describe(self) -> str:
        m = self.measured
        rate = m.matmul_flops_per_s / self.region_scales[0] if m.matmul_flops_per_s else None
        parts = [f"{self.key.cpu_model}, {self.key.cores} cores, torch {self.key.torch_version}",
                 f"measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(m.time_unix))} in {m.measure_s:.1f} s "
                 f"with up to {m.other_runnable:.1f} other threads running (load average {m.load_average_1m:.1f})"]
        figures = [f"matmul {rate / 1e9:.0f} GFLOP/s a rank" if rate else "matmul -",
                   f"two ranks at once x{m.contention:.2f}",
                   f"{m.forward.op_overhead_s * 1e6:.0f}/{m.backward.op_overhead_s * 1e6:.0f} us per op fwd/bwd"]
        if self.compiled is not None:
            c = self.compiled
            figures.append(f"compiled {c.forward.op_overhead_s * 1e6:.0f}/{c.backward.op_overhead_s * 1e6:.0f} us per op")
        overhead = self.effective_microbatch_overhead_s
        figures.append(f"{overhead * 1e3:.2f} ms per microbatch" if overhead is not None else "per microbatch: preset")
        link = self.link()
        figures.append(f"link {link.latency_s * 1e3:.2f} ms + {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
                       if link else "link: preset")
        text = f"{'; '.join(parts)}: {', '.join(figures)}"
        if m.other_runnable > busy_threads_above(self.key.cores):  # other work took cores from the measurement
            text += ("; measured on a busy machine: `partitioner calibrate --machine --refresh` when it is as busy "
                     "as the job will find it")
        if self.refits:
            text += (f"; refit from {len(self.refits)} run(s): regions x{self.forward_scale:.2f} forward, "
                     f"x{self.backward_scale:.2f} backward")
        return text

    # --- file ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, **_plain(self)}

    @classmethod
    def from_dict(cls, data, *, where: str = "machine profile") -> "MachineProfile":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: not a machine profile of this version ({found!r}, expected {FORMAT!r})")
        try:
            measured = dict(data["measured"])
            measured["forward"] = DirectionFit(**measured["forward"])
            measured["backward"] = DirectionFit(**measured["backward"])
            profile = cls(key=MachineKey(**data["key"]), measured=MachineMeasurements(**measured),
                          forward_scale=float(data["forward_scale"]), backward_scale=float(data["backward_scale"]),
                          microbatch_overhead_s=data.get("microbatch_overhead_s"),
                          link_latency_s=data.get("link_latency_s"),
                          refits=tuple(Refit(**r) for r in data.get("refits", ())),
                          compiled=CompiledFit.from_dict(data["compiled"]) if data.get("compiled") else None)
        except ValueError as exc:  # a figure outside its bounds says which (Note [machine figures are bounded])
            raise ValueError(f"{where}: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: malformed machine profile ({type(exc).__name__}: {exc})") from None
        return profile


# The problem's measured fixed costs by kind (partitioner/solver/problem.py) and the profile's figure of each.
_FIXED_COSTS = (("microbatch_overhead_s_by_kind", "effective_microbatch_overhead_s"),
                ("dtensor_op_s_by_kind", "dtensor_op_s"), ("tp_collective_s_by_kind", "tp_collective_s"),
                ("tp_skew_by_kind", "tp_skew"), ("recompute_fixed_s_by_kind", "recompute_fixed_s"))


def fill_fixed_costs(problem, profile: MachineProfile):
    """``problem`` with the cpu kind's fixed costs that no profile measured taken from this
    machine's (Note [machine profile]: ``--calibrate`` measures regions, not the schedule)."""
    changes = {}
    for field_name, figure in _FIXED_COSTS:
        value = getattr(profile, figure) if hasattr(profile, figure) else getattr(profile.measured, figure)
        by_kind = dict(getattr(problem, field_name) or {})
        if value is not None and by_kind.get(KIND) is None:
            by_kind[KIND] = float(value)
            changes[field_name] = by_kind
    return dataclasses.replace(problem, **changes) if changes else problem


def _plain(value) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(value), default=float))


def _scaled(fit: DirectionFit, scale: float) -> DirectionFit:
    return DirectionFit(fit.s_per_matmul_flop * scale, fit.s_per_other_flop * scale, fit.s_per_byte * scale,
                        fit.op_overhead_s * scale, fit.call_overhead_s)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"
