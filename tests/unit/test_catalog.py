import pytest

from app.catalog import Catalog, CatalogError, load_entry
from app.settings import REPO_ROOT


def test_shipped_catalog_is_valid():
    catalog = Catalog.from_dir(REPO_ROOT / "models")
    entry = catalog.get("sentence-transformers/all-MiniLM-L6-v2")
    assert entry is not None and entry.dims == 384
    assert entry.profile("cpu") is not None


def test_wrong_entry_names_file_field_and_allowed(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("id: x\nadapter: magic\nsource: {path: /tmp}\ndims: 3\n")
    with pytest.raises(CatalogError) as err:
        load_entry(path)
    assert "bad.yaml" in str(err.value) and "adapter" in str(err.value)
    assert "dense" in str(err.value)


def test_source_needs_exactly_one_origin(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("id: x\nadapter: dense\nsource: {path: /a, hub: b/c}\ndims: 3\n")
    with pytest.raises(CatalogError, match="exactly one of path, package or hub"):
        load_entry(path)


def test_unknown_model_is_reported_with_known_ones():
    catalog = Catalog.from_dir(REPO_ROOT / "models")
    with pytest.raises(CatalogError, match="not in the catalog"):
        catalog.require(["nope/nope"])
