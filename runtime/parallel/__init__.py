"""The parallel axes at run time: tensor groups, data-parallel gradient sync, sharded optimizer state.

tensor_parallel.py  a stage run by a tensor group: DTensor parameters, Megatron's collective points
                    (Note [tensor-parallel stages])
collective_bytes.py what tensor parallelism sends, counted at torch's functional collectives
grad_sync.py        the process groups every rank creates, tie and data-parallel gradient sync, buffer
                    broadcast
zero.py             optimizer state sharded over the replicas, ZeRO-1 (Note [sharded optimizer state])
control.py          the control group (gloo, for host-side bookkeeping) and the start-up barrier
                    (Note [the control group])
nccl_emulation.py   NCCL's device rules on a CPU run, for tests (Note [NCCL emulation])
"""
