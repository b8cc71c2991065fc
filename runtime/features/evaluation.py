"""Evaluation on the validation split during a run (Note [evaluation on the pipeline] in
runtime/execute/validation.py), declared once: its run flags, their refusals and its hook."""

from __future__ import annotations

from runtime.features.base import Feature, Hooks, Run, Setting

DEFAULT_BATCHES = 4  # enough samples for a steady curve, cheap next to the steps between passes
EVERY = Setting("eval_every", "every K steps (and after the last) a forward-only pass over the validation split: "
                "val_loss in metrics.jsonl (default: no evaluation; needs a program compiled with --data tokens:DIR "
                "whose folder has a val split)", low=1, compile=False, run=True, metavar="K",
                fix="evaluate every 1 or more steps (e.g. --eval-every 100); leave it out for no evaluation")
BATCHES = Setting("eval_batches", "with --eval-every: global batches of the validation split per pass, the same "
                  f"ones each time (default {DEFAULT_BATCHES})", low=1, compile=False, run=True, metavar="N",
                  fix=f"evaluate on 1 or more validation batches (default {DEFAULT_BATCHES})")


class Evaluation(Feature):
    name = "evaluation"
    settings = (EVERY, BATCHES)

    def flags_refusal(self, given):
        if given.get(BATCHES.key) is not None and given.get(EVERY.key) is None:
            return f"{BATCHES.flag} {given[BATCHES.key]} sizes the evaluation of {EVERY.flag}: add {EVERY.flag} K"
        return None

    def run_refusal(self, program, options):
        every = options.features.get(EVERY.key)
        if every is None or (program.get("data") or {}).get("eval_batch") is not None:
            return None
        return (f"{EVERY.flag} {every}: this program's data has no validation split (data.eval_batch): compile it "
                "with --data tokens:DIR whose folder has a val split (partitioner data prepare writes one), or "
                f"leave out {EVERY.flag}")

    def rank_refusal(self, program, options, rank):
        return self.run_refusal({"data": {"eval_batch": program.data.eval_batch}}, options)

    def attach(self, run: Run) -> Hooks | None:
        every = run.options.features.get(EVERY.key)
        if every is None:
            return None
        from runtime.execute.validation import Evaluator  # lazy: loads torch

        batches = run.options.features.get(BATCHES.key) or DEFAULT_BATCHES
        return Hooks(evaluator=Evaluator(run.trainer, every=every, batches=batches))


FEATURE = Evaluation()
