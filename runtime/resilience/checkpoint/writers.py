"""Which rank writes each name of a disk checkpoint.

Note [one writer per byte]: the replicas of a data-parallel group hold bit-identical parameters,
optimizer state and mutable buffers (gradients are all-reduced, buffers broadcast from replica 0:
Note [buffers across replicas]), so writing them once per replica writes every byte dp times.
Each name is written by exactly one rank of each data-parallel group (the ranks holding the same
stages, ``Layout.dp_groups``); the writers are spread so that every rank writes about the same
number of bytes (largest name first, to the replica that has written least so far: LPT, within 4/3
of the best split). Every rank still writes its own shard with its RNG states and meta, so the
manifest keeps one entry per rank; its "params" and "buffers" list what that shard holds, which is
all a reader looks at (``runtime.resilience.checkpoint.load.choose_shards`` takes each name from the shard
holding it: the same path as a reshard). A tie (a parameter on several stages) is written once per
group that holds it, as before. The disk tier must therefore be one filesystem every rank reads
(as a reshard already needs); the memory tier keeps each rank's whole state (runtime/resilience/memtier/).

Sharded state (one owner per shard) needs no choice: ``assign_writers`` is the one place that
picks among replicas, so a name held by one rank only is simply written by it.
"""

from __future__ import annotations

from runtime.program.spec import Program

# AdamW keeps two tensors of a parameter's shape beside it (runtime/resilience/checkpoint/state.py writes
# exp_avg and exp_avg_sq): what a parameter costs to write, in units of its own bytes.
PARAM_WRITE_FACTOR = 3


def assign_writers(holders: dict[str, tuple[int, ...]], nbytes: dict[str, int],
                   load: dict[int, int] | None = None) -> dict[str, int]:
    """{name: the rank that writes it}, each name to one of its ``holders``: names by decreasing
    ``nbytes`` (then by name), each to the holder with the fewest bytes assigned so far (then the
    lowest rank). ``load`` (rank -> bytes already assigned) is updated in place."""
    load = {} if load is None else load
    out: dict[str, int] = {}
    for name in sorted(holders, key=lambda n: (-nbytes.get(n, 0), n)):
        ranks = sorted(holders[name])
        if not ranks:
            raise ValueError(f"{name!r} has no rank holding it")
        writer = min(ranks, key=lambda r: (load.get(r, 0), r))
        out[name] = writer
        load[writer] = load.get(writer, 0) + nbytes.get(name, 0)
    return out


def state_names_of_group(program: Program, stages) -> list[str]:
    """The names a rank holding ``stages`` checkpoints: parameters, then mutable buffers."""
    names = program.params_of(stages)
    return list(dict.fromkeys(names + [n for k in sorted(stages) for n in program.stages[k].mutable_buffers]))


def writes_of_ranks(program: Program, nbytes: dict[str, int]) -> dict[int, frozenset[str]]:
    """rank -> the names its shard holds (Note [one writer per byte]), for every rank of
    ``program``; ``nbytes``: what writing each name costs (``write_cost``)."""
    layout = program.layout
    load: dict[int, int] = {}
    writes: dict[int, set[str]] = {r: set() for r in range(program.world_size)}
    for group in layout.dp_groups:
        stages = layout.stages_of_rank[group[0]]
        names = state_names_of_group(program, stages)
        if layout.tp_index_of_rank and layout.tp_index_of_rank[group[0]] > 0:
            # a split parameter: every tensor rank writes its piece; the rest once, by tensor index 0
            # (Note [tensor-parallel pieces] in runtime/resilience/checkpoint/tp_pieces.py)
            names = [n for n in names if n in (program.tp_sharded or {})]
        for name, rank in assign_writers({n: tuple(group) for n in names}, nbytes, load).items():
            writes[rank].add(name)
    return {r: frozenset(w) for r, w in writes.items()}


def all_names(program: Program) -> list[str]:
    """Every name any rank checkpoints, sorted: the index of the size exchange."""
    return sorted({n for k in range(program.num_stages) for n in state_names_of_group(program, [k])})


def write_cost(trainer) -> dict[str, int]:
    """What writing each of ``trainer``'s names costs in bytes (a parameter with its optimizer
    state, a mutable buffer)."""
    out = {name: int(p.numel() * p.element_size()) * PARAM_WRITE_FACTOR
           for name, p in trainer.named_parameters().items()}
    for name, b in trainer.named_mutable_buffers().items():
        out.setdefault(name, int(b.numel() * b.element_size()))
    return out


def balance(writes: dict[int, frozenset[str]], nbytes: dict[str, int]) -> dict:
    """Bytes each rank writes, and max / mean (1.0 is a perfect spread)."""
    per_rank = {r: sum(nbytes.get(n, 0) for n in names) for r, names in sorted(writes.items())}
    mean = sum(per_rank.values()) / max(1, len(per_rank))
    return {"bytes_per_rank": per_rank, "max_over_mean": (max(per_rank.values()) / mean) if mean else 1.0}
