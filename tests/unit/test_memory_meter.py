"""The peak-memory meter (runtime/observe/memory.py) on a tensor-parallel stage, without torchrun: one
process plays rank 0 of a tensor group of 2 on torch's fake process group (as
tests/unit/test_tp_traffic.py does), builds the program folder's stage as the runtime does
(``build_stage``, ``shard_stages``: DTensor parameters) and measures one microbatch forward and
backward with ``PeakMemory`` (Note [a DTensor's bytes]). In a child process: a process group and
DTensor's implicit replication are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import hf_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _measure(folder: str) -> dict:
    """In the child: PeakMemory over one microbatch of stage 0 on rank 0 of a fake group of 2."""
    import types

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.observe.memory import PeakMemory
    from runtime.program.spec import Program, load_plan
    from runtime.execute.stage import build_stage
    from runtime.parallel.tensor_parallel import shard_stages
    from runtime.program.user_code import tensor_dtype

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    program = Program.from_dict(load_plan(folder)["program"])
    module = build_stage(folder, 0)
    shard_stages([module], program, dist.group.WORLD, torch.device("cpu"))
    trainer = types.SimpleNamespace(device=torch.device("cpu"), modules=[module], stage_ids=(0,),
                                    optimizer=torch.optim.AdamW(module.parameters()))
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    local += [b.to_local() if isinstance(b, DTensor) else b for b in module.buffers()]
    inputs = [torch.zeros(spec.shape, dtype=tensor_dtype(spec.dtype)) for spec in program.stages[0].inputs]
    meter = PeakMemory(trainer).start()
    out = module(*inputs)
    flat = out if isinstance(out, (tuple, list)) else (out,)
    sum(o.float().sum() for o in flat if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    trainer.optimizer.step()
    peak = meter.stop()
    dist.destroy_process_group()
    return {"static": meter.static_bytes, "peak": peak,
            "dtensors": sum(isinstance(p, DTensor) for p in module.parameters()),
            "local_bytes": sum(t.untyped_storage().nbytes() for t in {id(t): t for t in local}.values()),
            "whole_bytes": sum(p.numel() * p.element_size() for p in module.parameters())
            + sum(b.numel() * b.element_size() for b in module.buffers())}


def test_the_meter_counts_a_tensor_parallel_stages_local_shards(tmp_path):
    """Without Note [a DTensor's bytes] the meter dies at start-up on a DTensor's storage (and on
    CUDA the meter is always on). Static bytes are this rank's shards, less than the whole."""
    plan = partitioner.compile(hf_llama(layers=1, width=32, heads=4, vocab=64, seq=8, batch=2),
                               cluster=ClusterSpec.homogeneous(2, "cpu"), global_batch=2, num_stages=1,
                               microbatches=1, tensor_parallel=2)
    plan.save(tmp_path / "program")
    done = subprocess.run([sys.executable, __file__, str(tmp_path / "program")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["dtensors"] > 0
    assert measured["static"] == measured["local_bytes"] < measured["whole_bytes"]
    # gradients and AdamW state of the shards alone come to twice the static bytes and more
    assert measured["peak"] > 2 * measured["static"]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps(_measure(sys.argv[1])))
