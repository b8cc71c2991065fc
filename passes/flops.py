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


# Note [experts priced at 0]: a mixture-of-experts layer sends each token to the experts its router
# picks, so how many rows each expert multiplies is known only at run time. Hugging Face's MoE
# models (Mixtral, Qwen2-MoE, ...) run their experts as one module holding 3-D weights, through a
# grouped matmul (``transformers.grouped_mm_fallback``, a custom op) that FlopCounterMode has no
# formula for: the experts, most of an MoE model's work, are priced at 0 FLOPs and every such plan
# is priced wrong. Until MoE pricing lands, the compiler says so instead of staying silent: one line
# on stderr at compile, and ``predicted.unpriced_flops`` in plan.json, which ``inspect`` prints
# (its words: ``unpriced_line`` in partitioner/inspect/table.py).
# An expert module is one whose class name or path segment says "experts" (a dense shared expert,
# Qwen2-MoE's ``shared_expert``, is an MLP priced as any other); it is reported when none of its
# nodes is priced at all.
_MATMULS = ("mm", "bmm", "addmm", "linear", "matmul", "einsum", "_grouped_mm", "grouped_mm", "baddbmm")


def _expert_module(node: fx.Node) -> str | None:
    """The outermost module around ``node`` that holds experts, by path (None: no such module)."""
    for path, kind in (node.meta.get("nn_module_stack") or {}).values():
        name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
        leaf = name.rsplit(".", 1)[-1].lower()
        if "experts" in leaf or "experts" in str(path).split("."):
            return str(path)
    return None


def _op_name(target) -> str:
    name = getattr(target, "name", None)
    return name() if callable(name) else getattr(target, "__name__", str(target))


def unpriced_experts(gm: fx.GraphModule) -> dict:
    """{"modules": [...], "ops": [...]} of the expert modules priced at 0 FLOPs, or {} (Note [experts
    priced at 0]). Reads the FLOPS meta annotate_flops wrote."""
    flops: dict[str, int] = {}
    ops: dict[str, set] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or (module := _expert_module(node)) is None:
            continue
        meta = ir.get(node, ir.FLOPS)
        flops[module] = flops.get(module, 0) + (meta.fwd_flops + meta.bwd_flops if meta is not None else 0)
        name = _op_name(node.target)
        namespace = name.split("::", 1)[0] if "::" in name else "aten"
        if namespace not in ("aten", "prims") or name.split("::")[-1].split(".")[0] in _MATMULS:
            ops.setdefault(module, set()).add(name)
    modules = sorted(m for m, f in flops.items() if f == 0)
    if not modules:
        return {}
    return {"modules": modules, "ops": sorted(set().union(*(ops.get(m, set()) for m in modules)))}

