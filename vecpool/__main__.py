"""`python -m vecpool ...`: the same as `vecpool ...` (e.g. `python -m vecpool serve MODEL`)."""

import sys

from vecpool.cli.main import main

if __name__ == "__main__":  # not when a spawned worker process imports this module
    sys.exit(main())
