"""Vendor the published OpenAPI schemas of the custom resources infra/k8s deploys.

tests/unit/infra/test_k8s.py validates the rendered KEDA, RabbitMQ-operator and
Prometheus-operator objects against these schemas; tests run without network access, so
the schemas live here. Each file is the CRD's `openAPIV3Schema` for one served version,
with the `description` texts dropped (two thirds of the bytes, no constraint in them).

Refresh after moving to a newer operator release (paths or URLs of the CRD YAML files):

    python tests/schemas/vendor_crds.py <raw URL or path of each CRD's YAML> ...

(the URLs are in tests/schemas/crds/README.md)
and update the table in tests/schemas/crds/README.md.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parent / "crds"


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"
                or not isinstance(v, str)}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def _read(source: str) -> str:
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=30) as response:
            return response.read().decode()
    return Path(source).read_text()


def vendor(source: str) -> list[Path]:
    crd = yaml.safe_load(_read(source))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    written = []
    for version in crd["spec"]["versions"]:
        if not version.get("served", True):
            continue
        schema = _without_descriptions(version["schema"]["openAPIV3Schema"])
        path = OUT / f"{group}_{kind.lower()}_{version['name']}.json"
        path.write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for written in vendor(arg):
            print(written.relative_to(OUT.parent.parent.parent), written.stat().st_size)
