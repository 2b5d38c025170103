"""`python -m client.bench`: the benchmark's command line (client/bench/cli.py)."""

import sys

from client.bench.cli import main

sys.exit(main())
