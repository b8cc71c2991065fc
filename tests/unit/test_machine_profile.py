"""This machine's cpu profile (partitioner/calibrate/machine.py): the cache (keyed, refreshed,
corrupt files measured again, atomic writes), what it replaces in a compile, --no-calibrate and
PARTITIONER_NO_CALIBRATE, and the stage times a run writes (runtime/observe/stage_times.py).

Measuring is replaced by a counter (``measured``) except in the one test that measures for real;
no wall-clock figure is asserted."""

from __future__ import annotations

import json
import os

import pytest

from _machine import cache, fake_profile, measured, other_machine  # noqa: F401 - cache, measured: fixtures
from partitioner.calibrate import machine
from partitioner.config.cluster import DEFAULT_LINKS, DEVICE_PRESETS, ClusterSpec


def test_the_cache_file_is_named_by_the_machine(cache):
    key = machine.MachineKey.here()
    assert machine.cache_path(key) == cache / f"machine-{key.digest}.json"
    assert key.cores == os.cpu_count() and key.cpu_model
    for field, value in (("torch_version", "0.0.1"), ("python_version", "3.99.0"), ("cores", key.cores + 1),
                         ("cpu_model", "Another CPU")):
        import dataclasses

        assert dataclasses.replace(key, **{field: value}).digest != key.digest, field


def test_measured_once_then_cached_and_refreshed_on_request(cache, measured):
    first = machine.machine_profile()
    assert first.how == "measured" and len(measured) == 1 and first.path.is_file()
    again = machine.machine_profile()
    assert again.how == "cached" and len(measured) == 1 and again.profile == first.profile
    fresh = machine.machine_profile(refresh=True)
    assert fresh.how == "measured" and len(measured) == 2
    assert fresh.profile.measurement_id != first.profile.measurement_id
    assert machine.machine_profile().profile == fresh.profile


def _negative_link():
    body = fake_profile().to_dict()
    body["measured"]["link_latency_s"] = -1.0
    return json.dumps(body)


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"format": "partitioner.machine/0"}',
                                     '{"format": "partitioner.machine/1", "key": {}}', "\udcff", _negative_link()])
def test_a_corrupt_or_foreign_cache_file_is_measured_again(cache, measured, content):
    path = machine.cache_path(machine.MachineKey.here())
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    got = machine.machine_profile()
    assert got.how.startswith("measured again (") and len(measured) == 1
    assert machine.MachineProfile.from_dict(json.loads(path.read_text())) == got.profile


def test_another_machines_profile_under_this_key_is_not_trusted(cache, measured):
    path = machine.save(other_machine(fake_profile()), machine.cache_path(machine.MachineKey.here()))
    got = machine.machine_profile()
    assert "another machine's" in got.how and len(measured) == 1 and got.path == path


def test_the_file_round_trips_and_names_its_format(cache):
    profile = fake_profile()
    path = machine.save(profile)
    body = json.loads(path.read_text())
    assert body["format"] == machine.FORMAT and body["key"]["cores"] == os.cpu_count()
    assert machine.load_cached(profile.key) == (profile, None)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(cache, monkeypatch):
    old = fake_profile()
    path = machine.save(old)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(machine.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        machine.save(fake_profile(microbatch_overhead_s=9e-3))
    assert machine.load_cached(old.key) == (old, None)
    assert sorted(p.name for p in cache.iterdir()) == [path.name]


def test_no_calibrate_env_and_preset_measure_nothing(cache, measured, monkeypatch):
    cluster = ClusterSpec.homogeneous(2, "cpu")
    assert machine.resolve("preset", cluster) is None
    assert machine.resolve("auto", ClusterSpec.homogeneous(8, "h100")) is None  # no cpu device
    monkeypatch.setenv(machine.NO_CALIBRATE_ENV, "1")
    assert machine.resolve("auto", cluster) is None
    assert measured == []
    monkeypatch.setenv(machine.NO_CALIBRATE_ENV, "0")
    assert machine.resolve("auto", cluster).how == "measured" and len(measured) == 1
    with pytest.raises(ValueError, match="machine_profile='fast'.*\"auto\".*\"preset\""):
        machine.resolve("fast", cluster)


def test_a_failed_measurement_leaves_the_preset(cache, monkeypatch):
    def broken(progress=None, **_):
        raise RuntimeError("no gloo here")

    monkeypatch.setattr(machine, "measure_machine", broken)
    said = []
    assert machine.resolve("auto", ClusterSpec.homogeneous(2, "cpu"), said.append) is None
    assert "no gloo here" in said[-1] and "cpu preset" in said[-1]
    with pytest.raises(RuntimeError, match="no gloo here"):
        machine.machine_profile()


def test_the_profile_replaces_only_the_presets_figures():
    profile = fake_profile(rate=80e9)
    preset = ClusterSpec.homogeneous(4, "cpu")
    got = profile.cluster_for(preset)
    assert {d.flops_per_s for d in got.devices} == {80e9}
    assert got.intra_node_link == profile.link() != DEFAULT_LINKS["cpu"][0]
    assert got.inter_node_link == preset.inter_node_link  # nothing measured another host
    assert profile.link().latency_s == 1.4e-3 and profile.link().bandwidth_bytes_per_s == 1.5e9
    given = ClusterSpec.from_dict({"group": [{"kind": "cpu", "count": 2, "flops_per_s": 7e9}],
                                   "links": {"intra_node": {"bandwidth_bytes_per_s": 3e9, "latency_s": 1e-5}}})
    kept = profile.cluster_for(given)
    assert {d.flops_per_s for d in kept.devices} == {7e9} and kept.intra_node_link == given.intra_node_link
    # a refit scale and the ranks' contention slow the rate the cluster states (MFU), as they slow the regions
    import dataclasses

    slower = dataclasses.replace(profile, forward_scale=2.0,
                                 measured=dataclasses.replace(profile.measured, contention=1.25))
    assert {d.flops_per_s for d in slower.cluster_for(preset).devices} == {32e9}
    assert slower.device_profile().forward.s_per_matmul_flop == pytest.approx(2.5 / 80e9)


def test_fit_of_the_gloo_timings():
    from partitioner.calibrate.machine_worker import BLOCK_MESSAGE_BYTES

    raw = {"allreduce": [[1024, 0.20e-3], [1 << 20, 1.20e-3], [4 << 20, 4.20e-3], [16 << 20, 16.20e-3]],
           "pingpong": [[128, 0.05e-3], [65536, 0.08e-3]],
           "pipeline_1": [[2, 1.0e-3], [10, 3.4e-3]], "pipeline_2": [[2, 5.0e-3], [10, 21.0e-3]],
           "pipeline_2_block": [[2, 30e-3], [10, 94e-3]], "block_alone_s": 5e-3,
           "collective_points": [[0.5e-3, 0.4e-3], [4e-3, 1.1e-3]], "contention": [10e-3, 12e-3]}
    got = machine.fit_gloo(raw)
    bandwidth = (3 << 20) / 3.0e-3
    assert got.link_bandwidth_bytes_per_s == pytest.approx(bandwidth)
    assert got.allreduce_latency_s == pytest.approx((0.20e-3 - 1024 / bandwidth) / 2)
    assert got.microbatch_overhead_s == pytest.approx(0.3e-3)
    assert got.pipeline_slot_s == pytest.approx(8.0e-3)
    # slot = contention x compute + overhead + latency + bytes / bandwidth
    assert got.link_latency_s == pytest.approx(8.0e-3 - 1.2 * 5e-3 - 0.3e-3 - BLOCK_MESSAGE_BYTES / bandwidth)
    assert got.p2p_latency_s == 0.05e-3
    assert got.contention == pytest.approx(1.2)
    assert machine.fit_gloo({**raw, "contention": [10e-3, 9e-3]}).contention == 1.0  # never faster beside another


@pytest.fixture(scope="module")
def tiny():
    from partitioner.models.builtin import gpt

    return gpt(layers=2, width=32, heads=2, vocab=64, seq=16)


def _compile(workload, **options):
    import partitioner

    return partitioner.compile(workload, cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=8, num_stages=2,
                               microbatches=4, dp=1, tensor_parallel=1, **options)


def test_the_profile_prices_the_plan(tiny):
    """The preset's plan has no time-model record; the profile's says so and costs what its figures say:
    slower regions and a larger per-microbatch overhead give a larger predicted step."""
    import dataclasses

    preset = _compile(tiny, machine_profile="preset")
    fast = fake_profile(microbatch_overhead_s=0.1e-3)
    slow = dataclasses.replace(fast, forward_scale=3.0, backward_scale=3.0, microbatch_overhead_s=4e-3)
    with_fast, with_slow = _compile(tiny, machine_profile=fast), _compile(tiny, machine_profile=slow)
    assert "cpu_time_model" not in preset.predicted
    record = with_fast.predicted["cpu_time_model"]
    assert record["measurement_id"] == fast.measurement_id and record["regions"] == "machine"
    assert with_slow.predicted["cpu_time_model"]["forward_scale"] == 3.0
    steps = [p.predicted["step_time_s"] for p in (preset, with_fast, with_slow)]
    assert len(set(steps)) == 3 and steps[2] > steps[1]
    assert with_fast.problem.microbatch_overhead_s_by_kind["cpu"] == 0.1e-3
    # AdamW's step, per step on the stage holding the parameters
    assert sum(r.step_s_by_kind["cpu"] for r in with_fast.problem.regions if r.step_s_by_kind) == pytest.approx(
        0.3e-9 * sum(r.param_bytes for r in with_fast.problem.regions))
    assert with_slow.problem.microbatch_overhead_s_by_kind["cpu"] == 4e-3
    assert with_fast.plan.cluster["links"]["intra_node"]["latency_s"] == 1.4e-3
    from partitioner.inspect import table

    assert "cpu time model  machine profile" in table(with_fast.plan) and "cpu time model" not in table(preset.plan)


def test_under_another_precision_only_the_fixed_costs_and_rate_apply(tiny):
    plan = _compile(tiny, machine_profile=fake_profile(), precision="bf16-mixed")
    assert plan.predicted["cpu_time_model"]["regions"] == "profile"
    assert plan.problem.microbatch_overhead_s_by_kind["cpu"] == 0.5e-3
    assert all(not (r.fwd_s_per_sample_by_kind or {}) for r in plan.problem.regions)  # the datasheet model


# ---- Note [compiled machine fit] -------------------------------------------------------------------

def _compiled_fit(op_overhead_s: float = 2e-6):
    from partitioner.calibrate.machine_profile import CompiledFit
    from partitioner.calibrate.profiles import DirectionFit

    return CompiledFit(forward=DirectionFit(1 / 90e9, 1 / 60e9, 1 / 60e9, op_overhead_s, 3e-4),
                       backward=DirectionFit(1 / 90e9, 1 / 60e9, 1 / 50e9, 2 * op_overhead_s, 2e-4),
                       forward_fit_median_rel_error=0.03, backward_fit_median_rel_error=0.06,
                       other_runnable=0.0, measure_s=50.0, time_unix=1.7e9)


@pytest.fixture
def measured_compiled(monkeypatch):
    """measure_compiled_fit replaced: returns a made-up fit, counts its calls."""
    calls = []

    def fake(progress=None, **_):
        calls.append(1)
        return _compiled_fit()

    monkeypatch.setattr(machine, "measure_compiled_fit", fake)
    return calls


def test_compiled_stages_are_priced_by_the_compiled_fit(tiny):
    """Fused kernels pay less per op: the compiled fit's plan is cheaper than the eager fit's on the
    same profile, says "machine compiled", and a refit's eager region scales do not touch it."""
    import dataclasses

    profile = dataclasses.replace(fake_profile(), compiled=_compiled_fit())
    eager = _compile(tiny, machine_profile=profile)
    compiled = _compile(tiny, machine_profile=profile, training={"compile_stages": True})
    assert eager.predicted["cpu_time_model"]["regions"] == "machine"
    assert compiled.predicted["cpu_time_model"]["regions"] == "machine compiled"
    assert compiled.predicted["step_time_s"] < eager.predicted["step_time_s"]
    refit = dataclasses.replace(profile, forward_scale=3.0, backward_scale=3.0)
    assert _compile(tiny, machine_profile=refit, training={"compile_stages": True}).predicted["step_time_s"] \
        == pytest.approx(compiled.predicted["step_time_s"])
    assert _compile(tiny, machine_profile=refit).predicted["step_time_s"] > eager.predicted["step_time_s"]
    priced = profile.device_profile(compiled=True)
    assert priced.meta["compiled"] and priced.dtensor_op_s == 0.0 and priced.forward.op_overhead_s == 2e-6
    with pytest.raises(ValueError, match="no compiled fit"):
        fake_profile().device_profile(compiled=True)


def test_the_compiled_fit_is_measured_once_and_cached(cache, measured, measured_compiled, tiny):
    said = []
    _compile(tiny)  # eager: the machine measured, no compiled fit
    assert measured == [1] and measured_compiled == []
    assert machine.load_cached(machine.MachineKey.here())[0].compiled is None
    plan = _compile(tiny, training={"compile_stages": True}, progress=said.append)
    assert measured_compiled == [1] and any("through torch.compile, once for this machine" in s for s in said)
    cached, _ = machine.load_cached(machine.MachineKey.here())
    assert cached.compiled == _compiled_fit() and cached.measurement_id == plan.predicted["cpu_time_model"][
        "measurement_id"]  # the eager measurement kept, the fit added
    assert plan.predicted["cpu_time_model"]["regions"] == "machine compiled"
    _compile(tiny, training={"compile_stages": True})
    assert measured_compiled == [1] and measured == [1]  # both from the cache now
    assert "compiled 2/4 us per op" in cached.describe()


def test_a_failed_compiled_measurement_prices_with_the_eager_fit(cache, measured, monkeypatch, tiny):
    def broken(progress=None, **_):
        raise RuntimeError("inductor found no C++ compiler")

    monkeypatch.setattr(machine, "measure_compiled_fit", broken)
    said = []
    plan = _compile(tiny, training={"compile_stages": True}, progress=said.append)
    assert plan.predicted["cpu_time_model"]["regions"] == "machine"
    assert any("no C++ compiler" in s and "priced by the eager fit" in s for s in said), said
    assert machine.load_cached(machine.MachineKey.here())[0].compiled is None


def test_cli_no_calibrate_prices_with_the_preset(cache, measured, tmp_path, capsys):
    from partitioner.cli import main

    model = "gpt:layers=2,width=32,heads=2,vocab=64,seq=16"
    assert main(["compile", model, "-o", str(tmp_path / "preset"), "--devices", "2", "--no-calibrate", "-q"]) == 0
    assert measured == []
    assert "cpu_time_model" not in json.loads((tmp_path / "preset" / "plan.json").read_text())["predicted"]
    assert main(["compile", model, "-o", str(tmp_path / "x"), "--calibrate", "--no-calibrate", "-q"]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["compile", model, "-o", str(tmp_path / "machine"), "--devices", "2"]) == 0
    err = capsys.readouterr().err
    assert measured == [1] and "[compile] machine: measured " in err and str(cache) in err
    assert json.loads((tmp_path / "machine" / "plan.json").read_text())["predicted"]["cpu_time_model"]


def test_cli_calibrate_shows_and_refreshes(cache, measured, capsys):
    from partitioner.cli import main

    assert main(["calibrate"]) == 0 and measured == [1]
    assert main(["calibrate", "--machine"]) == 0 and measured == [1]
    out = capsys.readouterr().out
    assert out.startswith("measured: ") and "cached: " in out and "per microbatch" in out
    assert main(["calibrate", "--machine", "--refresh"]) == 0 and measured == [1, 1]
    assert main(["calibrate", "--from-run", "x", "--refresh"]) == 2
    assert "give one" in capsys.readouterr().err


def test_measuring_this_machine(cache):
    """The one real measurement (seconds): every figure there and plausible, in a file that loads."""
    got = machine.machine_profile(refresh=True)
    m = got.profile.measured
    assert got.how == "measured" and machine.load_cached(got.profile.key) == (got.profile, None)
    assert m.matmul_flops_per_s
    for fit in (m.forward, m.backward):  # under load the non-negative fit may put the whole fixed cost
        assert fit.op_overhead_s >= 0 and fit.call_overhead_s >= 0  # on calls (op 0) or on ops: one holds it
        assert fit.op_overhead_s + fit.call_overhead_s > 0, fit
    assert m.microbatch_overhead_s is not None and m.microbatch_overhead_s > 0, "the gloo processes ran"
    assert m.link_bandwidth_bytes_per_s > 0 and got.profile.link() is not None
    assert m.threads == 1 and m.measure_s > 0 and m.optimizer_s_per_param_byte > 0


# ---- runtime/observe/stage_times.py -------------------------------------------------------------------------

class _Stage:
    def __init__(self, seconds):
        self.seconds = seconds

    def forward_one_chunk(self, *args):
        return "out"

    def backward_one_chunk(self, *args):
        return None


def test_stage_times_sum_each_steps_calls_and_take_medians(tmp_path, monkeypatch):
    from runtime.observe import clock as host_clock, stage_times

    clock = iter(range(10_000))
    monkeypatch.setattr(host_clock.time, "perf_counter", lambda: float(next(clock)))
    stage = _Stage(0)
    timer = stage_times.StageTimes([stage], [3], num_microbatches=2)
    loss = timer.timed_loss(lambda out, target: 1.0)
    for _step in range(3):
        timer.begin_step()
        for _ in range(2):  # each call reads the fake clock twice: 1 "second" a call
            assert stage.forward_one_chunk(0) == "out"
            loss("out", None)
            stage.backward_one_chunk(0)
        timer.end_step(schedule=(0.0, 10.0), optimizer=(10.0, 10.5))
    path = timer.write(str(tmp_path / "run"), rank=1, replica=0)
    body = json.loads(open(path).read())
    assert path.endswith("stage_times_rank_1.json") and body["format"] == stage_times.FORMAT
    assert body["stages"] == [{"stage": 3, "forward_s_per_microbatch": 1.0, "backward_s_per_microbatch": 1.0,
                               "weight_backward_s_per_microbatch": 0.0}]  # no split backward: no W time
    assert body["loss_s_per_microbatch"] == 1.0 and body["timed_steps"] == 2 and body["optimizer_s"] == 0.5
    assert stage_times.StageTimes([], [], 1).write(str(tmp_path / "none"), rank=0, replica=0) is None


@pytest.mark.parametrize("cores, then, now, again", [(2, 1.0, 0.0, True), (2, 0.5, 0.0, False), (2, 1.0, 0.7, False),
                                                     (4, 1.0, 0.0, False), (4, 2.5, 0.0, True), (64, 20.0, 0.0, False)])
def test_on_two_cores_one_other_thread_makes_a_measurement_busy(monkeypatch, cores, then, now, again):
    """The profile measures two ranks at once, so on 2 cores one other running thread (a package
    install) takes a core it needs and the profile is measured again once the machine is quiet; on
    more cores half of them must be taken (see Note [a busy measurement is provisional])."""
    import dataclasses

    profile = fake_profile(other_runnable=then)
    profile = dataclasses.replace(profile, key=dataclasses.replace(profile.key, cores=cores))
    monkeypatch.setattr(machine, "other_runnable_now", lambda: now)
    assert (machine.quieter_now(profile) is not None) is again
    assert ("measured on a busy machine" in profile.describe()) is (then > machine.busy_threads_above(cores))


@pytest.mark.parametrize("then, now, refit, kept", [(7.4, 0.0, False, False), (7.4, 3.0, False, True),
                                                     (7.4, 0.0, True, True), (0.5, 0.0, False, True)])
def test_a_profile_measured_busy_is_measured_again_once_the_machine_is_quiet(cache, measured, monkeypatch,
                                                                               then, now, refit, kept):
    """A profile measured with more other threads than half the cores is kept while the machine is
    still busy and measured again (once) when it is quiet; a profile a run refit is kept whatever
    the load (Note [a busy measurement is provisional])."""
    import dataclasses

    busy = fake_profile(other_runnable=then)
    if refit:
        busy = dataclasses.replace(busy, refits=(machine.Refit(
            run_dir="r", plan_hash="0" * 16, measured_step_s=0.1, predicted_before_s=0.2, predicted_after_s=0.1,
            forward_scale=1.1, backward_scale=1.2, microbatch_overhead_s=1e-3, time_unix=1.7e9),))
    machine.save(busy)
    monkeypatch.setattr(machine, "other_runnable_now", lambda: now)
    first = machine.machine_profile()
    assert (first.how == "cached") is kept and len(measured) == (0 if kept else 1), first.how
    if not kept:
        assert "measured again (the cached one was measured with 7.4 other threads running, 0.0 now)" == first.how
        assert machine.machine_profile().how == "cached" and len(measured) == 1  # the quiet one stays
