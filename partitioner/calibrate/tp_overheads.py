"""Tensor parallelism's fixed costs, measured here (Note [tensor-parallel overheads] in
partitioner/solver/tensor_parallel.py): DTensor's dispatch per op, and gloo's cost per
collective.

- ``dtensor_op_s``: the traced model runs forward and backward once with plain tensors and once
  with every parameter a ``Replicate`` DTensor on a tensor group of 2 (torch's fake process
  group: a replicated op issues no collective, and its local op is the plain op), attention
  through ``runtime.tensor_parallel.attention`` as the program runs it; the difference of the
  medians over the graph's ops (forward and backward, counted as the fitted time model counts
  them: calibrate's ``num_ops``) is the seconds per op. In process; skipped (None) where a process
  group is already up.
- ``tp_collective_s``: two processes on this host (gloo over loopback, a file rendezvous, one
  thread each) alternate a little compute and a small all-reduce; the median seconds the
  all-reduce adds, less the link's latency terms the solver adds itself (2 (tp-1) x the cpu
  link's latency), is the fixed cost per collective. On shared cores it is mostly the wait for
  the other member to be scheduled, so it grows with the machine's load: like every calibrated
  figure (medians, as the regions are timed), it is this machine at this time.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.fx as fx

_SMALL_ELEMS = 256  # a small all-reduce: the fixed cost, not the bytes


def measure_dtensor_op_s(gm: fx.GraphModule, args, *, repeats: int = 10, warmup: int = 2) -> float | None:
    """Seconds per op (forward + backward, as calibrate's ``num_ops`` counts them) that ``gm``
    costs as a tensor-parallel stage beyond the compute the solver divides (Note [tensor-parallel
    overheads]), or None where a process group is already up or nothing would be split."""
    import torch.distributed as dist

    from partitioner.calibrate.features import region_features
    from passes.regions import region_table
    from passes.tensor_parallel import sharded_parameters

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
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        from torch.distributed.tensor.experimental import implicit_replication

        from runtime.tensor_parallel import mesh_of, shard_stage

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
    (role, dim)), the calls where a tensor group settles its collectives (partitioner/lower.py)."""
    from partitioner.lower_tensor_parallel import tensor_parallel_calls

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


def measure_collective_s(*, calls: int = 200, timeout_s: float = 120.0) -> float | None:
    """Median seconds per small gloo all-reduce between two processes on this host, less the cpu
    link's latency terms; None if the two processes did not finish (the error is not the
    calibration's to raise: the preset stands)."""
    from partitioner.cluster import DEFAULT_LINKS

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
    per_call = json.loads(outputs[0][1].strip().splitlines()[-1])["median_s"]
    link_latency = 2 * (2 - 1) * DEFAULT_LINKS["cpu"][0].latency_s
    return max(0.0, per_call - link_latency)


def _collective_worker(rank: int, store_path: str, calls: int) -> None:
    """One of the two processes: a small all-reduce after a little compute, ``calls`` times (a
    tensor-parallel stage computes between its collectives, so each member arrives when the
    scheduler lets it), against the same compute alone; prints the median extra seconds per call."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    x, a = torch.ones(_SMALL_ELEMS), torch.randn(64, 64)

    def compute():  # ~0.5 ms here: about what a stage does between two of its collectives
        y = a
        for _ in range(16):
            y = (y @ a).tanh()
        return y

    for _ in range(10):
        compute()
        dist.all_reduce(x)
    alone, both = [], []
    for _ in range(calls):
        start = time.perf_counter()
        compute()
        middle = time.perf_counter()
        dist.all_reduce(x)
        end = time.perf_counter()
        alone.append(middle - start)
        both.append(end - start)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"median_s": statistics.median(both) - statistics.median(alone)}))


if __name__ == "__main__":
    _collective_worker(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
