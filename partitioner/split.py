"""Moved to partitioner/codegen/split.py. partitioner/lower.py still imports this path; the
`program` branch rewrites that file, and this module goes once it has merged."""

from partitioner.codegen.split import StageGraph, split_graph  # noqa: F401
