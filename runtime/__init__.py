"""What generated programs import. Runs without the compiler: depends only on torch (2.11 or newer),
numpy, safetensors and the standard library (never on ``partitioner``, ``passes`` or ortools; the
optional packages only where a run asks for them: Note [what the runtime needs]).

Rooms
-----
In the order a rank meets them (each folder's __init__ maps its modules):

program/            the program object (``Program``, plan.json's "program"), which rank holds what,
                    the user code it names
launch/             a rank's one call (``runtime.launch.rank.main``), the run flags, torchrun lines
execute/            a stage and its step: build, schedule, optimizer, precision, keyed randomness,
                    recompute; and the one-process oracle with the same math
data/               what a step trains on: make_batch's input contract, built-in batches and losses
parallel/           tensor groups, data-parallel gradient sync, ZeRO-1, the global gradient norm
resilience/         checkpoint/ (disk tier), memtier/ (memory tier), recovery, SDC digests, faults
features/           each training feature declared once: its settings, refusals, compile and run parts
observe/            what a run reports: peak memory, stage times, the step line and TensorBoard

errors.py           the runtime's errors (partitioner.errors re-exports them)
python_version.py   the Python >= 3.11 check run on import of partitioner and runtime
torch_version.py    the torch >= 2.11 check run first when a rank starts; what the runtime needs
file_trust.py       reading files of folders others may have prepared: no links followed, regular
                    files only, bounded reads, folders others cannot write in (Note [files are not
                    trusted])
scratch.py          the scratch folder beside an output (`data prepare`'s corpus, `export`'s
                    weights): locked while its maker lives, swept by the next once abandoned
                    (Note [abandoned scratch folders] there)
exchange.py         small values between ranks as JSON in byte tensors, never pickles (Note [no pickle
                    between ranks])

The test drivers (several folders in the same workers, the checkpoint drills) live in
tests/drivers/: they are never part of a program.

The program folder (written by partitioner/codegen/)
------------------------------------------------------
::

    DIR/plan.json        JSON; the runtime reads its "plan_hash" and its "program" object (below)
    DIR/stage_<k>.py     `import torch` (and `from runtime.execute import randomness` when it has random
                         ops: Note [randomness keyed by meaning]) + class Stage<k>(torch.nn.Module): no __init__ arguments, no
                         parameters of its own; forward(self, *activations) reads parameters as
                         attributes by their ORIGINAL dotted names (a list's child indexed, e.g.
                         `self.blocks[0].attn.qkv.weight`); a recomputed region is a method
                         of the class called through runtime.execute.recompute.checkpointed. Module-level lists PARAMETERS
                         (original names, in order), INPUTS, OUTPUTS (activation names), and
                         optionally BUFFERS (original names of non-trained tensors, e.g. masks;
                         loaded from the same weights file, never all-reduced; a buffer read on
                         two stages is listed by both) and MUTABLE_BUFFERS (the subset forward
                         updates in place, e.g. BatchNorm running statistics: checkpointed and
                         broadcast from replica 0 after each step; Note [mutable buffers] in
                         partitioner/codegen/split.py). forward returns the single output, or a tuple of
                         them in OUTPUTS order.
    DIR/weights/stage_<k>.safetensors   initial values keyed by original names (params + buffers)
    DIR/train.py         the one entry point: every rank runs it under torchrun and calls
                         runtime.launch.rank.main(<its folder>), which computes the rank's role
                         (stages, peers, actions) from the program (Note [roles from the plan] in
                         runtime/launch/entry_files.py; no file per rank). Without RANK a program of
                         several ranks exits naming the torchrun line (text:
                         runtime.launch.entry_files.train_file_text)
    DIR/run/             written by the run: metrics.jsonl, final/ (below)
    DIR/checkpoints/     step_<N>/shard_rank_<r>.safetensors + manifest.json (runtime/resilience/checkpoint/)

The "program" object: ``runtime.program.spec.Program`` is its single definition. Each field (and each
part: ``RankSpec``, ``StageSpec``, ``TensorSpec``, ``TieSpec``, ``DataSpec``, ``OptimizerSettings``,
``MemoryTierPlan``, ``RandomnessSpec``, ``InitSpec``) is documented where it is declared, and the
checks are in ``Program.from_dict`` / ``__post_init__``; plan.json holds ``Program.to_dict()``
(same keys, so ``Program.from_dict(json)`` reads any plan.json this compiler writes).
``load_program(DIR)`` checks the file hashes and returns the validated Program, with plan.json's
top-level "plan_hash", "model_fingerprint" and "workload" copied in.

Outputs of a run (DIR/run unless main(run_dir=...))::

    metrics.jsonl       rank 0, one line per step: {"step" (0-based, = make_batch's step), "loss"
                        (exact fp32 value: mean over microbatches and replicas), "step_time_s",
                        "samples_per_s", "lr" (the lr the step used), "time_unix"}; a resumed run
                        keeps the lines of the steps before its resume step and rewrites the rest
    summary.json        rank 0, rewritten at the end of every run: steps, "measured_step_time_s" (median
                        of the run's steps after the first), "predicted_step_time_s" (the plan's, or
                        null), "step_time_ratio" (measured / predicted) (Note [step time summary]), "folder"
                        (the program folder, absolute) and "plan_hash"
    stage_times_rank_<r>.json          rank r, per stage it holds: forward and backward seconds per
                                       microbatch, the loss's, the schedule and optimizer phases
                                       (medians over the steps after the first; runtime/observe/stage_times.py)
    final/rank_<r>.safetensors         rank r's parameters, original names
    final/optim_rank_<r>.safetensors   "<name>.exp_avg", "<name>.exp_avg_sq"; with sharded state (ZeRO-1)
                                       this rank's pieces, "optim_shard/<name>/<key>" as in a checkpoint
    final/optim_rank_<r>.json          steps_done, per-parameter AdamW step, lr_scheduler state; with
                                       sharded state optim_pieces {name: [start, end]} (and optim_tp_pieces)
    final/buffers_rank_<r>.safetensors rank r's mutable buffers (running statistics), original names

    checkpoint_stats_rank_<r>.jsonl    per checkpoint: step, stall_s, persist_s, bytes (commit_s on 0)
    memory_rank_<r>.json               with --measure-memory or on CUDA: measured_peak_bytes,
                                       predicted_peak_bytes, capacity_bytes (runtime/observe/memory.py)
    checkpoint_interval.json           the Young/Daly choice, when --mtbf chose it
    faults.jsonl                       injected faults that fired (rank, step, mode, time_unix)

Flags of train.py: the table in runtime/launch/run_options.py (``FLAGS``, `partitioner run`'s
too; an unknown flag is refused, naming the nearest): --steps N, --run-dir D, --checkpoint-dir D
(default DIR/checkpoints; must be writable, checked before training), --checkpoint-every K,
--mtbf 6h, --keep-checkpoints N (default 3), --no-checkpoint, the fault drills, the memory tier's,
--collective-timeout S, --measure-memory (or PARTITIONER_MEASURE_MEMORY=1). Every run
resumes from the newest checkpoint valid on every rank in the checkpoint directory and leaves a
committed checkpoint of its last step there.

Launch: ``partitioner run DIR``, or the torchrun line ``runtime.launch.torchrun.command_text``
gives (its rendezvous a file in a private folder: Note [no TCP rendezvous on one host]); across
hosts ``python -m runtime.launch.signed_rendezvous`` (Note [signed rendezvous state]). A one-rank
program also runs as ``python DIR/train.py``.
"""

from runtime.python_version import check_python as _check_python

_check_python()  # Python >= 3.11, with a message saying what to do (runtime/python_version.py)
