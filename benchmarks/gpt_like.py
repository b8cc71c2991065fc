"""Synthetic GPT-like partition problems built from closed-form formulas (no torch).

Used by the solver benchmarks while the torch front end is written elsewhere. Symbols:
L layers, h width, a heads, s sequence length, V vocabulary, f MLP width (4h for GPT, given
for Llama's SwiGLU), bf16 activations and weights.

Formulas (per sample = one sequence of s tokens):
* params: attention 4h^2 (Llama with grouped KV: 2h^2 + 2h·h_kv), MLP 2·h·f (GPT: 8h^2, SwiGLU:
  3·h·f), so a GPT block is 12h^2 and the model 12·L·h^2 + V·h (+ s·h positions, + V·h head if
  untied).
* flops: forward 2 · params · tokens for every matmul, plus attention scores and weighting
  2 · 2 · s^2 · h per layer; backward = 2 x forward, so training = 6 · params · tokens + attention.
  Head: 2 · s · h · V forward.
* memory per parameter, as the runtime keeps it under bf16-mixed (Note [mixed precision] in
  runtime/execute/precision.py, no sharding): 4 bytes fp32 weight (the master weights) + 2 bytes of its
  bf16 copy autocast caches for the step (the "weight" term, Note [precision in the cost model]),
  4 bytes fp32 gradient, 8 bytes AdamW m and v = 18 bytes.
* saved activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation",
  no tensor parallelism): s·h·34 + 5·a·s^2 bytes; split here as attention (with its norm)
  13·s·h + 5·a·s^2 and MLP (with its norm) 21·s·h. GPT only: for SwiGLU the MLP keeps
  4·s·h + 6·s·f (its input twice, then gate, up and their product at width f). Recomputing a
  region keeps only its input, 2·s·h bytes.
* edges: the residual stream between consecutive regions, at the plan's fp32 boundary dtype
  (the runtime casts a stage's outputs back to it): 4·s·h bytes ("op" granularity's inner edges
  stay at the bf16 2·s·h); logits are saved in fp32 for the loss (4·s·V bytes on the head).
"""

from __future__ import annotations

from partitioner.solver.problem import Edge, PartitionProblem, RegionCost, SharedParam

__all__ = ["gpt_like_problem", "gpt2_small", "llama_like", "PARAM_BYTES", "GRAD_BYTES", "OPTIMIZER_BYTES"]

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 6, 4, 8


def _region(name, params, fwd_flops, saved, recompute_saved, layer=None) -> RegionCost:
    return RegionCost(
        name=name,
        fwd_flops_per_sample=float(fwd_flops),
        bwd_flops_per_sample=2.0 * fwd_flops,
        param_bytes=int(PARAM_BYTES * params),
        grad_bytes=int(GRAD_BYTES * params),
        optimizer_bytes=int(OPTIMIZER_BYTES * params),
        activation_bytes_per_sample=int(saved),
        recompute_activation_bytes_per_sample=int(recompute_saved),
        layer=layer,
    )


def gpt_like_problem(
    *,
    layers: int,
    width: int,
    heads: int,
    seq: int,
    vocab: int,
    mlp_width: int | None = None,
    kv_heads: int | None = None,
    swiglu: bool = False,
    tied: bool = True,
    granularity: str = "fine",
) -> PartitionProblem:
    """Embedding, then per layer an attention and an MLP region ("fine") or one block region
    ("block"), then the head (final norm + LM head + loss), as a chain."""
    h, s, a, V = width, seq, heads, vocab
    f = mlp_width or 4 * h
    kv = kv_heads or heads
    h_kv = h * kv // heads
    residual = 2 * s * h
    attn_params = 2 * h * h + 2 * h * h_kv
    mlp_params = (3 if swiglu else 2) * h * f
    attn_flops = 2 * attn_params * s + 4 * s * s * h
    mlp_flops = 2 * mlp_params * s
    attn_saved = 13 * s * h + 5 * a * s * s
    mlp_saved = 4 * s * h + 6 * s * f if swiglu else 21 * s * h

    regions = [_region("embed", V * h + (0 if swiglu else s * h), 0.0, residual, residual)]
    if granularity == "op":
        edges: list[Edge] = []
        core_saved = attn_saved - 13 * s * h
        previous = 0
        for layer in range(layers):
            previous = _op_layer(regions, edges, previous, layer, h=h, s=s, f=f, h_kv=h_kv, swiglu=swiglu,
                                 core_saved=core_saved)
        head_params = 0 if tied else V * h
        regions.append(_region("head", head_params + h, 2 * s * h * V, residual + 4 * s * V, residual + 4 * s * V))
        edges.append(Edge(previous, len(regions) - 1, 2 * residual))  # fp32 boundary
        ties = (SharedParam(regions=(0, len(regions) - 1), param_bytes=PARAM_BYTES * V * h),) if tied else ()
        return PartitionProblem(regions=tuple(regions), edges=tuple(edges), ties=ties, input_bytes_per_sample=8 * s)
    for layer in range(layers):
        if granularity == "fine":
            regions.append(_region(f"layers.{layer}.attn", attn_params, attn_flops, attn_saved, residual, layer))
            regions.append(_region(f"layers.{layer}.mlp", mlp_params, mlp_flops, mlp_saved, residual, layer))
        elif granularity == "block":
            regions.append(_region(f"layers.{layer}", attn_params + mlp_params, attn_flops + mlp_flops,
                                   attn_saved + mlp_saved, residual, layer))
        else:
            raise ValueError(f"granularity={granularity!r} must be 'op', 'fine' or 'block'")
    head_params = 0 if tied else V * h
    regions.append(_region("head", head_params + h, 2 * s * h * V, residual + 4 * s * V, residual + 4 * s * V))
    edges = tuple(Edge(i, i + 1, 2 * residual) for i in range(len(regions) - 1))  # fp32 boundaries
    ties = (SharedParam(regions=(0, len(regions) - 1), param_bytes=PARAM_BYTES * V * h),) if tied else ()
    return PartitionProblem(regions=tuple(regions), edges=edges, ties=ties, input_bytes_per_sample=8 * s)


def _op_layer(regions: list, edges: list, previous: int, layer: int, *, h, s, f, h_kv, swiglu, core_saved) -> int:
    """One block at "op" granularity, as passes/regions.py cuts a real one: a region per matmul
    (Llama: q, k, v, attention core, o | gate, up, down; GPT: fused qkv, core, proj | fc, proj),
    the norm with its sublayer's first matmul, the residual add with its last. Saved bytes add up
    to the "fine" regions'. Edges as passes.region_graph.region_cut_edges prices them: a tensor read by
    several regions (the residual stream by a norm and an add, the normed input by q, k and v) is
    priced once, on the edge to its last reader, with 0-byte edges to the others."""
    res = 2 * s * h

    def add(name, params, fwd_flops, saved, inputs, input_bytes) -> int:
        # a recomputed region keeps its inputs (input_bytes: each tensor once)
        regions.append(_region(f"layers.{layer}.{name}", params, fwd_flops, saved, input_bytes, layer))
        rid = len(regions) - 1
        edges.extend(Edge(src, rid, b) for src, b in inputs)
        return rid

    if swiglu:
        q = add("q", h * h, 2 * h * h * s, 4 * s * h, [(previous, 0)], res)
        k = add("k", h * h_kv, 2 * h * h_kv * s, 0, [(q, 0)], res)
        v = add("v", h * h_kv, 2 * h * h_kv * s, 0, [(q, res), (k, 0)], res)
        core = add("core", 0, 4 * s * s * h, 2 * s * h + 4 * s * h_kv + core_saved,
                   [(q, res), (k, 2 * s * h_kv), (v, 2 * s * h_kv)], res + 4 * s * h_kv)
        o = add("o", h * h, 2 * h * h * s, 3 * s * h, [(core, res), (previous, res), (q, 0)], 2 * res)
        gate = add("gate", h * f, 2 * h * f * s, 4 * s * h + 2 * s * f, [(o, 0)], res)
        up = add("up", h * f, 2 * h * f * s, 2 * s * f, [(gate, res + 2 * s * f)], res + 2 * s * f)
        return add("down", h * f, 2 * h * f * s, 2 * s * f, [(up, 2 * s * f), (o, res), (gate, 0)],
                   2 * s * f + res)
    qkv = add("qkv", 3 * h * h, 6 * h * h * s, 4 * s * h, [(previous, 0)], res)
    core = add("core", 0, 4 * s * s * h, 6 * s * h + core_saved, [(qkv, 3 * res)], 3 * res)
    o = add("proj", h * h, 2 * h * h * s, 3 * s * h, [(core, res), (previous, res), (qkv, 0)], 2 * res)
    fc = add("fc", h * f, 2 * h * f * s, 4 * s * h, [(o, 0)], res)
    return add("mlp_proj", h * f, 2 * h * f * s, 21 * s * h - 4 * s * h, [(fc, 2 * s * f), (o, res)],
               2 * s * f + res)


def gpt2_small(granularity: str = "fine") -> PartitionProblem:
    """GPT-2 small: 12 layers, h = 768, 12 heads, s = 1024, V = 50257, tied embedding (124M)."""
    return gpt_like_problem(layers=12, width=768, heads=12, seq=1024, vocab=50257, granularity=granularity)


def llama_like(granularity: str = "fine") -> PartitionProblem:
    """Llama-2-7B-like: 32 layers, h = 4096, 32 heads, SwiGLU f = 11008, s = 4096, V = 32000,
    untied head."""
    return gpt_like_problem(layers=32, width=4096, heads=32, seq=4096, vocab=32000, mlp_width=11008,
                            swiglu=True, tied=False, granularity=granularity)
