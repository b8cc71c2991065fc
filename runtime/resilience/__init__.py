"""Nothing is lost: the disk and memory tiers, start-up recovery, silent-data-corruption checks, and
the fault points that drill them.

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
canary.py           compute-fault canaries: a second replica re-runs one microbatch of a stage and
                    compares digests before the all-reduce; rollback, blame, exclusion (Note
                    [compute canaries])
canary_rules.py     what a canary runs with, torch-free (``refusal``), and its exit code
exclusion.py        a canary's exclusion acted on: which host `run --elastic` leaves out (certain
                    blame only), nothing newer than the last agreeing canary kept restorable
                    (``set_aside``), no restarted round trains on (Note [excluding a host])
faults.py           every fault point: ``--fail-at RANK:STEP[:exit|kill|hang]``, ``--fail-persist
                    RANK:STEP:BYTES`` (a ``FaultPoint`` in the persist), ``--fail-host
                    HOST:STEP[:ATTEMPT]``, ``--flip-bit RANK:STEP[:TENSOR]``,
                    ``--fault-matmul RANK:STEP[:permanent]`` (Note [a faulty matmul])
"""
