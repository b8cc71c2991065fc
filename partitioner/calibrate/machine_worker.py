"""One of the two processes of the machine profile's gloo measurements (Note [machine profile] in
partitioner/calibrate/machine.py): run as ``python -m partitioner.calibrate.machine_worker RANK
STORE``, one thread, a file rendezvous, and rank 0 prints one JSON line of raw timings:

- ``allreduce``: [bytes, median s] of a two-rank all_reduce from 1 KiB to 16 MiB;
- ``pingpong``: [bytes, median s one way] of a blocking send/recv round trip, halved;
- ``pipeline_1`` / ``pipeline_2``: [microbatches, median s of one step] of a
  torch.distributed.pipelining 1F1B schedule over tiny Linear stages, built as runtime/schedule.py
  builds the generated programs' (static shapes, ``scale_grads``, a loss on the last stage): one
  stage on each rank alone (both ranks at once, as data-parallel ranks run), then one stage per
  rank. Two microbatch counts, so the parent fits seconds per microbatch as a slope, free of
  what a step pays once;
- ``collective_points``: tensor parallelism's (compute s, wait s) points
  (partitioner/calibrate/tp_overheads.py ``collective_points``);
- ``contention``: [median s alone, median s together] of a few milliseconds of the ops
  regions are made of (matmuls, GELU, layer norm), computed by each rank while the other waits
  on a barrier, then by both at once, in alternation: how much slower a rank computes while
  another computes beside it (shared caches and memory bandwidth, SMT siblings, and whatever
  else runs on the machine at the time).

Nothing here imports the compiler beyond that module: the process only times torch.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import torch

# Microbatch counts of the schedule timings (the slope between them is the per-microbatch cost).
PIPELINE_MICROBATCHES = (2, 10)
# A stage's activation: microbatch rows x features (4 x 16 floats: latency-bound, as small models' cuts are
# on this machine class; the bytes term is the all-reduce's bandwidth).
PIPELINE_ROWS, PIPELINE_FEATURES = 4, 16
ALLREDUCE_BYTES = (1024, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
PINGPONG_BYTES = (128, 64 << 10)


def _median_s(fn, *, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pipeline_step(num_stages: int, stage_index: int, group, m: int):
    """A step function of a 1F1B schedule over ``num_stages`` tiny stages (this rank's one)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rows, width = PIPELINE_ROWS, PIPELINE_FEATURES
    stage = PipelineStage(torch.nn.Linear(width, width), stage_index, num_stages, torch.device("cpu"),
                          input_args=(torch.zeros(rows, width, requires_grad=stage_index > 0),),
                          output_args=(torch.zeros(rows, width, requires_grad=True),), group=group)
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, target: ((out - target) ** 2).mean(),
                            scale_grads=True)
    inputs, target = torch.randn(m * rows, width), torch.randn(m * rows, width)
    last = stage_index == num_stages - 1

    def step():
        losses: list = []
        if stage_index == 0 and last:
            schedule.step(inputs, target=target, losses=losses)
        elif stage_index == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=target, losses=losses)

    return step


def _contention(rank: int, rounds: int = 8) -> list[float]:
    """[median seconds of ``compute`` alone, median seconds with both ranks computing], the
    ranks' mean."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(128, 128, generator=generator)
    up, down = torch.randn(128, 512, generator=generator) / 16, torch.randn(512, 128, generator=generator) / 32

    def compute():
        y = x
        for _ in range(40):  # ~15 ms here: longer than a scheduler's time slice, so sharing shows
            y = torch.nn.functional.layer_norm(y + torch.nn.functional.gelu(y @ up) @ down, (128,))
        return y

    alone, both = [], []
    with torch.no_grad():
        for i in range(rounds + 2):
            for turn in range(2):
                dist.barrier()
                if turn == rank:
                    start = time.perf_counter()
                    compute()
                    if i >= 2:
                        alone.append(time.perf_counter() - start)
                dist.barrier()
            dist.barrier()
            start = time.perf_counter()
            compute()
            if i >= 2:
                both.append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(alone), statistics.median(both)], dtype=torch.float64)
    dist.all_reduce(medians)  # the two ranks' mean: either may be the one another job slows
    return (medians / 2).tolist()


def measure(rank: int, *, repeats: int = 15) -> dict:
    import torch.distributed as dist

    from partitioner.calibrate.tp_overheads import collective_points

    out: dict = {"allreduce": [], "pingpong": [], "pipeline_1": [], "pipeline_2": []}
    for nbytes in ALLREDUCE_BYTES:
        x = torch.zeros(nbytes // 4)
        out["allreduce"].append([nbytes, _median_s(lambda: dist.all_reduce(x), repeats=repeats, warmup=3)])
    for nbytes in PINGPONG_BYTES:
        x = torch.zeros(nbytes // 4)

        def roundtrip():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)

        out["pingpong"].append([nbytes, _median_s(roundtrip, repeats=repeats, warmup=3) / 2])
    singles = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    for m in PIPELINE_MICROBATCHES:
        out["pipeline_1"].append([m, _median_s(_pipeline_step(1, 0, singles[rank], m), repeats=repeats, warmup=3)])
    dist.barrier()
    both = dist.new_group([0, 1])
    for m in PIPELINE_MICROBATCHES:
        out["pipeline_2"].append([m, _median_s(_pipeline_step(2, rank, both, m), repeats=repeats, warmup=3)])
    dist.barrier()
    out["collective_points"] = collective_points(40)
    out["contention"] = _contention(rank)
    return out


def main(rank: int, store_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the ranks run (partitioner run sets OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = measure(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
