"""Moved to partitioner/codegen/recompute.py. partitioner/lower.py still imports this path; the
`program` branch rewrites that file, and this module goes once it has merged."""

from partitioner.codegen.recompute import checkpoint_regions  # noqa: F401
