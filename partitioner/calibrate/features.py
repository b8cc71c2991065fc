"""The terms of the fitted time model, read off a graph: FLOPs by kind, bytes, ops (Note [the fitted
time model] in partitioner/calibrate/__init__.py)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx

from passes import ir


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


# Note [bytes under autocast]: under bf16-/fp16-mixed a memory-bound op moves the dtype autocast
# runs it in, not the traced fp32: the matmul-like ops write the compute dtype (torch's autocast
# "lower precision" list: linear, mm, bmm, attention, convolution), the ops on its fp32 list write
# fp32 (softmax, log-softmax, the norms, exp, log, pow, sums, the losses), and every other op writes
# the widest float dtype it reads (type promotion: the fp32 residual stream stays fp32, a dropout
# of a matmul's output stays 2 bytes). ``autocast_byte_scale`` propagates that through the graph
# as each node's output bytes over its traced bytes; the roofline of an accelerator prices memory
# with it (Note [accelerator roofline]); a fitted profile keeps the traced bytes it was fitted on.
_AUTOCAST_LOW = _MATMUL + ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                           "_scaled_dot_product_efficient_attention", "prelu")
_AUTOCAST_FP32 = ("softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm", "native_layer_norm",
                  "group_norm", "batch_norm", "rms_norm", "exp", "log", "log1p", "pow", "sum", "prod", "cumsum",
                  "cumprod", "norm", "cross_entropy", "nll_loss", "mse_loss", "cosine_similarity", "rsqrt", "erfinv")


def autocast_byte_scale(gm: fx.GraphModule, compute_bytes: int = 2) -> dict[fx.Node, float]:
    """node -> its output's bytes under autocast over its traced bytes (Note [bytes under autocast]),
    for nodes whose traced output is a 4-byte float; the others are absent (scale 1)."""
    scale: dict[fx.Node, float] = {}
    width: dict[fx.Node, int] = {}  # float element bytes of each node's output under autocast

    def traced_width(node) -> int | None:
        val = node.meta.get("val")
        val = val[0] if isinstance(val, (tuple, list)) and val else val
        return val.element_size() if isinstance(val, torch.Tensor) and val.dtype.is_floating_point else None

    for node in gm.graph.nodes:
        traced = traced_width(node)
        if traced is None:
            continue
        if node.op in ("placeholder", "get_attr") or node.op not in ("call_function", "call_method"):
            width[node] = traced
            continue
        name = op_name(node)
        if name in _AUTOCAST_LOW:
            out = min(traced, compute_bytes)
        elif name in _AUTOCAST_FP32:
            out = max(traced, 4)
        else:
            read = [width[a] for a in node.all_input_nodes if a in width]
            out = max(read) if read else traced
        width[node] = out
        if out != traced:
            scale[node] = out / traced
    return scale


def node_features(node: fx.Node, requires_grad: set[str],
                  byte_scale: dict[fx.Node, float] | None = None) -> tuple[Features, Features]:
    """(forward, backward) terms of one node (Note [the fitted time model]); ``byte_scale``:
    each node's bytes under autocast over its traced bytes (Note [bytes under autocast])."""
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
    scale = byte_scale or {}
    out_bytes = ir.get(node, ir.SHAPE).output_bytes * scale.get(node, 1.0)
    if name in _GATHER:  # reads only the rows it gathers; backward scatters into a full table
        table = sum(_tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes if a.op == "get_attr")
        fwd_bytes, bwd_bytes = 2 * out_bytes, out_bytes + table
    else:
        in_bytes = sum(_tensor_bytes(a.meta.get("val")) * scale.get(a, 1.0) for a in node.all_input_nodes)
        fwd_bytes = in_bytes + out_bytes
        bwd_bytes = fwd_bytes + out_bytes  # read the output's gradient and inputs, write inputs' gradients
    return (Features(memory_bytes=fwd_bytes, num_ops=1),
            Features(memory_bytes=bwd_bytes if differentiable else 0, num_ops=1 if differentiable else 0))


def group_features(nodes: Iterable[fx.Node], requires_grad: set[str],
                   byte_scale: dict[fx.Node, float] | None = None) -> tuple[Features, Features]:
    fwd, bwd = Features(), Features()
    for node in nodes:
        f, b = node_features(node, requires_grad, byte_scale)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def region_features(gm: fx.GraphModule, only: set[fx.Node] | None = None,
                    byte_scale: dict[fx.Node, float] | None = None) -> list[tuple[Features, Features]]:
    """(forward, backward) terms per region id, at the traced batch; of the nodes in ``only``
    when given (a region without any has zero terms); bytes scaled by ``byte_scale``."""
    members: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        members.setdefault(ir.get(node, ir.REGION).region_id, [])
        if only is None or node in only:
            members[ir.get(node, ir.REGION).region_id].append(node)
    needs = requires_grad_nodes(gm)
    return [group_features(members[r], needs, byte_scale) for r in sorted(members)]
