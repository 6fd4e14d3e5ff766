"""`python -m jspec_bench ...`: the same as `jspec bench ...`."""

import sys

from jspec_bench import main

if __name__ == "__main__":
    sys.exit(main())
