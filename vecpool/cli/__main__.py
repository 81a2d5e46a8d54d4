"""`python -m vecpool.cli ...`: the same as `vecpool ...`."""

import sys

from vecpool.cli.main import main

if __name__ == "__main__":  # not when a spawned worker process imports this module
    sys.exit(main())
