"""Recovery at start-up, from the fastest tier that survived: the memory tier (a rank's own slot,
else a peer's copy or a rebuild from parity), else the disk (docs/design.md §7), with every rank
agreeing on the step before any restores. The tiers' writers are runtime/resilience/memtier/ and
runtime/resilience/checkpoint/; this room only chooses, fetches, verifies and restores.

Note [recovery agreement]: at start-up each rank lists the checkpoints, verifies the manifest and
the shards it would read (sha256), and all-gathers the steps valid for it; every rank restores
the newest step valid for all, so all ranks resume from the same step. Corrupt or partial
checkpoints are skipped with a warning naming them; rank 0 renames the ones newer than the chosen
step to discarded_step_N, so the steps about to be re-trained write into clean directories;
the Checkpointer removes those (and unfinished *.tmp) before its first persist
(``runtime.resilience.checkpoint.clean_debris``), so a full disk does not crash-loop on them. A malformed
manifest counts as a corrupt one (Note [manifest schema] in runtime/resilience/checkpoint/manifest.py), and
``restore`` refuses a tensor whose shape or dtype differs from the live one before copying any.

Note [memory recovery]: each rank lists the committed slots of its host folder (records only, no
hashing yet) and the newest committed disk manifest; all-gather. Every rank then computes the same
choice: the newest step s for which every rank r has a tier, in order own memory, then the peer
copy (mode copy) or a reconstruction from parity (every other member of r's group holds own slot s
and parity s), and no older than the newest disk checkpoint. The ranks verify what they use
(sha256 of the own slot, of the received copy, of the reconstruction, of the parity) and parse
what they would restore (its meta names the step, rank and plan; a malformed slot counts as
absent), all-reduce the failures, and on any failure exclude that (rank, step, tier) and choose again; no rank restores
before every rank has verified. With no such step the disk tier recovers (``recover``). Slots
newer than the resumed step are then invalidated. Every rank logs "recovered step N from tier=T in
X ms" and appends it to RUN_DIR/recovery.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from runtime.parallel.control import control_group
from runtime.resilience import checkpoint as ck
from runtime.resilience.faults import attempt, say
from runtime.resilience.memtier.groups import Redundancy
from runtime.resilience.memtier.parity import reconstruct, survivor_piece

if TYPE_CHECKING:
    from runtime.resilience.memtier.tier import MemoryTier

TIERS = ("memory", "peer", "parity", "disk")  # what RecoveryResult.tier says (and recovery.jsonl: "none" when nothing)
_MAX_ROUNDS = 6

# ---------------------------------------------------------------------------------------------
# The disk tier (Note [recovery agreement])


def recover(trainer, ckpt_dir: str, *, not_after: int | None = None) -> int:
    """Restore the newest checkpoint valid on every rank into ``trainer``; returns the step to
    start at (0 when there is none). Collective over the world, on the control group (Note [the
    control group] in runtime/parallel/control.py: the steps are host integers).
    ``not_after``: only checkpoints of that step or older (a rollback, runtime/resilience/sdc.py)."""
    program, rank = trainer.program, trainer.rank
    needed = ck.needed_names(trainer)
    valid, newest = valid_for(trainer, ckpt_dir, warn=lambda msg: say(rank, "warning: " + msg))
    if not_after is not None:
        valid = [s for s in valid if s <= not_after]
    mine = torch.full((ck.RESUME_CANDIDATES,), -1, dtype=torch.int64, device="cpu")
    mine[:len(valid)] = torch.tensor(valid, dtype=torch.int64, device="cpu")
    group = control_group()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine, group=group)
    chosen = agree_newest([[int(s) for s in g.tolist() if s >= 0] for g in gathered])
    if chosen is None:
        if rank == 0 and ck.list_step_dirs(ckpt_dir):
            say(rank, f"warning: no valid checkpoint in {ckpt_dir}: starting from step 0")
        _discard_newer(ckpt_dir, -1, rank)
        return 0
    if newest is None or newest.step != chosen:
        newest = ck.load_for_rank(ckpt_dir, chosen, program, rank, needed)
    ck.restore(trainer, newest)
    if rank == 0:
        m = newest.manifest
        how = "same plan" if m.get("plan_hash") == program.plan_hash else (
            f"resharded from plan {m.get('plan_hash')} ({m.get('num_stages')} stages x dp {m.get('dp')}, "
            f"{m.get('world_size')} ranks)")
        say(rank, f"resuming from checkpoint {os.path.join(ckpt_dir, ck.step_dirname(chosen))} "
                   f"at step {chosen} ({how})")
    _discard_newer(ckpt_dir, chosen, rank)
    return chosen


def valid_for(trainer, ckpt_dir: str, *, warn=None) -> tuple[list[int], ck.LoadedCheckpoint | None]:
    """The checkpoints this rank could restore, newest first, and the newest loaded: verified,
    parsed and checked against the live trainer before the ranks agree (Note [valid means
    restorable] in runtime/resilience/checkpoint/validate.py)."""
    return ck.find_valid(ckpt_dir, trainer.program, trainer.rank, ck.needed_names(trainer), warn=warn,
                         limit=ck.RESUME_CANDIDATES, check=lambda loaded: ck.check_restorable(trainer, loaded))


def agree_newest(valid_per_rank: list[list[int]]) -> int | None:
    """The newest step every rank found valid (Note [recovery agreement]); None if there is none."""
    common = set.intersection(*(set(v) for v in valid_per_rank)) if valid_per_rank else set()
    return max(common) if common else None


def set_aside_newer(ckpt_dir: str, step: int, rank: int) -> None:
    """Rank 0: move every checkpoint newer than ``step`` to discarded_step_N (an exclusion's,
    Note [excluding a host] in runtime/resilience/exclusion.py)."""
    _discard_newer(ckpt_dir, step, rank)


def _discard_newer(ckpt_dir: str, chosen: int, rank: int) -> None:
    if rank != 0:
        return
    for step in ck.list_step_dirs(ckpt_dir):
        if step > chosen:
            src = os.path.join(ckpt_dir, ck.step_dirname(step))
            dst = os.path.join(ckpt_dir, "discarded_" + ck.step_dirname(step))
            if os.path.islink(dst):  # planted: the link itself goes, never what it points at (Note [files are not trusted])
                os.unlink(dst)
            else:
                shutil.rmtree(dst, ignore_errors=True)
            os.replace(src, dst)
            say(rank, f"moved {src} (newer than the resume step, not valid on every rank) to {dst}")
    if os.path.isdir(ckpt_dir):
        ck.fsync_dir(ckpt_dir)


# ---------------------------------------------------------------------------------------------
# The memory tier (Note [memory recovery]): the choice (pure), then the distributed fetch


def choose_step(own: list[dict], held: list[dict], red: Redundancy, excluded: set, *,
                not_before: int = -1) -> tuple[int, dict[int, str]] | None:
    """The newest step every rank can restore from memory (own slot, else peer copy, else parity),
    skipping (rank, step, tier) in ``excluded``; (step, {rank: tier}) or None."""
    world = len(own)
    steps = sorted({s for o in own for s in o}, reverse=True)
    for s in steps:
        if s < not_before:
            break
        tiers: dict[int, str] = {}
        for r in range(world):
            if s in own[r] and (r, s, "memory") not in excluded:
                tiers[r] = "memory"
                continue
            if red.mode == "copy":
                h = red.holder_of(r)
                if h is not None and s in held[h] and (r, s, "peer") not in excluded:
                    tiers[r] = "peer"
                    continue
            if red.mode == "parity" and red.protected(r) and (r, s, "parity") not in excluded:
                others = [m for m in red.group_of(r) if m != r]
                if all(s in own[m] and s in held[m] and (m, s, "memory") not in excluded for m in others) \
                        and len({held[m][s] for m in others}) == 1:
                    tiers[r] = "parity"
                    continue
            break
        else:
            return s, tiers
    return None


def why_not(own: list[dict], held: list[dict], red: Redundancy, newest: int | None) -> str:
    """Why no memory step was chosen, for the log line."""
    if not any(own) and not any(held):
        return "no committed memory snapshot on any host"
    if newest is None:
        return "no step every rank can restore from memory"
    lost = [r for r in range(len(own)) if newest not in own[r]]
    parts = []
    for r in lost:
        if red.mode == "copy":
            h = red.holder_of(r)
            parts.append(f"rank {r}: no own snapshot of step {newest}, "
                         + (f"no peer copy on rank {h}" if h is not None else "no peer (one host)"))
        elif red.mode == "parity" and red.protected(r):
            g = red.group_of(r)
            missing = [m for m in g if newest not in own[m]]
            parts.append(f"rank {r}: parity group {list(g)} lost {len(missing)} members ({missing}) at step {newest}"
                         if len(missing) > 1 else f"rank {r}: parity of step {newest} incomplete")
        else:
            parts.append(f"rank {r}: no own snapshot of step {newest} and no redundancy")
    return f"no step every rank can restore from memory ({'; '.join(parts) or 'slots failed verification'})"


@dataclass
class RecoveryResult:
    step: int
    tier: str                   # this rank's tier
    tiers: dict[int, str]
    seconds: float
    rounds: int
    failures: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)  # milliseconds per phase (what the time went to)


def recover_memory(tier: MemoryTier, ckpt_dir: str) -> RecoveryResult | None:
    """Restore the newest step every rank can restore from memory; None (nothing restored)
    when there is none, or when the disk holds a newer checkpoint."""
    t0 = time.perf_counter()
    inv = tier.store.inventory()
    disk_newest = ck.newest_committed(ckpt_dir)
    row = torch.full((9,), -1, dtype=torch.int64)
    for j, (s, b) in enumerate(sorted(inv["own"].items())[-2:]):
        row[2 * j], row[2 * j + 1] = s, b
    for j, (s, a) in enumerate(sorted(inv["held"].items())[-2:]):
        row[4 + 2 * j], row[5 + 2 * j] = s, a
    row[8] = disk_newest
    rows = [torch.zeros_like(row) for _ in range(tier.world)]
    dist.all_gather(rows, row, group=tier.group)
    phases = {"inventory_ms": (time.perf_counter() - t0) * 1e3}
    if tier.lost_marker and tier.rank == min(r for r, h in enumerate(tier.red.hosts)
                                              if h == tier.red.hosts[tier.rank]):
        # every rank of this host has wiped before the gather above: the marker has done its job
        try:
            os.unlink(tier.lost_marker)
        except FileNotFoundError:
            pass
    own = [{int(t[2 * j]): int(t[2 * j + 1]) for j in range(2) if int(t[2 * j]) >= 0} for t in rows]
    held = [{int(t[4 + 2 * j]): int(t[5 + 2 * j]) for j in range(2) if int(t[4 + 2 * j]) >= 0} for t in rows]
    disk = max(int(t[8]) for t in rows)
    excluded: set = set()
    failures: list = []
    for rounds in range(1, _MAX_ROUNDS + 1):
        choice = choose_step(own, held, tier.red, excluded, not_before=max(disk, 1))
        if choice is None:
            newest = max((s for o in own for s in o), default=None)
            if tier.rank == 0 and (any(own) or any(held)):
                reason = why_not(own, held, tier.red, newest)
                if newest is not None and disk >= newest and not failures:
                    reason = f"the disk holds step {disk}, as new as memory's newest ({newest})"
                if failures:
                    reason += "; failed verification: " + ", ".join(f"rank {r} step {s} tier {t}"
                                                                     for r, s, t in failures)
                say(0, f"memory tier: {reason}: recovering from disk")
            return None
        step, tiers = choice
        t1 = time.perf_counter()
        loaded, bad = _fetch(tier, step, tiers, own, held)
        phases["fetch_verify_ms"] = phases.get("fetch_verify_ms", 0.0) + (time.perf_counter() - t1) * 1e3
        t1 = time.perf_counter()
        flags = torch.zeros(tier.world, dtype=torch.int64)
        for r in bad:
            flags[r] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=tier.group)
        phases["agree_ms"] = phases.get("agree_ms", 0.0) + (time.perf_counter() - t1) * 1e3
        failed = [r for r in range(tier.world) if int(flags[r])]
        if not failed:
            break
        for r in failed:
            excluded.add((r, step, tiers[r]))
            failures.append((r, step, tiers[r]))
            if tier.rank == 0:
                say(0, f"memory tier: rank {r}'s step {step} from tier={tiers[r]} failed verification; "
                       "trying the next tier")
    else:
        return None
    t1 = time.perf_counter()
    ck.restore(tier.trainer, loaded)
    phases["restore_ms"] = (time.perf_counter() - t1) * 1e3
    tier.store.invalidate_newer(step)
    dist.barrier(group=tier.group)
    tier.recovery = RecoveryResult(step, tiers[tier.rank], tiers, time.perf_counter() - t0, rounds, failures,
                                   {k: round(v, 2) for k, v in phases.items()})
    return tier.recovery


def _fetch(tier: MemoryTier, step: int, tiers: dict[int, str], own: list[dict], held: list[dict]):
    """This rank's shard of ``step`` by its tier, verified and parsed (a LoadedCheckpoint), and the
    ranks whose tier failed here (every rank takes part in every transfer the choice implies, in
    one fixed order). Parsing comes before the ranks agree, so a slot whose meta is wrong fails
    here and the choice moves on (Note [memory recovery])."""
    red, me = tier.red, tier.rank
    bad: set[int] = set()
    mine = None
    if tiers[me] == "memory":
        found = tier.store.find(tier.store.own, step)
        mine = found[0].verify(found[1]) if found else None
        if mine is None:
            bad.add(me)
    sends, recvs = [], []
    # copies: holder -> owner (a 33-int64 header: bytes, sha256; then the bytes)
    for r in sorted(t for t, tier in tiers.items() if tier == "peer"):
        h = red.holder_of(r)
        if me == h:
            found = tier.store.find(tier.store.held, step)
            rec = found[1] if found else {"bytes": held[h].get(step, 0), "sha256": "00" * 32}
            n = int(rec["bytes"])
            data = found[0].read(n) if found else memoryview(bytearray(n))
            head = torch.tensor([n] + list(bytes.fromhex(rec["sha256"])), dtype=torch.int64)
            sends.append(dist.isend(head, dst=r, group=tier.group, tag=11))
            sends.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8)
                                    if n else torch.zeros(0, dtype=torch.uint8), dst=r, group=tier.group, tag=12))
        if me == r:
            n = held[h][step]
            head = torch.zeros(33, dtype=torch.int64)
            buf = torch.empty(n, dtype=torch.uint8)
            recvs.append(("peer", dist.irecv(head, src=h, group=tier.group, tag=11), head, buf))
            recvs.append(("peer-data", dist.irecv(buf, src=h, group=tier.group, tag=12), head, buf))
    # parity: every survivor -> the lost member (33-int64 header from its parity record, then its piece)
    pieces: list = []
    for r in sorted(t for t, tier in tiers.items() if tier == "parity"):
        g = red.group_of(r)
        lost = g.index(r)
        survivors = [m for m in g if m != r]
        c = held[survivors[0]][step]
        if me in survivors:
            i = g.index(me)
            piece, head_vals = _survivor_piece(tier, step, g, i, lost, c, r, bad)
            sends.append(dist.isend(torch.tensor(head_vals, dtype=torch.int64), dst=r, group=tier.group, tag=21))
            sends.append(dist.isend(piece, dst=r, group=tier.group, tag=22))
        if me == r:
            for m in survivors:
                head = torch.zeros(33, dtype=torch.int64)
                buf = torch.empty((len(g) - 1) * c, dtype=torch.uint8)
                w1 = dist.irecv(head, src=m, group=tier.group, tag=21)
                w2 = dist.irecv(buf, src=m, group=tier.group, tag=22)
                pieces.append((w1, w2, head, buf))
    for w in sends:
        w.wait()
    for kind, w, head, buf in recvs:
        w.wait()
    if tiers[me] == "peer":
        head, buf = recvs[0][2], recvs[0][3]
        sha = bytes(int(x) for x in head[1:].tolist()).hex()
        data = memoryview(buf.numpy())
        if int(head[0]) != len(data) or hashlib.sha256(data).hexdigest() != sha:
            bad.add(me)
        else:
            mine = data
    if tiers[me] == "parity":
        heads = []
        bufs = []
        for w1, w2, head, buf in pieces:
            w1.wait()
            w2.wait()
            heads.append(tuple(int(x) for x in head.tolist()))
            bufs.append(buf)
        if len(set(heads)) != 1 or heads[0][0] < 0:
            bad.add(me)
        else:
            n = heads[0][0]
            sha = bytes(heads[0][1:]).hex()
            data = reconstruct(bufs, n)
            if hashlib.sha256(data).hexdigest() != sha:
                bad.add(me)
            else:
                mine = data
    loaded = None
    if mine is not None:
        try:
            loaded = ck.loaded_from_bytes(mine, step=step, program=tier.trainer.program, rank=me,
                                          needed=ck.needed_names(tier.trainer),
                                          where=f"memory tier ({tiers[me]}) step {step} of rank {me}")
            ck.check_restorable(tier.trainer, loaded)  # Note [valid means restorable]
        except Exception as exc:  # noqa: BLE001 - any malformed shard is a failed tier, decided before agreeing
            say(me, f"warning: memory tier ({tiers[me]}) step {step} of rank {me} is unusable: {exc}")
            bad.add(me)
    return loaded, bad


def _survivor_piece(tier: MemoryTier, step, g, i, lost, c, lost_rank, bad) -> tuple[torch.Tensor, list[int]]:
    """Survivor i's piece for rebuilding member ``lost`` (its own slot and parity of ``step``,
    both verified; a failed one is sent as zeros and reported)."""
    zeros = torch.zeros((len(g) - 1) * c, dtype=torch.uint8)
    own = tier.store.find(tier.store.own, step)
    par = tier.store.find(tier.store.held, step)
    own_data = own[0].verify(own[1]) if own else None
    par_data = par[0].verify(par[1]) if par else None
    if own_data is None:
        bad.add(tier.rank)
    if par_data is None or own_data is None:
        bad.add(lost_rank)
        return zeros, [-1] + [0] * 32
    member = next((m for m in par[1].get("members", []) if m["rank"] == lost_rank), None)
    if member is None or int(par[1]["chunk_bytes"]) != c:
        bad.add(lost_rank)
        return zeros, [-1] + [0] * 32
    shard = torch.frombuffer(own_data, dtype=torch.uint8)
    parity = torch.frombuffer(par_data, dtype=torch.uint8)
    piece = survivor_piece(shard, parity, i, lost, len(g), c)
    return piece.contiguous(), [int(member["bytes"])] + list(bytes.fromhex(member["sha256"]))


# ---------------------------------------------------------------------------------------------
# Both tiers


def preallocate_optimizer_state(trainer) -> list:
    """Allocate (and touch) the Adam state a restore fills, for every parameter that has none,
    before the recovery is timed: a fresh process pays for first-touch page faults here, in
    start-up, for whichever tier then restores (runtime.resilience.checkpoint.restore fills tensors it finds).
    Returns the parameters given state; ``recover_any`` removes it again where nothing filled it."""
    made = []
    if getattr(trainer, "zero", None) is not None:  # its optimizer holds pieces (runtime/parallel/zero.py)
        return made
    with torch.no_grad():
        for p in trainer.named_parameters().values():
            if not trainer.optimizer.state.get(p):
                trainer.optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                made.append(p)
    return made


def recover_any(trainer, ckpt_dir: str, tier: MemoryTier | None, *, run_dir: str | None = None) -> int:
    """Recovery from the fastest tier that survived: the memory tier, else the disk
    (``recover``). Logs "recovered step N from tier=T in X ms" and appends it to
    RUN_DIR/recovery.jsonl."""
    made = preallocate_optimizer_state(trainer)
    dist.barrier(group=control_group())  # the ranks come up at different times: time the recovery, not the skew
    t0 = time.perf_counter()
    reads0 = ck.READS["shards"]
    result = recover_memory(tier, ckpt_dir) if tier is not None else None
    if result is not None:
        step, mine, tiers, rounds = result.step, result.tier, result.tiers, result.rounds
    else:
        step = recover(trainer, ckpt_dir)
        mine, tiers, rounds = ("disk" if step > 0 else "none"), {}, 0
        if tier is not None:
            tier.store.invalidate_newer(step)  # what the memory held past the resume step is void
    seconds = time.perf_counter() - t0
    for p in made:  # what no checkpoint filled goes again: AdamW creates its state at the first step
        if "step" not in trainer.optimizer.state.get(p, {}):
            trainer.optimizer.state.pop(p, None)
    if step > 0:
        say(trainer.rank, f"recovered step {step} from tier={mine} in {seconds * 1e3:.1f} ms")
        if trainer.rank == 0 and tiers:
            by = {}
            for r, t in sorted(tiers.items()):
                by.setdefault(t, []).append(r)
            say(0, f"recovered step {step}: " + ", ".join(f"tier={t} (ranks {','.join(map(str, rs))})"
                                                          for t, rs in by.items()))
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            row = {"rank": trainer.rank, "step": step, "tier": mine, "ms": seconds * 1e3, "rounds": rounds,
                   "tiers": {str(r): t for r, t in tiers.items()}, "disk_shards_read": ck.READS["shards"] - reads0,
                   "attempt": attempt(),
                   "failures": [list(f) for f in (result.failures if result else [])],
                   "phases": result.phases if result else {}, "time_unix": time.time()}
            with open(os.path.join(run_dir, "recovery.jsonl"), "a") as fh:
                fh.write(json.dumps(row) + "\n")
    return step
