"""A machine profile that cannot be poisoned (issue 42 finding 5; Note [machine figures are
bounded] in partitioner/calibrate/machine_profile.py): every figure is bounded when a profile is
made, a cached file outside the bounds is measured again with one line naming the file and the
figure, a run whose step time no run measures is refused before anything is written, and a cache
folder that cannot be written keeps the fresh measurement. Measuring is replaced by a counter."""

from __future__ import annotations

import dataclasses
import json

import pytest

from _machine import cache, fake_profile, measured  # noqa: F401 - cache, measured: fixtures
from partitioner.calibrate import machine
from partitioner.calibrate.profiles import DirectionFit
from partitioner.cli import main
from partitioner.config.cluster import ClusterSpec


def _poisoned(edit) -> str:
    body = fake_profile().to_dict()
    edit(body)
    return json.dumps(body)  # NaN and Infinity as Python's json writes and reads them


ZERO_FIT = {"s_per_matmul_flop": 0.0, "s_per_other_flop": 0.0, "s_per_byte": 0.0, "op_overhead_s": 0.0,
            "call_overhead_s": 0.0}
POISONS = {
    "contention 1e6": (lambda b: b["measured"].update(contention=1e6), "contention=1000000.0"),
    "overhead 1e6 s": (lambda b: b["measured"].update(microbatch_overhead_s=1e6), "microbatch_overhead_s=1000000.0"),
    "refit overhead NaN": (lambda b: b.update(microbatch_overhead_s=float("nan")), "microbatch_overhead_s=nan"),
    "coefficients 0": (lambda b: b["measured"].update(forward=ZERO_FIT), "forward.s_per_matmul_flop=0.0"),
    "scale 0": (lambda b: b.update(forward_scale=0.0), "forward_scale=0.0"),
    "latency inf": (lambda b: b.update(link_latency_s=float("inf")), "link_latency_s=inf"),
    "bandwidth 1": (lambda b: b["measured"].update(link_bandwidth_bytes_per_s=1.0), "link_bandwidth_bytes_per_s=1.0"),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_cached_profile_is_measured_again_in_one_line_naming_the_file(cache, measured, poison):
    edit, figure = POISONS[poison]
    path = machine.cache_path(machine.MachineKey.here())
    path.parent.mkdir(parents=True)
    path.write_text(_poisoned(edit))
    said = []
    got = machine.resolve("auto", ClusterSpec.homogeneous(2, "cpu"), said.append)
    assert len(measured) == 1 and got.how.startswith("measured again (")
    assert str(path) in got.how and figure in got.how and "\n" not in got.how, got.how
    assert machine.load_cached(got.profile.key) == (got.profile, None)  # overwritten with the measurement


@pytest.mark.parametrize("figures", [dict(contention=1e6), dict(microbatch_overhead_s=float("nan")),
                                     dict(forward=DirectionFit(0.0, 0.0, 0.0, 0.0)), dict(p2p_latency_s=-1e-3),
                                     dict(threads=0), dict(tp_skew=float("inf"))])
def test_a_measurement_outside_the_bounds_is_never_a_profile(figures):
    with pytest.raises(ValueError, match=r"is outside \[.*Note \[machine figures are bounded\]"):
        fake_profile(**figures)


def test_a_refit_outside_the_bounds_is_never_a_profile():
    profile = fake_profile()
    for change in (dict(forward_scale=3e7), dict(backward_scale=1e-9), dict(microbatch_overhead_s=1e6),
                   dict(link_latency_s=float("nan"))):
        with pytest.raises(ValueError, match="is outside"):
            dataclasses.replace(profile, **change)


@pytest.mark.parametrize("step", ["NaN", "0", "1e6", "-0.5", "Infinity", '"fast"', "null"])
def test_a_run_with_a_step_time_no_run_measures_is_refused_and_writes_nothing(cache, tmp_path, capsys, step):
    before = machine.save(fake_profile()).read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text('{"measured_step_time_s": %s, "folder": "%s"}' % (step, tmp_path / "gone"))
    assert main(["calibrate", "--from-run", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{run / 'summary.json'}: measured_step_time_s is " in err and "not refit" in err, err
    assert machine.cache_path(machine.MachineKey.here()).read_bytes() == before
    assert sorted(p.name for p in cache.iterdir()) == [machine.cache_path(machine.MachineKey.here()).name]


def test_an_unwritable_cache_folder_keeps_the_fresh_measurement(cache, measured, tmp_path):
    """The cache folder's place is a file (root ignores permission bits; this refuses anyone): the
    compile still prices with what it measured, and one line says it is not cached."""
    cache.parent.mkdir(parents=True)
    cache.write_text("not a folder")
    said = []
    got = machine.resolve("auto", ClusterSpec.homogeneous(2, "cpu"), said.append)
    assert got is not None and got.how == "measured" and len(measured) == 1
    assert got.profile.measured.load_average_1m == 1.0  # the measurement itself, not the preset
    lines = [s for s in said if "not cached" in s]
    assert len(lines) == 1 and str(cache) in lines[0] and "\n" not in lines[0], said
    assert cache.read_text() == "not a folder"
    with pytest.warns(UserWarning, match="not cached"):  # the API with no progress to say it through
        assert machine.machine_profile().how == "measured" and len(measured) == 2  # nothing was cached
