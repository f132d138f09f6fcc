import pytest

from tasks.adapters import ADAPTERS
from tasks.catalog import LORA_ADAPTERS, Catalog, CatalogError, load_catalog, load_entry
from tasks.errors import ErrorCode, ShoalError
from tasks.settings import DEFAULT_MODEL, PACKAGED_CATALOG_DIR, REPO_ROOT, Settings


def test_shipped_catalog_is_valid():
    catalog = load_catalog()
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
    catalog = load_catalog()
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
    assert entry.runtime == "pytorch"  # the default engine


def test_every_shipped_entry_is_valid_and_ids_are_unique():
    catalog = Catalog.from_dir(PACKAGED_CATALOG_DIR)
    entries = list(catalog)
    assert len({e.id for e in entries}) == len(entries)
    for entry in entries:
        assert catalog.origin(entry.id).suffix == ".yaml"


def test_a_source_checkout_reads_the_top_level_models_folder():
    # A wheel installs it as tasks/models instead (tests/e2e/test_wheel.py).
    assert PACKAGED_CATALOG_DIR == REPO_ROOT / "models"
    assert Settings.model_fields["catalog_dir"].default == PACKAGED_CATALOG_DIR
    assert load_catalog(PACKAGED_CATALOG_DIR).get(DEFAULT_MODEL) is not None


def test_a_user_folder_adds_entries_and_replaces_packaged_ones(tmp_path):
    (tmp_path / "mine.yaml").write_text(
        f"id: {DEFAULT_MODEL}\nadapter: dense\ndims: 384\ndescription: my own MiniLM\n"
        "source: {path: /srv/weights/minilm}\n")
    (tmp_path / "new.yaml").write_text("id: me/new\nadapter: dense\ndims: 8\n"
                                       "source: {hub: me/new}\n")
    packaged = load_catalog()
    catalog = load_catalog(tmp_path)
    mine = catalog.get(DEFAULT_MODEL)
    assert mine is not None and mine.description == "my own MiniLM"
    assert mine.source.path == "/srv/weights/minilm"
    assert catalog.origin(DEFAULT_MODEL) == tmp_path / "mine.yaml"
    assert catalog.get("me/new") is not None and catalog.origin("me/new") == tmp_path / "new.yaml"
    others = {e.id for e in packaged} - {DEFAULT_MODEL}
    assert others and all(catalog.origin(m) == packaged.origin(m) for m in others)
    assert packaged.get(DEFAULT_MODEL).description != "my own MiniLM"


def test_a_user_folder_must_exist_and_have_unique_ids(tmp_path):
    with pytest.raises(CatalogError, match="does not exist"):
        load_catalog(tmp_path / "nope")
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text("id: me/x\nadapter: dense\ndims: 8\nsource: {hub: me/x}\n")
    with pytest.raises(CatalogError, match="also defined in"):
        load_catalog(tmp_path)


# --- LoRA adapters --------------------------------------------------------------------------


LORA_ENTRY = ("id: x/y\nsource: {hub: x/y}\nadapter: dense\ndims: 8\n"
              "loras:\n  legal: {path: /srv/loras/legal}\n  team/support.v2: {hub: team/lora}\n")


def test_loras_name_their_sources(tmp_path):
    entry = load_entry(_write(tmp_path, LORA_ENTRY))
    assert set(entry.loras) == {"legal", "team/support.v2"}
    assert entry.loras["legal"].path == "/srv/loras/legal"
    assert entry.loras["team/support.v2"].hub == "team/lora"
    assert load_entry(_write(tmp_path, "id: a/b\nsource: {hub: a/b}\nadapter: causal-lm\n"
                                       "loras: {chat: {path: /l}}\n")).loras["chat"].path == "/l"
    assert load_entry(_write(tmp_path, "id: a/b\nsource: {hub: a/b}\nadapter: dense\n"
                                       "dims: 8\n")).loras == {}
    assert {"dense", "causal-lm"} == LORA_ADAPTERS and LORA_ADAPTERS.issubset(ADAPTERS)


@pytest.mark.parametrize("body,fragment", [
    # Only the families whose runtime serves LoRAs may list them.
    ("adapter: sparse\nloras: {a: {path: /l}}\n", "does not serve LoRA"),
    ("adapter: cross-encoder\nloras: {a: {path: /l}}\n", "does not serve LoRA"),
    # ':' separates model and LoRA in "model:lora"; names are header- and URL-safe.
    ("adapter: dense\ndims: 8\nloras: {'a:b': {path: /l}}\n", "no ':'"),
    ("adapter: dense\ndims: 8\nloras: {'': {path: /l}}\n", "not allowed"),
    ("adapter: dense\ndims: 8\nloras: {'my lora': {path: /l}}\n", "not allowed"),
    ("adapter: dense\ndims: 8\nloras: {'-x': {path: /l}}\n", "not allowed"),
    ("adapter: dense\ndims: 8\nloras: {a: {path: /l, hub: b/c}}\n", "exactly one"),
    # A request names its LoRA; a model does not default to one.
    ("adapter: dense\ndims: 8\nloras: {a: {path: /l}}\ndefaults: {lora: a}\n",
     "lora cannot be a default"),
])
def test_loras_are_checked(tmp_path, body, fragment):
    with pytest.raises(CatalogError) as err:
        load_entry(_write(tmp_path, "id: x/y\nsource: {hub: x/y}\n" + body))
    assert "loras" in str(err.value) or "defaults" in str(err.value)
    assert fragment in str(err.value)


def test_parse_takes_a_lora_of_the_entry_and_refuses_others(tmp_path):
    entry = load_entry(_write(tmp_path, LORA_ENTRY))
    parsed = entry.parse({"items": [{"text": "a"}], "options": {"lora": "team/support.v2"}})
    assert parsed.options.lora == "team/support.v2"
    assert entry.parse({"items": [{"text": "a"}]}).options.lora is None
    with pytest.raises(ShoalError) as err:
        entry.parse({"items": [{"text": "a"}], "options": {"lora": "medical"}})
    assert err.value.code == ErrorCode.LORA_NOT_FOUND and err.value.status == 404
    assert "'medical'" in err.value.message
    assert "['legal', 'team/support.v2']" in err.value.message
    # The schema's own checks come first.
    with pytest.raises(ShoalError) as err:
        entry.parse({"items": [{"text": "a"}], "options": {"lora": 3}})
    assert err.value.code == ErrorCode.VALIDATION_ERROR and "options.lora" in err.value.message


def test_parse_refuses_a_lora_where_the_model_has_none():
    catalog = load_catalog()
    embedder = catalog.get(DEFAULT_MODEL)
    with pytest.raises(ShoalError) as err:
        embedder.parse({"items": [{"text": "a"}], "options": {"lora": "legal"}})
    assert err.value.code == ErrorCode.LORA_NOT_FOUND
    assert "has no LoRA adapters" in err.value.message and DEFAULT_MODEL in err.value.message
    # Operations whose adapters never take a LoRA have no such option at all.
    reranker = next(e for e in catalog if e.operation == "score")
    with pytest.raises(ShoalError) as err:
        reranker.parse({"query": "q", "items": [{"text": "a"}], "options": {"lora": "legal"}})
    assert err.value.code == ErrorCode.VALIDATION_ERROR and "unknown options" in err.value.message


def test_a_generate_request_names_its_lora(tmp_path):
    entry = load_entry(_write(tmp_path, "id: a/b\nsource: {hub: a/b}\nadapter: causal-lm\n"
                                        "loras: {chat: {path: /l}}\n"))
    kwargs = {"items": [{"text": "hi"}], "options": {"lora": "chat", "max_tokens": 3}}
    assert entry.parse(kwargs).options.lora == "chat"
    with pytest.raises(ShoalError) as err:
        entry.parse({"items": [{"text": "hi"}], "options": {"lora": "chats"}})
    assert err.value.code == ErrorCode.LORA_NOT_FOUND and "['chat']" in err.value.message


# --- precision ------------------------------------------------------------------------------


def test_fp16_is_refused_in_the_cpu_profile(tmp_path):
    path = _write(tmp_path, "id: x/y\nsource: {hub: x/y}\nadapter: dense\ndims: 8\n"
                  "profiles:\n  cpu: {max_items: 8, precision: fp16}\n")
    with pytest.raises(CatalogError) as err:
        load_entry(path)
    message = str(err.value)
    assert "entry.yaml" in message and "profiles.cpu.precision" in message
    assert "fp16" in message and "['fp32', 'bf16']" in message


@pytest.mark.parametrize("profiles,expected", [
    ({"cpu": "bf16"}, {"cpu": "bf16"}),
    ({"cpu": "fp32", "cuda": "fp16"}, {"cpu": "fp32", "cuda": "fp16"}),
    ({"h100": "fp16", "l4": "bf16"}, {"h100": "fp16", "l4": "bf16"}),
])
def test_precisions_the_device_runs_are_accepted(tmp_path, profiles, expected):
    lines = "".join(f"  {device}: {{precision: {p}}}\n" for device, p in profiles.items())
    entry = load_entry(_write(tmp_path, "id: x/y\nsource: {hub: x/y}\nadapter: dense\n"
                              f"dims: 8\nprofiles:\n{lines}"))
    assert {device: entry.profile(device).precision for device in profiles} == expected


def test_a_profile_without_precision_leaves_it_to_the_device(tmp_path):
    entry = load_entry(_write(tmp_path, "id: x/y\nsource: {hub: x/y}\nadapter: dense\n"
                              "dims: 8\nprofiles:\n  cpu: {max_items: 8}\n"))
    assert entry.profile("cpu").precision is None


def test_an_unknown_precision_is_refused_with_the_known_ones(tmp_path):
    path = _write(tmp_path, "id: x/y\nsource: {hub: x/y}\nadapter: dense\ndims: 8\n"
                  "profiles:\n  cuda: {precision: fp8}\n")
    with pytest.raises(CatalogError) as err:
        load_entry(path)
    assert "profiles.cuda.precision" in str(err.value)
    assert all(f"'{p}'" in str(err.value) for p in ("fp32", "fp16", "bf16"))


# --- queue type -----------------------------------------------------------------------------

_ENTRY = "id: me/q\nadapter: dense\ndims: 8\nsource: {hub: me/q}\n"


@pytest.mark.parametrize("value", ["classic", "quorum"])
def test_an_entry_may_choose_its_queue_type(tmp_path, value):
    assert load_entry(_write(tmp_path, _ENTRY + f"queue_type: {value}\n")).queue_type == value
    assert load_entry(_write(tmp_path, _ENTRY)).queue_type is None  # SHOAL_QUEUE_TYPE's


@pytest.mark.parametrize("value", ["stream", "Classic", "1", "[classic]"])
def test_another_queue_type_is_refused_naming_the_field(tmp_path, value):
    path = _write(tmp_path, _ENTRY + f"queue_type: {value}\n")
    with pytest.raises(CatalogError) as refused:
        load_entry(path)
    message = str(refused.value)
    assert str(path) in message and "field 'queue_type'" in message, message
    assert "'quorum' or 'classic'" in message, message


def test_the_queue_type_is_the_models_not_a_devices(tmp_path):
    # One queue per model, declared alike by the gateway and workers on every device.
    path = _write(tmp_path, _ENTRY + "profiles: {cpu: {queue_type: classic}}\n")
    with pytest.raises(CatalogError, match=r"field 'profiles\.cpu\.queue_type'"):
        load_entry(path)
