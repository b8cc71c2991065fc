"""What generated programs import. Runs without the compiler: depends only on torch, safetensors and
the standard library (never on ``partitioner`` or ``passes``).

Modules
-------
Start-up and the program object:

launch.py           ``main(folder, rank=None, *, steps=None, run_dir=None, exit_on_error=True)``: the
                    one call of every rank_<r>.py (env, process groups, training, final save)
program.py          plan.json's "program" object as the frozen dataclass ``Program`` (every field
                    documented there), ``load_program``
program_parts.py    its parts: stages and the tensors crossing them, ranks, ties, data, optimizer,
                    memory tier, randomness and init recipes
layout.py           which rank holds what; the process groups every rank creates (``Layout``)
user_code.py        the callables and files a program names, made objects (Note [one user root])
entry_files.py      the text of rank_<r>.py and train.py (``entry_files``, ``write_entry_files``),
                    one emitter for codegen and hand-made test folders
errors.py           the runtime's errors (partitioner.errors re-exports them)
python_version.py   the Python >= 3.11 check run on import of partitioner and runtime

A stage and its step:

stage.py            ``build_stage(folder, k, device)``: stage_<k>.py + weights -> nn.Module
materialize.py      initial parameters of a model compiled on meta, made by the rank that holds
                    them (Note [materialize per rank])
pretrained.py       a Hugging Face model's weights per rank: own init, or pretrained safetensors
pipeline_schedules.py  each schedule torch runs, one class: its refusal, in-flight microbatches, action
                    order (Note [one class per schedule])
schedule.py         plan schedule -> torch.distributed.pipelining schedule; ``schedule_text(program)``
                    and ``timed_actions`` (the one simulation, also behind `inspect`'s timeline)
grad_sync.py        the process groups every rank creates, tie and data-parallel gradient sync, buffer
                    broadcast
run_options.py      the run flags as one table and one frozen ``RunOptions`` (`partitioner run` and
                    train.py parse the same; Note [one flag table])
train.py            optimizer + LR schedule, randomness context per microbatch, gradient sync,
                    ``RankTrainer``
precision.py        precision policies: autocast, master weights, fp16's loss scale (Note [mixed
                    precision])
grad_norm.py        the global gradient norm, clipping, the no-decay names (Note [global gradient norm])
zero.py             optimizer state sharded over the replicas, ZeRO-1 (Note [sharded optimizer state])
tensor_parallel.py  a stage run by a tensor group: DTensor parameters, Megatron's collective points
                    (Note [tensor-parallel stages])
collective_bytes.py what tensor parallelism sends, counted at torch's functional collectives
randomness.py       the keyed random ops stage files call (``randomness.dropout(x, p, train, op=,
                    batch_dim=)``, ``attention`` for SDPA with dropout, ...), the context they read,
                    and ``capture()`` / ``restored(snapshot)`` for recompute (Note [randomness keyed
                    by meaning])
recompute.py        ``checkpointed(fn, *args)``: a region the plan recomputes, under activation
                    checkpointing with the same random draws (Note [recompute draws the
                    same randomness])
data.py             deterministic batches and losses of the built-in workloads (Note [constant inputs])
corpus/             the on-disk token corpus: sources read as memmaps, layout-independent windows,
                    ``make_batch`` and one rank's ``rows`` (Note [global sample order])
hf_data.py          the same for the Hugging Face tasks other than causal LM

What a run reports:

memory.py           a rank's measured peak memory (``LiveBytes`` on CPU, the CUDA allocator on GPUs)
stage_times.py      each stage's measured seconds per microbatch (Note [stage times])
watch.py            the step line's ETA, model FLOPs, MFU, peak memory; TensorBoard

Resilience:

checkpoint/         the disk tier, a package of rooms (its __init__ re-exports the names callers
                    use): the shard format, state, durable writes, writers, deltas, the manifest,
                    verified loads, the interval, the persist (Notes [checkpoint format], [crash
                    consistency], [distributed commit])
memtier/            the memory tier, a package of rooms: groups (hosts, redundancy, cost: what the
                    compiler plans with), parity (XOR), slots (shared-memory slots, whole or absent),
                    tier (``MemoryTier``: background copy, redundancy exchange; ``settings_from``)
recovery.py         start-up recovery from the fastest tier that survived (``recover_any``): the
                    memory cascade (own slot, peer copy, parity; Note [memory recovery]) and the
                    disk's agreement on the newest valid checkpoint (``recover``, Note [recovery
                    agreement])
sdc.py              replica digests, the silent-data-corruption check and its rollback (Note
                    [replica digests])
faults.py           every fault point: ``--fail-at RANK:STEP[:exit|kill|hang]``, ``--fail-persist
                    RANK:STEP:BYTES`` (a ``FaultPoint`` in the persist), ``--fail-host
                    HOST:STEP[:ATTEMPT]``, ``--flip-bit RANK:STEP[:TENSOR]``

Launching, and the drivers tests and benchmarks use:

torchrun.py         ``torchrun_command``, ``run_env``, ``free_port``: every launch on this host
reference.py        ``train_reference(...)``: the one-process oracle with the same math
run_many.py         torchrun entry training several folders in the same workers (tests, benchmarks)
checkpoint_drills.py one-process drills of the checkpoint protocol (tests, benchmarks; never a program)

The program folder (written by partitioner/codegen/)
------------------------------------------------------
::

    DIR/plan.json        JSON; the runtime reads its "plan_hash" and its "program" object (below)
    DIR/stage_<k>.py     `import torch` (and `from runtime import randomness` when it has random
                         ops: Note [randomness keyed by meaning]) + class Stage<k>(torch.nn.Module): no __init__ arguments, no
                         parameters of its own; forward(self, *activations) reads parameters as
                         attributes by their ORIGINAL dotted names (FX codegen style, e.g.
                         `getattr(self.blocks, "0").attn.qkv.weight`); a recomputed region is a method
                         of the class called through runtime.recompute.checkpointed. Module-level lists PARAMETERS
                         (original names, in order), INPUTS, OUTPUTS (activation names), and
                         optionally BUFFERS (original names of non-trained tensors, e.g. masks;
                         loaded from the same weights file, never all-reduced; a buffer read on
                         two stages is listed by both) and MUTABLE_BUFFERS (the subset forward
                         updates in place, e.g. BatchNorm running statistics: checkpointed and
                         broadcast from replica 0 after each step; Note [mutable buffers] in
                         partitioner/codegen/split.py). forward returns the single output, or a tuple of
                         them in OUTPUTS order.
    DIR/weights/stage_<k>.safetensors   initial values keyed by original names (params + buffers)
    DIR/rank_<r>.py      what rank r runs, as constants (STAGES, PIPELINE_RANKS,
                         DATA_PARALLEL_RANKS, ACTIONS, NUM_MICROBATCHES, MICROBATCH_SIZE, LAUNCH,
                         ...; checked against the program at start-up: Note [rank file constants]
                         in runtime/entry_files.py), then one call: runtime.launch.main(<its
                         folder>, rank=r) (text: runtime.entry_files.rank_file_text(program, r))
    DIR/train.py         torchrun entry: runs rank_<RANK>.py; without RANK it exits naming the
                         torchrun line (text: runtime.entry_files.train_file_text)
    DIR/run/             written by the run: metrics.jsonl, final/ (below)
    DIR/checkpoints/     step_<N>/shard_rank_<r>.safetensors + manifest.json (runtime/checkpoint/)

The "program" object: ``runtime.program.Program`` is its single definition. Each field (and each
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
                                       (medians over the steps after the first; runtime/stage_times.py)
    final/rank_<r>.safetensors         rank r's parameters, original names
    final/optim_rank_<r>.safetensors   "<name>.exp_avg", "<name>.exp_avg_sq"; with sharded state (ZeRO-1)
                                       this rank's pieces, "optim_shard/<name>/<key>" as in a checkpoint
    final/optim_rank_<r>.json          steps_done, per-parameter AdamW step, lr_scheduler state; with
                                       sharded state optim_pieces {name: [start, end]} (and optim_tp_pieces)
    final/buffers_rank_<r>.safetensors rank r's mutable buffers (running statistics), original names

    checkpoint_stats_rank_<r>.jsonl    per checkpoint: step, stall_s, persist_s, bytes (commit_s on 0)
    memory_rank_<r>.json               with --measure-memory or on CUDA: measured_peak_bytes,
                                       predicted_peak_bytes, capacity_bytes (runtime/memory.py)
    checkpoint_interval.json           the Young/Daly choice, when --mtbf chose it
    faults.jsonl                       injected faults that fired (rank, step, mode, time_unix)

Flags of train.py / rank_<r>.py: the table in runtime/run_options.py (``FLAGS``, `partitioner run`'s
too; an unknown flag is refused, naming the nearest): --steps N, --run-dir D, --checkpoint-dir D
(default DIR/checkpoints; must be writable, checked before training), --checkpoint-every K,
--mtbf 6h, --keep-checkpoints N (default 3), --no-checkpoint, the fault drills, the memory tier's,
--collective-timeout S, --measure-memory (or PARTITIONER_MEASURE_MEMORY=1). Every run
resumes from the newest checkpoint valid on every rank in the checkpoint directory and leaves a
committed checkpoint of its last step there.

Launch: ``torchrun --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
DIR/train.py`` (set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for restarts with gloo). A one-rank
program also runs as ``python DIR/rank_0.py``.
"""

from runtime.python_version import check_python as _check_python

_check_python()  # Python >= 3.11, with a message saying what to do (runtime/python_version.py)
