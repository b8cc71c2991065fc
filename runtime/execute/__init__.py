"""A stage and its step: the module a rank builds, the schedule it runs, the optimizer step, and the
one-process oracle that does the same math.

stage.py            ``build_stage(folder, k, device)``: stage_<k>.py + weights -> nn.Module
materialize.py      initial parameters of a model compiled on meta, made by the rank that holds
                    them (Note [materialize per rank])
pretrained.py       a Hugging Face model's weights per rank: own init, or pretrained safetensors
schedule.py         plan schedule -> torch.distributed.pipelining schedule; ``schedule_text(program)``
                    and ``timed_actions`` (the one simulation, also behind `inspect`'s timeline)
recv_buffers.py     ``hold_in_flight(stage)``: a PipelineStage's receive buffers only while their
                    microbatch is in flight (Note [receive buffers in flight])
train.py            optimizer + LR schedule, randomness context per microbatch, gradient sync,
                    ``RankTrainer``
precision.py        precision policies: autocast, master weights, fp16's loss scale (Note [mixed
                    precision]); a CUDA program's kernel settings (Note [deterministic kernels on
                    a GPU])
host_copy.py        device tensors to the host with one wait (Note [one wait per snapshot])
randomness.py       the keyed random ops stage files call (``randomness.dropout(x, p, train, op=,
                    batch_dim=)``, ``attention`` for SDPA with dropout, ...), the context they read,
                    and ``capture()`` / ``restored(snapshot)`` for recompute (Note [randomness keyed
                    by meaning])
recompute.py        ``checkpointed(fn, *args)``: a region the plan recomputes, under activation
                    checkpointing with the same random draws (Note [recompute draws the
                    same randomness])
compile_stages.py   ``compile_rank(trainer)``: each stage's forward and recomputed regions through
                    torch.compile, warmed before step 1 (Note [compiled stages])
grad_norm.py        the global gradient norm, clipping, the no-decay names (Note [global gradient norm])
validation.py       ``Evaluator``: a forward-only pass over the validation split on the training
                    pipeline, val_loss every --eval-every steps (Note [evaluation on the pipeline])
reference.py        ``train_reference(...)``: the one-process oracle with the same math
"""
