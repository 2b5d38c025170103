"""`python -m client.openai`: the OpenAI-compatible frontend's command line (client/openai/cli.py)."""

import sys

from client.openai.cli import main

sys.exit(main())
