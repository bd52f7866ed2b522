"""`python -m marlflow.sandbox --code sol.py [--tests t.py] [--stdin in --expect out]`: see `_cli`."""

import sys

from marlflow.sandbox._cli import main

sys.exit(main())
