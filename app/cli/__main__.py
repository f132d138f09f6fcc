"""`python -m app.cli ...`: the `shoal` command run from a source tree (app.tuning.stack
starts the gateway, workers and Flower this way)."""

import sys

from app.cli.main import main

sys.exit(main())
