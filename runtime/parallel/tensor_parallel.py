"""A stage run by a tensor group: its parameters as DTensors, the traced code unchanged.

Note [tensor-parallel stages]: with ``tensor_parallel`` = tp > 1 every stage replica runs on tp
consecutive ranks (its tensor group, the tensor index innermost; runtime/program/layout.py). Each tensor
index runs its own copy of the pipeline (pipelines, data-parallel and tie groups are per tensor
index), so what crosses a stage boundary is whole on every rank and the pipelining code is the
same as without tensor parallelism. Inside a stage:

- every parameter is a ``torch.distributed.tensor.DTensor`` on the group's 1-d mesh: the ones the
  stage file's ``TENSOR_PARALLEL`` table names are ``Shard(dim)`` (column-parallel weights and
  biases on dim 0, row-parallel weights on dim 1, vocab-split embeddings and heads on dim 0; Note
  [tensor-parallel roles] in passes/tp_roles.py), the rest ``Replicate()``. Every rank
  builds the same full weights (same file, same keyed initialisation), so each takes its own
  chunk with no communication;
- the traced aten code keeps its global shapes (``view(x, [b, s, heads, d])``): DTensor's
  sharding propagation runs each op on the local shards, and inserts the collectives where the
  placements demand them: the all-reduce of a row-parallel linear's partial output when it meets
  the replicated residual stream, the all-reduce of a column-parallel linear's input gradient in
  backward (at the stage's input, ``from_local``'s backward), the vocab-split lookup's masked
  all-reduce, and the all-gather of vocab-split logits (``full_tensor`` at the stage's output);
- the stage's inputs enter as ``Replicate`` DTensors and its outputs leave as plain whole tensors;
  plain tensors the code makes itself (an ``arange``, a keyed dropout mask) are made on the
  device of the stage's parameters, the mesh's (Note [tensors a stage makes] in
  partitioner/codegen/split.py), and replicated by ``implicit_replication``: a keyed mask is drawn whole on every rank from the same keys as the
  oracle's (Note [randomness keyed by meaning]), and DTensor slices it to the local shard, so a
  sharded activation drops the same global elements as in the one-process run, and a replicated
  one the same on every tensor rank.

No hand-written collective in the forward or backward. Outside them, gradients and optimizer
state are DTensors too: the tie and data-parallel all-reduces run on their local tensors (same
tensor index, same shard), the gradient norm counts each shard once and a replicated gradient on
tensor index 0 only (``local_owned``), and checkpoints store each rank's local piece with its
global layout (``tp_pieces``, runtime/resilience/checkpoint/state.py).

Note [sequence parallelism]: with the plan's decision on (Korthikanti et al. 2022; Note [sequence
parallelism as a decision] in partitioner/solver/sequence_parallel.py), a row linear whose tokens
divide by tp is ``row_linear_scatter``: its partial sums are reduce-scattered to ``Shard`` on the
dim before the features (the sequence of [b, s, h]) instead of all-reduced, so the residual add,
norm and dropout that follow run, by DTensor's propagation, on each rank's 1/tp of the tokens
(the replicated residual stream it meets is sliced locally, no communication), and so do the next
sublayer's up to its ``column_input``, which all-gathers the slice (forward) and reduce-scatters
its partial input gradient back to the slice (backward). A keyed mask is still drawn whole and
DTensor takes the slice's part (the oracle's elements), a norm weight's gradient from a slice is
``Partial`` and summed by ``settle_gradients``, and the stage's outputs leave whole
(``full_tensor``). Parameters keep their placements: a checkpoint is the same with it or without.
For 2 ranks a reduce-scatter adds the same two numbers as the all-reduce.

Note [tensor parallelism under autocast]: the precision wrapper (runtime/execute/precision.py) is the same
on a tensor-parallel stage. Autocast is a dispatch key above DTensor's ``__torch_dispatch__``, so
it casts a DTensor linear's inputs (``aten._to_copy`` on the DTensor: each rank casts its shard)
and DTensor runs the bf16/fp16 matmul on the local shards; a parameter's cast is cached for the
step as without tp (one cast per weight per step, counted with a dispatch mode on tp 2, 2
microbatches). The collectives DTensor issues then carry the compute dtype: the row linear's
all-reduce, the head's logits all-gather, and, because ``column_input`` casts a column group's
input once before its linears, that group's input-gradient all-reduce in backward (Megatron's f
and g in bf16; measured with benchmarks/_tp_bytes_worker.py's dispatch mode on hf-llama 2 layers,
tp 2: 22 of 24 collectives bf16, 0.55x fp32's bytes). The vocab lookup's all-reduce stays fp32:
an embedding is not autocast, and that sum is exact (one rank's row, the others' zeros). gloo
and NCCL both reduce bf16 and fp16. The stage's outputs leave whole (``full_tensor``) and are then
cast to the plan's dtypes (the hooks run in that order). fp16's overflow test is the global norm
(runtime/execute/grad_norm.py), whose squares count every split gradient's local piece on every tensor
rank and a replicated one on tensor index 0, so an inf in any shard reaches every rank.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._pytree import tree_map


def memory_tier_refusal(mode: str, tensor_parallel: int) -> str:
    """Why ``--memory-tier MODE`` does not run on a tensor-parallel program, and the fix (said by
    ``partitioner run`` before any worker starts, and by every worker: runtime/launch/rank.py)."""
    return (f"--memory-tier {mode}: the in-memory checkpoint tier does not run with tensor parallelism yet "
            f"(this program has tensor_parallel={tensor_parallel}; Note [what tensor parallelism runs with] in "
            "partitioner/frontend/tp_support.py): pass --memory-tier off (disk checkpoints still run), or recompile "
            "with --tp 1")


def create_tensor_groups(layout, rank: int, *, timeout, backend: str | None = None):
    """Every tensor group, created on every rank in order (Note [group order]); this rank's, or None."""
    mine = None
    for ranks in layout.tensor_groups:
        g = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if rank in ranks:
            mine = g
    return mine


def mesh_of(group, device: torch.device):
    return DeviceMesh.from_group(group, device.type)


def is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a DTensor's local shard, shared storage; else ``t``)."""
    return t._local_tensor if is_dtensor(t) else t


def is_sharded(t) -> bool:
    return is_dtensor(t) and any(isinstance(p, Shard) for p in t.placements)


def shard_layout(t) -> tuple[int, int, int, int] | None:
    """(dim, start, end, global size) of this rank's piece of a sharded DTensor, else None."""
    if not is_dtensor(t):
        return None
    for p in t.placements:
        if isinstance(p, Shard):
            size = t.shape[p.dim]
            n, i = t.device_mesh.size(), t.device_mesh.get_local_rank()
            step = size // n
            return (p.dim, i * step, (i + 1) * step, size)
    return None


def shard_stage(module: torch.nn.Module, sharded: dict[str, int], mesh) -> torch.nn.Module:
    """Make every parameter of ``module`` a DTensor on ``mesh`` (Note [tensor-parallel stages]) and
    its forward take and give plain tensors."""
    size, index = mesh.size(), mesh.get_local_rank()
    done: dict[int, torch.nn.Parameter] = {}
    for name in module.parameter_names:
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        p = owner._parameters[leaf]
        if id(p) not in done:
            dim = sharded.get(name)
            with torch.no_grad():
                if dim is None:
                    value = DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)
                else:
                    if p.shape[dim] % size:
                        raise ValueError(f"{name} has {p.shape[dim]} rows on dim {dim}, not divisible by the "
                                         f"tensor group's {size} ranks: recompile with a --tp dividing it")
                    piece = p.data.chunk(size, dim)[index].contiguous()
                    value = DTensor.from_local(piece, mesh, [Shard(dim)], run_check=False)
            done[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
        owner._parameters[leaf] = done[id(p)]
    module.tp_sharded = dict(sharded)
    _wrap_forward(module, mesh)
    return module


def _wrap_forward(module: torch.nn.Module, mesh) -> None:
    """Inputs in as Replicate DTensors, outputs out whole. Hooks, not a replaced ``forward`` (as
    runtime/execute/precision.py's): a deep copy keeps working."""
    def enter(t):
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) \
            and not isinstance(t, DTensor) else t

    def leave(t):
        if not isinstance(t, DTensor):
            return t
        whole = t.full_tensor()
        # Note [a stage output is no view]: a Replicate DTensor's local tensor comes out as a view,
        # and torch's split backward (zb, zbv) detaches each stage output in place after its
        # input-gradient action, which autograd refuses on a view; a copy of the boundary tensor
        # is the same values and gradient, and frees the view's base instead of holding it.
        return whole.clone() if whole._is_view() else whole

    module.register_forward_pre_hook(lambda module, args: tree_map(enter, args))
    module.register_forward_hook(lambda module, args, output: tree_map(leave, output))


_implicit = None


def replicate_plain_tensors() -> None:
    """Treat every plain tensor that meets a DTensor as replicated, for the rest of the process:
    the stage code makes plain tensors (an arange, a keyed mask, rotary tables) and autograd saves
    them, so they meet DTensors in backward too, outside any context the forward could hold open.
    Only tensor-parallel ranks call this, and on them every plain tensor is whole and equal on every
    tensor rank (Note [tensor-parallel stages])."""
    global _implicit
    if _implicit is None:
        # lazy: loads torch.distributed.tensor, torch.utils._sympy (+59 torch modules)
        from torch.distributed.tensor.experimental import implicit_replication

        _implicit = implicit_replication()
        _implicit.__enter__()
        # left open, the generator is closed at interpreter teardown, after DTensor's module state
        # is gone, and prints an ignored AttributeError at the end of every tensor-parallel run
        atexit.register(_implicit.__exit__, None, None, None)


def shard_stages(modules, program, group, device: torch.device) -> None:
    """Every stage module of this rank on its tensor group, split as its stage file's
    ``TENSOR_PARALLEL`` table says (which must be what plan.json's program says)."""
    if group is None:
        raise ValueError(f"tensor_parallel={program.tensor_parallel} but this rank has no tensor group")
    mesh = mesh_of(group, device)
    replicate_plain_tensors()
    want = program.tp_sharded or {}
    for m in modules:
        dims = m.tensor_parallel_dims
        expected = {n: d for n, d in want.items() if n in m.parameter_names}
        if dims != expected:
            raise ValueError(f"stage_{m.stage_index}.py splits {dims} but plan.json's program splits {expected}: "
                             "recompile the program")
        shard_stage(m, dims, mesh)


def vocab_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, *args) -> torch.Tensor:
    """``aten.embedding`` over a vocab-split weight (Megatron's VocabParallelEmbedding): each rank
    looks up the ids its rows hold, zeros elsewhere, and one all-reduce sums the pieces. Written
    out rather than left to DTensor's own masked-partial lookup: torch 2.13 loses that pending
    mask through the ops that follow (an assertion in a cast or pow), and cannot turn the summed
    gradient coming back (Partial) into it. Here the gradient is made whole at ``from_local``'s
    backward (the all-reduce of Megatron's f operator) and flows into the local rows.
    Outside a tensor group it is the plain lookup."""
    if not is_dtensor(weight):
        return torch.ops.aten.embedding.default(weight, indices, padding_idx, *args)

    mesh = weight.device_mesh
    _dim, start, end, _rows = shard_layout(weight)
    ids = indices.to_local() if is_dtensor(indices) else indices
    outside = (ids < start) | (ids >= end)
    local_ids = (ids - start).masked_fill(outside, 0)
    # the padding row (no gradient) is a row of one rank only
    local_padding = padding_idx - start if start <= padding_idx < end else -1
    out = torch.ops.aten.embedding.default(weight.to_local(), local_ids, local_padding, *args)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A row-parallel linear whose partial sums are all-reduced here, once (Megatron's g operator).
    Left to itself DTensor keeps the sum pending through the residual add and settles it later,
    op by op, on q, k and v separately: three all-reduces where one does."""
    out = torch.ops.aten.linear.default(x, weight, bias)
    if is_dtensor(out):
        out = out.redistribute(out.device_mesh, [Replicate()])
    return out


def row_linear_scatter(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A row-parallel linear under sequence parallelism (Note [sequence parallelism]): its partial
    sums reduce-scattered along the sequence (the dim before the features), so what follows up to
    the next column input (residual add, norm, dropout) runs on this rank's 1/tp of the tokens."""
    out = torch.ops.aten.linear.default(x, weight, bias)
    if is_dtensor(out):
        out = _scatter(out, [Shard(out.dim() - 2)])
    return out


def _scatter(t: DTensor, placements: list) -> DTensor:
    """``t``'s pending sums reduce-scattered to ``placements``. On gloo as an all-reduce and this
    rank's slice: the same sums (the same two numbers for 2 ranks), and a fresh-clone suite run
    aborted with heap corruption after the sequence-parallel jobs' gloo reduce-scatters (left to
    investigate); NCCL runs the reduce-scatter itself."""
    if dist.get_backend(t.device_mesh.get_group()) == "gloo" and any(p.is_partial() for p in t.placements):
        t = t.redistribute(t.device_mesh, [Replicate()])
    return t.redistribute(t.device_mesh, placements)


class _ColumnInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # a sequence slice (Note [sequence parallelism]) is all-gathered here; its gradient, the
        # column linears' partial sums, is reduce-scattered back to the slice in backward
        ctx.placements = tuple(x.placements)
        if ctx.placements != (Replicate(),):
            return x.redistribute(x.device_mesh, [Replicate()])
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if is_dtensor(grad) and tuple(grad.placements) != ctx.placements:
            grad = _scatter(grad, list(ctx.placements))
        return grad


def column_input(x: torch.Tensor) -> torch.Tensor:
    """The input of a sublayer's column-parallel linears: the identity in forward; in backward the
    sum of their partial input gradients, all-reduced once here (Megatron's f operator) rather
    than wherever DTensor would settle it. Under autocast (Note [tensor parallelism under autocast])
    the input is cast to the compute dtype first, once for the group, so that all-reduce moves
    bf16/fp16 as the forward's row all-reduce does."""
    if not is_dtensor(x):
        return x
    device_type = local(x).device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if x.dtype != dtype and x.dtype == torch.float32:
            x = x.to(dtype)
    return _ColumnInput.apply(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` (no dropout: a keyed dropout is runtime.execute.randomness's) on
    each rank's heads. Attention is independent per head, so with q, k, v split on the head dim
    (column-parallel projections) each rank runs torch's fused kernel on its local heads, with no
    communication. DTensor has no CPU strategy for the fused kernel and decomposes it op by op at
    every call (tens of seconds), hence this; other layouts are made whole first."""
    if not is_dtensor(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)

    mesh = q.device_mesh
    heads = [Shard(1)]
    if not all(is_dtensor(t) and list(t.placements) == heads for t in (q, k, v)):
        q, k, v = (t.redistribute(mesh, [Replicate()]) if is_dtensor(t) else
                   DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (q, k, v))
        heads = [Replicate()]
    mask = attn_mask
    if mask is not None:
        if is_dtensor(mask):
            mask = mask.full_tensor()
        if heads != [Replicate()] and mask.dim() == 4 and mask.shape[1] > 1:  # one mask per head: ours
            n, i = mesh.size(), mesh.get_local_rank()
            mask = mask.chunk(n, 1)[i]
    out = F.scaled_dot_product_attention(q.to_local(), k.to_local(), v.to_local(), mask, dropout_p, is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
    return DTensor.from_local(out, mesh, heads, run_check=False)


def settle_gradients(params) -> None:
    """Give every gradient its parameter's layout. DTensor leaves a gradient that arrives as a sum
    of per-rank parts (a norm's weight behind a row-parallel linear) as ``Partial``: the all-reduce
    happens here, once, so the tie and data-parallel sums, the global norm and the optimizer all see
    whole (or properly split) gradients. Every tensor rank holds the same parameters in the same
    order, so the collectives line up."""
    for p in params:
        g = p.grad
        if g is not None and is_dtensor(g) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def local_owned(params_and_grads, tp_index: int) -> list[torch.Tensor]:
    """The gradients this rank counts in the global norm (Note [global gradient norm]): a sharded
    one's local piece on every tensor rank, a replicated one on tensor index 0 only."""
    out = []
    for g in params_and_grads:
        if g is None:
            continue
        if is_sharded(g):
            out.append(local(g))
        elif tp_index == 0:
            out.append(local(g))
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter or state tensor (an all-gather over the tensor group for a
    sharded one): collective, every rank of the group calls it in the same order."""
    return t.full_tensor() if is_dtensor(t) else t


def from_full(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole value) laid out as ``like`` is: this rank's chunk of a sharded DTensor,
    a replicated DTensor, or ``full`` itself."""
    if not is_dtensor(like):
        return full
    layout = shard_layout(like)
    piece = full if layout is None else full.narrow(layout[0], layout[1], layout[2] - layout[1]).contiguous()
    return DTensor.from_local(piece.to(local(like).device), like.device_mesh, like.placements, run_check=False)
