"""Each rank's measured peak memory beside the plan's prediction (Note [what a rank's peak counts] in
runtime/observe/memory.py), declared once: its run flag and its hooks."""

from __future__ import annotations

from runtime.features.base import Feature, Hooks, Run, Setting

MEASURE = Setting("measure_memory", "measure each rank's peak memory and print it next to the plan's prediction "
                  "(RUN_DIR/memory_rank_<r>.json; always on with CUDA; on CPU also $PARTITIONER_MEASURE_MEMORY=1)",
                  type=None, compile=False, run=True)


class PeakMemory(Feature):
    name = "peak_memory"
    settings = (MEASURE,)

    def attach(self, run: Run) -> Hooks | None:
        from runtime.observe import memory as peak  # lazy: loads torch

        if not (run.device.type == "cuda" or peak.requested(bool(run.options.features.get(MEASURE.key)))):
            return None
        meter = peak.PeakMemory(run.trainer).start()

        def finish():
            meter.stop()
            peak.report(meter, folder=run.folder, rank=run.rank, run_dir=run.run_dir)  # a collective: every rank

        return Hooks(wrap_after_step=meter.unmeasured, finish=finish)  # checkpoint snapshots are not the step's


FEATURE = PeakMemory()
