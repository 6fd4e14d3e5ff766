"""`python -m jspec ...`: the `jspec` command line."""

import sys

from jspec.cli import main

sys.exit(main())
