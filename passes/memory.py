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

Mixed precision with fp32 master weights is not modelled (parameters are taken at their dtype).

Note [saved activations]: ``saved_activation_bytes`` is what autograd keeps from the forward until
the backward. Each node is run alone on fake inputs under ``saved_tensors_hooks`` (Note [one op at
a time, on fake inputs] in passes/_simulate.py) and every saved tensor is classified by storage:
- (a view of) a node's output: counted once, on the node that owns that storage (through chains
  of views), however many consumers save it - the bytes are the owning storage's;
- a tensor born inside the op that is no node's output (dropout masks, layer-norm mean/rstd,
  SDPA's log-sum-exp): counted on the node that saved it;
- parameters, buffers and views of them: not activations (already in ``param_bytes``).
The microbatch inputs (placeholders) count when saved (e.g. token ids kept by embedding).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from partitioner import ir
from passes._simulate import get_module_attr, simulate

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


@ir.graph_pass(writes=(ir.MEMORY,))
def annotate_memory(gm: fx.GraphModule, *, optimizer: str = "adamw") -> fx.GraphModule:
    owners = state_bytes(gm, optimizer=optimizer)
    sims = simulate(gm, count_flops=False, record_saved=True)

    saved_bytes: dict[fx.Node, int] = {node: sim.saved_internal_bytes for node, sim in sims.items()}
    kept: set = set()  # (owner node, output index) storages some consumer saves
    for sim in sims.values():
        kept |= sim.saved_roots
    for owner, index in kept:
        saved_bytes[owner] += sims[owner].storage_bytes.get(index, 0)

    for node in gm.graph.nodes:
        param, grad, opt = owners.get(node, (0, 0, 0))
        ir.put(node, ir.MEMORY, ir.MemoryMeta(
            param_bytes=param, grad_bytes=grad, optimizer_bytes=opt,
            saved_activation_bytes=int(saved_bytes.get(node, 0)),
        ))
    return gm
