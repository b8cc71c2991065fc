"""The front end: what a user hands the compiler, traced and annotated, and what the ranks will need
to import of the user's code.

workload.py         what a user hands the compiler: model, example inputs, loss, make_batch
trace.py            the only file that calls torch.export / symbolic_trace
autograd_functions.py  a custom autograd.Function as one node calling its own apply
analysis.py         trace, key random ops, run the passes
randomness.py       every random op → a keyed draw (on the unpartitioned graph, before the split)
corpus_data.py      a workload made to train on a token corpus (--data; Note [a corpus replaces make_batch])
tp_support.py       what compile() accepts with a tensor-parallel degree, refused in words
user_source.py      where the ranks find make_batch, loss_fn and custom ops; a model file run
local_modules.py    the local modules a travelling file imports, tried as a rank imports them
rank_imports.py     what a rank can import: its sys.path, the spec it would find a name by
"""
