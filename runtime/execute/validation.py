"""Evaluation on the validation split: a forward-only pass of the pipeline every K steps
(``--eval-every K [--eval-batches N]``), reported as ``val_loss`` and ``val_ppl``.

Note [evaluation on the pipeline]: the pass runs on the training run's own pipeline and layout,
through torch's ``_PipelineSchedule.eval`` on the very schedule object that trains (its backward
actions become no-ops; torch re-makes the stages' buffers without gradients and again at the
next training step; under zbv: Note [evaluation under a V]), each rank on its replica's rows of
the same N validation batches every time (so the curve compares like with like). Not a send/recv
pass of our own: the same code that moves training's activations cannot disagree with it about
what crosses a cut. The loss is the program's loss_fn under the training autocast policy (Note
[mixed precision] in runtime/execute/precision.py), each microbatch's mean; with equal
microbatches the mean of the means is the mean over all samples, summed by one all-reduce.

The pass must not change the training run's numbers (a run with --eval-every trains bit for bit
as one without), so it changes nothing a checkpoint holds:
- no gradient (``torch.no_grad``), no optimizer or LR-scheduler step, no loss-scale update;
- dropout off: ``module.eval()`` for hand-written stages that read ``self.training``, and
  ``randomness.dropout_off()`` for compiled ones, whose traced graph fixes the train flag
  (Note [evaluation turns dropout off] in runtime/execute/randomness.py);
- the global RNG (the randomness hooks reseed it per microbatch: Note [randomness per microbatch]
  in runtime/execute/train.py) is forked and restored, and so are the keyed-randomness context,
  the hooks' counters and the buffers the forward updates (a traced BatchNorm updates its running
  statistics in any mode: Note [mutable buffers] in partitioner/codegen/split.py).

Pricing: the plan prices the training step only. An eval batch costs about the forward share of a
step, and forward FLOPs are about a third of forward + backward, so ``predicted_eval_s`` is
N * (1/3) * predicted_step_time_s: an approximation (it ignores that a forward-only pipeline
drains faster than 1F1B and that recompute is skipped), written beside the measured seconds.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

from runtime.data.synthetic import batch_inputs
from runtime.execute import randomness
from runtime.execute.precision import step_context
from runtime.program.spec import Program
from runtime.program.user_code import resolve_callable

# forward FLOPs / (forward + backward FLOPs) of a training step: the backward does about twice the
# forward's work (a gradient for the input and one for the weight per matmul)
FORWARD_SHARE_OF_STEP = 1.0 / 3.0


def eval_due(step: int, *, every: int, last_step: int) -> bool:
    """Whether an evaluation follows 0-based ``step``: every ``every`` steps and after the last."""
    return (step + 1) % every == 0 or step == last_step


def predicted_eval_s(program: Program, batches: int) -> float | None:
    """The pass's predicted seconds: N batches at the forward share of a predicted step (see the
    module's docstring: an approximation, the solver prices no evaluation)."""
    step_s = program.predicted_step_time_s
    return None if step_s is None else batches * FORWARD_SHARE_OF_STEP * step_s


# Note [evaluation under a V]: with ``has_backward`` off torch's backward actions are no-ops (no
# gradient computed, received or sent) except one: where a rank holds two adjacent stages (zbv's
# turn of the V, stages pp - 1 and pp on one rank) the backward of the later one hands its input
# gradient to the earlier one in place of a send, and torch 2.11-2.13 assert there ("can't
# steal_bwd_input if this stage doesn't have backward"), killing the rank at the first evaluation.
# So on such a rank the pass runs the training order with every action but the forward ones
# (FORWARD, SEND_F, RECV_F) taken out: the same forwards in the same order, what the pass computes
# on every other rank, and no new wait (a subsequence of a deadlock-free order waits on a subset of
# what it waited on). The order is put back after the pass, before the next training step.
FORWARD_ACTIONS = (torch_schedules.FORWARD, torch_schedules.SEND_F, torch_schedules.RECV_F)


@contextlib.contextmanager
def forward_actions_only(schedule):
    """Within: ``schedule`` runs only its forward actions on a rank that holds adjacent stages
    (Note [evaluation under a V]); unchanged elsewhere."""
    orders = getattr(schedule, "pipeline_order_with_comms", None)  # torch's _PipelineScheduleRuntime
    held = {stage.stage_index for stage in getattr(schedule, "_stages", ())}
    if not orders or not any(s + 1 in held for s in held):
        yield
        return
    rank = schedule.rank
    training = orders[rank]
    orders[rank] = [a for a in training if a is not None and a.computation_type in FORWARD_ACTIONS]
    try:
        yield
    finally:
        orders[rank] = training


class Evaluator:
    """One rank's part of the evaluation pass (Note [evaluation on the pipeline])."""

    def __init__(self, trainer, *, every: int, batches: int):
        program: Program = trainer.program
        if program.data.eval_batch is None:  # RunOptions.check_for refuses this at start-up
            raise ValueError("--eval-every: the program's data has no eval_batch (validation split)")
        self.trainer, self.every, self.batches = trainer, every, batches
        self.eval_batch = resolve_callable(program.data.eval_batch, trainer.folder)
        self._feeds: list[tuple[list, torch.Tensor | None]] | None = None
        self.seconds: list[float] = []
        self.last_val_loss: float | None = None

    def due(self, step: int, last_step: int) -> bool:
        return eval_due(step, every=self.every, last_step=last_step)

    def feeds(self) -> list[tuple[list, torch.Tensor | None]]:
        """This rank's (stage-0 inputs, targets) of each validation batch, read once: its replica's
        rows, inputs on the first stage only, targets on the last only (as ``RankTrainer._feed``)."""
        if self._feeds is None:
            t, program = self.trainer, self.trainer.program
            specs = program.stages[0].inputs
            self._feeds = []
            for i in range(self.batches):
                if not (t.is_first or t.is_last):  # a middle stage reads no data (Note [a rank reads its rows])
                    self._feeds.append(([], None))
                    continue
                args, target = self.eval_batch(i, program.global_batch)
                args = batch_inputs(args, program.data.keywords, program.data.constants, step=i)
                feed = ([t._replica_rows(a, sp.batch_dim or 0) for a, sp in zip(args, specs)]
                        if t.is_first else [])
                self._feeds.append((feed, t._replica_rows(target, 0) if t.is_last else None))
        return self._feeds

    def __call__(self) -> float:
        """The mean validation loss over the N batches (fp32), on every rank."""
        t, program = self.trainer, self.trainer.program
        m = program.num_microbatches
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32, device=t.device)
        buffers = {n: b.detach().clone() for n, b in t.named_mutable_buffers().items()}
        counters = [(h.step, h.next_mb) for h in t.randomness_hooks]
        rng_devices = [t.device.index or 0] if t.device.type == "cuda" else []
        scale = t.scaler.scale  # the schedule's loss is scaled under fp16 (Note [loss scaling])
        for module in t.modules:
            module.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices), \
                    randomness.restored(randomness.capture()), randomness.dropout_off(), \
                    step_context(program.precision, t.device.type):
                for i, (feed, target) in enumerate(self.feeds()):
                    for hook in t.randomness_hooks:  # keyed by the batch index (no draw uses it with dropout off)
                        hook.start(i, t.replica * m)
                    losses: list[torch.Tensor] = []
                    with forward_actions_only(t.schedule):  # Note [evaluation under a V]
                        t.schedule.eval(*feed, target=target, losses=losses if t.is_last else None,
                                        return_outputs=False)
                    for item in losses:
                        loss_sum += item.detach().float()
        finally:
            for module in t.modules:
                module.train()
            for hook, (step, next_mb) in zip(t.randomness_hooks, counters):
                hook.step, hook.next_mb = step, next_mb
            for name, value in t.named_mutable_buffers().items():
                value.copy_(buffers[name])
        if t.scaler.enabled:
            loss_sum /= scale
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        # every tensor rank of the last stage holds the loss, as in RankTrainer.train_step
        val_loss = float(loss_sum / (self.batches * m * program.dp * program.tensor_parallel))
        self.seconds.append(time.perf_counter() - start)
        self.last_val_loss = val_loss
        return val_loss

    def record(self, val_loss: float) -> dict:
        """The metrics.jsonl fields of one evaluation (val_ppl: inf where exp overflows)."""
        ppl = math.exp(val_loss) if val_loss < 700 else math.inf
        return {"val_loss": val_loss, "val_ppl": ppl if math.isfinite(ppl) else None,
                "eval_time_s": self.seconds[-1]}

    def summary(self) -> dict:
        """summary.json's evaluation fields (Note [step time summary] in runtime/execute/train.py)."""
        program = self.trainer.program
        return {"last_val_loss": self.last_val_loss, "eval_batches": self.batches, "eval_every": self.every,
                # N * 1/3 * the predicted step: the forward share of a step (module docstring)
                "predicted_eval_s": predicted_eval_s(program, self.batches),
                "measured_eval_s": (sorted(self.seconds)[len(self.seconds) // 2] if self.seconds else None)}
