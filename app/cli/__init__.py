"""The `shoal` command (`main`, the console script `app.cli:main`) and its subcommands.

`main.py` parses the command line and runs the gateway, a worker, settings, queues and
blob sweeps; each other module adds one group of subcommands: `models`, `keys`,
`flower`, `jobs` (embed, run-job), and `bench` and `tune`, which have parsers of their own
(their logic is the tuning package, `app.tuning`).
"""

from app.cli.main import main

__all__ = ["main"]
