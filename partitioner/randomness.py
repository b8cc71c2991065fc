"""Moved to partitioner/codegen/randomness.py. partitioner/verify.py still imports this path; the
`program` branch rewrites that file, and this module goes once it has merged."""

from partitioner.codegen.randomness import keyed_graph  # noqa: F401
