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
* memory per parameter (mixed precision Adam, no ZeRO): 2 bytes weight, 2 bytes gradient,
  12 bytes optimizer (fp32 master, m, v) = 16 bytes.
* saved activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation",
  no tensor parallelism): s·h·34 + 5·a·s^2 bytes; split here as attention (with its norm)
  13·s·h + 5·a·s^2 and MLP (with its norm) 21·s·h. GPT only: for SwiGLU the MLP keeps
  (2 + 2 + 3·f/h·2)·s·h. Recomputing a region keeps only its input, 2·s·h bytes.
* edges: the residual stream, 2·s·h bytes, between consecutive regions; logits are saved in
  fp32 for the loss (4·s·V bytes on the head).
"""

from __future__ import annotations

from partitioner.solver.problem import Edge, PartitionProblem, Region, Tie

__all__ = ["gpt_like_problem", "gpt2_small", "llama_like", "PARAM_BYTES", "GRAD_BYTES", "OPTIMIZER_BYTES"]

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12


def _region(name, params, fwd_flops, saved, recompute_saved, layer=None) -> Region:
    return Region(
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
    mlp_saved = (4 + 6 * f // h) * s * h if swiglu else 21 * s * h

    regions = [_region("embed", V * h + (0 if swiglu else s * h), 0.0, residual, residual)]
    for layer in range(layers):
        if granularity == "fine":
            regions.append(_region(f"layers.{layer}.attn", attn_params, attn_flops, attn_saved, residual, layer))
            regions.append(_region(f"layers.{layer}.mlp", mlp_params, mlp_flops, mlp_saved, residual, layer))
        elif granularity == "block":
            regions.append(_region(f"layers.{layer}", attn_params + mlp_params, attn_flops + mlp_flops,
                                   attn_saved + mlp_saved, residual, layer))
        else:
            raise ValueError(f"granularity={granularity!r} must be 'fine' or 'block'")
    head_params = 0 if tied else V * h
    regions.append(_region("head", head_params + h, 2 * s * h * V, residual + 4 * s * V, residual + 4 * s * V))
    edges = tuple(Edge(i, i + 1, residual) for i in range(len(regions) - 1))
    ties = (Tie(regions=(0, len(regions) - 1), param_bytes=PARAM_BYTES * V * h),) if tied else ()
    return PartitionProblem(regions=tuple(regions), edges=edges, ties=ties, input_bytes_per_sample=8 * s)


def gpt2_small(granularity: str = "fine") -> PartitionProblem:
    """GPT-2 small: 12 layers, h = 768, 12 heads, s = 1024, V = 50257, tied embedding (124M)."""
    return gpt_like_problem(layers=12, width=768, heads=12, seq=1024, vocab=50257, granularity=granularity)


def llama_like(granularity: str = "fine") -> PartitionProblem:
    """Llama-2-7B-like: 32 layers, h = 4096, 32 heads, SwiGLU f = 11008, s = 4096, V = 32000,
    untied head."""
    return gpt_like_problem(layers=32, width=4096, heads=32, seq=4096, vocab=32000, mlp_width=11008,
                            swiglu=True, tied=False, granularity=granularity)
