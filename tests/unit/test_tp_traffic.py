"""What a tensor group sends, counted in the generated program, against the cost model's figure
(Note [tensor-parallel traffic] in passes/tp_roles.py, ``sent_bytes`` in
partitioner/solver/tensor_groups.py).

One process plays rank 0 of a tensor group of 2 on torch's fake process group (collectives
return tensors of the right shapes and move nothing): it builds the program folder's stage as
the runtime does (``build_stage``, ``shard_stages``: the same DTensors, the same
``row_linear`` / ``column_input`` / ``vocab_embedding`` calls), runs one microbatch forward and
backward and settles the gradients (``settle_gradients``, the step's gathers) under
runtime/parallel/collective_bytes.py's counter. Which collectives DTensor issues depends on placements
and shapes, not on values, so the counts and bytes are the real program's (the 2-rank benchmark,
benchmarks/tensor_parallel.py, measured the same figures under torchrun). It runs in a child
process: a process group and DTensor's implicit replication are process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import partitioner
from partitioner.config.cluster import ClusterSpec
from partitioner.models.builtin import hf_bert
from partitioner.solver.tensor_groups import sent_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _count(folder: str) -> dict:
    """In the child: one microbatch of stage 0 on rank 0 of a fake tensor group of 2."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.parallel.collective_bytes import CollectiveBytes
    from runtime.program.spec import Program, load_plan
    from runtime.execute.stage import build_stage
    from runtime.parallel.tensor_parallel import settle_gradients, shard_stages
    from runtime.program.user_code import tensor_dtype

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    program = Program.from_dict(load_plan(folder)["program"])
    module = build_stage(folder, 0)
    shard_stages([module], program, dist.group.WORLD, torch.device("cpu"))
    inputs = [torch.zeros(spec.shape, dtype=tensor_dtype(spec.dtype)) for spec in program.stages[0].inputs]
    counted = {}
    with CollectiveBytes() as forward:
        out = module(*inputs)
    flat = out if isinstance(out, (tuple, list)) else (out,)
    loss = sum(o.float().sum() for o in flat if isinstance(o, torch.Tensor) and o.requires_grad)
    with CollectiveBytes() as backward:
        loss.backward()
    with CollectiveBytes() as step:
        settle_gradients(list(module.parameters()))
    for name, mode in (("forward", forward), ("backward", backward), ("step", step)):
        counted[name] = {"bytes": mode.bytes, "calls": mode.calls, "sent": mode.sent_bytes(2)}
    dist.destroy_process_group()
    return counted


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    folders, compiled = {}, {}
    # one model that has every kind (benchmarks/tensor_parallel.py counts three under torchrun):
    # a split attention (forward and backward all-reduces), a replicated MLP (BERT's intermediate
    # and output are sibling sublayers of one linear each), a vocab-split lookup and head (the
    # logits' all-gather) and the head's bias (gathered once a step)
    for name, workload in (("hf-bert", hf_bert(layers=1, width=32, heads=4, vocab=64, seq=8, batch=2)),):
        c = partitioner.compile(workload, cluster=ClusterSpec.homogeneous(2, "cpu", cores=2), global_batch=2,
                                num_stages=1, microbatches=1, tensor_parallel=2)
        folders[name] = str(tmp_path_factory.mktemp(name) / "program")
        c.save(folders[name])
        compiled[name] = c
    result = subprocess.run([sys.executable, __file__, json.dumps(folders)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return compiled, json.loads(result.stdout.strip().splitlines()[-1])


def test_the_bytes_a_tensor_group_sends_are_the_cost_models(counted):
    compiled, measured = counted
    name = "hf-bert"
    plan, regions = compiled[name].plan, compiled[name].problem.regions
    b = plan.microbatch_size
    per_region = [sent_bytes(r, 2) for r in regions]
    # per direction: what each rank sends, the figure the time model prices
    assert measured[name]["forward"]["sent"] == pytest.approx(b * sum(f for f, _, _ in per_region))
    assert measured[name]["backward"]["sent"] == pytest.approx(b * sum(bw for _, bw, _ in per_region))
    assert measured[name]["step"]["sent"] == pytest.approx(sum(s for _, _, s in per_region))
    # and the collectives, one by one: the latency the time model prices per collective
    calls = {d: sum(measured[name][d]["calls"].values()) for d in ("forward", "backward", "step")}
    assert calls == {"forward": sum(r.tp.fwd_collectives for r in regions),
                     "backward": sum(r.tp.bwd_collectives for r in regions),
                     "step": sum(r.tp.step_collectives for r in regions)}
    # backward is not the forward again: no all-gather of the logits, no all-reduce of the lookup
    assert "all_gather_into_tensor" in measured[name]["forward"]["bytes"]
    assert "all_gather_into_tensor" not in measured[name]["backward"]["bytes"]


def test_a_vocab_heads_bias_is_gathered_once_a_step(counted):
    compiled, measured = counted
    head = next(r for r in compiled["hf-bert"].problem.regions if r.tp.step_gather_bytes)
    assert measured["hf-bert"]["step"]["calls"] == {"all_gather_into_tensor": 1}
    assert head.tp.step_gather_bytes == 64 * 4  # the decoder's bias: one fp32 per vocabulary row
    # the norm weights' and the row linear's bias gradients are whole on every rank: nothing else
    assert sum(r.tp.step_gather_bytes for r in compiled["hf-bert"].problem.regions) == head.tp.step_gather_bytes


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps({name: _count(folder) for name, folder in json.loads(sys.argv[1]).items()}))
