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


def _write(tmp_path, text: str):
    path = tmp_path / "entry.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("body,fragment", [
    ("adapter: dense\n", "dims"),  # vectors need a width
    ("adapter: cross-encoder\ntasks: [encode]\n", "serves ['score']"),
    ("adapter: zero-shot\ndefaults: {hypothesis_template: 'no slot'}\n", "defaults"),
    ("adapter: causal-lm\ndefaults: {temperature: 9}\n", "options.temperature"),
    ("adapter: clip\ndims: 8\nimage_tokens: 0\n", "image_tokens"),
    ("adapter: dense\ndims: 8\nprompts: {query: 'q: ', passage: 'p: '}\n", "passage"),
])
def test_entries_are_checked_against_their_adapter(tmp_path, body, fragment):
    path = _write(tmp_path, "id: x/y\nsource: {hub: x/y}\n" + body)
    with pytest.raises(CatalogError) as err:
        load_entry(path)
    assert "entry.yaml" in str(err.value) and fragment in str(err.value)


def test_tasks_and_defaults_come_from_the_adapter(tmp_path):
    entry = load_entry(_write(tmp_path, "id: x/y\nsource: {hub: x/y}\nadapter: zero-shot\n"
                                        "defaults: {hypothesis_template: 'About {}.'}\n"))
    assert entry.tasks == ["classify"] and entry.operation == "classify"
    assert entry.contract.implementation.startswith("runtimes.pytorch.")


def test_every_shipped_entry_is_valid_and_ids_are_unique():
    catalog = Catalog.from_dir(REPO_ROOT / "models")
    entries = list(catalog)
    assert len({e.id for e in entries}) == len(entries)
    for entry in entries:
        assert catalog.origin(entry.id).suffix == ".yaml"
