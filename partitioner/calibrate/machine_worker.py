"""One of the two processes of the machine profile's gloo measurements (Note [machine profile] in
partitioner/calibrate/machine.py): run as ``python -m partitioner.calibrate.machine_worker RANK
STORE``, one thread, a file rendezvous, and rank 0 prints one JSON line of raw timings, each the
25th percentile of its repeats (``quiet``):

- ``allreduce``: [bytes, s] of a two-rank all_reduce from 1 KiB to 16 MiB;
- ``pingpong``: [bytes, s one way] of a blocking send/recv round trip, halved;
- ``pipeline_1``: [microbatches, s of one step] of a torch.distributed.pipelining 1F1B
  schedule of one tiny Linear stage on each rank alone (both ranks at once, as data-parallel
  ranks run), built as runtime/execute/schedule.py builds the generated programs' (static shapes,
  ``scale_grads``, a loss on the last stage). Two microbatch counts, so the parent fits seconds
  per microbatch as a slope, free of what a step pays once;
- ``pipeline_2_block``: the same schedule over two stages, one per rank, that compute as a small
  model's do (``block``: two MLP blocks of width 128 over a microbatch of 4 x 64 tokens, a
  128 KiB activation), with ``block_alone_s``, the seconds of that stage's forward and backward
  alone (each rank in turn, the other waiting on a barrier): what a pipeline adds to its
  stages' compute per microbatch when they do compute (a send to a busy peer takes longer than
  to an idle one);
- ``collective_points``: tensor parallelism's (compute s, wait s) points
  (partitioner/calibrate/tp_overheads.py ``collective_points``);
- ``contention``: [s alone, s together] of a few milliseconds of the ops
  regions are made of (matmuls, GELU, layer norm), computed by each rank while the other waits
  on a barrier, then by both at once, in alternation: how much slower a rank computes while
  another computes beside it (shared caches and memory bandwidth, SMT siblings, and whatever
  else runs on the machine at the time).

Nothing here imports the compiler beyond that module: the process only times torch.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from partitioner.calibrate.tp_overheads import collective_points

# Microbatch counts of the schedule timings (the slope between them is the per-microbatch cost).
PIPELINE_MICROBATCHES = (2, 10)
# A stage's activation: microbatch rows x features (4 x 16 floats: latency-bound, as small models' cuts are
# on this machine class; the bytes term is the all-reduce's bandwidth).
PIPELINE_ROWS, PIPELINE_FEATURES = 4, 16
ALLREDUCE_BYTES = (1024, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
# The computing stage of ``pipeline_2_block``: BLOCK_LAYERS MLP blocks of BLOCK_WIDTH on a
# microbatch of BLOCK_ROWS x BLOCK_TOKENS (about 5 ms of forward and backward on a 2020s core).
BLOCK_LAYERS, BLOCK_WIDTH, BLOCK_ROWS, BLOCK_TOKENS = 2, 128, 4, 64
BLOCK_MESSAGE_BYTES = BLOCK_ROWS * BLOCK_TOKENS * BLOCK_WIDTH * 4
BLOCK_MICROBATCHES = (2, 16)  # a wide range: the latency is a small difference of two large times
PINGPONG_BYTES = (128, 64 << 10)


def quiet(times) -> float:
    """The quieter quarter's edge (25th percentile) of repeated timings: other work on the
    machine only ever adds time (Note [machine profile] in partitioner/calibrate/machine.py)."""
    ordered = sorted(times)
    return ordered[(len(ordered) - 1) // 4]


def _quiet_s(fn, *, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return quiet(times)


def block(seed: int) -> torch.nn.Module:
    """``pipeline_2_block``'s stage: MLP blocks as small transformers have them."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        width = BLOCK_WIDTH
        return torch.nn.Sequential(*[layer for _ in range(BLOCK_LAYERS) for layer in (
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
            torch.nn.LayerNorm(width))])
    finally:
        torch.random.set_rng_state(generator_state)


def _pipeline_step(num_stages: int, stage_index: int, group, m: int, module: torch.nn.Module | None = None):
    """A step function of a 1F1B schedule over ``num_stages`` stages (this rank's one): tiny
    Linear stages, or ``module`` on microbatches of BLOCK_ROWS x BLOCK_TOKENS x BLOCK_WIDTH."""
    # lazy: loads torch.distributed.tensor, torch.distributed._shard (+300 torch modules)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    shape = (PIPELINE_ROWS, PIPELINE_FEATURES) if module is None else (BLOCK_ROWS, BLOCK_TOKENS, BLOCK_WIDTH)
    module = module if module is not None else torch.nn.Linear(PIPELINE_FEATURES, PIPELINE_FEATURES)
    stage = PipelineStage(module, stage_index, num_stages, torch.device("cpu"),
                          input_args=(torch.zeros(*shape, requires_grad=stage_index > 0),),
                          output_args=(torch.zeros(*shape, requires_grad=True),), group=group)
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, target: ((out - target) ** 2).mean(),
                            scale_grads=True)
    inputs, target = torch.randn(m * shape[0], *shape[1:]), torch.randn(m * shape[0], *shape[1:])
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
    """[seconds of ``compute`` alone, with both ranks computing] (``quiet``), the ranks' mean."""
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
    figures = torch.tensor([quiet(alone), quiet(both)], dtype=torch.float64)
    dist.all_reduce(figures)  # the two ranks' mean: either may be the one another job slows
    return (figures / 2).tolist()


def measure(rank: int, *, repeats: int = 15) -> dict:
    out: dict = {"allreduce": [], "pingpong": [], "pipeline_1": [], "pipeline_2_block": []}
    for nbytes in ALLREDUCE_BYTES:
        x = torch.zeros(nbytes // 4)
        out["allreduce"].append([nbytes, _quiet_s(lambda: dist.all_reduce(x), repeats=repeats, warmup=3)])
    for nbytes in PINGPONG_BYTES:
        x = torch.zeros(nbytes // 4)

        def roundtrip():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)

        out["pingpong"].append([nbytes, _quiet_s(roundtrip, repeats=repeats, warmup=3) / 2])
    singles = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    for m in PIPELINE_MICROBATCHES:
        out["pipeline_1"].append([m, _quiet_s(_pipeline_step(1, 0, singles[rank], m), repeats=repeats, warmup=3)])
    dist.barrier()
    both = dist.new_group([0, 1])
    stage = block(rank)
    x = torch.randn(BLOCK_ROWS, BLOCK_TOKENS, BLOCK_WIDTH, requires_grad=True)
    alone = torch.zeros(1, dtype=torch.float64)
    for turn in range(2):  # each rank's stage alone, the other waiting
        dist.barrier()
        if turn == rank:
            alone[0] = _quiet_s(lambda: stage(x).sum().backward(), repeats=repeats, warmup=3)
        dist.barrier()
    dist.all_reduce(alone)
    out["block_alone_s"] = float(alone[0]) / 2
    for m in BLOCK_MICROBATCHES:
        out["pipeline_2_block"].append([m, _quiet_s(_pipeline_step(2, rank, both, m, stage), repeats=10,
                                                    warmup=2)])
    dist.barrier()
    out["collective_points"] = collective_points(40)
    out["contention"] = _contention(rank)
    return out


def main(rank: int, store_path: str) -> None:
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
