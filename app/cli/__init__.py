"""The `shoal` command (`main`, the console script `app.cli:main`) and its subcommands.

One convention: each module below exposes `add_parser(sub)`, which adds its command (or
its few related commands) to the `shoal` parser and sets `run`, a function of the parsed
arguments that returns the exit code and imports what the command needs inside it, so
that parsing `shoal` stays light. `main.py` lists the modules once (`COMMANDS`) and calls
`args.run(args)`. The modules: `serve` (gateway, worker), `config` (settings, queues),
`models`, `export`, `keys`, `flower`, `jobs` (embed, run-job), `blobs` (sweep), `bench`,
`tune` (their logic is the tuning package, `app.tuning`) and `onboard` (`app.onboard`).
"""

from app.cli.main import main

__all__ = ["main"]
