"""One rank's training: stages, schedule, optimizer, gradient synchronization, metrics, final save.

The math is shared with ``runtime.execute.reference`` (``make_optimizer``, ``lr_factor``,
``microbatch_seed``), so the one-process oracle and the partitioned run differ only in where
things run and in floating-point summation order.

Note [randomness per microbatch]: random ops draw keyed by meaning, not by process (Note [randomness keyed
by meaning] in runtime/execute/randomness.py). Before every stage forward of every microbatch a forward
pre-hook (``MicrobatchRandomness``) sets the randomness context: the plan's seed, the step, the global
microbatch index (replica * num_microbatches + local index: the global batch is cut into
dp * num_microbatches consecutive microbatches) and the global index of its first sample. The
compiled stage files call runtime.execute.randomness, which keys each draw by (seed, step, sample or
microbatch, the op's name in the unpartitioned graph): the masks are those of the unpartitioned
model, on any stages, replicas, microbatching, schedule, and after a resume on another partition.
Every schedule runs a stage's forwards in microbatch order, so counting calls gives the index.

The hook also seeds the global RNG with ``microbatch_seed(seed, step, stage, global_microbatch)``,
for random ops that no lowering keyed (hand-written stage files): those draw per stage, so they
match a one-process run only when it chains the same stage modules (``train_reference``, given
the list of stages, reproduces them).

Note [global generators]: at start-up each rank seeds torch's, Python's and numpy's global
generators with seed + rank (``seed_host_generators``), so two clean runs draw the same numbers
anywhere outside the stage forwards (a loss, user code), and checkpoints carry all three states
(runtime/resilience/checkpoint/state.py ``capture_rng``), so a resumed run draws what the uninterrupted one would.
Per rank, because ranks do different work: one stream shared by all would give every rank the
same draws, which is never what data-parallel code wants.

Note [buffers across replicas]: buffers the forward updates (BatchNorm running statistics and
``num_batches_tracked``; Note [mutable buffers] in partitioner/codegen/split.py) see only their own
replica's microbatches, so replicas drift apart. After every optimizer step each data-parallel
group broadcasts replica 0's mutable buffers to the others, as DDP's ``broadcast_buffers`` does
(at the next forward instead; same values). Chosen over averaging because it is exact for every
dtype (the integer counter included), keeps the replicas bit-identical (so checkpoints and
``final/`` may take any replica's copy), and has a one-process oracle: ``train_reference`` with
``replicas=dp`` restores, at the end of each step, the buffers as they were after the first
replica's microbatches. Averaging would mix in the other replicas' statistics, but matches neither
the one-process run (a running average over all microbatches in order) nor any integer counter.
The cost is one broadcast of the buffer bytes per step, per stage.

Note [step time summary]: the plan is a promise, so every run ends (rank 0) with the line
``predicted X s/step, measured Y s/step (measured/predicted R)``. Y is the median step time of
the run's steps after its first (the first pays for warm-up: allocator, gloo connections), or of
the only step; X is the program's ``predicted_step_time_s``. Both go to RUN_DIR/summary.json for
benchmarks (benchmarks/step_time_accuracy.py). Step times never include checkpoint points
(``after_step`` runs outside the timed region).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from runtime.execute import randomness
from runtime.data.synthetic import batch_inputs
from runtime.parallel.grad_sync import Groups, sync_buffers, sync_gradients
from runtime.parallel.tensor_parallel import full_tensor
from runtime.program.spec import Program
from runtime.program.parts import OptimizerSettings
from runtime.execute.stage import build_stage
from runtime.observe.stage_times import StageTimes
from runtime.program.user_code import resolve_callable
from runtime.observe.watch import StepWatch
from runtime.execute.grad_norm import finish_step, param_groups
from runtime.execute.host_copy import step_values
from runtime.execute.precision import LossScaler, autocast, step_context, wrap_forward

# ---------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule (shared with the reference)


def lr_factor(step: int, cfg: OptimizerSettings | dict) -> float:
    """Multiplier of cfg["lr"] at 0-based ``step``: linear warmup over warmup_steps (step 0 gets
    1/warmup), then "cosine" (to min_lr_ratio at total_steps), "linear", or "constant"."""
    cfg = OptimizerSettings.coerce(cfg)
    warm = int(cfg.warmup_steps)
    if step < warm:
        return (step + 1) / warm
    kind = cfg.lr_schedule
    if kind == "constant":
        return 1.0
    floor = float(cfg.min_lr_ratio)
    progress = min(1.0, (step - warm) / max(1, int(cfg.total_steps) - warm))
    if kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    raise ValueError(f"lr_schedule {kind!r} is not one of 'cosine', 'linear', 'constant'")


def make_optimizer(params, cfg: OptimizerSettings | dict, names: list[str] | None = None):
    """AdamW over ``params`` and its LambdaLR schedule. ``names`` (one per parameter, original
    names) put the parameters cfg.no_decay lists into a group without weight decay (Note [no
    weight decay] in runtime/execute/grad_norm.py); without names every parameter decays alike.
    cfg.fused (default: on where torch has the kernel) or cfg.foreach pick the kernel. A dict is
    read as ``OptimizerSettings.from_dict`` (tests and the reference pass plain dicts)."""
    cfg = OptimizerSettings.coerce(cfg)
    params = list(params)
    if not params:
        # A stage may hold no parameters (a parameter-free slice of the graph). A placeholder that
        # never gets a gradient keeps the step loop and the learning-rate schedule uniform.
        params = [torch.nn.Parameter(torch.zeros(0))]
    # The fused kernel (one pass over each parameter's four tensors) is ~3x faster than torch's
    # default per-parameter loop on CPU; the oracle uses this same function, so results agree.
    fused = cfg.fused
    if fused is None:
        fused = cfg.foreach is None and all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    if names is not None and len(names) == len(params) and cfg.no_decay:
        groups = param_groups(list(zip(names, params)), cfg.weight_decay, cfg.no_decay)
    else:
        groups = [{"params": params, "weight_decay": cfg.weight_decay}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas),
                            eps=cfg.eps, weight_decay=cfg.weight_decay,
                            foreach=cfg.foreach, fused=bool(fused) or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: lr_factor(s, cfg)] * len(groups))
    return opt, sched


def microbatch_size(program: Program) -> int:
    """Samples per microbatch: the global batch is cut into dp * num_microbatches equal parts."""
    return program.microbatch_size


def microbatch_seed(seed: int, step: int, stage: int, microbatch: int) -> int:
    """See Note [randomness per microbatch]."""
    return (((seed * 1_000_003 + step) * 1_009 + stage) * 1_000_033 + microbatch) % (2**63 - 1)


def seed_host_generators(seed: int) -> None:
    """Seed torch's, Python's and numpy's global generators (Note [global generators])."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        # optional dependency: numpy (torch runs without it); the except below handles its absence
        import numpy
    except ImportError:  # numpy is optional for torch; without it there is nothing to seed
        return
    numpy.random.seed(seed % 2**32)


class MicrobatchRandomness:
    """Forward pre-hook that sets the randomness context of (step, microbatch) and seeds the
    global RNG per (step, stage, microbatch); see Note [randomness per microbatch]."""

    def __init__(self, seed: int, stage: int, microbatch_size: int):
        self.seed, self.stage, self.microbatch_size = seed, stage, microbatch_size
        self.step, self.next_mb = 0, 0

    def start(self, step: int, first_microbatch: int) -> None:
        self.step, self.next_mb = step, first_microbatch

    def __call__(self, module, args):
        randomness.set_context(seed=self.seed, step=self.step, microbatch=self.next_mb,
                               first_sample=self.next_mb * self.microbatch_size)
        torch.manual_seed(microbatch_seed(self.seed, self.step, self.stage, self.next_mb))
        self.next_mb += 1


# ---------------------------------------------------------------------------------------------
# The rank's training loop


def keep_metrics_before(path: str, start_step: int) -> None:
    """Rewrite metrics.jsonl (atomically) without the lines of steps >= start_step."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] < start_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                continue  # a line cut short by a crash
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def step_time_summary(run_dir: str, program: Program, times: list[float], *, start_step: int, steps: int,
                      folder: str = "", evaluation: dict | None = None) -> str:
    """Write RUN_DIR/summary.json and return the run's closing line (Note [step time summary]);
    ``evaluation``: the evaluator's fields (last_val_loss, predicted_eval_s, ...) when the run evaluated."""
    measured = statistics.median(times[1:] if len(times) > 1 else times)
    predicted = program.predicted_step_time_s
    ratio = measured / predicted if predicted else None
    summary = {"first_step": start_step, "steps": steps, "timed_steps": max(len(times) - 1, 1),
               "measured_step_time_s": measured, "predicted_step_time_s": predicted, "step_time_ratio": ratio,
               # which program ran: `calibrate --from-run` finds its plan.json from any --run-dir
               "folder": os.path.abspath(folder) if folder else None, "plan_hash": program.plan_hash,
               **(evaluation or {})}
    path = os.path.join(run_dir, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    evaluated = ""
    if evaluation and None not in (evaluation.get("predicted_eval_s"), evaluation.get("measured_eval_s")):
        # Note [evaluation on the pipeline] in runtime/execute/validation.py
        evaluated = (f"; eval predicted ~{evaluation['predicted_eval_s']:.3g} s/pass (forward share), "
                     f"measured {evaluation['measured_eval_s']:.3g} s/pass")
    if predicted is None:
        return f"predicted - s/step (the plan has none), measured {measured:.4g} s/step"
    return (f"predicted {predicted:.4g} s/step, measured {measured:.4g} s/step (measured/predicted {ratio:.2f})"
            + evaluated)


class RankTrainer:
    """Everything one rank needs to train: built once, then ``run`` steps."""

    def __init__(self, folder: str, program: Program, rank: int, *, device: torch.device,
                 groups: Groups, run_dir: str):
        # lazy: loads torch.distributed.tensor, torch.distributed._shard (+300 torch modules)
        from runtime.execute.schedule import build_schedule, pipeline_stage

        self.folder, self.program, self.rank, self.device = folder, program, rank, device
        self.layout = program.layout
        self.groups, self.run_dir = groups, run_dir
        self.replica = self.layout.replica_of_rank[rank]
        self.stage_ids = self.layout.stages_of_rank[rank]
        self.num_stages = program.num_stages
        self.modules = [build_stage(folder, s, device) for s in self.stage_ids]
        self.tp_index = self.layout.tp_index_of_rank[rank] if program.tensor_parallel > 1 else 0
        if program.tensor_parallel > 1:  # Note [tensor-parallel stages] in runtime/parallel/tensor_parallel.py
            from runtime.parallel.tensor_parallel import shard_stages

            shard_stages(self.modules, program, groups.tensor, device)
        self.randomness_hooks = []
        for s, m in zip(self.stage_ids, self.modules):
            hook = MicrobatchRandomness(program.seed, s, program.microbatch_size)
            m.register_forward_pre_hook(hook)
            self.randomness_hooks.append(hook)
            m.train()
        self.pipe_stages = [pipeline_stage(m, program, s, device, groups.pipeline)
                            for s, m in zip(self.stage_ids, self.modules)]
        data = program.data
        self.make_batch: Callable = resolve_callable(data.make_batch, folder)
        self.read_rows: Callable | None = resolve_callable(data.rows, folder) if data.rows is not None else None
        self.loss_fn: Callable = resolve_callable(data.loss_fn, folder)

        for s, m in zip(self.stage_ids, self.modules):  # Note [mixed precision] in runtime/execute/precision.py
            wrap_forward(m, program.precision, device.type, program.stages[s].outputs)
        self.scaler = LossScaler.for_policy(program.precision)

        def loss_under_policy(output, target):
            with autocast(program.precision, device.type):
                loss = self.loss_fn(output, target)
            return loss.float() * self.scaler.scale if self.scaler.enabled else loss

        # each stage's forward, backward and loss seconds, for `calibrate --from-run` (Note [stage times])
        self.stage_times = StageTimes(self.pipe_stages, self.stage_ids, program.num_microbatches, device)
        self.schedule = build_schedule(self.pipe_stages, program, self.stage_times.timed_loss(loss_under_policy))
        self.zero = None
        if program.shard_optimizer and program.dp > 1:  # Note [sharded optimizer state] in runtime/parallel/zero.py
            from runtime.parallel.zero import ShardedOptimizer

            named: dict[str, list] = {}
            for m in self.modules:
                for name in m.parameter_names:
                    named.setdefault(name, []).append(m.get_parameter(name))
            self.zero = ShardedOptimizer(named, program.optimizer, dp=program.dp, replica=self.replica,
                                         group=groups.data_parallel, make_optimizer=make_optimizer, device=device)
            self.optimizer, self.lr_scheduler = self.zero.optimizer, self.zero.lr_scheduler
        else:
            names_of = {id(m.get_parameter(n)): n for m in self.modules for n in m.parameter_names}
            params = [p for m in self.modules for p in m.parameters()]
            self.optimizer, self.lr_scheduler = make_optimizer(
                params, program.optimizer, [names_of.get(id(p), "") for p in params])
        self.last_grad_norm, self.last_skipped = None, False
        self.is_first = 0 in self.stage_ids
        self.is_last = self.num_stages - 1 in self.stage_ids
        self.steps_done = 0
        self.compile_s = None  # Note [compiled stages] in runtime/execute/compile_stages.py: before step 1, timed apart
        if program.compile_stages:
            from runtime.execute.compile_stages import compile_rank  # lazy: only a compiled program loads dynamo

            self.compile_s = compile_rank(self)

    def _replica_rows(self, t: torch.Tensor, batch_dim: int) -> torch.Tensor:
        rows = self.program.global_batch // self.program.dp
        return t.narrow(batch_dim, self.replica * rows, rows).to(self.device)

    # Note [a rank reads its rows]: with a data source that reads rows (``data.rows``, a corpus's:
    # Note [a corpus replaces make_batch] in partitioner/frontend/corpus_data.py), a rank asks for
    # its replica's rows of the global batch only, and of them only what its stages take: the first
    # stage the inputs, the last the targets, a middle stage nothing (it reads no byte of data).
    # The rows are the ones make_batch's whole batch would give (the source's order is global), so
    # the step is the same step; without such a source every rank builds the global batch and
    # slices it.
    def _feed(self, step: int) -> tuple[list, torch.Tensor | None]:
        """This rank's stage-0 inputs (its replica's rows; empty off the first stage) and targets
        (None off the last stage)."""
        program = self.program
        specs = program.stages[0].inputs
        if self.read_rows is None:
            args, target = self.make_batch(step, program.global_batch)
        else:
            want = ("both" if self.is_last else "inputs") if self.is_first else ("targets" if self.is_last else None)
            rows = program.global_batch // program.dp
            args, target = self.read_rows(step, program.global_batch, want=want,
                                          rows=range(self.replica * rows, (self.replica + 1) * rows))
            if not self.is_first:
                return [], target.to(self.device) if self.is_last else None
        # Notes [keyword inputs] and [constant inputs] in runtime/data/synthetic.py: another value of a
        # constant input than the traced one is refused here, before the step runs
        args = batch_inputs(args, program.data.keywords, program.data.constants, step=step)
        if self.read_rows is not None:
            return [a.to(self.device) for a in args], target.to(self.device) if self.is_last else None
        feed = [self._replica_rows(a, (sp.batch_dim or 0)) for a, sp in zip(args, specs)] if self.is_first else []
        return feed, self._replica_rows(target, 0) if self.is_last else None

    def _data_reads(self) -> dict:
        """What this process has read of the corpus so far (counted by the corpus's source cache)."""
        if self.read_rows is None:
            return {}
        from runtime.data.corpus.batches import reads  # lazy: only a corpus-fed program counts its reads

        return reads()

    def train_step(self, step: int) -> float:
        """One optimizer step on global batch ``step``; returns the step's mean loss (on every rank)."""
        program = self.program
        m = program.num_microbatches
        feed, tgt = self._feed(step)
        for hook in self.randomness_hooks:
            hook.start(step, self.replica * m)
        self.stage_times.begin_step()
        losses: list[torch.Tensor] = []

        clock = self.stage_times.clock  # Note [timing on a device] in runtime/observe/clock.py
        schedule_start = clock.mark()
        with step_context(program.precision, self.device.type):  # Note [mixed precision]
            self.schedule.step(*feed, target=tgt, losses=losses if self.is_last else None,
                               return_outputs=False)
        optimizer_start = clock.mark()
        scale_used = self.scaler.scale
        self.finish_gradients_and_step()
        optimizer_end = clock.mark()
        sync_buffers(list(self.named_mutable_buffers().values()), self.layout, self.rank, self.groups)
        # The step's loss: mean over microbatches and replicas (one all-reduce over the world).
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last:
            for item in losses:
                loss_sum += item.detach().float()
            if self.scaler.enabled:  # the schedule's losses are scaled (Note [loss scaling])
                loss_sum /= scale_used
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        self.steps_done = step + 1
        loss = float(loss_sum / (m * program.dp * program.tensor_parallel))  # every tensor rank holds the loss
        # after the float's sync: a GPU's event marks are all reached by now
        self.stage_times.end_step(schedule=(schedule_start, optimizer_start), optimizer=(optimizer_start, optimizer_end))
        return loss

    def finish_gradients_and_step(self) -> None:
        """Sync, unscale, the global norm, clip, step or skip (runtime/execute/grad_norm.py ``finish_step``)."""
        self.last_grad_norm, self.last_skipped = finish_step(self, sync_gradients)

    def run(self, steps: int, *, start_step: int = 0, log: bool = True, log_every: int = 1,
            before_step: Callable[[int], None] | None = None,
            after_step: Callable[[int, float, float], None] | None = None, evaluator=None) -> list[float]:
        """Train steps start_step..steps-1; returns their losses.

        before_step(step): called before each step (fault injection). after_step(step, loss,
        step_time_s): called after each step, outside the timed region (checkpoint points).
        log_every: rank 0 prints the step line of every Nth step (and of the first and last), then
        a one-line summary of the run. evaluator (runtime/execute/validation.py): a forward-only pass
        over the validation split after the steps it is due, outside the timed step (Note
        [evaluation on the pipeline]); its val_loss joins the step's record and line.
        Resuming (start_step > 0) keeps the metrics lines of steps before start_step and drops the
        rest (steps re-run after a restart are written again)."""
        program = self.program
        losses = []
        reads_before = self._data_reads()
        times: list[float] = []
        metrics = None
        # ETA, FLOP/s, MFU, peak memory per rank, TensorBoard (runtime/observe/watch.py); on every rank
        watch = StepWatch(self.folder, self.device, rank=self.rank, run_dir=self.run_dir, steps=steps,
                          start_step=start_step) if log else None
        if self.rank == 0 and log:
            os.makedirs(self.run_dir, exist_ok=True)
            path = os.path.join(self.run_dir, "metrics.jsonl")
            if start_step > 0:
                keep_metrics_before(path, start_step)
            metrics = open(path, "w" if start_step == 0 else "a")
        try:
            for step in range(start_step, steps):
                if before_step is not None:
                    before_step(step)
                lr = float(self.lr_scheduler.get_last_lr()[0])
                t0 = time.perf_counter()
                loss = self.train_step(step)
                dt = time.perf_counter() - t0
                losses.append(loss)
                val = evaluator() if evaluator is not None and evaluator.due(step, steps - 1) else None
                watched = watch.measure(step, dt) if watch is not None else {}
                if metrics is not None:
                    rate = program.global_batch / dt
                    record = {"step": step, "loss": loss, "step_time_s": dt, "samples_per_s": rate, "lr": lr,
                              # null when not finite (an fp16 overflow: skipped); absent when the program
                              # computes no norm (Note [global gradient norm] in runtime/execute/grad_norm.py)
                              **({} if self.last_grad_norm is None else {"grad_norm": self.last_grad_norm
                                  if math.isfinite(self.last_grad_norm) else None}),
                              **({"skipped": self.last_skipped, "loss_scale": self.scaler.scale}
                                 if self.scaler.enabled else {}),
                              **({} if val is None else evaluator.record(val)),
                              "time_unix": time.time(), **watched}
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                    watch.board_write(record)
                    times.append(dt)
                    if (step + 1) % log_every == 0 or step in (start_step, steps - 1) or val is not None:
                        print(f"step {step + 1}/{steps} loss {loss:.4f} {dt:.2f} s/step {rate:.1f} samples/s"
                              f"{'' if val is None else f' val {val:.4f}'}{watch.line(record)}", flush=True)
                if after_step is not None:
                    after_step(step, loss, dt)
        finally:
            if metrics is not None:
                metrics.close()
            if watch is not None:
                watch.close()
        if log and losses:  # every rank: Note [stage times]
            self.stage_times.write(self.run_dir, rank=self.rank, replica=self.replica)
            if self.read_rows is not None:  # what this run read of the corpus (Note [a rank reads its rows])
                read = {key: value - reads_before[key] for key, value in self._data_reads().items()}
                with open(os.path.join(self.run_dir, f"data_reads_rank_{self.rank}.json"), "w") as f:
                    json.dump({"rank": self.rank, "stages": list(self.stage_ids), **read}, f)
        if metrics is not None and losses:
            mean = sum(times) / len(times)
            print(f"trained steps {start_step + 1}..{steps}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                  f"{mean:.3f} s/step, {program.global_batch / mean:.1f} samples/s", flush=True)
            print(step_time_summary(self.run_dir, program, times, start_step=start_step, steps=steps,
                                    folder=self.folder, evaluation=evaluator.summary() if evaluator else None),
                  flush=True)
        return losses

    # --- state, keyed by original parameter names ---------------------------------------------

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Original name -> parameter (a tied parameter held twice on this rank appears once)."""
        out: dict[str, torch.nn.Parameter] = {}
        for m in self.modules:
            for name in m.parameter_names:
                out.setdefault(name, m.get_parameter(name))
        return out

    def named_mutable_buffers(self) -> dict[str, torch.Tensor]:
        """Original name -> buffer, for the buffers the forward updates (Note [mutable buffers]
        in partitioner/codegen/split.py); each lives on exactly one stage (checked by Program)."""
        return {name: m.get_buffer(name) for m in self.modules for name in m.mutable_buffer_names}

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
        """(parameters, optimizer tensors "<name>.exp_avg"/"<name>.exp_avg_sq", JSON-able rest)."""
        # whole tensors (a sharded one gathered over its tensor group: every tensor rank calls this)
        params = {n: full_tensor(p.detach()).cpu().clone() for n, p in self.named_parameters().items()}
        opt_tensors: dict[str, torch.Tensor] = {}
        steps = []
        for n, p in self.named_parameters().items():
            st = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    opt_tensors[f"{n}.{key}"] = full_tensor(st[key].detach()).cpu().clone()
            if "step" in st:
                steps.append((n, st["step"]))
        param_steps = step_values(steps)  # one transfer on a GPU (Note [one wait per snapshot])
        meta = {"rank": self.rank, "stages": list(self.stage_ids), "replica": self.replica,
                "steps_done": self.steps_done, "param_steps": param_steps,
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "plan_hash": self.program.plan_hash}
        if self.zero is not None:  # Note [sharded optimizer state]: the moments live on this rank's pieces
            pieces, steps, tp_pieces = self.zero.final_entries(opt_tensors)
            param_steps.update(steps)
            meta.update(optim_pieces=pieces, optim_tp_pieces=tp_pieces)
        return params, opt_tensors, meta

    def save_final(self) -> None:
        final = os.path.join(self.run_dir, "final")
        os.makedirs(final, exist_ok=True)
        params, opt_tensors, meta = self.state_tensors()
        save_file(params, os.path.join(final, f"rank_{self.rank}.safetensors"))
        save_file(opt_tensors, os.path.join(final, f"optim_rank_{self.rank}.safetensors"))
        save_file({n: b.detach().cpu().clone() for n, b in self.named_mutable_buffers().items()},
                  os.path.join(final, f"buffers_rank_{self.rank}.safetensors"))
        meta["lr_scheduler"] = {k: v for k, v in meta["lr_scheduler"].items()
                                if isinstance(v, (int, float, str, list, type(None)))}
        with open(os.path.join(final, f"optim_rank_{self.rank}.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
