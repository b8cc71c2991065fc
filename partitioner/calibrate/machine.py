"""This machine's CPU profile: measured once (seconds), cached per machine, refit from runs.

    partitioner calibrate --machine [--refresh]     # show (measure if absent, or again) the profile
    partitioner calibrate --from-run out/demo/run   # refit it to what a finished run measured
    partitioner compile ... [--no-calibrate]        # priced by it (default), or by the cpu preset

Note [machine profile]
    The ``cpu`` preset's figures (partitioner/cluster.py: 50 GFLOP/s, 1 ms per microbatch, gloo
    at 1 GB/s + 50 us, ...) were measured on one machine; on another the prediction is off by
    what that machine differs in (1.6 to 2.4x for `make demo` on a machine it was not tuned on).
    The machine profile measures this machine's figures once, model-independently, in seconds,
    one thread per process as the ranks run (``torch.set_num_threads(1)``):

    * the fitted time model's coefficients (Note [the fitted time model] in
      partitioner/calibrate/__init__.py: seconds per matmul FLOP, per other FLOP, per byte of the
      memory-bound ops, per op, forward and backward): ``calibrate`` run on a fixed reference
      model (``reference_workload``: embedding, two pre-norm transformer blocks of width 64 and 256,
      layer norms, attention, a vocabulary head; every region and every distinct op alone), not
      on the user's. Its recompute fixed cost and DTensor's dispatch per op come from the same
      graph (partitioner/calibrate/recompute_cost.py, tp_overheads.py);
    * the optimizer's step as the runtime makes it (AdamW, fused, over 4 MiB of parameters in
      small tensors): seconds per parameter byte, paid once a step by the stage holding them
      (``optimizer_s_per_param_byte``, as Note [accelerator roofline] prices it on GPUs);
    * two local processes over gloo (partitioner/calibrate/machine_worker.py):
      - the seconds per microbatch of a one-stage 1F1B schedule of torch.distributed.pipelining on
        a tiny stage: the schedule's own cost and the loss (``microbatch_overhead_s``);
      - the seconds per microbatch slot of a two-stage one whose stages compute as a small
        model's do: what is left of the slot beyond the stage's compute, its bytes and that
        overhead is what a stage pays per send in a pipeline, the link's latency (a send to a
        busy peer takes longer than to an idle one, so tiny stages would under-price it);
      - a two-rank all-reduce at 1 KiB to 16 MiB: its least-squares slope over the larger sizes
        is the link's bandwidth;
      - tensor parallelism's per-collective cost and drift (``collective_points``);
      - the ranks' contention: how many times longer about 15 ms of matmuls, GELU and layer norm
        take in each process while the other computes too than while it waits (shared caches
        and memory bandwidth, SMT siblings, whatever else the machine runs at the time). The
        region coefficients are multiplied by it (``region_scales``), since ranks compute side by
        side; a one-rank plan is over-predicted by it (1.0 to 1.1 on an idle machine).
      Per-microbatch figures are slopes over two microbatch counts, so what a step pays once
      (the schedule's set-up) is not charged per microbatch.

    The two-process timings keep the quieter quarter of their repeats (25th percentile), not the
    median: other work on a shared machine only ever adds time, and the profile is this machine
    with its cores to the job, as the cpu preset's figures were taken (partitioner/cluster.py).
    A run on a busier machine takes longer than predicted; ``calibrate --from-run`` refits the
    profile to it where that is how the machine will be.

    It prices a compile by becoming, for the ``cpu`` kind, what a ``--calibrate`` profile would
    be (``device_profile``: region seconds from the reference fit, the measured overheads) and by
    replacing the preset's figures in the cluster (``cluster_for``: flops_per_s, the measured
    matmul rate; the intra-node link), never a figure the user gave (a cluster file's
    ``flops_per_s`` or ``[links.intra_node]`` wins: Note [what the machine profile replaces]).
    Regions follow the reference fit only under fp32 (the profile is measured in fp32: another
    policy keeps the datasheet region model at the measured rate, with the measured overheads).
    ``--calibrate`` (this model's regions measured) wins over the reference fit for the regions;
    the machine profile still gives what ``--calibrate`` does not measure (the per-microbatch
    overhead, the link). Every figure is this machine at the time it was measured: the most
    other threads seen running while measuring are in the profile, and its description (printed
    by every compile) says so when they held half the cores or more; ``--refresh`` measures
    again, and ``calibrate --from-run`` refits it to a real run (partitioner/calibrate/refit.py,
    Note [refit from a run]).

Note [machine profile cache]
    One JSON file per machine, ``$XDG_CACHE_HOME/partitioner/machine-<key>.json`` (default
    ``~/.cache``), the key a digest of what makes the figures this machine's: the CPU model
    (/proc/cpuinfo's "model name", else ``platform.processor()``), the core count, torch's and
    Python's versions (a new torch changes the kernels and the dispatch). Written atomically (a
    unique temporary file in the folder, fsync, rename, fsync the folder), so two compiles
    measuring at once each leave a whole file. A file that is not JSON, not this format
    (``FORMAT``), for another key, or malformed is measured again and overwritten, never
    trusted and never a traceback. ``PARTITIONER_NO_CALIBRATE=1`` (or ``--no-calibrate``, or
    ``compile(machine_profile="preset")``) prices with the preset: the test suite sets it, so no
    golden file depends on the machine.

Note [what the machine profile replaces]
    A cpu device whose ``flops_per_s`` is the preset's, and the intra-node link when it is the
    cpu preset's (every device cpu): a value equal to the preset is the preset's, since a cluster
    file that gives no figure gets exactly the preset's. Other nodes of a multi-node cpu cluster
    are assumed to be this machine, as their core count is (Note [core sharing]). The inter-node
    link stays the preset's: nothing here measures another host.

Note [the API measures too]
    ``partitioner.compile`` defaults to ``machine_profile="auto"``, as the CLI does: the promise
    (docs/design.md §12) is the same through every way in, and the cost is one measurement per
    machine, cached. "auto" prices cpu devices with the cached profile, measuring it the first
    time; a cluster with no cpu device measures nothing; ``PARTITIONER_NO_CALIBRATE=1`` or
    ``machine_profile="preset"`` keeps the preset (deterministic plans for scripts and tests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from partitioner.calibrate.profiles import DeviceProfile, DirectionFit
from partitioner.cluster import DEFAULT_LINKS, DEVICE_PRESETS, ClusterSpec, LinkSpec

FORMAT = "partitioner.machine/1"
NO_CALIBRATE_ENV = "PARTITIONER_NO_CALIBRATE"
CACHE_ENV = "XDG_CACHE_HOME"
KIND = "cpu"  # the device kind this machine's processes are (Note [core sharing] in cluster.py)
_WORKER_TIMEOUT_S = 120.0


# ---- what the profile is -------------------------------------------------------------------------

@dataclass(frozen=True)
class MachineKey:
    """What makes measured figures this machine's (Note [machine profile cache])."""

    cpu_model: str
    cores: int
    torch_version: str
    python_version: str

    @classmethod
    def here(cls) -> "MachineKey":
        import torch

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
        import math

        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values = dataclasses.astuple(value) if isinstance(value, DirectionFit) else (value,)
            if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                      or v < 0) for v in values):
                raise ValueError(f"measured {f.name}={value!r} must be finite numbers >= 0 (measure again: "
                                 "partitioner calibrate --machine --refresh)")
        if self.contention <= 0:
            raise ValueError(f"measured contention={self.contention!r} must be > 0")

    @property
    def matmul_flops_per_s(self) -> float | None:
        return 1.0 / self.forward.s_per_matmul_flop if self.forward.s_per_matmul_flop > 0 else None


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

    def device_profile(self) -> DeviceProfile:
        """The profile a compile prices the ``cpu`` kind with (Note [machine profile])."""
        m = self.measured
        forward_scale, backward_scale = self.region_scales
        return DeviceProfile(
            kind=KIND, forward=_scaled(m.forward, forward_scale), backward=_scaled(m.backward, backward_scale),
            meta={"precision": "fp32", "source": "machine", "threads": m.threads},
            microbatch_overhead_s=self.effective_microbatch_overhead_s, dtensor_op_s=m.dtensor_op_s,
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

    def plan_record(self, *, regions: bool, path: Path | None = None) -> dict:
        """What plan.json's ``predicted.cpu_time_model`` says priced it (Note [refit from a run] reads it)."""
        return {"source": "machine profile", "file": path.name if path else None, "key": self.key.digest,
                "measurement_id": self.measurement_id, "regions": "machine" if regions else "profile",
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
        overhead = self.effective_microbatch_overhead_s
        figures.append(f"{overhead * 1e3:.2f} ms per microbatch" if overhead is not None else "per microbatch: preset")
        link = self.link()
        figures.append(f"link {link.latency_s * 1e3:.2f} ms + {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s"
                       if link else "link: preset")
        text = f"{'; '.join(parts)}: {', '.join(figures)}"
        if m.other_runnable > 0.5 * self.key.cores:  # other work took cores from the measurement
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
                          refits=tuple(Refit(**r) for r in data.get("refits", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: malformed machine profile ({type(exc).__name__}: {exc})") from None
        if not (profile.forward_scale > 0 and profile.backward_scale > 0):
            raise ValueError(f"{where}: scales {profile.forward_scale}, {profile.backward_scale} must be > 0")
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


# ---- the cache -----------------------------------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "partitioner"


def cache_path(key: MachineKey) -> Path:
    return cache_dir() / f"machine-{key.digest}.json"


def load_cached(key: MachineKey) -> tuple[MachineProfile | None, str | None]:
    """(the cached profile of ``key``, None) or (None, why there is none usable)."""
    path = cache_path(key)
    if not path.is_file():
        return None, "none cached"
    try:
        profile = MachineProfile.from_dict(json.loads(path.read_text()), where=str(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path} unreadable ({type(exc).__name__})"
    except ValueError as exc:
        return None, str(exc)
    if profile.key != key:
        return None, f"{path} is another machine's ({profile.key.cpu_model}, {profile.key.cores} cores)"
    return profile, None


def save(profile: MachineProfile, path: Path | None = None) -> Path:
    """Write ``profile`` to its cache file atomically (Note [machine profile cache])."""
    path = Path(path) if path is not None else cache_path(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(profile.to_dict(), indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:  # a filesystem without directory fsync: the rename is still atomic
        pass
    return path


# ---- measuring ------------------------------------------------------------------------------------

def reference_workload():
    """The fixed model the region coefficients are fitted on (Note [machine profile]): the ops
    small models are made of, at two widths, 2 x 64 tokens (the demo's microbatch)."""
    import functools

    import torch
    import torch.nn as nn

    from partitioner.models import Block
    from partitioner.workload import Workload
    from runtime import data

    class Reference(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(512, 64)
            self.narrow = Block(64, 2, 0.0)
            self.widen = nn.Linear(64, 256)
            self.wide = Block(256, 4, 0.0)
            self.norm = nn.LayerNorm(256)
            self.head = nn.Linear(256, 512, bias=False)

        def forward(self, tokens):
            return self.head(self.norm(self.wide(self.widen(self.narrow(self.embed(tokens))))))

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = Reference()
    finally:
        torch.random.set_rng_state(generator_state)
    return Workload(model=model, example_args=(torch.zeros(2, 64, dtype=torch.long),), loss_fn=data.causal_lm_loss,
                    make_batch=functools.partial(data.token_batch, vocab=512, seq=64, seed=0), name="machine-reference")


def measure_machine(progress: Callable[[str], None] | None = None, *, repeats: int = 10,
                    gloo: bool = True) -> MachineProfile:
    """Measure this machine (Note [machine profile]): seconds, not minutes. ``gloo=False`` skips
    the two-process figures (they stay the preset's)."""
    import torch

    from partitioner.analysis import analyze
    from partitioner.calibrate import calibrate
    from partitioner.calibrate.measure import _example_inputs
    from partitioner.calibrate.tp_overheads import fit_collectives, measure_dtensor_op_s

    say = progress or (lambda _message: None)
    started = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    others = [_other_runnable(load)]  # at the start, between the parts, at the end: the busiest counts
    workload = reference_workload()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    import warnings

    with warnings.catch_warnings():  # torch's own deprecation notices (export, pytree): not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        try:
            say("machine profile: the reference ops, one thread")
            gm, _table = analyze(workload, granularity="sublayer")
            fitted = calibrate(workload, gm, repeats=repeats, warmup=3, threads=1)
            try:
                dtensor_op_s = measure_dtensor_op_s(gm, _example_inputs(workload))
            except Exception:  # noqa: BLE001 - DTensor's figure is optional: the preset stands
                dtensor_op_s = None
            optimizer_s_per_param_byte = measure_optimizer_s_per_param_byte()
        finally:
            torch.set_num_threads(old_threads)
    others.append(_other_runnable(load, seconds=0.3))
    g = _measure_gloo(say) if gloo else None
    others.append(_other_runnable(load, seconds=0.3))
    tp = fit_collectives(g.collective_points, g.link_latency_s) if g else {}
    measured = MachineMeasurements(
        forward=_scaled(fitted.forward, 1.0), backward=_scaled(fitted.backward, 1.0),
        forward_fit_median_rel_error=float(fitted.meta["forward_median_rel_error"]),
        backward_fit_median_rel_error=float(fitted.meta["backward_median_rel_error"]),
        microbatch_overhead_s=g.microbatch_overhead_s if g else None,
        pipeline_slot_s=g.pipeline_slot_s if g else None,
        link_latency_s=g.link_latency_s if g else None,
        link_bandwidth_bytes_per_s=g.link_bandwidth_bytes_per_s if g else None,
        allreduce_latency_s=g.allreduce_latency_s if g else None,
        p2p_latency_s=g.p2p_latency_s if g else None,
        recompute_fixed_s=fitted.recompute_fixed_s, dtensor_op_s=dtensor_op_s,
        tp_collective_s=tp.get("tp_collective_s"), tp_skew=tp.get("tp_skew"),
        contention=g.contention if g else 1.0, optimizer_s_per_param_byte=optimizer_s_per_param_byte, threads=1,
        load_average_1m=float(load), other_runnable=max(others),
        measure_s=time.perf_counter() - started, time_unix=time.time())
    return MachineProfile(key=MachineKey.here(), measured=_finite(measured))


def measure_optimizer_s_per_param_byte(num_bytes: int = 4 << 20, *, repeats: int = 10) -> float:
    """Seconds of one optimizer step (runtime/train.py ``make_optimizer``: AdamW, its fused
    kernel where torch has one, and the schedule's step) per parameter byte, over ``num_bytes``
    of fp32 parameters in 64 KiB tensors, a small model's (Note [machine profile]). The step's
    own fixed cost is in the figure, spread over those bytes."""
    import statistics

    import torch

    from runtime.train import make_optimizer

    params = [torch.nn.Parameter(torch.zeros(16384)) for _ in range(max(1, num_bytes // (16384 * 4)))]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer, schedule = make_optimizer(params, {"lr": 1e-3})
    times = []
    for i in range(3 + repeats):
        start = time.perf_counter()
        optimizer.step()
        schedule.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / sum(p.numel() * p.element_size() for p in params)


def _other_runnable(load_average: float, seconds: float = 0.5) -> float:
    """Threads besides this one running or waiting for a core, averaged over ``seconds``
    (/proc/loadavg's fourth field, which the 1-minute load average lags by a minute); the load
    average where there is no /proc."""
    samples = []
    for _ in range(10):
        try:
            with open("/proc/loadavg") as f:
                samples.append(max(0, int(f.read().split()[3].split("/")[0]) - 1))
        except (OSError, ValueError, IndexError):
            return float(load_average)
        time.sleep(seconds / 10)
    return sum(samples) / len(samples)


def _finite(measured: MachineMeasurements) -> MachineMeasurements:
    """Plain floats (numpy's from the fit), every one finite."""
    def clean(value):
        if isinstance(value, DirectionFit):
            return DirectionFit(*(float(getattr(value, f.name)) for f in dataclasses.fields(DirectionFit)))
        return float(value) if isinstance(value, float) or hasattr(value, "dtype") else value
    return MachineMeasurements(**{f.name: clean(getattr(measured, f.name)) for f in dataclasses.fields(measured)})


def _measure_gloo(say: Callable[[str], None]) -> GlooFigures | None:
    """The two-process figures (machine_worker.py), or None when the processes did not finish
    (not the compile's error: the preset's figures stand, and the profile says so)."""
    say("machine profile: two processes over gloo (schedule, sends, all-reduce)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    with tempfile.TemporaryDirectory(prefix="machine-profile-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [subprocess.Popen([sys.executable, "-m", "partitioner.calibrate.machine_worker", str(rank), store],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
                 for rank in range(2)]
        outputs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=_WORKER_TIMEOUT_S)
                outputs.append((p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            say("machine profile: the gloo processes did not finish; the preset's link and overheads stand")
            return None
    if any(code != 0 for code, _, _ in outputs):
        last = next((err.strip().splitlines()[-1] for code, _, err in outputs if code != 0 and err.strip()), "")
        say(f"machine profile: a gloo process failed ({last}); the preset's link and overheads stand")
        return None
    return fit_gloo(json.loads(outputs[0][1].strip().splitlines()[-1]))


@dataclass(frozen=True)
class GlooFigures:
    """What the two processes measured, fitted (``fit_gloo``; MachineMeasurements' fields of the same names)."""

    microbatch_overhead_s: float
    pipeline_slot_s: float
    link_latency_s: float
    link_bandwidth_bytes_per_s: float
    allreduce_latency_s: float
    p2p_latency_s: float
    contention: float
    collective_points: tuple  # tensor parallelism's (compute s, wait s) points (tp_overheads.fit_collectives)


def fit_gloo(raw: dict) -> GlooFigures:
    """The figures of ``machine_worker``'s raw timings (Note [machine profile])."""
    from partitioner.calibrate.machine_worker import BLOCK_MESSAGE_BYTES

    def slope(points):
        (x0, y0), (x1, y1) = points[0], points[-1]
        return max(0.0, (y1 - y0) / (x1 - x0))

    allreduce = sorted(raw["allreduce"])
    # the bandwidth: a least-squares slope over the larger sizes (one noisy size moves it little);
    # the latency from the smallest
    big = allreduce[1:]
    mean_x = sum(x for x, _ in big) / len(big)
    mean_y = sum(y for _, y in big) / len(big)
    per_byte = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in big) / sum((x - mean_x) ** 2 for x, _ in big))
    bandwidth = 1.0 / per_byte if per_byte > 0 else DEFAULT_LINKS[KIND][0].bandwidth_bytes_per_s
    smallest_bytes, smallest_s = allreduce[0]
    # a two-rank ring all-reduce: n / bandwidth + 2 latencies (Note [cost model] in evaluate.py)
    allreduce_latency = max(0.0, (smallest_s - smallest_bytes / bandwidth) / 2)
    overhead = slope(raw["pipeline_1"])
    alone_s, together_s = raw["contention"]
    contention = max(1.0, together_s / alone_s) if alone_s > 0 else 1.0  # never faster beside another
    slot = slope(raw["pipeline_2_block"])
    # Each stage of the two-stage schedule computes and sends once per microbatch, as the cost
    # model charges it: slot = contention x compute + overhead + latency + bytes / bandwidth
    link_latency = max(0.0, slot - contention * raw["block_alone_s"] - overhead - BLOCK_MESSAGE_BYTES / bandwidth)
    return GlooFigures(microbatch_overhead_s=overhead, pipeline_slot_s=slot, link_latency_s=link_latency,
                       link_bandwidth_bytes_per_s=bandwidth, allreduce_latency_s=allreduce_latency,
                       p2p_latency_s=sorted(raw["pingpong"])[0][1],
                       contention=contention,
                       collective_points=tuple(tuple(p) for p in raw["collective_points"]))


# ---- what a compile asks for ---------------------------------------------------------------------

@dataclass(frozen=True)
class Resolved:
    """The machine profile a compile prices with, where it came from and how it was found."""

    profile: MachineProfile
    path: Path
    how: str  # "cached", "measured" or "measured again (<why>)"


def machine_profile(*, refresh: bool = False, progress: Callable[[str], None] | None = None) -> Resolved:
    """This machine's profile: the cached one, else (or with ``refresh``) measured and cached."""
    key = MachineKey.here()
    path = cache_path(key)
    why = "refresh"
    if not refresh:
        cached, why = load_cached(key)
        if cached is not None:
            return Resolved(cached, path, "cached")
    profile = measure_machine(progress)
    save(profile, path)
    how = "measured" if why in ("none cached", "refresh") else f"measured again ({why})"
    return Resolved(profile, path, how)


def calibration_disabled() -> bool:
    """``PARTITIONER_NO_CALIBRATE`` set to anything but "", "0" or "false" (Note [machine profile cache])."""
    return os.environ.get(NO_CALIBRATE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def resolve(option, cluster: ClusterSpec, progress: Callable[[str], None] | None = None) -> Resolved | None:
    """The machine profile a compile over ``cluster`` prices with (Note [the API measures too]):
    ``option`` "auto" (cached or measured; none without a cpu device or with
    PARTITIONER_NO_CALIBRATE), "preset" (none), or a MachineProfile."""
    if not isinstance(option, MachineProfile) and option not in ("auto", "preset", None, False):
        raise ValueError(f"machine_profile={option!r}: give \"auto\" (this machine's cached profile, measured "
                         "the first time), \"preset\" (the cpu preset's figures) or a MachineProfile")
    if not any(d.kind == KIND for d in cluster.devices):
        return None  # nothing it prices
    if isinstance(option, MachineProfile):
        return Resolved(option, cache_path(option.key), "given")
    if option != "auto" or calibration_disabled():
        return None
    try:
        return machine_profile(progress=progress)
    except Exception as exc:  # noqa: BLE001 - a compile still has the preset; `partitioner calibrate` raises it
        if progress is not None:
            progress(f"machine: measuring this machine failed ({type(exc).__name__}: {exc}); pricing with the "
                     "cpu preset (partitioner calibrate --machine shows the error)")
        return None
