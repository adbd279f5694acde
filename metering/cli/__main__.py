"""`python -m metering.cli`: the `metering` command."""

import sys

from metering.cli import main

sys.exit(main())
