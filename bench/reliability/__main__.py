"""`python -m bench.reliability`: bench/reliability/run.py."""

import sys

from bench.reliability.run import main

if __name__ == "__main__":
    sys.exit(main())
