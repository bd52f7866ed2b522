"""`python -m marlflow ...`: the same as the `marlflow` command (marlflow.cli)."""

import sys

from marlflow.cli import main

sys.exit(main())
