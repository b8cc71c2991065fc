"""The terms of the fitted time model, read off a graph: FLOPs by kind, bytes, ops (Note [the fitted
time model] in partitioner/calibrate/__init__.py)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx

from partitioner import ir


TERMS = ("matmul_flops", "other_flops", "memory_bytes", "num_ops")
_MATMUL = ("linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "conv1d", "conv2d",
           "conv3d", "_scaled_mm", "einsum")
_GATHER = ("embedding", "index", "gather", "index_select")
VIEW_OPS = ("view", "_unsafe_view", "reshape", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
         "squeeze", "t", "alias", "split", "split_with_sizes", "chunk", "unbind", "detach", "as_strided",
         "_assert_tensor_metadata", "lift_fresh_copy")


# ---- features ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Features:
    """The model's terms for one group of nodes, one direction, at the traced batch."""

    matmul_flops: float = 0.0
    other_flops: float = 0.0
    memory_bytes: float = 0.0
    num_ops: float = 0.0

    def vector(self) -> list[float]:
        return [self.matmul_flops, self.other_flops, self.memory_bytes, self.num_ops]

    def __add__(self, other: "Features") -> "Features":
        return Features(*(a + b for a, b in zip(self.vector(), other.vector())))


def op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))  # "linear.default", "add.Tensor"
    return name.split(".")[0]


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel()) * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def requires_grad_nodes(gm: fx.GraphModule) -> set[str]:
    """Nodes whose output autograd differentiates: reached from a trainable parameter through
    ops with floating outputs (placeholders - token ids, the microbatch - never require grad)."""
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    needs: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            if node.target in trainable:
                needs.add(node.name)
        elif node.op in ("call_function", "call_method"):
            val = node.meta.get("val")
            flat = val if isinstance(val, (tuple, list)) else (val,)
            floating = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in flat)
            if floating and any(a.name in needs for a in node.all_input_nodes):
                needs.add(node.name)
    return needs


def node_features(node: fx.Node, requires_grad: set[str]) -> tuple[Features, Features]:
    """(forward, backward) terms of one node (Note [the fitted time model])."""
    if node.op not in ("call_function", "call_method") or node.target is operator.getitem:
        return Features(), Features()
    name = op_name(node)
    flops = ir.get(node, ir.FLOPS)
    differentiable = node.name in requires_grad
    if name in _MATMUL:
        return (Features(matmul_flops=flops.fwd_flops, num_ops=1),
                Features(matmul_flops=flops.bwd_flops, num_ops=1 if differentiable else 0))
    if flops.fwd_flops or flops.bwd_flops:  # attention by formula, anything else FlopCounter counts
        return (Features(other_flops=flops.fwd_flops, num_ops=1),
                Features(other_flops=flops.bwd_flops, num_ops=1 if differentiable else 0))
    if name in VIEW_OPS:
        return Features(num_ops=1), Features(num_ops=1 if differentiable else 0)
    out_bytes = ir.get(node, ir.SHAPE).output_bytes
    if name in _GATHER:  # reads only the rows it gathers; backward scatters into a full table
        table = sum(_tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes if a.op == "get_attr")
        fwd_bytes, bwd_bytes = 2 * out_bytes, out_bytes + table
    else:
        in_bytes = sum(_tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        fwd_bytes = in_bytes + out_bytes
        bwd_bytes = fwd_bytes + out_bytes  # read the output's gradient and inputs, write inputs' gradients
    return (Features(memory_bytes=fwd_bytes, num_ops=1),
            Features(memory_bytes=bwd_bytes if differentiable else 0, num_ops=1 if differentiable else 0))


def group_features(nodes: Iterable[fx.Node], requires_grad: set[str]) -> tuple[Features, Features]:
    fwd, bwd = Features(), Features()
    for node in nodes:
        f, b = node_features(node, requires_grad)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def region_features(gm: fx.GraphModule, only: set[fx.Node] | None = None) -> list[tuple[Features, Features]]:
    """(forward, backward) terms per region id, at the traced batch; of the nodes in ``only``
    when given (a region without any has zero terms)."""
    members: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        members.setdefault(ir.get(node, ir.REGION).region_id, [])
        if only is None or node in only:
            members[ir.get(node, ir.REGION).region_id].append(node)
    needs = requires_grad_nodes(gm)
    return [group_features(members[r], needs) for r in sorted(members)]
