"""`python -m bench.structured`: bench/structured/run.py."""

import sys

from bench.structured.run import main

if __name__ == "__main__":
    sys.exit(main())
