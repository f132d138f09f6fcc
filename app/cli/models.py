"""`shoal models list|show|validate|adapters`: read and check the model catalog."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from tasks.adapters import ADAPTERS
from tasks.catalog import CatalogError, ModelEntry, load_catalog, load_entry


def catalog_dir(args: argparse.Namespace) -> Path:
    """The user's folder (--catalog-dir, else SHOAL_CATALOG_DIR), else the packaged one."""
    if args.catalog_dir:
        return Path(args.catalog_dir)
    from tasks.settings import get_settings

    return get_settings().catalog_dir


def _row(entry: ModelEntry) -> list[str]:
    source = entry.source.hub or entry.source.package or entry.source.path or ""
    return [entry.id, entry.adapter, entry.operation, str(entry.dims or "-"),
            str(entry.max_seq_length or "-"), ",".join(sorted(entry.profiles)) or "-", source]


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def list_models(args: argparse.Namespace) -> int:
    catalog = load_catalog(catalog_dir(args))
    entries = [e for e in catalog if args.adapter is None or e.adapter == args.adapter]
    header = ["ID", "ADAPTER", "TASK", "DIMS", "MAX_LEN", "PROFILES", "SOURCE"]
    _print_table([header] + [_row(e) for e in sorted(entries, key=lambda e: e.id)])
    return 0


def show_model(args: argparse.Namespace) -> int:
    catalog = load_catalog(catalog_dir(args))
    entry = catalog.get(args.model)
    if entry is None:
        print(f"{args.model!r} is not in the catalog; known: {sorted(e.id for e in catalog)}",
              file=sys.stderr)
        return 1
    contract = entry.contract
    print(f"# {catalog.origin(entry.id)}")
    print(f"# adapter {contract.name}: {contract.summary}; inputs {sorted(contract.inputs)}"
          + (f"; outputs {list(contract.outputs)}" if contract.outputs else ""))
    print(yaml.safe_dump(entry.model_dump(mode="json", exclude_none=True), sort_keys=False),
          end="")
    return 0


def validate(args: argparse.Namespace) -> int:
    """Check every file (not stopping at the first error) and, with --sources, that local
    weights are where the entry says. Without paths: the files of the user's folder if one
    is set, else the packaged catalog's."""
    paths = [Path(p) for p in args.paths] or sorted(catalog_dir(args).glob("*.yaml"))
    if not paths:
        print("no catalog files found", file=sys.stderr)
        return 1
    failed = 0
    seen: dict[str, Path] = {}
    for path in paths:
        try:
            entry = load_entry(path)
            if entry.id in seen:
                raise CatalogError(f"{path}: id '{entry.id}' is also defined in {seen[entry.id]}")
            seen[entry.id] = path
            if args.sources and not entry.source.hub:
                from tasks.sources import SourceError, resolve_source

                try:
                    resolve_source(entry.source)
                except SourceError as exc:
                    raise CatalogError(f"{path}: source: {exc}") from None
        except CatalogError as exc:
            failed += 1
            print(f"FAIL {exc}")
        else:
            print(f"ok   {path}  {entry.id} ({entry.adapter})")
    print(f"{len(paths) - failed} valid, {failed} invalid")
    return 1 if failed else 0


def list_adapters(_: argparse.Namespace) -> int:
    rows = [["ADAPTER", "TASK", "INPUTS", "OUTPUTS", "WHAT"]]
    rows += [[c.name, c.operation, ",".join(sorted(c.inputs)), ",".join(c.outputs) or "-",
              c.summary] for c in ADAPTERS.values()]
    _print_table(rows)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="list, show and validate catalog entries")
    models.add_argument("--catalog-dir", help="a folder of your own entries, read over the "
                        "packaged catalog (default: SHOAL_CATALOG_DIR)")
    actions = models.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="one line per entry")
    listing.add_argument("--adapter", choices=sorted(ADAPTERS))
    listing.set_defaults(run=list_models)
    show = actions.add_parser("show", help="one entry in full")
    show.add_argument("model")
    show.set_defaults(run=show_model)
    check = actions.add_parser("validate", help="check catalog files; exit 1 if any is wrong")
    check.add_argument("paths", nargs="*", help="files (default: every file of the catalog)")
    check.add_argument("--sources", action="store_true",
                       help="also check that local/package weights exist")
    check.set_defaults(run=validate)
    actions.add_parser("adapters", help="the model families").set_defaults(run=list_adapters)
