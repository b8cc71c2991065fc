"""Tensor parallelism's fixed costs, measured here (Note [tensor-parallel overheads] in
partitioner/solver/tensor_groups.py): DTensor's dispatch per op, and gloo's cost per
collective.

- ``dtensor_op_s``: the traced model runs forward and backward once with plain tensors and once
  with every parameter a ``Replicate`` DTensor on a tensor group of 2 (torch's fake process
  group: a replicated op issues no collective, and its local op is the plain op), attention
  through ``runtime.parallel.tensor_parallel.attention`` as the program runs it; the difference of the
  medians over the graph's ops (forward and backward, counted as the fitted time model counts
  them: calibrate's ``num_ops``) is the seconds per op. In process; skipped (None) where a process
  group is already up.
- ``tp_collective_s`` and ``tp_skew``: two processes on this host (gloo over loopback, a file
  rendezvous, one thread each) alternate compute and a small all-reduce, at two amounts of
  compute between. The wait grows with the compute since the last collective: on shared cores
  the members drift apart while the scheduler hands the cores around, and each collective
  re-aligns them. The slope is ``tp_skew`` (seconds waited per second a member computes), the
  intercept, less the link's latency terms the solver adds itself (2 (tp-1) x the cpu link's
  latency), ``tp_collective_s``. Both grow with the machine's load: like every calibrated figure
  (medians, as the regions are timed), they are this machine at this time.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from partitioner.calibrate.features import region_features
from partitioner.config.cluster import DEFAULT_LINKS
from partitioner.codegen.tp_collectives import tensor_parallel_calls
from runtime.parallel.tensor_parallel import mesh_of, shard_stage

_SMALL_ELEMS = 256  # a small all-reduce: the fixed cost, not the bytes


def measure_dtensor_op_s(gm: fx.GraphModule, args, *, repeats: int = 10, warmup: int = 2) -> float | None:
    """Seconds per op (forward + backward, as calibrate's ``num_ops`` counts them) that ``gm``
    costs as a tensor-parallel stage beyond the compute the solver divides (Note [tensor-parallel
    overheads]), or None where a process group is already up or nothing would be split."""
    # lazy: loads networkx
    from passes.region_graph import region_table
    # lazy: loads networkx
    from passes.tp_roles import sharded_parameters

    sharded = sharded_parameters(gm)
    if dist.is_initialized() or not sharded:
        return None
    ops = sum(f.num_ops + b.num_ops for f, b in region_features(gm))
    # the compute the solver keeps per member: each region's FLOPs x (sharded share / 2 + the rest)
    flops = kept = 0.0
    for r in region_table(gm):
        share = min(1.0, r.tp_sharded_param_bytes / r.param_bytes) if r.param_bytes else 0.0
        flops += r.fwd_flops + r.bwd_flops
        kept += (r.fwd_flops + r.bwd_flops) * (share / 2 + 1 - share)
    fraction = kept / flops if flops else 1.0
    plain = _runnable(gm)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        # lazy: loads torch.distributed.tensor, torch.utils._sympy (+59 torch modules)
        from torch.distributed.tensor.experimental import implicit_replication

        stage = _runnable(gm, tp_sharded=sharded)
        stage.parameter_names = tuple(n for n, _ in gm.named_parameters())
        shard_stage(stage, {name: dim for name, (_role, dim) in sharded.items()},
                    mesh_of(dist.group.WORLD, torch.device("cpu")))
        t_plain = _median_step(plain, args, repeats, warmup)
        with implicit_replication():
            t_stage = _median_step(stage, args, repeats, warmup)
    finally:
        dist.destroy_process_group()
    return max(0.0, (t_stage - fraction * t_plain) / max(1, ops))


def _runnable(gm: fx.GraphModule, tp_sharded: dict | None = None) -> fx.GraphModule:
    """A copy of ``gm`` as a stage file runs it: no metadata asserts; with ``tp_sharded`` (name ->
    (role, dim)), the calls where a tensor group settles its collectives (partitioner/codegen/lower.py)."""
    out = copy.deepcopy(gm)
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            out.graph.erase_node(node)  # the stage files drop it too (partitioner/codegen/split.py)
    out.recompile()
    if tp_sharded:
        tensor_parallel_calls(out, tp_sharded)
    return out


def _median_step(module, args, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        out = module(*args)
        flat = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if flat:
            sum(o.float().sum() for o in flat).backward()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        for p in module.parameters():
            p.grad = None
    return statistics.median(times)  # as calibrate times the regions: this machine at this time


def measure_collectives(*, calls: int = 60, timeout_s: float = 120.0) -> dict | None:
    """{"tp_collective_s", "tp_skew"} measured between two processes on this host (gloo, one
    thread each), or None if they did not finish (not the calibration's error to raise: the
    presets stand). Each alternates compute and a small functional all-reduce (as DTensor issues
    them), at two amounts of compute between: the wait grows with the compute since the last
    collective (the members drift apart while the scheduler hands the cores around), so the
    slope is ``tp_skew`` (seconds waited per second computed) and the intercept, less the cpu
    link's latency terms the solver adds itself, ``tp_collective_s``."""
    with tempfile.TemporaryDirectory(prefix="tp-collective-") as tmp:
        store = os.path.join(tmp, "store")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
        procs = [subprocess.Popen([sys.executable, "-m", "partitioner.calibrate.tp_overheads", str(rank), store,
                                   str(calls)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  cwd=root) for rank in range(2)]
        outputs = []
        try:
            for p in procs:
                out, _err = p.communicate(timeout=timeout_s)
                outputs.append((p.returncode, out))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            return None
    if any(code != 0 for code, _ in outputs):
        return None
    return fit_collectives(json.loads(outputs[0][1].strip().splitlines()[-1])["points"])


def fit_collectives(points, link_latency_s: float | None = None) -> dict:
    """{"tp_collective_s", "tp_skew"} from ``collective_points``' two (compute s, wait s) points;
    ``link_latency_s``: the intra-node link's latency the solver will add per collective (default
    the cpu preset's)."""
    (c_short, w_short), (c_long, w_long) = points
    skew = max(0.0, (w_long - w_short) / (c_long - c_short)) if c_long > c_short else 0.0
    latency_s = DEFAULT_LINKS["cpu"][0].latency_s if link_latency_s is None else link_latency_s
    link_latency = 2 * (2 - 1) * latency_s
    return {"tp_collective_s": max(0.0, w_short - skew * c_short - link_latency), "tp_skew": skew}


def _collective_worker(rank: int, store_path: str, calls: int) -> None:
    """One of the two processes: ``collective_points`` printed as JSON."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    points = collective_points(calls)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"points": points}))


def collective_points(calls: int) -> list[tuple[float, float]]:
    """(compute seconds, median extra seconds of the all-reduce after it) at two amounts of
    compute, on the default process group of two ranks (also partitioner/calibrate/machine_worker.py)."""
    x, a = torch.ones(_SMALL_ELEMS), torch.randn(64, 64)

    def compute(n):
        y = a
        for _ in range(n):
            y = (y @ a).tanh()
        return y

    points = []
    for n in (16, 128):  # ~0.5 ms and ~4 ms here: a stage computes milliseconds between collectives
        alone, both = [], []
        for i in range(10 + calls):
            start = time.perf_counter()
            compute(n)
            middle = time.perf_counter()
            funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
            end = time.perf_counter()
            if i >= 10:
                alone.append(middle - start)
                both.append(end - start)
        points.append((statistics.median(alone), statistics.median(both) - statistics.median(alone)))
    return points


if __name__ == "__main__":
    _collective_worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
