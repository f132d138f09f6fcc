"""`shoal keys add|hash|check`: make API keys and the keys file entries that hold their hashes."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from gateway.auth.key_file import KeyEntry, KeyFileError, hash_key, new_key, parse_key_file


def _keys_file(args: argparse.Namespace) -> Path | None:
    if args.file:
        return Path(args.file)
    from tasks.settings import get_settings

    return get_settings().api_keys_file


def _entry(args: argparse.Namespace, key: str) -> dict[str, Any]:
    raw: dict[str, Any] = {"name": args.name, "hash": hash_key(key)}
    if args.models:
        raw["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.rpm is not None:
        raw["requests_per_minute"] = args.rpm
    if args.tpm is not None:
        raw["tokens_per_minute"] = args.tpm
    if args.inputs:
        raw["inputs"] = [g.strip() for g in args.inputs.split(",") if g.strip()]
    if args.admin:
        raw["admin"] = True
    KeyEntry.model_validate(raw)  # the same check the gateway makes
    return raw


def _append(path: Path, entry: dict[str, Any]) -> None:
    """Add `entry` to the keys file at `path` (created 0600 if missing), replacing the file
    whole so a gateway never reads half of it."""
    entries: list[Any] = []
    if path.exists():
        entries = [e.model_dump(exclude_none=True)
                   for e in parse_key_file(path.read_text(), str(path)).keys]
    if any(e["name"] == entry["name"] for e in entries):
        raise KeyFileError(f"{path}: a key named {entry['name']!r} is already there")
    text = yaml.safe_dump({"keys": [*entries, entry]}, sort_keys=False)
    parse_key_file(text, str(path))  # names and hashes still unique
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add(args: argparse.Namespace) -> int:
    key = new_key()
    try:
        entry = _entry(args, key)
        if args.file:
            _append(Path(args.file), entry)
    except (KeyFileError, ValueError) as exc:
        print(f"shoal keys add: {exc}", file=sys.stderr)
        return 1
    print(f"# the API key {args.name!r}, shown this once (shoal keeps only its hash):")
    print(key)
    if args.file:
        print(f"# added to {args.file}; gateways reading it take it within "
              "SHOAL_API_KEYS_RELOAD_S")
    else:
        print("# its entry for the keys file (SHOAL_API_KEYS_FILE):")
        print(yaml.safe_dump({"keys": [entry]}, sort_keys=False), end="")
    return 0


def hash_(args: argparse.Namespace) -> int:
    """The stored form of a key read from stdin (a key made elsewhere)."""
    key = sys.stdin.readline().strip()
    if not key:
        print("shoal keys hash: give the key on stdin", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def check(args: argparse.Namespace) -> int:
    path = _keys_file(args)
    if path is None:
        print("no keys file: SHOAL_API_KEYS_FILE is not set (the API is open)")
        return 0
    try:
        keys = parse_key_file(path.read_text(), str(path)).keys
    except (OSError, KeyFileError) as exc:
        print(f"shoal keys check: {exc}", file=sys.stderr)
        return 1
    for e in keys:
        print(f"{e.name}\tmodels={','.join(e.models)}\trequests/min="
              f"{e.requests_per_minute or '-'}\ttokens/min={e.tokens_per_minute or '-'}")
    print(f"{path}: {len(keys)} keys, valid")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="make API keys (gateway/auth/key_file.py)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    adding = keys_sub.add_parser("add", help="make a key: print it once, and its entry")
    adding.add_argument("name", help="the key's name (in logs and errors, never the key)")
    adding.add_argument("--models", help="comma-separated ids or globs it may use (default: *)")
    adding.add_argument("--rpm", type=int, help="requests per minute (default: no limit)")
    adding.add_argument("--tpm", type=int, help="tokens per minute (default: no limit)")
    adding.add_argument("--inputs", help="comma-separated blob-store key globs its bulk jobs "
                        "may name as input (default: only its own jobs' uploads)")
    adding.add_argument("--admin", action="store_true",
                        help="an operator's key: sees and cancels every key's jobs")
    adding.add_argument("--file", help="add the entry to this keys file (created 0600)")
    adding.set_defaults(run=add)
    keys_sub.add_parser("hash", help="the stored hash of a key given on stdin").set_defaults(
        run=hash_)
    checking = keys_sub.add_parser("check", help="check a keys file")
    checking.add_argument("file", nargs="?", help="default: SHOAL_API_KEYS_FILE")
    checking.set_defaults(run=check)
