"""A machine profile with made-up figures (no measuring), and the cache fixtures, for the tests of
partitioner/calibrate/machine.py and refit.py."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.calibrate import machine
from partitioner.calibrate.machine import MachineKey, MachineMeasurements, MachineProfile
from partitioner.calibrate.profiles import DirectionFit


def fake_profile(*, key: MachineKey | None = None, rate: float = 80e9, **measured) -> MachineProfile:
    """This machine's key (unless given) and round figures, every measured field overridable."""
    figures = dict(
        forward=DirectionFit(1 / rate, 2 / rate, 1 / 50e9, 8e-6),
        backward=DirectionFit(1 / rate, 2 / rate, 1 / 40e9, 15e-6),
        forward_fit_median_rel_error=0.1, backward_fit_median_rel_error=0.1,
        microbatch_overhead_s=0.5e-3, pipeline_slot_s=2e-3, link_latency_s=1.4e-3,
        link_bandwidth_bytes_per_s=1.5e9, allreduce_latency_s=1e-4, p2p_latency_s=1e-3,
        recompute_fixed_s=2e-4, dtensor_op_s=5e-5, tp_collective_s=3e-4, tp_skew=0.2, contention=1.0, optimizer_s_per_param_byte=0.3e-9,
        threads=1, load_average_1m=0.5, other_runnable=0.0, measure_s=8.0, time_unix=1.7e9)
    figures.update(measured)
    return MachineProfile(key=key or MachineKey.here(), measured=MachineMeasurements(**figures))


def other_machine(profile: MachineProfile) -> MachineProfile:
    return dataclasses.replace(profile, key=dataclasses.replace(profile.key, cpu_model="Another CPU"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, calibration on (the suite's conftest turns it off)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(machine.NO_CALIBRATE_ENV, raising=False)
    return tmp_path / "cache" / "partitioner"


@pytest.fixture
def measured(monkeypatch):
    """measure_machine replaced: returns fake profiles, counts its calls."""
    calls = []

    def fake_measure(progress=None, **_):
        calls.append(1)
        return fake_profile(load_average_1m=float(len(calls)))  # each measurement tells itself apart

    monkeypatch.setattr(machine, "measure_machine", fake_measure)
    return calls
