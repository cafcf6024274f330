"""`python -m bench.policy`: bench/policy/run.py."""

import sys

from bench.policy.run import main

if __name__ == "__main__":
    sys.exit(main())
