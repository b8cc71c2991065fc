"""Measuring this machine (Note [machine profile] in partitioner/calibrate/machine.py): the
reference model's regions and ops fitted in one thread, AdamW's step, and two processes over gloo
(machine_worker.py) for the schedule, the sends, the all-reduce and how much slower a rank computes
beside another. Seconds, not minutes."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from partitioner.calibrate import calibrate
from partitioner.calibrate.machine_profile import KIND, CompiledFit, MachineKey, MachineMeasurements, MachineProfile, _scaled
from partitioner.calibrate.machine_worker import BLOCK_MESSAGE_BYTES
from partitioner.calibrate.measure import _example_inputs
from partitioner.calibrate.profiles import DirectionFit
from partitioner.calibrate.tp_overheads import fit_collectives, measure_dtensor_op_s
from partitioner.config.cluster import DEFAULT_LINKS
from partitioner.models.builtin import Block
from partitioner.frontend.workload import Workload
from runtime.data import synthetic as data

_WORKER_TIMEOUT_S = 120.0


def reference_workload():
    """The fixed model the region coefficients are fitted on (Note [machine profile]): the ops
    small models are made of, at two widths, 2 x 64 tokens (the demo's microbatch)."""
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
    # lazy: loads OR-Tools
    from partitioner.frontend.analysis import analyze

    say = progress or (lambda _message: None)
    started = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    others = [_other_runnable(load)]  # at the start, between the parts, at the end: the busiest counts
    workload = reference_workload()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)

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


def measure_compiled_fit(progress: Callable[[str], None] | None = None, *, repeats: int = 10) -> CompiledFit:
    """The reference model's regions through torch.compile, one thread, fitted (Note [compiled
    machine fit]): a minute here, most of it inductor compiling each region twice."""
    from partitioner.frontend.analysis import analyze  # lazy: loads OR-Tools

    started = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    others = [_other_runnable(load)]
    workload = reference_workload()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            gm, _table = analyze(workload, granularity="sublayer")
            fitted = calibrate(workload, gm, repeats=repeats, warmup=3, threads=1, progress=progress, compiled=True)
        finally:
            torch.set_num_threads(old_threads)
    others.append(_other_runnable(load, seconds=0.3))
    return CompiledFit(forward=_scaled(fitted.forward, 1.0), backward=_scaled(fitted.backward, 1.0),
                       forward_fit_median_rel_error=float(fitted.meta["forward_median_rel_error"]),
                       backward_fit_median_rel_error=float(fitted.meta["backward_median_rel_error"]),
                       other_runnable=max(others), measure_s=time.perf_counter() - started, time_unix=time.time())


def measure_optimizer_s_per_param_byte(num_bytes: int = 4 << 20, *, repeats: int = 10) -> float:
    """Seconds of one optimizer step (runtime/execute/train.py ``make_optimizer``: AdamW, its fused
    kernel where torch has one, and the schedule's step) per parameter byte, over ``num_bytes``
    of fp32 parameters in 64 KiB tensors, a small model's (Note [machine profile]). The step's
    own fixed cost is in the figure, spread over those bytes."""
    # lazy: loads safetensors
    from runtime.execute.train import make_optimizer

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
