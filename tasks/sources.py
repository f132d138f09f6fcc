"""Turn a catalog `source` into a local directory of its files: the workers load weights
from it, the gateway reads tokenizers from it (`gateway.calls.model_tokenizers`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tasks.catalog import Source


class SourceError(RuntimeError):
    pass


def resolve_source(source: Source, local_only: bool = False) -> str:
    """The local directory of the weights (what from_pretrained is given); `local_only`:
    a hub model only from the local cache (SourceError if it is not there)."""
    if source.path:
        path = Path(source.path).expanduser() / source.subdir
        if not path.is_dir():
            raise SourceError(f"model directory {path} does not exist")
        return str(path)
    if source.package:
        spec = importlib.util.find_spec(source.package)
        if spec is None or not spec.submodule_search_locations:
            raise SourceError(
                f"package '{source.package}' is not installed (pip install "
                f"{source.package.replace('_', '-')})"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / source.subdir
        if not path.is_dir():
            raise SourceError(f"package '{source.package}' has no directory {source.subdir!r}")
        return str(path)
    assert source.hub
    return download(source.hub, source.revision, local_only)


def download(repo_id: str, revision: str | None, local_only: bool = False) -> str:
    """A local snapshot of a hub repository (cached; offline mode reads the cache only).

    Adapters then read every file the same way for all sources (sentence-transformers
    configs, a ColBERT projection), instead of each asking the hub on its own.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id=repo_id, revision=revision,
                                 local_files_only=local_only)
    except LocalEntryNotFoundError as exc:
        raise SourceError(f"{repo_id} is not in the local Hugging Face cache and the hub "
                          f"cannot be reached (offline?): {exc}") from exc
    except HfHubHTTPError as exc:
        raise SourceError(f"cannot download {repo_id} from the hub: {exc}") from exc
