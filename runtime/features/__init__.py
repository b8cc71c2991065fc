"""Training features, each declared once.

Note [one feature, one module]: a training feature (the compute canaries, peak-memory measurement,
evaluation, ...) is one module here owning its settings (key, flag, help, check: ``Setting``), its
refusals, what the compile decides for it and what it hooks around a rank's step (``Feature``).
``registry.FEATURES`` names them all; the shared files (the compiler's top, the settings, the
lowering, the program spec, the run options, the rank) loop over it and name no feature
(tests/unit/test_features_declared_once.py). Values travel as one table per object: the user's in
``TrainingSettings.features``, the compile's in ``Decisions.features`` (both flat in plan.json, as
before), the program's in ``Program.features`` (plan.json program "features", PROGRAM_FORMAT 2 in
runtime/program/spec.py) and a run's flags in ``RunOptions.features``. The modules are torch-free at
import and take plain values, so the compiler and the runtime both read them (runtime/ never
imports partitioner/).

Note [feature pricing]: what a feature costs a step is the cost model's (partitioner/solver/),
beside the other prices and calibrated with them; a feature names its pricing module by path
(``Feature.pricing``) and the compiler calls its ``predicted(decided, facts)``, so this package
stays importable without the compiler.

base.py        Setting, Feature, Hooks, Run, Layout: what a feature declares
registry.py    FEATURES, the one list, and the tables built from it (schema, flags, job keys)
canaries.py    the compute canaries (Note [compute canaries] in runtime/resilience/canary.py)
evaluation.py  val_loss on the validation split during a run (Note [evaluation on the pipeline])
peak_memory.py each rank's measured peak memory beside the plan's (Note [what a rank's peak counts])
"""
