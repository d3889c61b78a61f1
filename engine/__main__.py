"""`python -m engine RECIPE ...`: the same command line as `python -m engine.train`."""

import sys

from engine.cli import main

sys.exit(main())
