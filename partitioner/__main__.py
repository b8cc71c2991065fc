"""`python -m partitioner ...`: the `partitioner` command, for environments without its script."""

import sys

from partitioner.cli import main

sys.exit(main())
