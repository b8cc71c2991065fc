"""The contract between passes: the node.meta keys we own, their values, and how to read them.

torch's own keys (``val``, ``nn_module_stack``, ``stack_trace``, ``source_fn_stack``) are read-only
for us. Ours are the constants below. Each has exactly one writer (``WRITER``), and each value is a
frozen dataclass whose numeric fields carry their unit in the name. A reader that finds a key
missing gets :class:`MissingMetaError` naming the pass that writes it.

Note [one writer per key]: a pass declares the keys it reads and writes with :func:`graph_pass`;
the wrapper checks every read key is on every node before the pass runs (naming its writer) and
calls :func:`check_written` after it, so a pass that forgets a node is caught where it happens,
not three passes later. The passes run in the order of ``passes.PIPELINE``, where each declared
read is written by an earlier pass (tests/unit/test_pass_contract.py runs the list and checks
every key a pass touches is one it declared).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch.fx as fx

SHAPE = "partitioner.shape"
FLOPS = "partitioner.flops"
MEMORY = "partitioner.memory"
REGION = "partitioner.region"
ATTENTION = "partitioner.attention_core"
TP = "tp_role"  # the key named in the tensor-parallel contract (docs/design.md §4)


@dataclass(frozen=True)
class ShapeMeta:
    """What a node produces. Tuple outputs list one entry per tensor; ``output_bytes`` sums them."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    output_bytes: int

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.shapes[0] if len(self.shapes) == 1 else None


@dataclass(frozen=True)
class FlopsMeta:
    """FLOPs of one forward and of its backward, for the example inputs (one microbatch)."""

    fwd_flops: int
    bwd_flops: int
    # the part of bwd_flops that produces parameter gradients (Note [weight-gradient flops] in
    # partitioner/solver/zero_bubble.py)
    bwd_weight_flops: int = 0


@dataclass(frozen=True)
class MemoryMeta:
    """Bytes a node holds during training.

    Parameter, gradient and optimizer bytes are attributed once per parameter, to the node that
    reads it first (a tied embedding is counted once). ``saved_activation_bytes`` is what autograd
    keeps from this node's forward until its backward, for one microbatch: the node's output when a
    consumer saves it, plus tensors saved inside the op that are not any node's output.
    ``bwd_transient_bytes`` is the activation-gradient bytes alive while this node's backward
    runs, beyond saved activations and model state (they scale with the microbatch), and
    ``bwd_param_grad_bytes`` the fresh gradients of the parameters it reads (they do not)
    (Note [backward transients] in passes/memory.py).
    ``held_bytes`` is what the runtime keeps from the forward to the backward outside autograd's
    saved tensors; only the output node has it: the outputs PipelineStage keeps for the loss and
    the loss's float copy of them (Note [the loss on the last stage]). Recomputing a region does
    not drop it.
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_activation_bytes: int
    bwd_transient_bytes: int = 0
    bwd_param_grad_bytes: int = 0
    held_bytes: int = 0
    # What the transient is made of, for a tensor group to divide the split part (Note [sharded
    # transients] in passes/tp_activations.py): the gradient bytes of this node's output when it
    # requires grad, and per storage it owns whose gradient is kept alive past it (the frontier),
    # (the name of the last node using it, its bytes).
    output_grad_bytes: int = 0
    grad_spans: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class RegionMeta:
    region_id: int
    name: str


@dataclass(frozen=True)
class AttentionCoreMeta:
    """The attention core a node belongs to (Note [the attention core] in passes/attention_core.py);
    None: none."""

    core_id: int | None


@dataclass(frozen=True)
class TpMeta:
    """What tensor parallelism does to a node (Note [tensor-parallel roles] in passes/tp_roles.py).

    ``role``: "column", "row", "vocab" or "replicated" on linear / embedding nodes whose weight is a
    parameter, None on every other node. Per traced batch (Note [tensor-parallel traffic]):
    ``comm_bytes`` the payload of the all-reduce it adds in forward, ``comm_bwd_bytes`` that of the
    all-reduce it adds in backward, ``gather_bytes`` the whole output a forward all-gather
    assembles (a vocab-split head's logits); per step: ``step_gather_bytes``, on a get_attr node,
    the bytes of a replicated parameter whose gradient is all-gathered after the schedule;
    ``lookup_bytes``: of ``comm_bytes``, a vocab-split lookup's, which autocast leaves in the
    embedding's dtype (Note [tensor parallelism under autocast] in runtime/parallel/tensor_parallel.py).
    ``sharded_param_bytes``: on a get_attr node, the bytes of its parameter that the tensor group
    divides; ``divisor``: what the degree must divide (0: nothing)."""

    role: str | None
    comm_bytes: int = 0
    sharded_param_bytes: int = 0
    divisor: int = 0
    comm_bwd_bytes: int = 0
    gather_bytes: int = 0
    step_gather_bytes: int = 0
    lookup_bytes: int = 0


VALUE_TYPES: dict[str, type] = {
    SHAPE: ShapeMeta,
    FLOPS: FlopsMeta,
    MEMORY: MemoryMeta,
    REGION: RegionMeta,
    ATTENTION: AttentionCoreMeta,
    TP: TpMeta,
}

WRITER: dict[str, str] = {
    SHAPE: "passes.shapes.annotate_shapes",
    FLOPS: "passes.flops.annotate_flops",
    MEMORY: "passes.memory.annotate_memory",
    REGION: "passes.regions.annotate_regions",
    ATTENTION: "passes.attention_core.annotate_attention_cores",
    TP: "passes.tp_roles.annotate_tensor_parallel",
}


class MissingMetaError(KeyError):
    def __init__(self, node: fx.Node, key: str):
        self.node_name, self.key = node.name, key
        super().__init__(
            f"node {node.name!r} has no {key!r}: run {WRITER.get(key, 'its writer')} before reading it"
        )

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


def get(node: fx.Node, key: str) -> Any:
    try:
        return node.meta[key]
    except KeyError:
        raise MissingMetaError(node, key) from None


def has(node: fx.Node, key: str) -> bool:
    return key in node.meta


def put(node: fx.Node, key: str, value: Any) -> None:
    expected = VALUE_TYPES[key]
    if not isinstance(value, expected):
        raise TypeError(f"{key} on {node.name!r} must be a {expected.__name__}, got {type(value).__name__}")
    node.meta[key] = value


@dataclass(frozen=True)
class PassSpec:
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


def graph_pass(*, reads: Iterable[str], writes: Iterable[str]) -> Callable:
    """Declare the keys of ours a pass reads and writes; the driver checks both (Note [one writer
    per key]). Both are required: a pass that reads none of our keys says ``reads=()``."""

    def wrap(fn: Callable) -> Callable:
        spec = PassSpec(f"{fn.__module__}.{fn.__name__}", tuple(reads), tuple(writes))
        for key in spec.writes:
            if WRITER.get(key) != spec.name:
                raise AssertionError(f"{spec.name} writes {key}, whose writer is {WRITER.get(key)}")

        @functools.wraps(fn)
        def run(gm: fx.GraphModule, *args, **kwargs):
            for key in spec.reads:
                for node in gm.graph.nodes:
                    get(node, key)  # raises naming the missing writer
            result = fn(gm, *args, **kwargs)
            check_written(gm, spec)
            return result

        run.spec = spec  # type: ignore[attr-defined]
        return run

    return wrap


def check_written(gm: fx.GraphModule, spec: PassSpec) -> None:
    for key in spec.writes:
        missing = [n.name for n in gm.graph.nodes if key not in n.meta]
        if missing:
            raise AssertionError(f"{spec.name} declared {key} but left {len(missing)} nodes without it: {missing[:5]}")


def as_dict(value: Any) -> dict:
    return dataclasses.asdict(value)
