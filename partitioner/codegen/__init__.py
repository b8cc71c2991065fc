"""Plan + traced graph → the program folder (docs/design.md §6).

```
DIR/plan.json          the plan, its hash, the "program" the runtime reads, every file's sha256, and
                       the solver's problem and assignment (what `inspect --node` prices moves with)
DIR/stage_<k>.py       stage k's forward, one statement per op, with the model's source lines as comments
DIR/train.py           the one entry point every rank runs; a rank computes its role (stages, peers,
                       actions) from plan.json (runtime/launch/entry_files.py): no file per rank
DIR/weights/stage_<k>.safetensors   initial parameters keyed by their original names
DIR/README.md          how to run it here and on N nodes
```
Same inputs give the same bytes: nothing here reads the clock, and every mapping is sorted or
in graph order. Generated files import only torch and runtime, and the modules that register
custom ops a stage calls (Note [custom ops travel]).

The lowering passes over the traced graph live here too, in the order they run:
  lower.py        the back end's driver: retrace at the microbatch, split, program object, emit
  boundary_dtypes.py  each value's dtype under the program's autocast (Note [boundaries in the autocast dtype])
  split.py        one GraphModule per pipeline stage, boundary tensors named for their module
  recompute.py    recomputed regions → checkpointed methods of the stage
  tp_collectives.py  where a tensor group settles its collectives, written into a stage graph
  stage_code.py   a stage graph → stage_<k>.py (Note [stage code])
  spelling.py     how a stage file spells an aten call: F / torch / method / operator where it is the same call
  readme.py       README.md
  folder.py       the whole folder, written atomically (write_program)
"""

from partitioner.codegen.folder import write_program

__all__ = ["write_program"]
