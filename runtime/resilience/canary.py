"""Compute-fault canaries: a second replica re-runs one microbatch of another replica's stage and
compares digests of what both computed, before the data-parallel all-reduce mixes them.

Note [compute canaries]: replica digests (Note [replica digests] in runtime/resilience/sdc.py)
compare state after the all-reduce, so a wrong product in a matmul, averaged into every replica's
gradient, never shows. A canary looks earlier: every K-th step each rank records its stage's
microbatch 0 (inputs, received gradients, digests of what it computed), sends the record to the
next replica of its data-parallel group, and re-runs the previous replica's record on its own
parameters (bit-identical: replicas agree) with the owner's keyed masks (Note [randomness per
microbatch] in runtime/execute/train.py), through torch's own hooks and ``stage_backward``, into
gradients set aside (a canary changes nothing the run computes). Same code, inputs, parameters
and device kind: the digests agree to the bit unless a device computed wrongly. Every rank gets
every verdict, so all reach one finding: with 3 or more replicas the faulty rank fails two pairs
and is blamed, with 2 both are named. On a finding the ranks roll back as for a replica check,
to the newest checkpoint at or before the last agreeing canary; a rank blamed again is a
persistent fault and is excluded (Note [excluding a host] in runtime/resilience/exclusion.py).
One stage per rank, no tensor parallelism or sharded state (runtime/resilience/canary_rules.py).
"""

from __future__ import annotations

import io
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward

from runtime.execute import randomness
from runtime.execute.precision import step_context
from runtime.resilience.canary_rules import EXIT_EXCLUDE
from runtime.resilience.exclusion import ExcludeRanks
from runtime.resilience.faults import say
from runtime.resilience.sdc import SilentDataCorruption, tensor_digest

PARTS = ("outputs", "loss", "input grads", "param grads")


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _digest(tensors) -> int:
    return int(sum(int(tensor_digest(t)) for t in tensors if isinstance(t, torch.Tensor)))


def _as_tuple(output):
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def _send_receive(out: torch.Tensor, to: int, into: torch.Tensor, src: int, group) -> None:
    """Send ``out`` to ``to`` and receive ``into`` from ``src`` as one batch: NCCL progresses a
    pair's send only once the peer's receive is posted with it, so at dp 2 (``to == src``) two
    separate isends would each wait for the other's irecv (Note [NCCL emulation] in
    runtime/parallel/nccl_emulation.py)."""
    ops = [dist.P2POp(dist.isend, out, to, group), dist.P2POp(dist.irecv, into, src, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


class CanaryMismatch(SilentDataCorruption):
    """Raised on every rank when a canary's digests differ (Note [compute canaries])."""

    def __str__(self) -> str:  # one line for all pairs, the blame once
        pairs = "; ".join(f"rank {v.verifier} re-ran microbatch 0 of stage {v.stage} of rank {v.owner}: "
                          f"{', '.join(v.parts)} differ" for v in self.findings)
        blamed = sorted({r for v in self.findings for r in v.blamed})
        return (f"compute canary at step {self.step}: {pairs}; blamed rank{'s' if len(blamed) > 1 else ''} "
                f"{', '.join(map(str, blamed))}; rolling back to a checkpoint at or before step {self.last_agreed}")


class Verdict:
    """One failing pair, as every rank reads it from the all_gather: a Finding for ``SilentDataCorruption``."""

    def __init__(self, owner: int, verifier: int, parts: list[str], stage: int, blamed: tuple[int, ...]):
        self.owner, self.verifier, self.parts, self.stage, self.blamed = owner, verifier, parts, stage, blamed

    def text(self, step: int, replica_of) -> str:
        who = ", ".join(f"rank {r} (replica {replica_of[r]})" for r in self.blamed)
        return (f"compute canary: rank {self.verifier} re-ran microbatch 0 of stage {self.stage} of rank "
                f"{self.owner} at step {step}: {', '.join(self.parts)} differ; blamed {who}")


class ComputeCanary:
    """The canary of one rank (Note [compute canaries]); ``install`` wraps the trainer's stage,
    schedule and gradient step, ``before_step`` is a RankTrainer.run hook."""

    def __init__(self, trainer, every: int, *, run_dir: str, start_step: int = 0, hosts: list[int] | None = None):
        self.trainer, self.every, self.run_dir = trainer, int(every), run_dir
        self.hosts = hosts  # host of each rank, for exclude.json
        self.layout = trainer.layout
        self.group = next(g for g in self.layout.dp_groups if trainer.rank in g)
        self.index = self.group.index(trainer.rank)
        self.last_agreed = start_step
        self.armed, self.step = False, -1
        self.record: dict = {}
        self.blamed_before: set[int] = set()
        self.seconds: list[float] = []

    # -- the owner's record, taken as the schedule runs --------------------------------------------

    def install(self) -> "ComputeCanary":
        stage, trainer = self.trainer.pipe_stages[0], self.trainer
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        recv_acts, recv_grads = stage._retrieve_recv_activations, stage._retrieve_recv_grads
        loss_fn = trainer.schedule._loss_fn
        self.loss_fn = loss_fn

        def forward_one_chunk(chunk, args, kwargs=None, *rest, **more):
            out = fwd(chunk, args, kwargs, *rest, **more)
            if self.armed and chunk == 0:
                if stage.is_first:
                    self.record.update(inputs=_clone(list(args)), kwargs=_clone(kwargs or {}))
                self.record["outputs"] = _digest(stage.fwd_cache[0][0])
            return out

        def retrieve_recv_activations(chunk, *rest, **more):
            got = recv_acts(chunk, *rest, **more)
            if self.armed and chunk == 0:
                self.record.update(inputs=_clone(list(got)), kwargs={},
                                   grad_inputs=[bool(getattr(t, "requires_grad", False)) for t in got])
            return got

        def retrieve_recv_grads(chunk, *rest, **more):
            got = recv_grads(chunk, *rest, **more)
            if self.armed and chunk == 0:
                self.record["output_grads"] = _clone(list(got))
            return got

        def backward_one_chunk(chunk, *args, **kwargs):
            out = bwd(chunk, *args, **kwargs)
            if self.armed and chunk == 0:
                self.record["input grads"] = _digest(stage.bwd_cache.get(0, ()))
                self.record["param grads"] = self._param_grads_digest()
            return out

        def loss(output, target):
            value = loss_fn(output, target)
            if self.armed and "target" not in self.record:  # the first loss of the step: microbatch 0's
                self.record.update(target=_clone(target), loss=_digest([value]))
            return value

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage._retrieve_recv_activations, stage._retrieve_recv_grads = retrieve_recv_activations, retrieve_recv_grads
        trainer.schedule._loss_fn = loss
        finish = trainer.finish_gradients_and_step

        def finish_gradients_and_step():
            if self.armed:
                self.check(self.step)  # before the all-reduce mixes the replicas' gradients
            finish()

        trainer.finish_gradients_and_step = finish_gradients_and_step
        return self

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def before_step(self, step: int) -> None:
        self.step, self.armed = step, self.due(step)
        self.record = {"step": step, "owner": self.trainer.rank, "replica": self.trainer.replica}

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        module = self.trainer.modules[0]
        return sorted((n, module.get_parameter(n)) for n in module.parameter_names)

    def _param_grads_digest(self) -> int:
        return _digest([p.grad for _n, p in self._params() if p.grad is not None])

    # -- the verifier's re-run ---------------------------------------------------------------------

    def rerun(self, rec: dict) -> dict:
        """Digests of the owner's microbatch 0, recomputed here; nothing of this rank's state changes."""
        trainer, module, stage = self.trainer, self.trainer.modules[0], self.trainer.pipe_stages[0]
        device = trainer.device
        params = self._params()
        saved_grads = [p.grad for _n, p in params]
        saved_buffers = [(b, b.detach().clone()) for b in module.buffers()]
        hook = trainer.randomness_hooks[0]
        saved_hook = (hook.step, hook.next_mb)
        saved_loss_s = trainer.stage_times.loss_s
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        try:
            for _n, p in params:
                p.grad = None
            hook.start(rec["step"], rec["replica"] * trainer.program.num_microbatches)  # the owner's masks
            inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in rec["inputs"]]
            for i, wants in enumerate(rec.get("grad_inputs") or ()):
                if wants:
                    inputs[i] = inputs[i].detach().requires_grad_(True)
            kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rec["kwargs"].items()}
            got = {}
            with randomness.restored(randomness.capture()), step_context(trainer.program.precision, device.type):
                output = module(*inputs, **kwargs)
                outputs = _as_tuple(output)
                got["outputs"] = _digest(outputs)
                flat_inputs = inputs + list(kwargs.values())
                if stage.is_last:
                    value = self.loss_fn(output, rec["target"].to(device))
                    got["loss"] = _digest([value])
                    grads_in = stage_backward(value, None, flat_inputs)
                else:
                    grads = [g.to(device) if isinstance(g, torch.Tensor) else g for g in rec["output_grads"]]
                    grads_in = stage_backward(outputs, grads, flat_inputs)
                got["input grads"] = _digest(list(grads_in)[:len(inputs)] if not stage.is_first else ())
                got["param grads"] = self._param_grads_digest()
            return got
        finally:
            for (_n, p), g in zip(params, saved_grads):
                p.grad = g
            with torch.no_grad():
                for b, copy in saved_buffers:
                    b.copy_(copy)
            hook.step, hook.next_mb = saved_hook
            trainer.stage_times.loss_s = saved_loss_s
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, device)

    # -- exchange, verdicts, blame -----------------------------------------------------------------

    def _exchange(self, rec: dict) -> dict:
        """Send ``rec`` to the next replica of the group, receive the previous one's (a ring)."""
        group = self.trainer.groups.data_parallel
        n = len(self.group)
        nxt, prev = self.group[(self.index + 1) % n], self.group[(self.index - 1) % n]
        buf = io.BytesIO()
        torch.save(rec, buf)
        device = torch.device("cpu") if dist.get_backend() == "gloo" else self.trainer.device  # nccl: on the device
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
        size, their_size = torch.tensor([payload.numel()], dtype=torch.int64, device=device), \
            torch.zeros(1, dtype=torch.int64, device=device)
        _send_receive(size, nxt, their_size, prev, group)
        theirs = torch.empty(int(their_size.item()), dtype=torch.uint8, device=device)
        _send_receive(payload, nxt, theirs, prev, group)
        return torch.load(io.BytesIO(theirs.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)

    def check(self, step: int) -> None:
        t0 = time.perf_counter()
        theirs = self._exchange(self.record)
        got = self.rerun(theirs)
        wrong = [i for i, part in enumerate(PARTS) if part in theirs and got.get(part) != theirs[part]]
        mine = torch.tensor([int(theirs["owner"]), sum(1 << i for i in wrong)], dtype=torch.int64,
                            device=self.trainer.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu().tolist()
        self.seconds.append(time.perf_counter() - t0)
        verdicts = self.verdicts(table)
        if not verdicts:
            self.last_agreed = step + 1  # the step's gradients were right: its state is good
            return
        self.trainer.optimizer.zero_grad(set_to_none=True)  # the step is dropped on every rank
        exc = CanaryMismatch(step, verdicts, self.last_agreed, self.layout.replica_of_rank)
        blamed = sorted({r for v in verdicts for r in v.blamed})
        again = sorted(set(blamed) & self.blamed_before)
        self.blamed_before.update(blamed)
        if self.trainer.rank == 0:
            say(0, str(exc) if not again else f"{exc} (again)")
            self._log({"step": step, "pairs": [{"owner": v.owner, "verifier": v.verifier, "parts": v.parts,
                                                "stage": v.stage} for v in verdicts],
                       "blamed_ranks": blamed, "last_agreed_step": self.last_agreed, "repeat": bool(again)})
        if again:
            self.exclude(again, step)
        raise exc

    def verdicts(self, table: list[list[int]]) -> list[Verdict]:
        """The failing pairs of every group, with whom each blames (Note [compute canaries])."""
        out = []
        for group in self.layout.dp_groups:
            failing = [(table[v][0], v, table[v][1]) for v in group if table[v][1]]
            if not failing:
                continue
            count: dict[int, int] = {}
            for owner, verifier, _mask in failing:
                for r in (owner, verifier):
                    count[r] = count.get(r, 0) + 1
            stage = self.layout.stages_of_rank[group[0]][0]
            for owner, verifier, mask in failing:
                twice = tuple(sorted(r for r in (owner, verifier) if count[r] >= 2)) if len(group) >= 3 else ()
                out.append(Verdict(owner, verifier, [p for i, p in enumerate(PARTS) if mask >> i & 1], stage,
                                   twice or tuple(sorted({owner, verifier}))))
        return out

    def exclude(self, ranks: list[int], step: int) -> None:
        """A rank blamed again after a rollback: RUN_DIR/exclude.json, then exit EXIT_EXCLUDE on every rank."""
        if self.trainer.rank == 0:
            body = {"exclude_ranks": ranks, "step": step, "good_step": self.last_agreed,
                    "reason": "compute canary mismatch after a rollback",
                    "certain": len(self.group) >= 3,  # with 2 replicas both are named
                    "hosts_of_ranks": None if self.hosts is None else sorted({self.hosts[r] for r in ranks}),
                    "time_unix": time.time()}
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "exclude.json.tmp"), "w") as fh:
                json.dump(body, fh, indent=1)
            os.replace(os.path.join(self.run_dir, "exclude.json.tmp"), os.path.join(self.run_dir, "exclude.json"))
            say(0, f"compute canary: rank(s) {ranks} wrong again after a rollback: a persistent fault; wrote "
                   f"{os.path.join(self.run_dir, 'exclude.json')}; the job stops (exit {EXIT_EXCLUDE}) for a "
                   "re-plan without them")
        dist.barrier()  # exclude.json is written before anyone leaves
        raise CanaryExclude(ranks, self.last_agreed)

    def rolled_back(self, step: int) -> None:
        self.last_agreed = step

    def _log(self, row: dict) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "canary.jsonl"), "a") as fh:
            fh.write(json.dumps({**row, "time_unix": time.time()}) + "\n")

    def finish(self) -> None:
        """RUN_DIR/canary_stats_rank_<r>.json: how many canaries, their seconds (the benchmark's); rank 0
        closes with this rank's measured cost per step beside the plan's (Note [canary price])."""
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, f"canary_stats_rank_{self.trainer.rank}.json"), "w") as fh:
            json.dump({"every": self.every, "canaries": len(self.seconds), "seconds": self.seconds}, fh)
        if self.trainer.rank != 0 or not self.seconds:
            return
        from runtime.program.spec import load_plan  # lazy: read once, at the end

        predicted = (load_plan(self.trainer.folder).get("predicted") or {}).get("sdc_canary_s_per_step")
        mean = sum(self.seconds) / len(self.seconds)
        said = "" if predicted is None else f", predicted {predicted * 1e3:.3g} ms/step"
        say(0, f"compute canaries: {len(self.seconds)} run every {self.every} steps, {mean * 1e3:.3g} ms each on "
               f"rank 0 ({mean / self.every * 1e3:.3g} ms/step{said})")


class CanaryExclude(ExcludeRanks):
    """Every rank leaves with EXIT_EXCLUDE: ``ranks`` computed wrongly twice (RUN_DIR/exclude.json)."""

    exit_code = EXIT_EXCLUDE  # runtime/launch/rank.py's main leaves with it

    def __init__(self, ranks: list[int], good_step: int):
        self.ranks, self.good_step = ranks, good_step  # good_step: the last agreeing canary's
        super().__init__(f"compute canary: exclude ranks {ranks} (RUN_DIR/exclude.json)")


def attach(trainer, every: int, *, run_dir: str, start_step: int, hosts: list[int] | None = None):
    """The rank's installed canary, or None when ``every`` is 0 (Note [compute canaries])."""
    if not every:
        return None
    return ComputeCanary(trainer, every, run_dir=run_dir, start_step=start_step, hosts=hosts).install()
