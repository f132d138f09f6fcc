"""Where a model comes from, and the catalog file onboarding writes for it.

`locate(SOURCE)` turns what a user typed (a folder, an installed package, a hub id) into
the local folder to read and the catalog `source:` that finds it again. `render` writes
the entry as YAML with each detected value commented with the file it came from, so a
reader can check every line against the model's own files.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import re
from pathlib import Path
from typing import Any

import yaml

from app.onboard.detect import Detection
from app.onboard.files import OnboardError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def locate(source: str) -> tuple[Path, dict[str, str]]:
    """The folder to read and the entry's `source:` for SOURCE: a folder; a package
    (`package:NAME[/SUBDIR]`, or an installed package's name: its first subfolder with a
    config.json); or a hub id (`org/name`, only where the hub can be reached)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path.resolve(), {"path": str(path.resolve())}
    name = source.removeprefix("package:")
    package, _, subdir = name.partition("/")
    if package.isidentifier():
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            root = Path(next(iter(spec.submodule_search_locations)))
            if not subdir:
                found = sorted(p.parent for p in root.glob("*/config.json"))
                subdir = found[0].name if found else ""
            folder = root / subdir
            if not folder.is_dir():
                raise OnboardError(f"package {package} has no folder {subdir!r}")
            return folder, {"package": package, **({"subdir": subdir} if subdir else {})}
        if source.startswith("package:"):
            raise OnboardError(f"package {package} is not installed")
    if _HUB_ID.fullmatch(source):
        from tasks.sources import SourceError, download

        try:
            return Path(download(source, None)), {"hub": source}
        except SourceError as exc:
            raise OnboardError(str(exc).splitlines()[0]) from None
    raise OnboardError(f"{source} is not a folder, an installed package or a hub id "
                       "(org/name)")


_CARD_ID = re.compile(
    r"(?:SentenceTransformer|CrossEncoder|SparseEncoder|from_pretrained|pipeline)"
    r"""\((?:[^)'"]*,\s*)?(?:model=)?['"]([A-Za-z0-9][\w.-]*/[\w.-]+)['"]""")


def model_id(folder: Path, given: str | None) -> tuple[str, str]:
    """The id users will call it by, and where it came from: given; else the hub id the
    model card's own usage code loads (config.json's _name_or_path is not used: a
    fine-tune records its base model there); else `local/<folder name>`."""
    if given:
        return given, "given on the command line (--id)"
    card = folder / "README.md"
    if card.is_file():
        ids = _CARD_ID.findall(card.read_text(encoding="utf-8", errors="replace"))
        if ids:
            best = max(set(ids), key=ids.count)
            return best, "README.md, the model card's usage code"
    name = folder.name if folder.name not in ("model", "") else folder.parent.name
    return f"local/{name}", "the folder's name (no --id, no id in a model card)"


def entry_fields(model: str, source: dict[str, str], detection: Detection) -> dict[str, Any]:
    """The catalog entry as a dict (what `ModelEntry.model_validate` takes)."""
    fields: dict[str, Any] = {"id": model, "adapter": detection.adapter, "source": source}
    prompts: dict[str, str] = {}
    for name, setting in detection.settings.items():
        if name == "id":
            continue
        if name.startswith("prompts."):
            prompts[name.split(".", 1)[1]] = setting.value
        else:
            fields[name] = setting.value
    if prompts:
        fields["prompts"] = prompts
    return fields


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6)
    return text.removesuffix("\n...\n").strip()


def render(fields: dict[str, Any], detection: Detection, header: list[str],
           profile: tuple[str, dict[str, Any], list[str]] | None = None) -> str:
    """The YAML text of an entry: `header` comment lines, each field with its source as a
    comment, and `profile` (device, fields, comment lines) under `profiles:`."""
    lines = [f"# {line}" if line else "#" for line in header]
    comments = {name: s.source for name, s in detection.settings.items()}
    comments["adapter"] = detection.why
    for name, value in fields.items():
        if isinstance(value, dict) and not value:
            continue  # an empty mapping would read back as null
        if isinstance(value, dict):
            lines.append(f"{name}:")
            for key, inner in value.items():
                note = comments.get(f"{name}.{key}")
                lines.append(f"  {key}: {_scalar(inner)}" + (f"  # {note}" if note else ""))
            continue
        note = comments.get(name)
        lines.append(f"{name}: {_scalar(value)}" + (f"  # {note}" if note else ""))
    if detection.labels:
        lines.append(f"# labels (config.json id2label): {', '.join(detection.labels)}")
    for note in detection.notes:
        lines.append(f"# note: {note}")
    if profile is not None:
        device, values, notes = profile
        lines += ["profiles:", f"  {device}:"]
        lines += [f"    # {line}" for line in notes]
        lines += [f"    {key}: {_scalar(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def header_lines(source_arg: str, library: str, headline: str) -> list[str]:
    return [f"Written by `shoal onboard {source_arg}` on {dt.date.today().isoformat()}: "
            "detected from the model's own files",
            f"and checked against {library} ({headline}).",
            "Each value's comment names the file it was read from."]


def file_name(model: str) -> str:
    """The catalog file for a model id: its last part, lowercased."""
    return re.sub(r"[^a-z0-9.]+", "-", model.rsplit("/", 1)[-1].lower()).strip("-") + ".yaml"
