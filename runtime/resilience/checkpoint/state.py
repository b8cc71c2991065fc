"""A rank's state, both ways: what a checkpoint takes of a RankTrainer (``state_entries``, the one
definition of a shard's contents, Note [checkpoint format] in runtime/resilience/checkpoint/shard.py; the
host-memory ``snapshot``, the only stall of a disk checkpoint; every RNG state) and how a loaded
checkpoint goes back in (``LoadedCheckpoint``, ``take_state``, ``restore``). No file and no process
group here."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field

import torch

from runtime.execute.host_copy import host_copies, step_values
from runtime.resilience.checkpoint.shard import FORMAT
from runtime.resilience.checkpoint.tp_pieces import piece_entries
from runtime.errors import CheckpointCorruptError, PlanMismatchError
from runtime.program.spec import Program
from runtime.parallel.tensor_parallel import from_full, local
from runtime.parallel.zero import adam_step, full_state

# ---------------------------------------------------------------------------------------------
# Taking the state


def capture_rng() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng/torch_cpu": torch.get_rng_state().clone()}
    meta: dict = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda_{i}"] = st.clone()
    version, state, gauss = random.getstate()
    meta["python_random"] = [version, list(state), gauss]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["rng/numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy_random"] = [name, int(pos), int(has_gauss), float(cached)]
    return tensors, meta


def cuda_rng_split(keys, visible: int) -> tuple[list[tuple[int, str]], list[int]]:
    """The checkpoint's CUDA generator states (``rng/cuda_<i>``) this host can take, as (device
    index, key) in index order, and the indices it has no device for: a writer saw every GPU of
    its host, and a resume may run where fewer are visible."""
    indexed = sorted((int(k.rsplit("_", 1)[1]), k) for k in keys)
    return [(i, k) for i, k in indexed if i < visible], [i for i, _ in indexed if i >= visible]


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict, *, rank: int | None = None) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    cuda = [k for k in tensors if k.startswith("rng/cuda_")]
    if cuda and torch.cuda.is_available():
        keep, dropped = cuda_rng_split(cuda, torch.cuda.device_count())
        for i, k in keep:
            torch.cuda.set_rng_state(tensors[k], i)
        if dropped:  # the rank's own device is among those kept (it runs on one of them)
            print(f"[rank {rank}] warning: {dropped_rng_line(len(cuda), len(keep), dropped)}", file=sys.stderr,
                  flush=True)
    if meta.get("python_random"):
        version, state, gauss = meta["python_random"]
        random.setstate((version, tuple(state), gauss))
    np = sys.modules.get("numpy")
    if np is not None and meta.get("numpy_random") and "rng/numpy_keys" in tensors:
        name, pos, has_gauss, cached = meta["numpy_random"]
        np.random.set_state((name, tensors["rng/numpy_keys"].numpy().astype("uint32"), pos,
                             has_gauss, cached))


def dropped_rng_line(saved: int, visible: int, dropped: list[int]) -> str:
    return (f"the checkpoint holds the CUDA generator states of {saved} devices and this host sees {visible}: "
            f"restored cuda:0..{visible - 1}, dropped cuda:{','.join(map(str, dropped))} (no device here runs them)")


def _json_scheduler_state(sched) -> dict:
    return {k: v for k, v in sched.state_dict().items()
            if k != "lr_lambdas" and isinstance(v, (int, float, str, bool, list, type(None)))}


def state_entries(trainer, writes: frozenset[str] | None = None) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """A RankTrainer's shard, by tensor name (Note [checkpoint format]), and its meta: the one
    definition both writers use (``snapshot`` and the memory tier's preallocated copy).
    ``writes``: only these parameters and buffers (the disk tier, Note [one writer per byte] in
    runtime/resilience/checkpoint/writers.py); None: all of them (the memory tier).
    Parameters and Adam state are the live tensors: the caller copies them before the optimizer
    next runs. Mutable buffers are copied now, because the next forward updates them while a
    background copy may still be running."""
    tensors: list[tuple[str, torch.Tensor]] = []
    names, steps, tp_pieces = [], [], {}
    for name, p in trainer.named_parameters().items():
        if writes is not None and name not in writes:
            continue
        names.append(name)
        st = trainer.optimizer.state.get(p, {})
        if "step" in st:
            steps.append((name, st["step"]))
        span = piece_entries(name, p, st, tensors)  # Note [tensor-parallel pieces]
        if span is not None:
            tp_pieces[name] = span
            continue
        tensors.append((f"param/{name}", local(p).detach()))  # a replicated DTensor is whole here
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors.append((f"optim/{name}/{key}", local(st[key]).detach()))
    param_steps = step_values(steps)
    pieces, tp_state = sharded_state_entries(trainer, tensors, param_steps)
    buffers = {n: b for n, b in trainer.named_mutable_buffers().items() if writes is None or n in writes}
    with torch.no_grad():
        tensors += [(f"buffer/{name}", b.detach().to("cpu", copy=True)) for name, b in buffers.items()]
    rng_tensors, rng_meta = capture_rng()
    tensors += sorted(rng_tensors.items())
    program = trainer.program
    meta = {"format": FORMAT, "step": trainer.steps_done, "rank": trainer.rank,
            "stages": list(trainer.stage_ids), "replica": trainer.replica,
            "plan_hash": program.plan_hash, "model_fingerprint": program.model_fingerprint,
            "params": names, "buffers": list(buffers), "param_steps": param_steps,
            "lr_scheduler": _json_scheduler_state(trainer.lr_scheduler), **rng_meta}
    if pieces is not None:
        meta["optim_pieces"] = pieces
    if tp_state:  # Note [sharded state with tensor parallelism] in runtime/resilience/checkpoint/tp_pieces.py
        meta["optim_tp_pieces"] = tp_state
    if tp_pieces:
        meta["tp_pieces"] = tp_pieces
    scaler = getattr(trainer, "scaler", None)
    if scaler is not None and scaler.enabled:
        meta["loss_scale"] = scaler.state()
    return tensors, meta


def sharded_state_entries(trainer, tensors: list, param_steps: dict) -> tuple[dict | None, dict | None]:
    """The pieces of sharded optimizer state (Note [sharded optimizer state] in runtime/parallel/zero.py):
    appended to ``tensors`` as optim_shard/<name>/<key>; returns meta optim_pieces and
    optim_tp_pieces, or Nones."""
    zero = getattr(trainer, "zero", None)
    if zero is None:
        return None, None
    more, pieces, steps, tp_pieces = zero.state_entries()
    if getattr(trainer, "tp_index", 0) > 0:  # a replicated parameter's pieces: tensor index 0 writes them
        more = [(n, t) for n, t in more if not n.startswith("optim_shard/")]
        pieces = {}
    tensors += more
    param_steps.update(steps)
    return pieces, tp_pieces


@dataclass
class Snapshot:
    step: int  # steps done
    rank: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    stall_s: float = 0.0


def snapshot(trainer, writes: frozenset[str] | None = None) -> Snapshot:
    """Copy a RankTrainer's state (only ``writes``, when given) to host memory, keyed by original
    names (Note [one wait per snapshot])."""
    t0 = time.perf_counter()
    entries, meta = state_entries(trainer, writes)
    tensors = host_copies(entries)
    snap = Snapshot(trainer.steps_done, trainer.rank, tensors, meta)
    snap.stall_s = time.perf_counter() - t0
    return snap


def state_names(program: Program, stages) -> list[str]:
    """What a rank holding ``stages`` of ``program`` reads from a checkpoint: its parameters, then
    its mutable buffers (original names, each once)."""
    entries = [program.stages[k] for k in sorted(stages)]
    return list(dict.fromkeys([n for st in entries for n in st.params]
                              + [n for st in entries for n in st.mutable_buffers]))


def needed_names(trainer) -> list[str]:
    """What the trainer restores from a checkpoint: its parameters, then its mutable buffers."""
    return list(dict.fromkeys([n for m in trainer.modules for n in m.parameter_names]
                              + [n for m in trainer.modules for n in m.mutable_buffer_names]))


# ---------------------------------------------------------------------------------------------
# Putting it back


@dataclass
class LoadedCheckpoint:
    step: int
    manifest: dict
    params: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg", "exp_avg_sq"}
    param_steps: dict[str, float]
    lr_scheduler: dict
    rng_tensors: dict[str, torch.Tensor] | None  # None after a reshard
    rng_meta: dict | None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # mutable buffers, original names
    # sharded optimizer state: name -> [(start, end, {"exp_avg", "exp_avg_sq"})] in the flattened
    # parameter (runtime/parallel/zero.py ``piece_state`` stitches them)
    optim_pieces: dict[str, list] = field(default_factory=dict)
    loss_scale: dict | None = None  # fp16-mixed's scale (Note [loss scaling])


def take_state(loaded: LoadedCheckpoint, name: str, tensors: dict[str, torch.Tensor], meta: dict,
               where: str) -> None:
    """Put parameter ``name`` (with its Adam state) or mutable buffer ``name`` of one shard into
    ``loaded``: the one reader of a shard's state, for the disk and the memory tier."""
    if f"param/{name}" in tensors:
        loaded.params[name] = tensors[f"param/{name}"]
        st = {k: tensors[f"optim/{name}/{k}"] for k in ("exp_avg", "exp_avg_sq")
              if f"optim/{name}/{k}" in tensors}
        if st:
            loaded.optim[name] = st
        take_pieces(loaded, name, tensors, meta)
        if name in meta.get("param_steps", {}):
            loaded.param_steps[name] = meta["param_steps"][name]
        if meta.get("loss_scale") and loaded.loss_scale is None:
            loaded.loss_scale = meta["loss_scale"]
    elif f"buffer/{name}" in tensors:
        loaded.buffers[name] = tensors[f"buffer/{name}"]
    else:
        raise CheckpointCorruptError(f"{where} lacks parameter or buffer {name!r}")


def take_pieces(loaded: LoadedCheckpoint, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Add the shard's piece of ``name``'s sharded optimizer state, if it holds one."""
    span = (meta.get("optim_pieces") or {}).get(name)
    if span is None:
        return
    st = {k: tensors[f"optim_shard/{name}/{k}"] for k in ("exp_avg", "exp_avg_sq")
          if f"optim_shard/{name}/{k}" in tensors}
    if st:
        have = loaded.optim_pieces.setdefault(name, [])
        if all(tuple(span) != (a, b) for a, b, _ in have):
            have.append((int(span[0]), int(span[1]), st))
        if name in meta.get("param_steps", {}):  # the piece's shard knows its AdamW step
            loaded.param_steps[name] = meta["param_steps"][name]


def pieces_complete(loaded: LoadedCheckpoint, name: str, sharded: bool) -> bool:
    """Whether the optimizer state of parameter ``name`` is whole: held unsharded, or (in a
    checkpoint of ``sharded`` state) pieces covering it. Not a parameter: nothing to cover."""
    if name in loaded.optim or name not in loaded.params:
        return True
    if name not in loaded.optim_pieces:
        return not sharded
    covered = 0
    for a, b, _ in sorted(loaded.optim_pieces[name], key=lambda t: t[0]):
        if a > covered:
            return False
        covered = max(covered, b)
    return covered >= loaded.params[name].numel()


def _mismatch(kind: str, name: str, live: torch.Tensor, saved: torch.Tensor, step: int) -> str | None:
    if tuple(live.shape) == tuple(saved.shape) and live.dtype == saved.dtype:
        return None
    return (f"checkpoint step {step} holds {kind} {name!r} as {tuple(saved.shape)} {saved.dtype}, but the "
            f"model has {tuple(live.shape)} {live.dtype}: the checkpoint is of another model configuration; "
            "pass a --checkpoint-dir of this model's checkpoints (or an empty one), or recompile with the "
            "configuration that wrote it")


def check_shapes(trainer, ckpt: LoadedCheckpoint) -> None:
    """PlanMismatchError naming the first tensor of ``ckpt`` whose shape or dtype differs from the
    live parameter, optimizer state or mutable buffer it would be copied into (both shapes and the
    fix); nothing is copied before this passes."""
    for name, buffer in trainer.named_mutable_buffers().items():
        if name in ckpt.buffers and (msg := _mismatch("mutable buffer", name, buffer, ckpt.buffers[name], ckpt.step)):
            raise PlanMismatchError(msg)
    for m in trainer.modules:
        for name in m.parameter_names:
            p = m.get_parameter(name)
            if name not in ckpt.params:
                raise CheckpointCorruptError(f"checkpoint step {ckpt.step} lacks parameter {name!r}")
            if msg := _mismatch("parameter", name, p, ckpt.params[name], ckpt.step):
                raise PlanMismatchError(msg)
            live_state = trainer.optimizer.state.get(p) or {}
            for k, v in ckpt.optim.get(name, {}).items():
                # against the preallocated state when there is one (its dtype), else the parameter's shape
                live = live_state.get(k)
                live = live if isinstance(live, torch.Tensor) else torch.empty(p.shape, dtype=v.dtype, device="meta")
                if msg := _mismatch(f"optimizer state {k} of", name, live, v, ckpt.step):
                    raise PlanMismatchError(msg)


def restore(trainer, ckpt: LoadedCheckpoint) -> None:
    """Put a loaded checkpoint into a RankTrainer (every copy of a tied parameter, every mutable
    buffer). Every tensor is checked against the live one first (``check_shapes``), so a wrong
    checkpoint changes nothing."""
    check_shapes(trainer, ckpt)
    if ckpt.optim_pieces and getattr(trainer, "zero", None) is None:
        _unshard_optim(trainer, ckpt)
    seen: set[int] = set()
    with torch.no_grad():
        for name, buffer in trainer.named_mutable_buffers().items():
            if name not in ckpt.buffers:
                raise CheckpointCorruptError(f"checkpoint step {ckpt.step} lacks mutable buffer {name!r}")
            buffer.copy_(ckpt.buffers[name].to(buffer.device))
        for m in trainer.modules:
            for name in m.parameter_names:
                p = m.get_parameter(name)
                p.copy_(from_full(p, ckpt.params[name].to(local(p).device)))  # Note [tensor-parallel pieces]
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if name in ckpt.optim and getattr(trainer, "zero", None) is None:
                    old = trainer.optimizer.state.get(p) or {}
                    st = {}
                    for k, v in ckpt.optim[name].items():
                        cur = old.get(k)  # state already allocated (runtime.resilience.recovery.preallocate_optimizer_state): fill it
                        same = isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == v.dtype \
                            and cur.device == p.device
                        v = from_full(p, v.to(local(p).device))
                        st[k] = cur.copy_(v) if same else v.clone()
                    if name in ckpt.param_steps:
                        st["step"] = adam_step(ckpt.param_steps[name], local(p), trainer.optimizer)
                    trainer.optimizer.state[p] = st
    if getattr(trainer, "zero", None) is not None:
        trainer.zero.restore(ckpt.params, ckpt.optim, ckpt.optim_pieces, ckpt.param_steps)
    scaler = getattr(trainer, "scaler", None)
    if scaler is not None:
        scaler.load(ckpt.loss_scale)
    if ckpt.lr_scheduler:
        restore_schedule(trainer.lr_scheduler, trainer.optimizer, ckpt.lr_scheduler)
    if ckpt.rng_tensors is not None:
        restore_rng(ckpt.rng_tensors, ckpt.rng_meta or {}, rank=trainer.rank)
    trainer.steps_done = ckpt.step


def _unshard_optim(trainer, ckpt: LoadedCheckpoint) -> None:
    """Sharded pieces -> whole Adam state by name, for a trainer without sharding (a reshard to
    dp 1 or to replicated state)."""
    for name, p in trainer.named_parameters().items():
        if name not in ckpt.optim:
            st = full_state(name, p.numel(), p.shape, ckpt.optim, ckpt.optim_pieces)
            if st is not None:
                ckpt.optim[name] = st


def restore_schedule(sched, optimizer, saved: dict) -> None:
    """Note [the plan's learning rate]: a checkpoint restores the schedule's position (its step
    counters), never its learning rates: the live scheduler was built from the plan's optimizer
    settings (base learning rate, warm-up, decay), so a program recompiled with another --lr trains
    at that lr, and a shard's lr lists (whatever they say) are not read. The lr is recomputed as
    LambdaLR.step computes it (base * lambda(step)): the same floats as an uninterrupted run. Every
    parameter group has its own lambda and base, so a reshard that changes the number of groups
    (Note [no weight decay] in runtime/execute/grad_norm.py) needs nothing more."""
    sched.last_epoch = int(saved["last_epoch"])
    sched._step_count = int(saved.get("_step_count", sched.last_epoch + 1))
    lrs = [base * lmbda(sched.last_epoch) for lmbda, base in zip(sched.lr_lambdas, sched.base_lrs)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs
