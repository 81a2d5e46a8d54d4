"""`python -m vecpool.cli ...`: the same as `vecpool ...`."""

import sys

from vecpool.cli.main import main

sys.exit(main())
