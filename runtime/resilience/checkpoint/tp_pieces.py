"""Tensor-parallel pieces in a checkpoint: each rank stores its shard of a split parameter with the
shard's place in the whole, and a reader at any tensor-parallel degree stitches the whole back.

Note [tensor-parallel pieces]: a parameter a tensor group splits (Note [tensor-parallel stages] in
runtime/parallel/tensor_parallel.py) is written by every rank of the group, each its own piece, under the
usual names (``param/<name>``, ``optim/<name>/exp_avg``...) and with shard meta ``tp_pieces``
{name: [dim, start, end, whole size on dim]}; a replicated one is written whole, once (tensor
index 0's data-parallel groups; runtime/resilience/checkpoint/writers.py). A reader first takes the name
from the shard ``choose_shards`` picked, as for any name; if that holds a piece, it reads every
shard listing the name (each verified like any shard), checks that the pieces tile the whole
dimension, and concatenates them (``stitch_tp_pieces``): the loaded checkpoint then holds whole
tensors, which ``restore`` lays out as the live parameter is (``tensor_parallel.from_full``: the
rank's chunk at this run's degree, or the whole at tp 1). So a run written at tp 2 resumes at tp
1, and one written at tp 1 resumes at tp 2, like any reshard by name.
"""

from __future__ import annotations

import torch

from runtime.errors import CheckpointCorruptError
from runtime.parallel.tensor_parallel import local, shard_layout
from runtime.parallel.zero import piece_state

KEYS = ("exp_avg", "exp_avg_sq")


def piece_entries(name: str, param: torch.Tensor, state: dict, tensors: list) -> list | None:
    """Append this rank's piece of a split parameter (and its Adam state) to ``tensors``; returns
    the piece's [dim, start, end, size], or None for a tensor that is not split (the caller writes
    it whole)."""
    layout = shard_layout(param)
    if layout is None:
        return None
    tensors.append((f"param/{name}", local(param).detach()))
    for key in KEYS:
        if key in state:
            tensors.append((f"optim/{name}/{key}", local(state[key]).detach()))
    return [int(v) for v in layout]


def stitch_tp_pieces(loaded, needed: list[str], read: dict, manifest: dict, read_entry, step: int) -> None:
    """Make every needed name that was written in pieces whole in ``loaded`` (Note [tensor-parallel
    pieces]). ``read``: rank -> (tensors, meta) of the shards read so far (extended here);
    ``read_entry(entry)``: a verified read of one more shard."""
    if not any((meta.get("tp_pieces") or {}) for _t, meta in read.values()):
        return
    for name in needed:
        holders = [e for e in sorted(manifest["shards"], key=lambda e: e["rank"]) if name in e["params"]]
        pieces = []
        for entry in holders:
            if entry["rank"] not in read:
                read[entry["rank"]] = read_entry(entry)
            tensors, meta = read[entry["rank"]]
            span = (meta.get("tp_pieces") or {}).get(name)
            if span is not None and f"param/{name}" in tensors:
                pieces.append((tuple(span), tensors))
        if not pieces:
            continue
        dim, size = pieces[0][0][0], pieces[0][0][3]
        unique = {}
        for span, tensors in pieces:
            if span[0] != dim or span[3] != size:
                raise CheckpointCorruptError(f"checkpoint step {step}: the pieces of {name!r} disagree on their "
                                             f"layout ({pieces[0][0]} and {span})")
            unique.setdefault(span[1], (span, tensors))
        covered, parts = 0, []
        for start in sorted(unique):
            span, tensors = unique[start]
            if start != covered:
                break
            parts.append(tensors)
            covered = span[2]
        if covered != size:
            raise CheckpointCorruptError(f"checkpoint step {step}: the tensor-parallel pieces of {name!r} cover "
                                         f"[0, {covered}) of its {size} rows on dim {dim} (a shard is missing)")
        loaded.params[name] = torch.cat([t[f"param/{name}"] for t in parts], dim)
        state = {key: torch.cat([t[f"optim/{name}/{key}"] for t in parts], dim)
                 for key in KEYS if all(f"optim/{name}/{key}" in t for t in parts)}
        if state:
            loaded.optim[name] = state


# Note [sharded state with tensor parallelism]: with ZeRO-1 (runtime/parallel/zero.py) and tp > 1, each tensor
# index's data-parallel group shards the optimizer state of its own local tensors: a split
# parameter's shard is flattened, and each replica owns a range of it. Such a piece is stored
# under ``optim_tp_shard/<name>/<key>`` with shard meta ``optim_tp_pieces`` {name: [start, end,
# dim, shard start, shard end, whole size, *shard shape]}: both layouts, the ZeRO range within the
# tensor-parallel piece. A replicated parameter's pieces are the usual ``optim_shard`` ones (its
# local tensor is the whole). A reader stitches the ZeRO ranges of each tensor-parallel piece,
# then the pieces along their dim (``stitch_sharded_tp_state``): the loaded state is whole, and
# ``restore`` lays it out at the live degrees (runtime/parallel/zero.py ``restore``, or the unsharded path),
# so tp 2 x dp 2 resumes at tp 1, at dp 1 or unsharded, by name.


def stitch_sharded_tp_state(loaded, needed: list[str], read: dict, manifest: dict, read_entry, step: int) -> None:
    """Whole Adam state in ``loaded.optim`` for every needed name whose state was written as
    tensor-parallel ZeRO pieces (Note [sharded state with tensor parallelism]): every shard of the
    stages holding the name is read (verified like any shard) for its pieces."""
    if not any((meta.get("optim_tp_pieces") or {}) for _t, meta in read.values()):
        return
    entries = sorted(manifest["shards"], key=lambda e: e["rank"])
    for name in needed:
        if name in loaded.optim:
            continue
        stages = {tuple(e["stages"]) for e in entries if name in e["params"]}
        for entry in entries:
            if tuple(entry["stages"]) in stages and entry["rank"] not in read:
                read[entry["rank"]] = read_entry(entry)
        by_shard: dict[tuple, list] = {}  # (dim, shard start, shard end, size, shape) -> ZeRO pieces
        for rank in sorted(read):
            tensors, meta = read[rank]
            span = (meta.get("optim_tp_pieces") or {}).get(name)
            if span is None:
                continue
            start, end, dim, lo, hi, size, *shape = (int(v) for v in span)
            st = {k: tensors[f"optim_tp_shard/{name}/{k}"] for k in KEYS if f"optim_tp_shard/{name}/{k}" in tensors}
            if st:
                by_shard.setdefault((dim, lo, hi, size, tuple(shape)), []).append((start, end, st))
            if name in meta.get("param_steps", {}):
                loaded.param_steps[name] = meta["param_steps"][name]
        if not by_shard:
            continue
        dims = {(k[0], k[3]) for k in by_shard}
        if len(dims) > 1:
            raise CheckpointCorruptError(f"checkpoint step {step}: the pieces of {name!r} disagree on their "
                                         f"tensor-parallel layout ({sorted(dims)})")
        parts, covered = [], 0
        for key in sorted(by_shard, key=lambda k: k[1]):
            dim, lo, hi, size, shape = key
            if lo != covered:
                break
            numel = 1
            for n in shape:
                numel *= n
            st = piece_state(name, 0, numel, {}, {name: by_shard[key]})  # raises on a gap
            parts.append({k: v.reshape(shape) for k, v in st.items()})
            covered = hi
        dim, size = next(iter(dims))
        if covered != size:
            raise CheckpointCorruptError(f"checkpoint step {step}: the sharded optimizer state of {name!r} covers "
                                         f"[0, {covered}) of its {size} rows on dim {dim} (a shard is missing)")
        loaded.optim[name] = {k: torch.cat([p[k] for p in parts], dim) for k in parts[0]}
