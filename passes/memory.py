"""memory: bytes each node holds during training (``partitioner.memory``), for one microbatch.

Note [who owns model state]: parameter, gradient and optimizer bytes are attributed once per
tensor to the first get_attr node that reads it (by target and by tensor identity, so a tied
embedding - one get_attr used twice, or two names for one tensor - counts once). ``param_bytes``
covers everything the module holds: trainable parameters, frozen ones, buffers and lifted
constants (a stage must hold all of them). Only parameters that require grad get ``grad_bytes``
(= param bytes, gradients share the parameter's dtype) and ``optimizer_bytes``:

    adamw / adam      2 x param bytes   (exp_avg and exp_avg_sq, kept by torch.optim in the
                                          parameter's dtype: fp32 parameters -> fp32 state;
                                          the per-parameter ``step`` scalar is ignored)
    sgd_momentum      1 x param bytes   (momentum buffer)
    sgd               0

Parameters, gradients and state are taken at the traced dtype, which is what the runtime keeps
under every precision policy (fp32 parameters are the master weights under autocast); the
policy's extra terms (autocast's weight copies, the compute dtype's FLOP rate) are added after the
passes: Note [precision in the cost model] in partitioner/solver/precision_cost.py.

Note [saved activations]: ``saved_activation_bytes`` is what autograd keeps from the forward until
the backward. Each node is run alone on fake inputs under ``saved_tensors_hooks`` (Note [one op at
a time, on fake inputs] in passes/_fake_run.py) and every saved tensor is classified by storage:
- (a view of) a node's output: counted once, on the node that owns that storage (through chains
  of views), however many consumers save it - the bytes are the owning storage's;
- a tensor born inside the op that is no node's output (dropout masks, layer-norm mean/rstd,
  SDPA's log-sum-exp): counted on the node that saved it;
- parameters, buffers and views of them: not activations (already in ``param_bytes``).
The microbatch inputs (placeholders) count when saved (e.g. token ids kept by embedding).

Note [backward transients]: while node n's backward runs, autograd holds, besides the saved
activations and the parameters' ``.grad``: the gradient frontier (the gradient of every storage
that requires grad, made at or before n and used after it: a residual stream's lives across a
whole block), the gradients n makes for its inputs and parameters (counted whole: sums are out
of place), and the op's temporaries, taken as one more tensor of its output's size (softmax,
GELU and layer-norm backward allocate about that). Computed on the whole graph, it is an upper
bound for a stage's subset. Parameter gradients are kept apart (``bwd_param_grad_bytes``): they
do not scale with the microbatch. A region's transient is its largest node's (one node runs
backward at a time), each part maximised separately (conservative).

Note [the loss on the last stage]: when the loss is applied outside the graph (a Workload with a
``loss_fn``, called by PipelineStage on the last stage's outputs), the output node carries it:
- held (``held_bytes``, kept outside autograd's saved tensors): the outputs themselves (PipelineStage keeps them until their backward) plus, per float
  output element, 4 bytes: cross entropy keeps the float32 log-softmax of the logits;
- transient: per float output element, 8 bytes (the float32 gradients of the log-probabilities
  and of the logits, alive together in log_softmax's backward), plus the gradient cast back to
  the output's dtype when that is not float32.
A model that returns its own loss has the loss ops in the graph, costed like any other node; its
output node holds the (scalar) outputs only.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from passes import ir
from passes._fake_run import get_module_attr, run_nodes_on_fake

OPTIMIZER_STATE_FACTOR = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}


def optimizer_state_factor(optimizer: str) -> int:
    key = optimizer.lower().replace("-", "_")
    if key not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(
            f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATE_FACTOR)} "
            "(optimizer state bytes per parameter byte are 2, 2, 1, 0, 0)")
    return OPTIMIZER_STATE_FACTOR[key]


def state_bytes(gm: fx.GraphModule, *, optimizer: str = "adamw") -> dict[fx.Node, tuple[int, int, int]]:
    """(param, grad, optimizer) bytes per get_attr node that first reads a tensor (Note [who owns
    model state])."""
    factor = optimizer_state_factor(optimizer)
    owners: dict[fx.Node, tuple[int, int, int]] = {}
    seen_targets: set[str] = set()
    seen_tensors: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in seen_targets:
            continue
        seen_targets.add(node.target)
        try:
            value = get_module_attr(gm, node.target)
        except AttributeError:
            continue
        if not isinstance(value, torch.Tensor) or id(value) in seen_tensors:
            continue
        seen_tensors.add(id(value))
        nbytes = int(value.numel()) * value.element_size()
        trainable = isinstance(value, torch.nn.Parameter) and value.requires_grad
        owners[node] = (nbytes, nbytes if trainable else 0, factor * nbytes if trainable else 0)
    return owners


def _output_tensors(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    return [t for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor)]


def backward_transients(gm: fx.GraphModule, sims) -> tuple[dict[fx.Node, int], dict[fx.Node, int], dict]:
    """Bytes of gradients alive during each node's backward (Note [backward transients]):
    (activation gradients, fresh parameter gradients) per node, and per owner node the spans of
    its frontier storages as (last user's name, bytes)."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    born: dict = {}   # storage root -> (position of its owner, bytes)
    last: dict = {}   # storage root -> last position that uses it (through any alias)
    for node in nodes:
        sim = sims[node]
        for i, root in enumerate(sim.roots):
            if root is None or not (i < len(sim.requires_grad) and sim.requires_grad[i]):
                continue
            owner, index = root
            born.setdefault(root, (position[owner], sims[owner].storage_bytes.get(index, 0)))
            end = max([position[u] for u in node.users] + [position[node]])
            last[root] = max(last.get(root, 0), end)
    delta = [0] * (len(nodes) + 1)
    spans: dict = {}
    for root, (start, nbytes) in born.items():
        if last[root] > start:
            delta[start] += nbytes
            delta[last[root]] -= nbytes
            spans.setdefault(root[0], []).append((nodes[last[root]].name, nbytes))
    frontier, running = [], 0
    for i in range(len(nodes)):
        running += delta[i]
        frontier.append(running)

    def grad_bytes_of(arg: fx.Node) -> int:
        sim = sims.get(arg)
        if sim is None or not any(sim.requires_grad):
            return 0
        return sum(t.numel() * t.element_size() for t in _output_tensors(arg))

    activations: dict[fx.Node, int] = {}
    params: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op != "call_function" or not any(sims[node].requires_grad):
            continue
        inputs = sum(grad_bytes_of(a) for a in node.all_input_nodes if a.op != "get_attr")
        params[node] = sum(grad_bytes_of(a) for a in node.all_input_nodes if a.op == "get_attr")
        own = ir.get(node, ir.SHAPE).output_bytes
        activations[node] = frontier[position[node]] + inputs + own
    return activations, params, spans


def loss_bytes(output: fx.Node, *, loss_outside_graph: bool) -> tuple[int, int]:
    """(held, transient) bytes of the output node (Note [the loss on the last stage])."""
    tensors = [t for arg in output.all_input_nodes for t in _output_tensors(arg)]
    held = sum(t.numel() * t.element_size() for t in tensors)
    if not loss_outside_graph:
        return held, 0
    floats = [t for t in tensors if t.dtype.is_floating_point]
    transient = sum(8 * t.numel() + (t.numel() * t.element_size() if t.dtype != torch.float32 else 0)
                    for t in floats)
    return held + sum(4 * t.numel() for t in floats), transient


@ir.graph_pass(reads=(ir.SHAPE,), writes=(ir.MEMORY,))
def annotate_memory(gm: fx.GraphModule, *, optimizer: str = "adamw",
                    loss_outside_graph: bool = False) -> fx.GraphModule:
    """``loss_outside_graph``: the Workload applies a ``loss_fn`` to the graph's outputs (Note
    [the loss on the last stage])."""
    owners = state_bytes(gm, optimizer=optimizer)
    sims = run_nodes_on_fake(gm, count_flops=False, record_saved=True)
    transients, param_grads, spans = backward_transients(gm, sims)

    saved_bytes: dict[fx.Node, int] = {node: sim.saved_internal_bytes for node, sim in sims.items()}
    kept: set = set()  # (owner node, output index) storages some consumer saves
    for sim in sims.values():
        kept |= sim.saved_roots
    for owner, index in kept:
        saved_bytes[owner] += sims[owner].storage_bytes.get(index, 0)

    held: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            held[node], transients[node] = loss_bytes(node, loss_outside_graph=loss_outside_graph)
        param, grad, opt = owners.get(node, (0, 0, 0))
        ir.put(node, ir.MEMORY, ir.MemoryMeta(
            param_bytes=param, grad_bytes=grad, optimizer_bytes=opt,
            saved_activation_bytes=int(saved_bytes.get(node, 0)),
            bwd_transient_bytes=int(transients.get(node, 0)),
            bwd_param_grad_bytes=int(param_grads.get(node, 0)),
            held_bytes=int(held.get(node, 0)),
            output_grad_bytes=int(sum(t.numel() * t.element_size() for t in _output_tensors(node))
                                  if node in sims and any(sims[node].requires_grad) else 0),
            grad_spans=tuple(spans.get(node, ())),
        ))
    return gm
