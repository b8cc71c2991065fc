"""The `partitioner` command and its helpers.

  commands.py   partitioner compile | inspect | run | verify: the parser and one function a command
  run.py        `run`: the folder and flags checked on this host, then torchrun
  examples.py   the examples under commands.py's subcommands' --help
  progress.py   compile's progress lines on stderr
  examples.py   the examples each subcommand's --help ends with
  data.py       `partitioner data prepare | check`: a corpus folder from text, checked
  generate.py   `partitioner generate DIR --prompt TEXT`: a causal LM's checkpoint, sampled
  elastic.py    `partitioner replan DIR --ranks R,..` and `run --elastic`'s checks and launch
  verify.py     `verify`: the program trained beside the one-process oracle, compared
  demo.py       `make demo` (``python -m partitioner.cli.demo``): the main job end to end
  __main__.py   ``python -m partitioner.cli``

The console script is ``partitioner.cli:main``; ``python -m partitioner`` and ``python -m
partitioner.cli`` run the same. Importing this package imports no torch (`--help` stays fast).
"""

from partitioner.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
