"""`python -m bench.peers`: bench/peers/run.py."""

import sys

from bench.peers.run import main

if __name__ == "__main__":
    sys.exit(main())
