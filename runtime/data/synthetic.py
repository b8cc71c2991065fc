"""Synthetic, deterministic data and losses for the built-in workloads.

Note [data is a function of the step]: every batch is a pure function of (seed, step), so a rank
can regenerate any step's batch without state; a resumed run, or a run on another partition, sees
exactly the data of the uninterrupted run. Every rank builds the whole global batch and keeps its
own data-parallel slice.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from runtime.errors import InputMismatchError


def token_batch(step: int, batch_size: int, *, vocab: int, seq: int, seed: int = 0):
    """Next-token data: ``(tokens,)`` and ``targets`` (tokens shifted by one), both [batch, seq]."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    stream = torch.randint(0, vocab, (batch_size, seq + 1), generator=gen)
    return (stream[:, :-1].contiguous(),), stream[:, 1:].contiguous()


def regression_batch(step: int, batch_size: int, *, features: int, outputs: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch_size, features, generator=gen)
    return (x,), torch.randn(batch_size, outputs, generator=gen)


def causal_lm_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy. Accepts a Hugging Face output (uses ``.logits``) or a tensor."""
    logits = getattr(logits, "logits", logits)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


# Note [keyword inputs]: make_batch may return its inputs as a tuple (the forward's positional
# inputs) or as a dict of keyword inputs ({"input_ids": ..., "attention_mask": ...}). torch.export
# makes each keyword input a placeholder of the graph, in the order of the example's dict, and
# stage 0 receives the placeholders in graph order; the program records that order as
# ``data.keywords``, and every consumer (the ranks' stage 0, the one-process oracle, the stage
# chain) turns the dict into that one positional order with ``batch_inputs``. Only the original
# nn.Module, called by the oracle, takes them back as keywords.


# Note [constant inputs]: an input that holds no tensor (pool="first", a flag, a scale, None, a
# tuple of ints), as an example keyword or positional input, is specialised by the trace:
# torch.export bakes its value into the graph, where only the guard export adds checks it, and
# that guard is dropped with the others (partitioner/frontend/trace.py ``_clean``, which also drops the
# input itself). So it is no input of any stage and never crosses one; the program records it with
# its traced value (``data.constants``: [keyword or position, value], plain JSON values only,
# checked before the trace), and every consumer of make_batch's inputs (the ranks, the oracle, the
# stage chain) checks and drops it here: a make_batch that returns another value is refused at the
# step it does so, before the step runs, for the graph would silently keep the traced one. The
# oracle that calls the user's own module passes the constants back (runtime/execute/reference.py).


def holds_tensor(value) -> bool:
    """Whether ``value`` is a tensor or a list, tuple or dict holding one (else: a constant input)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return False


def constant_inputs(args, kwargs) -> list[list]:
    """[[position or keyword, value]] of the inputs that hold no tensor (Note [constant inputs])."""
    return ([[i, v] for i, v in enumerate(args) if not holds_tensor(v)]
            + [[k, v] for k, v in kwargs.items() if not holds_tensor(v)])


def _canonical(value) -> str | None:
    try:  # a tuple and a list of the same values are one value; True and 1 are not
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return None


def same_constant(got, expected) -> bool:
    """Is ``got`` the constant input ``expected`` (a plain JSON value), as the graph baked it?"""
    return _canonical(got) is not None and _canonical(got) == _canonical(expected)


def _check_constant(got, expected, name: str, step: int | None) -> None:
    if same_constant(got, expected):
        return
    at = f" at step {step}" if step is not None else ""
    raise InputMismatchError(
        f"make_batch returned {name}={got!r}{at}, but the program was specialised to {name}={expected!r} when "
        "it was traced (a non-tensor input's value is baked into the graph: Note [constant inputs] in "
        f"runtime/data/synthetic.py): return {name}={expected!r} at every step, or recompile with the value you want "
        "(one program per value)")


def batch_inputs(inputs, keywords=(), constants=(), *, step: int | None = None) -> tuple:
    """make_batch's inputs as the positional tuple stage 0 takes (Note [keyword inputs]), the
    constant inputs checked against their traced values and dropped (Note [constant inputs]);
    ``step`` names the step in a refusal."""
    by_name = {k: v for k, v in constants if isinstance(k, str)}
    by_position = {k: v for k, v in constants if isinstance(k, int)}
    if isinstance(inputs, dict):
        if not keywords and not by_name:
            raise InputMismatchError(f"make_batch returned a dict of inputs {sorted(inputs)} but the program was "
                                     "compiled for positional inputs: return a tuple, or recompile with this make_batch")
        expected = list(keywords) + [k for k in by_name if k not in keywords]
        missing = [k for k in expected if k not in inputs]
        extra = sorted(set(inputs) - set(expected))
        if missing or extra:
            raise InputMismatchError(f"make_batch returned inputs {sorted(inputs)} but the program takes {expected}"
                                     f"{f' (missing {missing})' if missing else ''}{f' (unexpected {extra})' if extra else ''}: "
                                     "return the keys of the example inputs the program was compiled with")
        for name, value in by_name.items():
            _check_constant(inputs[name], value, name, step)
        return tuple(inputs[k] for k in keywords)
    if keywords or by_name:
        raise InputMismatchError(f"make_batch returned {type(inputs).__name__} inputs but the program takes the keyword "
                                 f"inputs {list(keywords) + list(by_name)}: return a dict with those keys")
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    inputs = tuple(inputs)
    if by_position:
        if max(by_position) >= len(inputs):
            raise InputMismatchError(f"make_batch returned {len(inputs)} inputs but the program was compiled with "
                                     f"{max(by_position) + 1} or more: return the inputs of the example")
        for i, value in by_position.items():
            _check_constant(inputs[i], value, f"input {i}", step)
        inputs = tuple(a for i, a in enumerate(inputs) if i not in by_position)
    return inputs


def with_constants(args: tuple, keywords, constants) -> tuple[tuple, dict]:
    """(positional, keyword) inputs for the user's own module from a program's stage-0 inputs
    ``args`` (``batch_inputs``' result): keyword inputs by name, constants back in place."""
    by_position = {k: v for k, v in constants if isinstance(k, int)}
    positional = list(args[:len(args) - len(keywords)])
    for i in sorted(by_position):
        positional.insert(i, by_position[i])
    named = dict(zip(keywords, args[len(args) - len(keywords):]))
    named.update({k: v for k, v in constants if isinstance(k, str)})
    return tuple(positional), named
