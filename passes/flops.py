"""flops: forward and backward FLOPs of each node (``partitioner.flops``), for one microbatch.

Every call_function node is run alone on fake inputs (Note [one op at a time, on fake inputs] in
passes/_fake_run.py) under ``torch.utils.flop_counter.FlopCounterMode``, forward, then
``torch.autograd.grad`` back to those of its inputs that require grad. So the backward counts
only the gradients autograd really computes: ``mm``'s gradient with respect to an input that does
not require grad (token ids, masks, buffers, anything computed from them only) costs nothing.
Requires-grad propagates from the trainable parameters through the differentiable ops.

Note [attention by formula]: FlopCounterMode counts 0 FLOPs for scaled_dot_product_attention on
CPU (its CPU kernels are not in the registry) and Hugging Face models use SDPA. SDPA nodes are
therefore counted by formula: forward = ``flop_counter.sdpa_flop_count`` (Q·Kᵀ and P·V, full
square even when ``is_causal``, GQA shapes with the query's head count, masks cost nothing), which
is exactly what the eager twin's two matmuls count. The backward counts the four matmuls eager
attention differentiates (dP = dO·Vᵀ and dQ = dS·K, dK = dSᵀ·Q, dV = Pᵀ·dO, each only when its
input requires grad) - ``sdpa_backward_flop_count`` without its flash-attention recomputation of
Q·Kᵀ, so an SDPA model and its eager twin total the same FLOPs. Fused kernels may recompute more:
that is an implementation cost, not model work.

placeholder, get_attr and output nodes, views and elementwise ops get 0 (FlopCounterMode counts
only matmuls, convolutions and attention).
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.flop_counter import bmm_flop, sdpa_flop_count

from passes import ir
from passes._fake_run import NodeRun, is_sdpa, run_nodes_on_fake, state_requires_grad


def _shape(value) -> tuple[int, ...]:
    return tuple(int(s) for s in value.meta["val"].shape)


def sdpa_flops(node: fx.Node, sims: dict[fx.Node, NodeRun]) -> ir.FlopsMeta:
    """FLOPs of one SDPA node (Note [attention by formula])."""
    names = ("query", "key", "value")
    query, key, value = (node.args[i] if len(node.args) > i else node.kwargs[names[i]] for i in range(3))
    b, h_q, s_q, d_q = _shape(query)
    _, _, s_k, _ = _shape(key)
    d_v = _shape(value)[-1]
    # sdpa_flop_count wants q/k/v with matching heads or GQA; count with the query's heads, as
    # eager attention does after repeat_kv.
    fwd = sdpa_flop_count((b, h_q, s_q, d_q), (b, h_q, s_k, d_q), (b, h_q, s_k, d_v))

    def requires_grad(arg) -> bool:
        return isinstance(arg, fx.Node) and bool(sims[arg].requires_grad) and sims[arg].requires_grad[0]

    q_rg, k_rg, v_rg = (requires_grad(a) for a in (query, key, value))
    bwd = 0
    if q_rg or k_rg:  # dP = dO · Vᵀ, then the two matmuls of the scores
        bwd += bmm_flop((b * h_q, s_q, d_v), (b * h_q, d_v, s_k))
        if q_rg:
            bwd += bmm_flop((b * h_q, s_q, s_k), (b * h_q, s_k, d_q))
        if k_rg:
            bwd += bmm_flop((b * h_q, s_k, s_q), (b * h_q, s_q, d_q))
    if v_rg:  # dV = Pᵀ · dO
        bwd += bmm_flop((b * h_q, s_k, s_q), (b * h_q, s_q, d_v))
    return ir.FlopsMeta(fwd_flops=int(fwd), bwd_flops=int(bwd))


def _weight_flops(gm: fx.GraphModule, node: fx.Node, fwd: int, bwd: int) -> int:
    """The gradient product into a parameter the node reads directly costs its forward product
    (Note [weight-gradient flops] in partitioner/solver/zero_bubble.py); 0 for every other node."""
    reads_param = any(isinstance(a, fx.Node) and a.op == "get_attr" and state_requires_grad(gm, a)
                      for a in (*node.args, *node.kwargs.values()))
    return min(fwd, bwd) if reads_param else 0


@ir.graph_pass(reads=(), writes=(ir.FLOPS,))  # runs each node on fake inputs (``val``)
def annotate_flops(gm: fx.GraphModule) -> fx.GraphModule:
    sims = run_nodes_on_fake(gm, count_flops=True, record_saved=False)
    for node in gm.graph.nodes:
        if is_sdpa(node):
            meta = sdpa_flops(node, sims)
            if not any(sims[node].requires_grad):
                meta = ir.FlopsMeta(fwd_flops=meta.fwd_flops, bwd_flops=0)
        else:
            sim = sims[node]
            meta = ir.FlopsMeta(fwd_flops=int(sim.fwd_flops), bwd_flops=int(sim.bwd_flops),
                                bwd_weight_flops=_weight_flops(gm, node, int(sim.fwd_flops), int(sim.bwd_flops)))
        ir.put(node, ir.FLOPS, meta)
    return gm
