"""This machine's CPU profile: measured once (seconds), cached per machine, refit from runs. This
module is the cache and what a compile asks for (``resolve``); what the profile is lives in
machine_profile.py, how it is measured in machine_measure.py (their names are re-exported here).

    partitioner calibrate --machine [--refresh]     # show (measure if absent, or again) the profile
    partitioner calibrate --from-run out/demo/run   # refit it to what a finished run measured
    partitioner compile ... [--no-calibrate]        # priced by it (default), or by the cpu preset

Note [machine profile]
    The ``cpu`` preset's figures were measured on one machine; on another the prediction is off by
    what that machine differs in (1.6 to 2.4x for `make demo`). So the machine profile measures
    this machine once, model-independently, one thread per process as the ranks run: the fitted
    time model on a fixed reference model (``reference_workload``, not the user's: one measurement
    serves every compile), the optimizer step, and over two gloo processes the pipeline's
    per-microbatch overhead, the link, tensor parallelism's collectives and the ranks' contention
    (machine_measure.py lists how). Per-microbatch figures are slopes over two microbatch counts,
    so a step's one-off cost is not charged per microbatch. The timings keep the 25th percentile,
    not the median: other work only ever adds time, and the profile is this machine with its cores
    to the job. It replaces only the preset's figures, never one the user gave (Note [what the
    machine profile replaces]); ``--calibrate`` wins for the regions; regions follow the reference
    fit only under fp32 (it is measured in fp32). A busy machine's figures are provisional (Note [a
    busy measurement is provisional]); ``calibrate --from-run`` refits them (Note [refit from a run]).

Note [machine profile cache]
    One JSON file per machine, ``$XDG_CACHE_HOME/partitioner/machine-<key>.json`` (default
    ``~/.cache``), the key a digest of what makes the figures this machine's: the CPU model
    (/proc/cpuinfo's "model name", else ``platform.processor()``), the core count, torch's and
    Python's versions (a new torch changes the kernels and the dispatch). Written atomically (a
    unique temporary file in the folder, fsync, rename, fsync the folder), so two compiles
    measuring at once each leave a whole file. A file that is not JSON, not this format
    (``FORMAT``), for another key, malformed, or holding a figure outside its bounds (Note
    [machine figures are bounded] in partitioner/calibrate/machine_profile.py) is measured again
    and overwritten, never trusted and never a traceback; the compile's line names the file and
    the figure. A cache folder that cannot be written (read-only, full) does not throw the fresh
    measurement away: it prices the compile, and one line says it is not cached (``save_or_say``). ``PARTITIONER_NO_CALIBRATE=1`` (or ``--no-calibrate``, or
    ``compile(machine_profile="preset")``) prices with the preset: the test suite sets it, so no
    golden file depends on the machine.

Note [compiled machine fit]
    Compiled stages (Note [compiled stages] in runtime/execute/compile_stages.py) pay a quarter to
    a third of an eager op's fixed cost per op here, so the eager fit prices a compiled plan too
    slow and steers the solver by a cost that will not be paid. The first compile with
    compile_stages on a machine whose profile has no compiled fit measures the reference model
    through torch.compile (about a minute, said as it starts) and adds it to the cached profile.
    Such plans price cpu regions with it, ``dtensor_op_s`` 0 (Note [compiled regions priced]) and
    none of a refit's region scales (those are the eager fit's); a refit of such a run refits the
    per-microbatch overhead only. A failed measurement (no C compiler for inductor) is said and
    priced with the eager fit. The per-call term is not priced per region: a compiled stage is one call.

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
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from partitioner.calibrate.machine_measure import (_other_runnable, fit_gloo, measure_compiled_fit, measure_machine,
                                                   reference_workload)
from partitioner.calibrate.machine_profile import (FORMAT, KIND, MachineKey, MachineMeasurements, MachineProfile, Refit,
                                                   busy_threads_above, fill_fixed_costs)
from partitioner.config.cluster import ClusterSpec

# its own names and those of machine_profile.py and machine_measure.py it re-exports (callers take them from here)
__all__ = ["CACHE_ENV", "FORMAT", "KIND", "NO_CALIBRATE_ENV", "MachineKey", "MachineMeasurements", "MachineProfile",
           "Refit", "Resolved", "cache_dir", "cache_path", "calibration_disabled", "fill_fixed_costs", "fit_gloo",
           "load_cached", "machine_profile", "measure_machine", "other_runnable_now", "quieter_now",
           "reference_workload", "resolve", "save", "save_or_say", "with_compiled_fit"]

NO_CALIBRATE_ENV = "PARTITIONER_NO_CALIBRATE"
CACHE_ENV = "XDG_CACHE_HOME"


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
            why = quieter_now(cached)
            if why is None:
                return Resolved(cached, path, "cached")
    profile = measure_machine(progress)
    save_or_say(profile, path, progress)
    how = "measured" if why in ("none cached", "refresh") else f"measured again ({why})"
    return Resolved(profile, path, how)


def save_or_say(profile: MachineProfile, path: Path, progress: Callable[[str], None] | None) -> str | None:
    """Save ``profile`` to ``path``; when the cache folder cannot take it, the reason, said in one
    line: the fresh measurement still prices this compile (it is not thrown away for a cache)."""
    try:
        save(profile, path)
    except OSError as exc:
        why = (f"not cached: {path.parent} is not writable ({exc.strerror or type(exc).__name__}); this compile "
               f"uses the measurement, the next measures again (set {CACHE_ENV} to a writable folder)")
        if progress is not None:
            progress(f"machine: {why}")
        else:
            warnings.warn(f"machine profile {why}", stacklevel=3)
        return why
    return None


def with_compiled_fit(resolved: Resolved, progress: Callable[[str], None] | None = None) -> Resolved:
    """``resolved`` whose profile has a compiled fit: measured now and added to the cached file
    when it has none (Note [compiled machine fit]); ``resolved`` itself when measuring fails."""
    if resolved.profile.compiled is not None:
        return resolved
    say = progress or (lambda _message: None)
    say("machine: compiled stages are priced by this machine's compiled regions: measuring the reference "
        "model through torch.compile, once for this machine (about a minute)")
    try:
        fit = measure_compiled_fit(say)
    except Exception as exc:  # noqa: BLE001 - the eager fit still prices the plan; the line says so
        say(f"machine: measuring compiled regions failed ({type(exc).__name__}: {str(exc)[:200]}); compiled "
            "stages are priced by the eager fit")
        return resolved
    profile = dataclasses.replace(resolved.profile, compiled=fit)
    if resolved.how != "given":  # a profile the caller passed is theirs, not the cache's
        cached, _why = load_cached(profile.key)  # another compile may have refit it meanwhile: keep that
        if cached is not None and cached.measurement_id == profile.measurement_id:
            profile = dataclasses.replace(cached, compiled=fit)
        save_or_say(profile, resolved.path, say)
    return Resolved(profile, resolved.path, resolved.how)


def quieter_now(profile: MachineProfile) -> str | None:
    """Why ``profile`` (the cached one) should be measured again now, or None to keep it.

    Note [a busy measurement is provisional]: a profile measured while other work held the cores
    (more other runnable threads than half the cores, or than leave the two cores its two ranks run
    on at once) prices every later plan with that work's contention: one measured at load 34.8 on 2
    cores kept a 34 ms link latency, and every prediction after it was 3-7x the measured step; one
    measured on 2 cores beside a package install (1.0 other thread) halved the matmul rate (40
    against 90 GFLOP/s quiet) and priced the demo's step at 82 ms against 34 ms quiet. Such a
    profile is kept only while the machine is still busy; the first compile that finds it quiet
    (no more taken than that, and under half the threads seen then) measures again, once: the new
    profile is a quiet one. A profile a run refit (``refits``) is the user's and is kept."""
    then = profile.measured.other_runnable
    busy_above = busy_threads_above(profile.key.cores)
    if then <= busy_above or profile.refits:
        return None
    now = other_runnable_now()
    if now > busy_above or now >= then / 2:
        return None
    return f"the cached one was measured with {then:.1f} other threads running, {now:.1f} now"


def other_runnable_now() -> float:
    """Other threads running or waiting for a core now (a fifth of a second's average)."""
    return _other_runnable(os.getloadavg()[0], seconds=0.2)


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
