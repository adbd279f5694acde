"""`python -m metering.cli`: the `metering` command."""

import sys

from metering.cli import main

if __name__ == "__main__":  # imported by a walk over the package, it runs nothing
    sys.exit(main())
