"""`python -m vecpool ...`: the same as `vecpool ...` (e.g. `python -m vecpool serve MODEL`)."""

import sys

from vecpool.cli.main import main

sys.exit(main())
