"""Calibration: the fit, the profile file, build_problem with a profile, and --calibrate end to end.

No wall-clock assertions: measured times only have to be positive and the pipeline to run."""

from __future__ import annotations

import json
import random

import pytest

from partitioner import calibrate as cal


def _synthetic_rows(fit: cal.DirectionFit, n: int, seed: int, noise: float = 0.0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        f = cal.Features(matmul_flops=rng.choice([0, 1]) * rng.uniform(1e5, 1e9),
                         other_flops=rng.choice([0, 0, 1]) * rng.uniform(1e5, 1e8),
                         memory_bytes=rng.choice([0, 1]) * rng.uniform(1e3, 1e8),
                         num_ops=rng.randint(1, 40))
        seconds = (fit.seconds(f) + fit.call_overhead_s) * (1 + rng.uniform(-noise, noise))
        rows.append((f, seconds))
    return rows


def test_fit_recovers_known_parameters():
    true = cal.DirectionFit(s_per_matmul_flop=1 / 40e9, s_per_other_flop=1 / 10e9, s_per_byte=1 / 20e9,
                            op_overhead_s=15e-6, call_overhead_s=5e-6)
    fitted = cal.fit_direction(_synthetic_rows(true, 60, seed=1))
    for name in ("s_per_matmul_flop", "s_per_other_flop", "s_per_byte", "op_overhead_s", "call_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6), name


def test_fit_with_noise_stays_close_and_non_negative():
    true = cal.DirectionFit(1 / 40e9, 1 / 10e9, 1 / 20e9, 15e-6, 0.0)
    fitted = cal.fit_direction(_synthetic_rows(true, 200, seed=2, noise=0.05))
    assert fitted.s_per_matmul_flop == pytest.approx(true.s_per_matmul_flop, rel=0.1)
    assert fitted.op_overhead_s == pytest.approx(true.op_overhead_s, rel=0.1)
    assert min(fitted.s_per_matmul_flop, fitted.s_per_other_flop, fitted.s_per_byte, fitted.op_overhead_s,
               fitted.call_overhead_s) >= 0


def test_nnls_never_returns_negative_coefficients():
    # y depends on column 0 only; column 1 anti-correlates: plain lstsq would go negative.
    rows = [[1.0, 0.0], [2.0, 1.0], [3.0, 0.5], [4.0, 2.0]]
    x = cal.nnls_relative(rows, [1.0, 1.9, 3.1, 3.8])
    assert all(v >= 0 for v in x)


def _gpt_graph():
    from partitioner.frontend.analysis import analyze
    from partitioner.models.builtin import gpt

    workload = gpt(layers=2, width=32, heads=2, vocab=64, seq=16, batch=2)
    gm, _ = analyze(workload)
    return workload, gm


def test_profile_round_trip_changes_region_times(tmp_path):
    from partitioner.config.cluster import ClusterSpec
    from partitioner.calibrate.priced_problem import build_problem
    from partitioner.solver.problem import region_times_s

    _workload, gm = _gpt_graph()
    profile = cal.DeviceProfile(kind="cpu", forward=cal.DirectionFit(1 / 20e9, 1 / 5e9, 1 / 10e9, 20e-6),
                                backward=cal.DirectionFit(1 / 25e9, 1 / 5e9, 1 / 10e9, 30e-6),
                                meta={"note": "synthetic"})
    path = profile.save(tmp_path / "cpu.profile.json")
    loaded = cal.DeviceProfile.load(path)
    assert loaded == profile and loaded.meta == {"note": "synthetic"}

    plain, priced = build_problem(gm, 2), build_problem(gm, 2, profiles=[loaded])
    device = ClusterSpec.homogeneous(1, "cpu").devices[0]
    features = cal.region_features(gm)
    for region_plain, region, (fwd, bwd) in zip(plain.regions, priced.regions, features):
        # The per-op part is paid once per microbatch, the rest per sample (Note [per sample]).
        fixed = fwd.num_ops * profile.forward.op_overhead_s
        assert region.fwd_s_per_microbatch_by_kind["cpu"] == pytest.approx(fixed)
        assert region.fwd_s_per_sample_by_kind["cpu"] == pytest.approx((profile.forward.seconds(fwd) - fixed) / 2)
        assert region_times_s(region, device, 1)[0] == pytest.approx(fixed + (profile.forward.seconds(fwd) - fixed) / 2)
        assert region_times_s(region, device, 2) == pytest.approx(profile.region_seconds(fwd, bwd))
        assert region_times_s(region, device, 2) != region_times_s(region_plain, device, 2)
    # Another kind is untouched: the datasheet model still prices it.
    h100 = ClusterSpec.homogeneous(1, "h100").devices[0]
    assert region_times_s(priced.regions[1], h100, 2) == region_times_s(plain.regions[1], h100, 2)


def test_profile_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "cpu"}))
    with pytest.raises(ValueError, match="not a device profile"):
        cal.DeviceProfile.load(bad)
    with pytest.raises(ValueError, match="no such file"):
        cal.DeviceProfile.load(tmp_path / "missing.json")


def test_features_split_matmul_memory_and_ops():
    _workload, gm = _gpt_graph()
    features = cal.region_features(gm)
    block_fwd, block_bwd = features[1]
    assert block_fwd.matmul_flops > 0 and block_fwd.other_flops > 0  # linear layers, attention
    assert block_fwd.memory_bytes > 0 and block_fwd.num_ops > 5
    assert block_bwd.matmul_flops == pytest.approx(2 * block_fwd.matmul_flops, rel=0.01)


def test_live_bytes_counts_allocations_and_frees():
    import torch

    with cal.LiveBytes() as mode:
        a = torch.ones(1024)  # 4 KiB
        b = a * 2  # 4 KiB more
        del a, b
        c = torch.zeros(256)  # after the frees, 1 KiB
    assert mode.peak == 8192
    assert mode.current == 1024
    del c


def test_live_bytes_does_not_count_views_of_older_tensors():
    """`linear` transposes its weight: a view of a parameter made before the mode allocates nothing."""
    import torch

    weight = torch.ones(32, 32)
    with cal.LiveBytes() as mode:
        view = weight.t()
        weight.add_(1)
        out = torch.ones(4, 32) @ view  # 512 B (plus the 512 B input)
    assert mode.peak == 1024
    del view, out


def test_calibrate_compile_end_to_end(tmp_path):
    from partitioner.cli import main

    out, profile_path = tmp_path / "out", tmp_path / "cpu.profile.json"
    code = main(["compile", "gpt:layers=2,width=32,heads=2,vocab=64,seq=16", "-o", str(out), "--devices", "2",
                 "--stages", "2", "--calibrate", "--calibrate-repeats", "2", "--profile-out", str(profile_path),
                 "-q"])
    assert code == 0 and (out / "plan.json").is_file()
    profile = cal.DeviceProfile.load(profile_path)
    assert profile.kind == "cpu"
    regions = [m for m in profile.measurements if m["kind"] == "region"]
    assert len(regions) == 4 and all(m["fwd_s"] > 0 and m["bwd_s"] > 0 for m in regions)
    assert all(m["peak_live_bytes"] > 0 for m in regions)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["num_stages"] == 2

    # The saved profile is reusable: --profile prices the same model without measuring.
    code = main(["compile", "gpt:layers=2,width=32,heads=2,vocab=64,seq=16", "-o", str(tmp_path / "again"),
                 "--devices", "2", "--stages", "2", "--profile", str(profile_path), "-q"])
    assert code == 0
