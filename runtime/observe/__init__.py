"""What a run reports beyond its loss: memory, stage times, the step line.

clock.py            seconds of device work: CUDA events or the host clock (Note [timing on a device])
memory.py           a rank's measured peak memory (``LiveBytes`` on CPU, the CUDA allocator on GPUs)
stage_times.py      each stage's measured seconds per microbatch (Note [stage times])
watch.py            the step line's ETA, model FLOPs, MFU, peak memory; TensorBoard
"""
