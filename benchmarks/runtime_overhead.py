"""What the generated programs cost over the code a person would write by hand, in one run.

    .venv/bin/python benchmarks/runtime_overhead.py [--steps 30] [--rounds 3]

Two ratios (throughput, higher is better for us):
  1. a 1-stage generated program  vs  a plain eager training loop (same model, data, and the
     program's own AdamW: runtime.execute.train.make_optimizer over the plan's optimizer settings),
     target >= 0.95;
  2. our 2-stage program  vs  a hand-written torch.distributed.pipelining program (pipeline() +
     Schedule1F1B) with the same split, target >= 1.0.
Every run uses one thread per process (two processes on two cores for the pipelines), and each
figure is the median step time after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from runtime.launch.torchrun import run_env, torchrun_command

MODEL = "gpt:layers=4,width=256,heads=4,vocab=2048,seq=128"
GLOBAL_BATCH = 16
MICROBATCHES = 4
WARMUP = 5


def median_after_warmup(times: list[float]) -> float:
    return statistics.median(times[WARMUP:])


def handwritten_optimizer(named_params, program_folder: str):
    """The optimizer our program runs, built by the same function (runtime.execute.train.make_optimizer)
    from the compiled program's own settings (plan.json's program.optimizer: lr, betas, weight
    decay, the cosine schedule, the no-decay names, fused or not): like for like, every side pays
    the same optimizer step with the same parameter groups (torch's default per-parameter loop
    costs ~4x the fused kernel on CPU, ~2% of this model's step, and would be measured as our
    runtime's gain)."""
    from runtime.program.spec import load_program
    from runtime.execute.train import make_optimizer

    names, params = zip(*named_params)
    return make_optimizer(list(params), load_program(program_folder).optimizer, list(names))


def optimizer_text(opt) -> str:
    """Which AdamW kernel and parameter groups ``opt`` runs (printed, so like for like is seen)."""
    groups = ", ".join(f"{len(g['params'])} params decay {g['weight_decay']}" for g in opt.param_groups)
    return (f"{type(opt).__name__} fused={opt.defaults.get('fused')} foreach={opt.defaults.get('foreach')} "
            f"betas={tuple(opt.defaults['betas'])} [{groups}]")


def eager_loop(steps: int, program_folder: Path) -> float:
    """The baseline a user writes: forward, loss, backward over microbatches, AdamW step."""
    from partitioner.models.builtin import load_workload

    torch.set_num_threads(1)
    workload = load_workload(MODEL)
    model = workload.model
    opt, sched = handwritten_optimizer(list(model.named_parameters()), str(program_folder))
    times = []
    for step in range(steps):
        start = time.perf_counter()
        (tokens,), target = workload.make_batch(step, GLOBAL_BATCH)
        for x, y in zip(tokens.chunk(MICROBATCHES), target.chunk(MICROBATCHES)):
            loss = workload.loss_fn(model(x), y) / MICROBATCHES
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    OPTIMIZERS["eager"] = optimizer_text(opt)
    return median_after_warmup(times)


OPTIMIZERS: dict[str, str] = {}  # each side's optimizer_text


def generated_program(folder: Path, steps: int) -> float:
    from partitioner.solver.plan import Plan

    plan = Plan.load(folder)
    # Fresh run and checkpoint folders each time: the program would otherwise resume from the
    # previous run's checkpoint and train fewer steps (or none).
    run_dir = Path(tempfile.mkdtemp(prefix="bench-run-", dir=folder))
    command = torchrun_command(folder / "train.py", plan.world_size, args=[
        "--steps", str(steps), "--run-dir", str(run_dir), "--checkpoint-dir", str(run_dir / "checkpoints")])
    done = subprocess.run(command, env=run_env(), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return median_after_warmup([r["step_time_s"] for r in rows])


def handwritten_pipeline_worker(steps: int, split_at: str, out_path: str, program_folder: str) -> None:
    """Runs under torchrun: the program a person writes with torch.distributed.pipelining."""
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    from partitioner.models.builtin import load_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = load_workload(MODEL)
    (tokens,), _ = workload.make_batch(0, GLOBAL_BATCH)
    pipe = pipeline(workload.model, mb_args=(tokens.chunk(MICROBATCHES)[0],),
                    split_spec={split_at: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=workload.loss_fn)
    opt, sched = handwritten_optimizer(list(stage.submod.named_parameters()), program_folder)
    times = []
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        (tokens,), target = workload.make_batch(step, GLOBAL_BATCH)
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=target, losses=[])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        # A step ends when every rank has finished it (under 1F1B the first stage runs the last
        # backward): the generated program's step time also ends at an all-ranks reduction.
        dist.barrier()
        times.append(time.perf_counter() - start)
    Path(f"{out_path}.optimizer_{rank}").write_text(optimizer_text(opt))
    if rank == world - 1:
        Path(out_path).write_text(json.dumps(times))
    dist.destroy_process_group()


def handwritten_pipeline(steps: int, split_at: str, program_folder: Path) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        command = torchrun_command(__file__, 2, args=["--worker", "--steps", str(steps), "--split-at", split_at,
                                                      "--out", str(out), "--program", str(program_folder)])
        done = subprocess.run(command, env=run_env(), capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
        for rank in (0, 1):
            OPTIMIZERS[f"hand2 rank {rank}"] = Path(f"{out}.optimizer_{rank}").read_text()
        return median_after_warmup(json.loads(out.read_text()))


def split_module_name(plan) -> str:
    """The first module of stage 1, as pipeline()'s split_spec names it (e.g. blocks.2)."""
    first_region = plan.stages[1].region_names[0]  # "block.2"
    if not first_region.startswith("block."):
        raise ValueError(f"stage 1 starts at {first_region!r}: this benchmark needs a split between blocks")
    return "blocks." + first_region.split(".")[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best median counts")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--split-at")
    parser.add_argument("--out")
    parser.add_argument("--program", help="(worker) the compiled folder whose optimizer settings to use")
    args = parser.parse_args()
    if args.worker:
        handwritten_pipeline_worker(args.steps, args.split_at, args.out, args.program)
        return 0

    import partitioner
    from partitioner.config.cluster import ClusterSpec
    from partitioner.models.builtin import load_workload

    with tempfile.TemporaryDirectory() as tmp:
        one, two = Path(tmp) / "one", Path(tmp) / "two"
        partitioner.compile(load_workload(MODEL), cluster=ClusterSpec.homogeneous(1, "cpu"),
                            global_batch=GLOBAL_BATCH, num_stages=1, dp=1, microbatches=MICROBATCHES).save(one)
        plan2 = partitioner.compile(load_workload(MODEL), cluster=ClusterSpec.homogeneous(2, "cpu"),
                                    global_batch=GLOBAL_BATCH, num_stages=2, dp=1, microbatches=MICROBATCHES)
        plan2.save(two)
        split_at = split_module_name(plan2)
        # On a shared machine load comes and goes: alternate the runs (A B A B ...) and keep each
        # one's best median, so a burst of load penalizes neither side more than the other.
        runs = {"eager": lambda: eager_loop(args.steps, one), "ours1": lambda: generated_program(one, args.steps),
                "hand2": lambda: handwritten_pipeline(args.steps, split_at, two),
                "ours2": lambda: generated_program(two, args.steps)}
        best = {name: float("inf") for name in runs}
        rounds: dict[str, list[float]] = {name: [] for name in runs}
        for _round in range(args.rounds):
            for name, run in runs.items():
                rounds[name].append(run())
                best[name] = min(best[name], rounds[name][-1])
        eager_s, ours1_s, hand2_s, ours2_s = best["eager"], best["ours1"], best["hand2"], best["ours2"]
    print(f"model {MODEL}, global batch {GLOBAL_BATCH}, {MICROBATCHES} microbatches, "
          f"median of {args.steps - WARMUP} steps after {WARMUP} warm-up, best of {args.rounds} alternating rounds")
    print(f"{'run':<44} {'step ms':>9} {'samples/s':>10}")
    for name, t in (("plain eager loop (1 process)", eager_s), ("generated 1-stage program", ours1_s),
                    (f"hand-written pipelining, split at {split_at}", hand2_s), ("generated 2-stage program", ours2_s)):
        print(f"{name:<44} {t * 1e3:>9.2f} {GLOBAL_BATCH / t:>10.1f}")
    print("every round's median, ms: " + "; ".join(f"{name} " + " ".join(f"{t * 1e3:.0f}" for t in times)
                                                 for name, times in rounds.items()))
    print("optimizers (ours: runtime.execute.train.make_optimizer over the same plan settings, in each rank): "
          + "; ".join(f"{k}: {v}" for k, v in OPTIMIZERS.items()))
    r1, r2 = eager_s / ours1_s, hand2_s / ours2_s
    print(f"ratio 1-stage program / eager loop (throughput): {r1:.3f} (target >= 0.95)")
    print(f"ratio 2-stage program / hand-written pipelining (throughput): {r2:.3f} (target >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
