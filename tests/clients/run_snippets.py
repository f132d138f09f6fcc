"""Runs docs/clients.md's snippets in .venv-clients, for tests/e2e/test_clients.py.

Reads a JSON list of `{"name", "code", "probe"}` from the file its argument names. Each
snippet runs as a script would (its own globals, `__name__ == "__main__"`), its printed
output kept apart; then `probe`, an expression over the snippet's globals, says what the
test checks. Prints one JSON object, `{name: {"probe": ..., "printed": ...}}` or
`{name: {"error": traceback}}`: one snippet's failure never hides another's result.

Runs with the client venv's python only: it imports nothing of shoal's.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback


def run(snippet: dict[str, str]) -> dict[str, object]:
    printed = io.StringIO()
    namespace: dict[str, object] = {"__name__": "__main__"}
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(snippet["code"], f"docs/clients.md:{snippet['name']}", "exec"),
                 namespace)
            probe = eval(snippet["probe"], namespace)
    except BaseException:
        return {"error": traceback.format_exc(), "printed": printed.getvalue()}
    return {"probe": probe, "printed": printed.getvalue()}


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as spec:
        snippets = json.load(spec)
    results = {snippet["name"]: run(snippet) for snippet in snippets}
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
