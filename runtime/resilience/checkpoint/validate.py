"""Whether a checkpoint that verified (sha256) can also be restored, decided before the ranks agree
on it: a shard's meta field by field (``check_meta``), and everything a rank would restore against
the live trainer (``check_restorable``).

Note [valid means restorable]: the sha256 says the bytes are the ones written, not that they make
sense: a header whose shape or dtype lies, meta of the wrong type, an RNG or scheduler state that
does not load, would otherwise fail in ``restore``, after every rank agreed on that step, and fail
the same way on every restart. So a rank counts a checkpoint valid only when every field it would
use has its type and range and every tensor it would copy has the live tensor's shape and dtype;
anything else is CheckpointCorruptError naming the file and the field, the checkpoint is not valid
on that rank (Note [recovery agreement] in runtime/resilience/recovery.py), and the agreement falls
back to the next older one.
"""

from __future__ import annotations

import math
import random
import sys

import torch

from runtime.errors import CheckpointCorruptError, PlanMismatchError
from runtime.resilience.checkpoint.shard import READABLE_FORMATS
from runtime.resilience.checkpoint.state import check_shapes


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ints(v, n: int | None = None) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v)


def _names(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _spans(v, n: int | None) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _ints(s, n) for k, s in v.items())


def meta_problem(meta) -> str | None:
    """What is wrong with a shard's meta (Note [checkpoint format]), or None."""
    if not isinstance(meta, dict):
        return f"its meta is a {type(meta).__name__}, not an object"
    checks = [
        ("format", lambda v: v in READABLE_FORMATS, True),
        ("step", _int, True), ("rank", _int, True),
        ("stages", lambda v: _ints(v) and all(x >= 0 for x in v), False), ("replica", _int, False),
        ("params", _names, True), ("buffers", _names, False),
        ("param_steps", lambda v: isinstance(v, dict) and all(isinstance(k, str) and _number(x) and x >= 0
                                                              for k, x in v.items()), False),
        ("lr_scheduler", lambda v: isinstance(v, dict), False),
        ("python_random", lambda v: isinstance(v, list) and len(v) == 3, False),
        ("numpy_random", lambda v: isinstance(v, list) and len(v) == 4, False),
        ("optim_pieces", lambda v: _spans(v, 2), False),
        ("tp_pieces", lambda v: _spans(v, 4), False),
        ("optim_tp_pieces", lambda v: _spans(v, None) and all(len(s) >= 6 for s in v.values()), False),
        ("loss_scale", lambda v: isinstance(v, dict), False),
        ("encoding", lambda v: isinstance(v, dict), False),
    ]
    for key, ok, required in checks:
        if key not in meta:
            if required:
                return f"its meta lacks {key!r}"
            continue
        if meta[key] is not None and not ok(meta[key]):
            return f"its meta field {key!r} is malformed ({_short(meta[key])})"
    enc = meta.get("encoding")
    if enc:
        base = enc.get("base_step")
        if base is not None and not _int(base):
            return f"its encoding's base_step is malformed ({_short(base)})"
        entries = enc.get("tensors")
        if not isinstance(entries, dict):
            return f"its encoding's tensors are malformed ({_short(entries)})"
        for key, e in entries.items():
            if not (isinstance(e, dict) and isinstance(e.get("dtype"), str) and _ints(e.get("shape"))
                    and all(x >= 0 for x in e["shape"]) and isinstance(e.get("delta"), bool)
                    and isinstance(e.get("sha256"), str)):
                return f"its encoding of {key!r} is malformed ({_short(e)})"
    return _scheduler_problem(meta.get("lr_scheduler")) or _python_random_problem(meta.get("python_random"))


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_meta(meta, where: str) -> None:
    """CheckpointCorruptError naming ``where`` and the field when ``meta_problem`` finds one."""
    problem = meta_problem(meta)
    if problem:
        raise CheckpointCorruptError(f"{where}: {problem}")


def _scheduler_problem(state) -> str | None:
    """Only the counters are restored (Note [the plan's learning rate] in
    runtime/resilience/checkpoint/state.py); the rest must still be what a LambdaLR writes: JSON
    values under names that are not one of its objects (its optimizer, its lambdas)."""
    if not state:
        return None
    if not _int(state.get("last_epoch")) or not _int(state.get("_step_count", 0)):
        return (f"its lr_scheduler's step counters are malformed (last_epoch {_short(state.get('last_epoch'))}, "
                f"_step_count {_short(state.get('_step_count'))})")
    for key in ("base_lrs", "_last_lr"):
        if key in state and not (isinstance(state[key], list) and all(_number(x) for x in state[key])):
            return f"its lr_scheduler's {key} is malformed ({_short(state[key])})"
    for key, v in state.items():
        if key in ("optimizer", "lr_lambdas") or not isinstance(v, (int, float, str, bool, list, type(None))):
            return f"its lr_scheduler holds {key!r} = {_short(v)}, which no LambdaLR state holds"
    return None


def _python_random_problem(state) -> str | None:
    if not state:
        return None
    try:  # a private generator: the process's own is set only by restore
        version, values, gauss = state
        random.Random().setstate((version, tuple(values), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        return f"its python_random state does not load ({exc})"
    return None


def _rng_problem(tensors: dict[str, torch.Tensor], meta: dict) -> str | None:
    cpu = tensors.get("rng/torch_cpu")
    if cpu is None:
        return "it lacks rng/torch_cpu"
    try:  # a private generator, as above
        torch.Generator().set_state(cpu.clone())
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"its rng/torch_cpu state does not load ({str(exc).splitlines()[0]})"
    for key, t in tensors.items():
        if key.startswith("rng/cuda_") and t.dtype != torch.uint8:
            return f"its {key} state is {t.dtype}, not torch.uint8"
    np = sys.modules.get("numpy")
    state = meta.get("numpy_random")
    if np is not None and state and "rng/numpy_keys" in tensors:
        try:
            name, pos, has_gauss, cached = state
            np.random.RandomState().set_state((name, tensors["rng/numpy_keys"].numpy().astype("uint32"), pos,
                                               has_gauss, cached))
        except (TypeError, ValueError, RuntimeError) as exc:
            return f"its numpy_random state does not load ({exc})"
    return None


def check_restorable(trainer, loaded) -> None:
    """CheckpointCorruptError when ``restore(trainer, loaded)`` would fail: a tensor of another
    shape or dtype than the live one (the shard's header lied: the model fingerprint matched), an
    RNG state that does not load (Note [valid means restorable])."""
    where = f"checkpoint step {loaded.step}"
    try:
        check_shapes(trainer, loaded)
    except PlanMismatchError as exc:
        raise CheckpointCorruptError(str(exc).split(": the checkpoint is of another")[0]
                                     + ", though its model fingerprint is this model's: its header lies") from None
    if loaded.rng_tensors is not None:
        problem = _rng_problem(loaded.rng_tensors, loaded.rng_meta or {})
        if problem:
            raise CheckpointCorruptError(f"{where}: {problem}")
