"""Optimizer state sharded over the data-parallel replicas (ZeRO stage 1).

Note [sharded optimizer state]: the replicas of a stage hold the same parameters, so each need
only update a 1/dp slice. A rank's trained parameters are laid end to end in one flat fp32 index
space padded to a multiple of dp, replica r owning the r-th slice (a parameter cut by a boundary
has a piece on each side). AdamW is elementwise, so AdamW over the pieces is AdamW over the whole,
bit for bit. Each step the flat gradient is reduce-scattered (each replica gets its slice,
averaged), the global norm counts each slice (Note [global gradient norm]), the optimizer steps
the pieces, and the updated slices are all-gathered back. Under NCCL that moves the bytes of the
all-reduce it replaces and the AdamW state shrinks by dp. Gloo's reduce-scatter is slower than
its all-reduce (48 against 29 ms on 900k elements over 2 ranks here), so on gloo the first step
is the all-reduce and sharding costs one all-gather more (priced so: Note [sharding as a
candidate] in partitioner/solver/zero_choice.py).

Built on torch.distributed's collectives (reduce_scatter_tensor / all_gather_into_tensor), not
FSDP2's fully_shard: FSDP2 shards the parameters themselves (ZeRO-3) and all-gathers them before
every forward of every microbatch, which a pipeline stage running m microbatches would pay m
times; its reshard_after_forward=False mode keeps them gathered, i.e. ZeRO-2, but its sharded
gradients then need the per-microbatch reduce-scatter that pipelining's gradient accumulation
does not do. Stage 1 on plain collectives keeps the stage modules plain nn.Modules, so the
pipelining schedule, recompute and the stage files are unchanged. ZeRO-2 (gradients sharded
during accumulation) is not built.

With tensor parallelism a parameter is a DTensor and its *local* tensor is what this rank holds
and what its data-parallel group (the replicas of the same tensor index) shares: the flat space
is of the local tensors, the pieces are views of them, and the collectives run on each tensor
index's data-parallel group (Note [sharded state with tensor parallelism] in
runtime/resilience/checkpoint/tp_pieces.py says how such pieces are checkpointed).

Checkpoints store each piece once, by original name, with its range in the flattened parameter
(``optim_shard/<name>/<key>`` tensors and meta ``optim_pieces``: {name: [start, end]}); a reader
at any dp degree, sharded or not, stitches the pieces it needs (``piece_state``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.errors import CheckpointCorruptError
from runtime.parallel.tensor_parallel import from_full, local, shard_layout

# torch 2.13 renamed them (the old names warn); the same collectives.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Piece:
    name: str
    start: int  # elements of the flattened parameter
    end: int
    flat_offset: int  # where the piece starts in this replica's slice


def layout(names: list[str], numels: list[int], dp: int, replica: int) -> tuple[list[Piece], int, int]:
    """(this replica's pieces, slice length L, padded total dp·L) of the flat index space."""
    total = sum(numels)
    length = max(1, -(-total // dp))
    lo, hi = replica * length, (replica + 1) * length
    pieces, offset = [], 0
    for name, n in zip(names, numels):
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            pieces.append(Piece(name, a - offset, b - offset, a - lo))
        offset += n
    return pieces, length, length * dp


class ShardedOptimizer:
    """The rank's AdamW over its pieces, and the collectives of Note [sharded optimizer state]."""

    def __init__(self, named: dict[str, list[torch.nn.Parameter]], cfg, *, dp: int, replica: int, group,
                 make_optimizer, device: torch.device):
        """``make_optimizer(params, cfg, names)``: runtime/execute/train.py's (passed in: train imports this).
        ``device``: the rank's; the flat buffers go to the data-parallel group's collectives on it,
        also when this rank trains no parameter."""
        self.named = named  # name -> every copy of it on this rank (a tie on one rank: two)
        self.names = list(named)
        # a DTensor's local shard (Note [sharded state with tensor parallelism]); else the parameter
        first = [local(named[n][0]) for n in self.names]
        dtypes = {p.dtype for p in first}
        if len(dtypes) > 1:
            raise ValueError(f"sharded optimizer state needs one parameter dtype per rank, got "
                             f"{sorted(map(str, dtypes))}: compile with --shard-optimizer off")
        self.dp, self.replica, self.group = dp, replica, group
        self.numels = [p.numel() for p in first]
        self.pieces, self.length, self.padded = layout(self.names, self.numels, dp, replica)
        self.device = first[0].device if first else device
        self.dtype = first[0].dtype if first else torch.float32
        # Each piece is a view of its parameter's own storage (no master copy: the fp32
        # parameters are the master weights, Note [mixed precision]); the optimizer updates this
        # replica's slice in place and the all-gather fills in the others'.
        self.masters = [torch.nn.Parameter(local(named[pc.name][0]).data.view(-1)[pc.start:pc.end])
                        for pc in self.pieces]
        self.optimizer, self.lr_scheduler = make_optimizer(self.masters, cfg, [pc.name for pc in self.pieces])
        self.gloo = group is not None and dist.get_backend(group) == "gloo"

    # -- the step ------------------------------------------------------------------------------

    def reduce_scatter_grads(self) -> list[torch.Tensor]:
        """Step 1: each piece's .grad = its slice of the replicas' averaged gradient."""
        grads = []
        for n in self.names:
            p = local(self.named[n][0])
            g = self.named[n][0].grad
            grads.append((local(g) if g is not None else torch.zeros_like(p)).reshape(-1))
        pad = self.padded - sum(self.numels)
        flat = torch.cat(grads + ([torch.zeros(pad, dtype=self.dtype, device=self.device)] if pad else []))
        if self.group is None:
            mine = flat[self.replica * self.length:(self.replica + 1) * self.length]
        elif self.gloo:  # gloo's all-reduce beats its reduce-scatter (see the Note)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            mine = flat[self.replica * self.length:(self.replica + 1) * self.length]
        else:
            mine = torch.empty(self.length, dtype=self.dtype, device=self.device)
            _REDUCE_SCATTER(mine, flat, op=dist.ReduceOp.SUM, group=self.group)
        if self.dp != 1:
            mine = mine / self.dp
        for pc, master in zip(self.pieces, self.masters):
            master.grad = mine[pc.flat_offset:pc.flat_offset + pc.end - pc.start].clone()
        for n in self.names:
            for p in self.named[n]:
                p.grad = None  # the full gradient is no longer needed
        return [m.grad for m in self.masters]

    def owned_grads(self, owned_names: set[str], tp_index: int = 0) -> list[torch.Tensor]:
        """The piece gradients this rank counts in the global norm: of its owned names, and with
        tensor parallelism a replicated parameter's on tensor index 0 only (its other tensor
        ranks hold the same pieces)."""
        return [m.grad for pc, m in zip(self.pieces, self.masters) if pc.name in owned_names
                and (tp_index == 0 or shard_layout(self.named[pc.name][0]) is not None)]

    def step(self, take: bool) -> None:
        """Steps 2-3: the optimizer over the pieces (unless the step is skipped), then the
        all-gather of the slices into the full parameters (skipped steps leave them as they are)."""
        if take:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if take:
            self.all_gather_params()

    def all_gather_params(self) -> None:
        with torch.no_grad():
            mine = torch.zeros(self.length, dtype=self.dtype, device=self.device)
            for pc, master in zip(self.pieces, self.masters):
                mine[pc.flat_offset:pc.flat_offset + pc.end - pc.start].copy_(master)
            if self.group is None:
                full = mine
            else:
                full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
                _ALL_GATHER(full, mine, group=self.group)
            offset = 0
            for n, numel in zip(self.names, self.numels):
                for p in self.named[n]:
                    local(p).view(-1).copy_(full[offset:offset + numel])
                offset += numel

    # -- checkpoints ----------------------------------------------------------------------------

    def state_entries(self) -> tuple[list[tuple[str, torch.Tensor]], dict, dict, dict]:
        """(tensors optim_shard/<name>/<key>, meta optim_pieces {name: [start, end]}, param_steps,
        meta optim_tp_pieces). A piece of a tensor-parallel split parameter is of that rank's
        shard, not of the whole: it goes under optim_tp_shard/<name>/<key> with optim_tp_pieces
        {name: [start, end, dim, shard start, shard end, whole size, *shard shape]} (Note [sharded
        state with tensor parallelism])."""
        tensors, pieces, steps, tp_pieces = [], {}, {}, {}
        for pc, master in zip(self.pieces, self.masters):
            st = self.optimizer.state.get(master, {})
            live = self.named[pc.name][0]
            layout = shard_layout(live)
            prefix = "optim_shard" if layout is None else "optim_tp_shard"
            if layout is None:
                pieces[pc.name] = [pc.start, pc.end]
            else:
                tp_pieces[pc.name] = [pc.start, pc.end, *layout, *local(live).shape]
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors.append((f"{prefix}/{pc.name}/{key}", st[key].detach()))
            if "step" in st:
                steps[pc.name] = float(st["step"])
        return tensors, pieces, steps, tp_pieces

    def final_entries(self, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
        """This rank's pieces of AdamW state for ``final/optim_rank_<r>``: tensors added under the
        checkpoint's names (optim_shard/<name>/<key>, optim_tp_shard/... for a split parameter's
        shard), returning (optim_pieces, param_steps, optim_tp_pieces) as ``state_entries`` does."""
        more, pieces, steps, tp_pieces = self.state_entries()
        tensors.update((name, t.cpu().clone()) for name, t in more)
        return pieces, steps, tp_pieces

    def restore(self, params: dict[str, torch.Tensor], full_optim: dict, pieces: dict, param_steps: dict) -> None:
        """Fill the masters from the loaded parameters and each piece's Adam state from whatever
        the checkpoint holds (full state by name, or pieces: ``piece_state``). A loaded tensor is
        whole; a split parameter takes this rank's shard of it first (``from_full``), whose
        flattening the pieces index."""
        def mine(name, whole):
            return local(from_full(self.named[name][0], whole))

        wholes: dict[str, dict | None] = {}

        def whole_state(name):  # a split parameter's whole state: by name, or stitched from whole-tensor pieces
            if name not in wholes:
                live = self.named[name][0]
                wholes[name] = full_optim.get(name) or (
                    full_state(name, live.numel(), live.shape, {}, pieces) if shard_layout(live) is not None else None)
            return wholes[name]

        with torch.no_grad():
            for pc, master in zip(self.pieces, self.masters):
                master.copy_(mine(pc.name, params[pc.name]).reshape(-1)[pc.start:pc.end].to(master.device))
                whole = whole_state(pc.name)
                full = {} if whole is None else {pc.name: {k: mine(pc.name, v) for k, v in whole.items()}}
                st = piece_state(pc.name, pc.start, pc.end, full, pieces)
                if st is None:
                    continue
                new = {k: v.to(master.device, master.dtype).clone() for k, v in st.items()}
                if pc.name in param_steps:
                    new["step"] = adam_step(param_steps[pc.name], master, self.optimizer)
                self.optimizer.state[master] = new


def adam_step(value: float, param: torch.Tensor, optimizer) -> torch.Tensor:
    """A restored AdamW ``step`` where torch keeps it: on the parameter's device for the fused and
    capturable kernels (the fused CUDA kernel reads it there; a CPU one is an illegal memory
    access), on the CPU otherwise (torch's adam.py ``_init_group``, ``Optimizer.load_state_dict``)."""
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    return torch.tensor(value, dtype=torch.float32, device=param.device if on_device else torch.device("cpu"))


def piece_state(name: str, start: int, end: int, full_optim: dict, pieces: dict) -> dict | None:
    """Elements [start, end) of the flattened Adam state of ``name``: from a full tensor
    (``full_optim[name][key]``) or stitched from saved pieces (``pieces[name]``: a list of
    (start, end, {key: 1-D tensor})). None when the checkpoint holds no state for it (a step 0
    checkpoint); CheckpointCorruptError when the pieces leave a gap."""
    if name in full_optim:
        return {k: v.reshape(-1)[start:end] for k, v in full_optim[name].items()}
    saved = sorted(pieces.get(name, ()), key=lambda t: t[0])
    if not saved:
        return None
    keys = set(saved[0][2])
    out = {k: torch.empty(end - start, dtype=saved[0][2][k].dtype) for k in keys}
    covered = start
    for a, b, st in saved:
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            continue
        if lo > covered:
            break
        for k in keys:
            out[k][lo - start:hi - start] = st[k][lo - a:hi - a]
        covered = max(covered, hi)
    if covered < end:
        raise CheckpointCorruptError(f"the checkpoint's optimizer pieces of {name!r} cover elements up to "
                                     f"{covered}, but [{start}, {end}) is needed: a shard is missing")
    return out


def full_state(name: str, numel: int, shape, full_optim: dict, pieces: dict) -> dict | None:
    """The whole Adam state of ``name`` (for an unsharded trainer), shaped like the parameter."""
    st = piece_state(name, 0, numel, full_optim, pieces)
    return None if st is None else {k: v.reshape(shape) for k, v in st.items()}
