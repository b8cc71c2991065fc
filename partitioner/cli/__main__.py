"""`python -m partitioner.cli ...`: the `partitioner` command."""

import sys

from partitioner.cli.commands import main

sys.exit(main())
