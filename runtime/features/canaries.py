"""The compute canaries (Note [compute canaries] in runtime/resilience/canary.py), declared once:
the setting, its refusals, the compile's decision and the run's hooks."""

from __future__ import annotations

from runtime.features.base import Feature, Hooks, Layout, Run, Setting
from runtime.resilience.canary_rules import program_refusal, refusal

EVERY = Setting("sdc_canary_every", "every K steps a second replica re-runs microbatch 0 of each stage and "
                "compares digests before the all-reduce (0: never, the compile's default; needs dp > 1; on a run: "
                "default the plan's)",
                low=0, fix="give a number of steps >= 0 (0: no compute canaries)", run=True, metavar="K")
PREDICTED = ("sdc_canary_s_per_step", "sdc_canary_bubble_s")  # plan.json "predicted" keys (Note [canary price])


class Canaries(Feature):
    name = "canaries"
    settings = (EVERY,)
    pricing = "partitioner.solver.canary_cost"

    def sharding(self, asked, shard):
        return "off" if asked.get(EVERY.key) and shard == "auto" else shard  # they run on replicated state

    def decide(self, asked, layout: Layout) -> dict:
        every = asked.get(EVERY.key) or 0
        why = refusal(every, dp=layout.dp, tensor_parallel=layout.tensor_parallel, sharded=layout.sharded,
                      local_stages=layout.local_stages, schedule=layout.schedule,
                      what=f"{EVERY.key}={every} ({EVERY.flag})")
        if why:
            raise ValueError(why)
        return {EVERY.key: every} if every else {}  # left out when off: an older plan round-trips unchanged

    def program(self, decided):
        return {EVERY.key: decided[EVERY.key]} if decided.get(EVERY.key) else {}

    def inspect_lines(self, decided, predicted, dp, ms):
        """What the canaries add to the predicted step and the bubble they use (Note [canary price])."""
        every = decided.get(EVERY.key)
        if not every or dp < 2:
            return []
        extra, bubble = (predicted.get(k, 0.0) for k in PREDICTED)
        return [f"compute canary  a replica re-runs one microbatch of each stage every {every} steps, {ms(extra)} "
                f"ms/step in the predicted step ({ms(bubble)} ms of re-runs per canary fit in pipeline bubbles)"]

    def run_refusal(self, program, options):
        every = options.features.get(EVERY.key)
        return program_refusal(program, every) if every else None

    def replanned(self, program, options, say):
        """Off, said once, where the re-planned program cannot run one (dp 1 after the loss)."""
        given = options.features.get(EVERY.key)
        every = given if given is not None else (program.get("features") or {}).get(EVERY.key)
        if every and program_refusal(program, int(every)):
            say(f"elastic: the re-planned program has dp {program.get('dp')}: no compute canaries from here on "
                "(a canary needs a second replica)")
            return {EVERY.key: 0}
        return {}

    def rank_refusal(self, program, options, rank):
        every = options.features.get(EVERY.key)
        every = program.features.get(EVERY.key) if every is None else every
        return refusal(every or 0, dp=program.dp, tensor_parallel=program.tensor_parallel,
                       local_stages=len(program.layout.stages_of_rank[rank]),
                       sharded=program.shard_optimizer and program.dp > 1, schedule=program.pipeline_schedule)

    def attach(self, run: Run) -> Hooks | None:
        every = run.value(EVERY.key) or 0
        if not every:
            return None
        from runtime.resilience import canary  # lazy: loads torch

        c = canary.attach(run.trainer, every, run_dir=run.run_dir, start_step=run.start_step, hosts=run.hosts)
        return Hooks(before_step=c.before_step, rolled_back=c.rolled_back, finish=c.finish, digest_check=c)


FEATURE = Canaries()
