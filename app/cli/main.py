"""The `shoal` command: run the gateway or a worker, inspect settings and queues."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app.cli import (
    bench,
    blobs,
    config,
    export,
    flower,
    jobs,
    keys,
    models,
    onboard,
    serve,
    tune,
)

# Each module's `add_parser(sub)` adds its command(s) and sets `run`; in `shoal --help` order.
COMMANDS = (serve, config, models, export, keys, flower, jobs, blobs, bench, tune, onboard)


class CommandParser(argparse.ArgumentParser):
    """A command's parser: an argument it does not know is its own error, shown with its
    own usage (`shoal bench: error: ...`), not the top-level list of commands."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "--"]:
        del argv[1]  # `shoal bench -- ARGS`, as `shoal bench` has always taken it
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    args.argv = argv  # the words after `shoal`, for a command that records its command line
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
