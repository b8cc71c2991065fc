"""Random ops keyed by meaning: what the generated stage files call instead of torch's dropout.

Note [randomness keyed by meaning]: every random op of the traced graph is rewritten before the
graph is split (partitioner/frontend/randomness.py, ``lower_randomness``) into a call of this module, named
by the op's node name in the unpartitioned graph (``op="dropout_3"``). Each call draws from a
generator seeded by

    (plan seed, step, global sample index, op)      for a tensor with a batch dimension: every
                                                    sample's rows are drawn by their own generator
    (plan seed, step, global microbatch index, op)  for a tensor without one

The trainer (runtime/execute/train.py) sets the context (seed, step, first sample of the microbatch,
microbatch index) before every stage forward of every microbatch, and the one-process oracle
(runtime/execute/reference.py) sets the same context around the unpartitioned graph. The masks therefore
depend on neither the stages, nor the data-parallel degree, nor how a replica's rows are cut into
microbatches (a sample's rows are the same whichever microbatch holds it), nor a resume on another
partition (step and sample come from the checkpointed step and the data, not from process state).

A tensor without a batch dimension is keyed by the microbatch index, which does depend on the
microbatch count: such draws (rare: a random table shared by every sample) agree across stages,
replicas and reshards that keep the microbatch size, not across ones that change it.

Masks are drawn on the tensor's device by a hash of the key and the element's index, not by a
torch generator, so the same key gives the same mask on every device (Note [device-independent
draws]).

Recompute (torch.utils.checkpoint) replays a forward later, when the context already names a later
microbatch: ``capture()`` snapshots the context at forward time and ``restored(snapshot)`` makes it
current again for the replay (runtime/execute/recompute.py runs the checkpointed function under it).

Note [evaluation turns dropout off]: a compiled stage file calls ``dropout(x, p, True, ...)``: the
model was traced in training mode, so the train flag is a constant of the graph and
``module.eval()`` cannot reach it. The evaluation pass (runtime/execute/validation.py) runs inside
``dropout_off()`` instead, under which every keyed dropout (``dropout``, ``native_dropout``, the
attention probabilities' in ``attention``) is the identity, as torch's are in eval mode, and so is
a stochastic-depth mask (``drop_mask``, Note [in-place random ops]). Other random ops (``rand``,
``bernoulli``) are not dropout and still draw.

This module imports only torch (``tensor_parallel_attention``, on a tensor-parallel stage only, loads
runtime/parallel/tensor_parallel.py when it runs): generated files may import only torch and runtime.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_MASK64 = (1 << 64) - 1
# Tags the two kinds of key, so a per-sample key never equals a per-microbatch one.
_PER_SAMPLE, _PER_MICROBATCH = 0x5A4D, 0x4D42


@dataclass(frozen=True)
class Context:
    """What a keyed draw reads besides the op: set per stage forward per microbatch."""

    seed: int
    step: int
    first_sample: int  # global index (in the step's global batch) of the microbatch's first sample
    microbatch: int  # global microbatch index: replica * num_microbatches + local index


_current: Context | None = None
_dropout_off = False  # Note [evaluation turns dropout off]


def set_context(*, seed: int, step: int, first_sample: int, microbatch: int) -> None:
    global _current
    _current = Context(int(seed), int(step), int(first_sample), int(microbatch))


def current() -> Context:
    if _current is None:
        raise RuntimeError(
            "a keyed random op ran with no randomness context: call runtime.execute.randomness.set_context("
            "seed=, step=, first_sample=, microbatch=) before the forward (the trainer and "
            "runtime.execute.reference do, before every stage forward of every microbatch)")
    return _current


def capture() -> Context | None:
    """The current context, opaque to callers: hand it to ``restored`` to replay a forward."""
    return _current


@contextlib.contextmanager
def restored(snapshot: Context | None):
    """Make ``snapshot`` (from ``capture()``) the current context inside the block, then put back
    whatever was current before: a recompute under 1F1B runs between other microbatches' forwards.

    runtime.execute.recompute checkpoints ``_replay(fn, capture(), *args)``, which runs ``fn`` under
    ``restored(snapshot)`` both times (a no-op the first time), with either form of
    torch.utils.checkpoint (Note [cheap checkpointing]).
    """
    global _current
    previous, _current = _current, snapshot
    try:
        yield
    finally:
        _current = previous


@contextlib.contextmanager
def dropout_off():
    """Inside the block every keyed dropout is the identity (Note [evaluation turns dropout off])."""
    global _dropout_off
    previous, _dropout_off = _dropout_off, True
    try:
        yield
    finally:
        _dropout_off = previous


# ---------------------------------------------------------------------------------------------
# Keys and draws


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=None)
def _op_key(op: str) -> int:
    return int.from_bytes(hashlib.blake2b(op.encode(), digest_size=8).digest(), "little")


def key(seed: int, step: int, kind: int, index: int, op: str) -> int:
    """The generator seed of one draw: a 63-bit hash of its meaning (see the Note)."""
    h = _op_key(op)
    for part in (seed, step, kind, index):
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


# Note [device-independent draws]: a keyed draw is a counter-based hash, not a torch generator:
# element j of a sample (or microbatch) keyed k is splitmix64(k + (j + 1) * golden) in int64 tensor
# ops, its top 24 bits the fp32 uniform (exact: 24 bits fit fp32's mantissa). The same integers give
# the same bits on every device, so a CUDA program's masks are the CPU oracle's masks, and an
# H100's are an A100's or a MIG slice's: torch's CUDA generator spreads a draw over a grid sized by
# the GPU's multiprocessor count, so its values for a large tensor depend on the GPU model. The
# wrap-around of int64 add and multiply is what splitmix64 means by mod 2**64 (two's complement on
# every device torch runs on; tests/unit/test_randomness.py holds the tensor version to the
# Python integers). A normal draw is Box-Muller over two uniforms of one counter pair: its log and
# cos come from each device's math library, so normals agree across devices to the last bits
# rather than bitwise; uniforms (every dropout, bernoulli and rand) agree bitwise.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed64(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= (1 << 63) else x


def _mix64_top24_(z: torch.Tensor) -> torch.Tensor:
    """The top 24 bits of splitmix64's output function of an int64 tensor (the Python
    ``_splitmix64`` after its add), in place. Its last step, z ^ (z >> 31), leaves bits 40..63 as
    they are, so it is skipped. In place because a draw is a dozen passes over 8-byte integers:
    fresh tensors for each cost four times the time on a CPU."""
    shifted = torch.empty_like(z)
    for bits, multiplier in ((30, _MIX1), (27, _MIX2)):
        torch.bitwise_right_shift(z, bits, out=shifted)
        shifted &= (1 << (64 - bits)) - 1  # torch's >> on int64 is arithmetic; splitmix64's is logical
        z ^= shifted
        z *= _signed64(multiplier)
    z >>= 40
    z &= (1 << 24) - 1
    return z


def hashed_uniform(keys: torch.Tensor, count: int, *, first: int = 0) -> torch.Tensor:
    """fp32 U[0, 1) of shape (len(keys), count): row i, column j is the hash of (keys[i], first + j)
    (Note [device-independent draws]). ``keys``: int64 on the device to draw on."""
    rows = len(keys)
    if rows == 0 or count == 0:
        return torch.empty((rows, count), dtype=torch.float32, device=keys.device)
    # one buffer of states, made in place: each fresh tensor of a large draw costs its page faults
    z = torch.empty((rows, count), dtype=torch.int64, device=keys.device)
    torch.arange(first + 1, first + count + 1, dtype=torch.int64, device=keys.device, out=z[0])
    z[0].mul_(_signed64(_GOLDEN))
    if rows > 1:
        z[1:].copy_(z[0].expand(rows - 1, count))
    z.add_(keys.reshape(-1, 1))
    return _mix64_top24_(z).to(torch.float32).mul_(1.0 / (1 << 24))


def _hashed(keys: list[int], count: int, *, device: torch.device, normal: bool) -> torch.Tensor:
    keyed = torch.tensor([_signed64(k) for k in keys], dtype=torch.int64, device=device)
    if not normal:
        return hashed_uniform(keyed, count)
    pairs = hashed_uniform(keyed, 2 * count).reshape(len(keys), count, 2)
    radius = torch.sqrt(-2.0 * torch.log1p(-pairs[..., 0]))  # 1 - u in (0, 1]: log never sees 0
    return radius * torch.cos((2.0 * math.pi) * pairs[..., 1])


def _draw(shape, *, op: str, batch_dim: int | None, device: torch.device, normal: bool) -> torch.Tensor:
    """fp32 U[0, 1) (or N(0, 1)) keyed draws of ``shape``; rows along ``batch_dim`` are samples
    first_sample, first_sample + 1, ..."""
    ctx = current()
    shape = tuple(int(s) for s in shape)
    if batch_dim is None:
        k = key(ctx.seed, ctx.step, _PER_MICROBATCH, ctx.microbatch, op)
        return _hashed([k], math.prod(shape), device=device, normal=normal).reshape(shape)
    batch_dim = batch_dim % len(shape)
    rows = shape[batch_dim]
    rest = shape[:batch_dim] + shape[batch_dim + 1:]
    # Each sample's block is its own row of counters, so its values do not depend on how many
    # samples share the microbatch.
    keys = [key(ctx.seed, ctx.step, _PER_SAMPLE, ctx.first_sample + i, op) for i in range(rows)]
    out = _hashed(keys, math.prod(rest), device=device, normal=normal).reshape((rows,) + rest)
    return out.movedim(0, batch_dim).contiguous()


# Note [masks outside the compiled graph]: the draws are one custom op, ``partitioner_keyed::fill``,
# in eager and compiled stages alike. torch.compile cannot look inside it, so it reads the
# randomness context when the op runs, not when the graph was traced: a compiled stage draws the
# masks of the step and microbatch it runs (were the context read by traced Python, dynamo would
# guard on its integers and recompile for every microbatch), the same bits as eager (the op is the
# same code), and a recompute rerun under ``restored`` draws the first run's masks. Tagged
# nondeterministic_seeded, so AOTAutograd's partitioner saves its output for backward and never
# reruns it there (in backward the context names another microbatch). The result is made
# contiguous so its strides are those the fake implementation promises.
@torch.library.custom_op("partitioner_keyed::fill", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _keyed_fill(shape: list[int], op: str, batch_dim: int | None, normal: bool,
                device: torch.device | None) -> torch.Tensor:
    # device None: the default device, resolved here (dynamo cannot trace get_default_device)
    return _draw(shape, op=op, batch_dim=batch_dim, device=device or torch.get_default_device(), normal=normal)


@_keyed_fill.register_fake
def _keyed_fill_fake(shape, op, batch_dim, normal, device):
    return torch.empty([int(s) for s in shape], dtype=torch.float32, device=device or torch.get_default_device())


def _fill(shape, *, op: str, batch_dim: int | None, device, dtype: torch.dtype, normal: bool) -> torch.Tensor:
    """A tensor of ``shape`` filled with keyed draws (Note [masks outside the compiled graph]),
    drawn in fp32 and cast to ``dtype``."""
    device = torch.device(device) if device is not None else None
    out = torch.ops.partitioner_keyed.fill([int(s) for s in shape], op, batch_dim, normal, device)
    return out if dtype == torch.float32 else out.to(dtype)


def _uniform_like(x: torch.Tensor, *, op: str, batch_dim: int | None) -> torch.Tensor:
    # Drawn in fp32 whatever x's dtype: a bf16 run and an fp32 run then drop the same elements.
    return _fill(x.shape, op=op, batch_dim=batch_dim, device=x.device, dtype=torch.float32, normal=False)


# ---------------------------------------------------------------------------------------------
# The keyed ops (one per random aten op the lowering rewrites)


def dropout(x: torch.Tensor, p: float, train: bool = True, *, op: str, batch_dim: int | None = 0) -> torch.Tensor:
    """``aten.dropout``: zero each element with probability p, scale the rest by 1 / (1 - p)."""
    if not train or p == 0.0 or _dropout_off:
        return x
    if p >= 1.0:
        return x * 0.0
    keep = _uniform_like(x, op=op, batch_dim=batch_dim) >= p
    # masked_fill saves only the boolean mask for backward (as torch's native_dropout does).
    return x.masked_fill(~keep, 0.0) * (1.0 / (1.0 - p))


def native_dropout(x: torch.Tensor, p: float, train: bool | None = True, *, op: str,
                   batch_dim: int | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout``: (output, boolean keep mask)."""
    if not train or p == 0.0 or _dropout_off:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = _uniform_like(x, op=op, batch_dim=batch_dim) >= p
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return x.masked_fill(~keep, 0.0) * scale, keep


def bernoulli(x: torch.Tensor, p: float | torch.Tensor | None = None, *, op: str,
              batch_dim: int | None = 0) -> torch.Tensor:
    """``aten.bernoulli``: 1 with probability x (or p where given: a float, or a tensor that
    broadcasts to x, as ``x.bernoulli_(p)`` takes), in x's shape and dtype."""
    u = _uniform_like(x, op=op, batch_dim=batch_dim)
    prob = x.float() if p is None else p.float() if isinstance(p, torch.Tensor) else p
    return (u < prob).to(x.dtype)


# Note [in-place random ops]: timm's DropPath (``x.new_empty(shape).bernoulli_(keep)``),
# torchvision's StochasticDepth (``torch.empty(size).bernoulli_(p)``), ``nn.Dropout(inplace=True)``
# (``aten.dropout_``) and initializers in forward (``uniform_``, ``normal_``) draw in place. export
# threads every later read through the in-place node's result, so the lowering gives that node the
# out-of-place keyed draw below (the overwritten tensor's old values are never read: bernoulli_,
# uniform_ and normal_ ignore them, dropout_ reads them as its input). Writing into the tensor
# instead would break where it is a stage's received input, a leaf autograd may not change in
# place. Where another alias of the tensor is read after the write (a view made before it), the
# result alone does not carry the draw: the lowering refuses that (partitioner/frontend/randomness.py).
# ``x.bernoulli_(keep)`` with a float keep is the mask of stochastic depth: DropPath and
# StochasticDepth return x unchanged in eval mode, which the traced graph (training mode) cannot
# see, so it becomes ``drop_mask``, which under ``dropout_off`` keeps every sample: it is ``keep``
# where the graph divides the mask by keep (``div_(keep)``: keep / keep is exactly 1), else 1.


def drop_mask(x: torch.Tensor, keep: float, scaled: bool, *, op: str, batch_dim: int | None = 0) -> torch.Tensor:
    """``x.bernoulli_(keep)``, a stochastic-depth mask (Note [in-place random ops]): 1 with
    probability keep in x's shape and dtype; under ``dropout_off`` every sample kept (``keep`` when
    ``scaled``: the graph divides the mask by it)."""
    if _dropout_off:
        return torch.full_like(x, keep if scaled else 1.0)
    return bernoulli(x, keep, op=op, batch_dim=batch_dim)


def uniform(x: torch.Tensor, low: float = 0.0, high: float = 1.0, *, op: str, batch_dim: int | None = 0) -> torch.Tensor:
    """``x.uniform_(low, high)``: U[low, high) of x's shape, in x's dtype (Note [in-place random ops])."""
    u = _uniform_like(x, op=op, batch_dim=batch_dim)
    return (u * (high - low) + low).to(x.dtype)


def normal(x: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, op: str, batch_dim: int | None = 0) -> torch.Tensor:
    """``x.normal_(mean, std)``: N(mean, std²) of x's shape, in x's dtype (Note [in-place random ops])."""
    z = _fill(x.shape, op=op, batch_dim=batch_dim, device=x.device, dtype=torch.float32, normal=True)
    return (z * std + mean).to(x.dtype)


def rand(size, *, op: str, batch_dim: int | None, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """``aten.rand``: U[0, 1) of ``size`` on ``device`` (a stage passes its own: Note [tensors a stage
    makes] in partitioner/codegen/split.py)."""
    out = _fill(size, op=op, batch_dim=batch_dim, device=device, dtype=torch.float32, normal=False)
    return out.to(dtype or torch.get_default_dtype())


def randn(size, *, op: str, batch_dim: int | None, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    out = _fill(size, op=op, batch_dim=batch_dim, device=device, dtype=torch.float32, normal=True)
    return out.to(dtype or torch.get_default_dtype())


def rand_like(x: torch.Tensor, *, op: str, batch_dim: int | None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    out = _fill(x.shape, op=op, batch_dim=batch_dim, device=x.device, dtype=torch.float32, normal=False)
    return out.to(dtype or x.dtype)


def randn_like(x: torch.Tensor, *, op: str, batch_dim: int | None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    out = _fill(x.shape, op=op, batch_dim=batch_dim, device=x.device, dtype=torch.float32, normal=True)
    return out.to(dtype or x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
              enable_gqa: bool = False, op: str, batch_dim: int | None = 0,
              heads: tuple[int, int] | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` whose attention-probability dropout is keyed.

    Without dropout it is torch's fused kernel. With dropout it is the explicit
    softmax(q kᵀ · scale + mask) · v, the dropout mask drawn on the probabilities
    (batch, heads, query, key) like every other keyed op: the fused kernels draw their mask from
    the global generator in an order no other partition can reproduce. ``heads`` = (index, count):
    q, k, v hold the index-th of count equal slices of the heads (a tensor group's rank,
    ``tensor_parallel_attention``): the mask is drawn for all the heads,
    as unsliced, and this slice's rows kept, so each head drops what it drops in the whole model."""
    if dropout_p == 0.0 or _dropout_off:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    length_q, length_k = q.shape[-2], k.shape[-2]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale_factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale_factor
    if is_causal:
        causal = torch.ones(length_q, length_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    probs = torch.softmax(scores, dim=-1)
    if heads is None:
        probs = dropout(probs, dropout_p, True, op=op, batch_dim=batch_dim)
    elif dropout_p >= 1.0:
        probs = probs * 0.0
    else:
        index, count = heads
        whole = [*probs.shape[:-3], probs.shape[-3] * count, *probs.shape[-2:]]
        u = _fill(whole, op=op, batch_dim=batch_dim, device=probs.device, dtype=torch.float32, normal=False)
        keep = u.chunk(count, -3)[index] >= dropout_p
        probs = probs.masked_fill(~keep, 0.0) * (1.0 / (1.0 - dropout_p))
    return probs @ v


def tensor_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                              dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                              enable_gqa: bool = False, op: str, batch_dim: int | None = 0) -> torch.Tensor:
    """``attention`` on a tensor-parallel stage (partitioner/codegen/tp_collectives.py writes it there):
    on each rank's heads, as ``tensor_parallel.attention`` runs torch's kernel. q, k, v split on the
    head dim go in as local tensors, and the keyed mask is drawn for every head and sliced to this
    rank's (``heads``), so each head drops the elements it drops in the one-process model. Run on
    DTensors op by op instead, the explicit softmax-dropout-matmul is slow to dispatch, and its
    backward turns a head split into a strided one that inductor in torch 2.13 cannot make whole
    (``aten._local_scalar_dense`` while tracing the backward: the compiled forward fell back to
    eager)."""
    # lazy: loads torch.distributed.tensor, which only a tensor-parallel stage needs
    from runtime.parallel.tensor_parallel import DTensor, Replicate, Shard, is_dtensor

    if not is_dtensor(q):
        return attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa, op=op,
                         batch_dim=batch_dim)
    mesh = q.device_mesh
    n, i = mesh.size(), mesh.get_local_rank()
    split = [Shard(1)]
    if not all(is_dtensor(t) and list(t.placements) == split for t in (q, k, v)):
        q, k, v = (t.redistribute(mesh, [Replicate()]) if is_dtensor(t) else
                   DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (q, k, v))
        split = [Replicate()]
    mask = attn_mask
    if mask is not None:
        if is_dtensor(mask):
            mask = mask.full_tensor()
        if split != [Replicate()] and mask.dim() == 4 and mask.shape[1] > 1:  # one mask per head
            mask = mask.chunk(n, 1)[i]
    out = attention(q.to_local(), k.to_local(), v.to_local(), mask, dropout_p, is_causal, scale=scale,
                    enable_gqa=enable_gqa, op=op, batch_dim=batch_dim, heads=(i, n) if split != [Replicate()] else None)
    return DTensor.from_local(out, mesh, split, run_check=False)
