"""The disk tier of checkpoints: what one is on disk, how it is written so that a crash never
leaves half of one, how it is read back and verified, and when it is taken. One room per concern;
this package re-exports the names callers use (``from runtime.resilience import checkpoint as ck``).

Rooms
-----
shard.py      the shard format, its layout for the disk (``shard_pieces``, streamed) and for
              preallocated memory (``ShardLayout``), its one reader (``parse_shard``) (Note
              [checkpoint format])
state.py      what a shard holds of a RankTrainer (``state_entries``, ``snapshot``, RNG states) and
              how a loaded one goes back in (``LoadedCheckpoint``, ``take_state``, ``restore``)
tp_pieces.py  a tensor-parallel rank's piece of a split parameter and its place; stitching the
              whole back at any degree (Notes [tensor-parallel pieces], [sharded state with
              tensor parallelism])
durable.py    tmp + fsync + rename + fsync dir, every step through a ``runtime.resilience.faults.FaultPoint``;
              ``write_pieces_atomic`` streams buffers and hashes them while writing
writers.py    which rank writes each name (``writes_of_ranks``, ``assign_writers``; Note [one
              writer per byte])
delta.py      lossless incremental shards: XOR against the last commit, byte planes, zstd (Note
              [lossless deltas])
manifest.py   the commit record (``manifest_for``, ``write_manifest``, ``read_manifest`` with its
              schema check), the step directories, pruning to N that verify, debris,
              ``commit_local`` (Notes [crash consistency], [manifest schema])
validate.py   is a verified checkpoint restorable? its shard meta field by field, its tensors
              and RNG states against the live trainer, before the ranks agree (Note [valid
              means restorable])
load.py       verified, possibly resharded loads of what one rank needs (``load_for_rank``,
              ``find_valid``, ``loaded_from_bytes`` for the memory tier's bytes)
interval.py   Young/Daly (``young_daly_interval``), ``parse_duration_s``
persist.py    ``Checkpointer``: checkpoint points, the background persist, the distributed commit
              (Note [distributed commit])
shared.py     is the checkpoint folder one folder for every node? checked once at the start of a
              multi-node run (Note [shared checkpoint folder])

Everything but ``persist`` works without a process group. The start-up side (which checkpoint
every rank resumes from, and the memory tier before it) is runtime/resilience/recovery.py; the memory tier
is runtime/resilience/memtier/.
"""

from runtime.resilience.checkpoint.durable import (CHUNK_BYTES, check_writable, fsync_dir, makedirs_durable, write_file_atomic,
                                        write_pieces_atomic)
from runtime.resilience.checkpoint.interval import parse_duration_s, young_daly_interval
from runtime.resilience.checkpoint.load import (READS, RESUME_CANDIDATES, ShardChoice, check_declared_sizes, choose_shards,
                                     find_valid, load_for_rank,
                                     loaded_from_bytes, parse_verified, read_shard)
from runtime.resilience.checkpoint.manifest import (MANIFEST, ShardInfo, check_model, clean_debris, commit_local, list_step_dirs,
                                         manifest_for, newest_committed, persist_shard, prune, read_manifest,
                                         remove_checkpoint, schema_problem, verifies, write_manifest)
from runtime.resilience.checkpoint.persist import Checkpointer
from runtime.resilience.checkpoint.shard import (FORMAT, READABLE_FORMATS, ShardLayout, parse_shard, serialize, shard_filename,
                                      shard_pieces, step_dirname)
from runtime.resilience.checkpoint.validate import check_meta, check_restorable, meta_problem
from runtime.resilience.checkpoint.state import (LoadedCheckpoint, Snapshot, capture_rng, needed_names, restore, restore_rng,
                                      snapshot, state_entries, state_names, take_state)
from runtime.errors import CheckpointCorruptError, PlanMismatchError
from runtime.resilience.faults import FaultPoint, SimulatedCrash

__all__ = [
    "CHUNK_BYTES", "FORMAT", "MANIFEST", "READABLE_FORMATS", "READS", "RESUME_CANDIDATES", "CheckpointCorruptError", "Checkpointer",
    "FaultPoint", "LoadedCheckpoint", "PlanMismatchError", "ShardChoice", "ShardInfo", "ShardLayout",
    "SimulatedCrash", "Snapshot", "capture_rng", "check_declared_sizes", "check_meta", "check_model", "check_restorable", "check_writable", "choose_shards", "clean_debris",
    "commit_local", "find_valid", "fsync_dir", "list_step_dirs", "load_for_rank", "loaded_from_bytes",
    "makedirs_durable", "manifest_for", "meta_problem", "needed_names", "newest_committed", "parse_duration_s", "parse_shard",
    "parse_verified", "persist_shard", "prune", "read_manifest", "read_shard", "remove_checkpoint", "restore",
    "restore_rng", "schema_problem", "serialize", "shard_filename", "shard_pieces", "snapshot", "state_entries", "state_names",
    "step_dirname", "take_state", "verifies", "write_file_atomic", "write_manifest", "write_pieces_atomic", "young_daly_interval",
]
