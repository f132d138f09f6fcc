"""`shoal onboard` without hints: tiny random models saved the way their ecosystems save
them are detected, proven against their reference library and written as entries that
the catalog accepts; bad input and files that lie are refused with nothing written.

Tuning needs the live stack (tests/e2e/test_onboard_serving.py); here --no-tune."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.cli import main
from app.onboard.files import OnboardError
from app.onboard.onboard import onboard
from app.onboard.pooling_probe import PAIRS
from tasks.catalog import load_entry
from tests.tiny_classifiers import build_tiny_ner, build_tiny_nli, build_tiny_sentiment
from tests.tiny_clip import build_tiny_clip
from tests.tiny_encoders import build_tiny_colbert_st
from tests.tiny_models import MINILM_DIR, build_tiny_bert
from tests.tiny_onboard import (
    build_causal_lm_with_generation_config,
    build_cls_trained_saved_as_mean,
    build_not_a_model,
    build_remote_code,
    build_st_cross_encoder,
    build_st_dense,
    build_st_sparse,
    build_truncated_weights,
    build_unknown_architecture,
)

REPO = Path(__file__).resolve().parents[2]


def quiet(_: str) -> None:
    pass


def _onboard(folder: Path, catalog: Path, **kwargs) -> dict:
    outcome = onboard(str(folder), catalog, tune_it=False, say=quiet, **kwargs)
    assert outcome.path is not None and outcome.path.is_file()
    load_entry(outcome.path)  # what `shoal models validate` checks
    (parity,) = outcome.report.candidates
    assert parity.parity_ok, parity
    return yaml.safe_load(outcome.path.read_text())


FAMILIES = {
    # name: (builder, expected adapter, expected fields)
    "st-mean-prompts": (
        lambda out: build_st_dense(out, "mean", True,
                                   prompts={"query": "query: ", "document": "passage: "}),
        "dense", {"pooling": "mean", "normalize": True, "max_seq_length": 64,
                  "prompts": {"query": "query: ", "document": "passage: "}}),
    "st-cls": (lambda out: build_st_dense(out, "cls", False), "dense",
               {"pooling": "cls", "normalize": False, "dims": 32}),
    "plain-encoder": (build_tiny_bert, "dense", {"normalize": False, "dims": 32}),
    "cross-encoder": (build_st_cross_encoder, "cross-encoder", {}),
    "sparse": (build_st_sparse, "sparse", {}),
    "sentiment": (build_tiny_sentiment, "sequence-classification", {}),
    "nli": (build_tiny_nli, "zero-shot", {}),
    "ner": (build_tiny_ner, "token-classification", {}),
    "clip": (build_tiny_clip, "clip", {}),
    "causal-lm": (build_causal_lm_with_generation_config, "causal-lm", {}),
    "colbert": (build_tiny_colbert_st, "multivector", {"dims": 16}),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_onboards_without_hints(name, tmp_path):
    builder, adapter, expected = FAMILIES[name]
    folder = builder(tmp_path / name)
    entry = _onboard(folder, tmp_path / "catalog")
    assert entry["adapter"] == adapter
    assert entry["source"] == {"path": str(folder.resolve())}
    assert entry["id"] == f"local/{name}"
    for key, value in expected.items():
        assert entry[key] == value, (key, entry)


def test_the_packaged_minilm_matches_its_hand_written_entry(tmp_path):
    entry = _onboard(MINILM_DIR, tmp_path)
    hand = yaml.safe_load((REPO / "models/all-minilm-l6-v2.yaml").read_text())
    assert entry["id"] == hand["id"]  # from the model card's usage code
    for key in ("adapter", "dims", "max_seq_length"):
        assert entry[key] == hand[key], key
    # The hand-written entry leaves these to the sentence-transformers files: the same.
    assert (entry["pooling"], entry["normalize"]) == ("mean", True)
    text = next(tmp_path.glob("*.yaml")).read_text()
    assert "max_seq_length: 256  # sentence_bert_config.json max_seq_length" in text


def test_files_that_claim_mean_for_weights_trained_with_cls_are_refused(tmp_path):
    folder = build_cls_trained_saved_as_mean(tmp_path / "lying", list(PAIRS))
    catalog = tmp_path / "catalog"
    with pytest.raises(OnboardError, match=r"files say mean pooling.*far better with cls"):
        onboard(str(folder), catalog, tune_it=False, say=quiet)
    assert not catalog.exists()
    # Told, the user serves CLS: checked against the reference rebuilt with CLS pooling.
    entry = _onboard(folder, catalog, pooling="cls")
    assert entry["pooling"] == "cls"
    assert "given on the command line" in next(catalog.glob("*.yaml")).read_text()


def test_an_entry_no_choice_makes_match_is_refused(tmp_path, capsys):
    # A Dense projection after pooling: shoal's dense adapter has none, so no pooling or
    # normalisation choice reproduces sentence-transformers' vectors.
    folder = build_st_dense(tmp_path / "projected", "mean", True, dense_dims=16)
    catalog = tmp_path / "catalog"
    code = main(["onboard", str(folder), "--no-tune", "--catalog-dir", str(catalog)])
    assert code == 3
    err = capsys.readouterr().err
    assert "refused, nothing written" in err and "sentence-transformers" in err
    assert not catalog.exists()


@pytest.mark.parametrize("builder, reason", [
    (build_not_a_model, "no config.json"),
    (build_truncated_weights, "truncated"),
    (build_unknown_architecture, "unknown architecture FrobnicatorModel"),
    (build_remote_code, "needs remote code"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(builder, reason, tmp_path,
                                                            capsys):
    folder = builder(tmp_path / "bad")
    catalog = tmp_path / "catalog"
    assert main(["onboard", str(folder), "--catalog-dir", str(catalog)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0], lines
    assert not catalog.exists()


def test_an_existing_entry_is_kept_unless_forced(tmp_path, capsys):
    folder = build_st_dense(tmp_path / "m", "mean", True)
    catalog = tmp_path / "catalog"
    assert main(["onboard", str(folder), "--no-tune", "--catalog-dir", str(catalog)]) == 0
    path = next(catalog.glob("*.yaml"))
    path.write_text(path.read_text() + "# mine\n")
    assert main(["onboard", str(folder), "--no-tune", "--catalog-dir", str(catalog)]) == 2
    assert "--force" in capsys.readouterr().err
    assert path.read_text().endswith("# mine\n")
    assert main(["onboard", str(folder), "--no-tune", "--force", "--catalog-dir",
                         str(catalog)]) == 0
    assert not path.read_text().endswith("# mine\n")


def test_a_dry_run_prints_the_entry(tmp_path, capsys):
    folder = build_st_dense(tmp_path / "m", "cls", True)
    assert main(["onboard", str(folder), "--no-tune", "--dry-run", "--catalog-dir",
                         str(tmp_path / "catalog")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["pooling"] == "cls" and not (tmp_path / "catalog").exists()


def test_a_missing_folder_is_bad_input():
    with pytest.raises(OnboardError, match="not a folder, an installed package or a hub id"):
        onboard("/nonexistent/model", Path("/tmp/unused"), tune_it=False, say=quiet)


def test_a_catalog_run_verifies_reports_and_resumes(tmp_path):
    from app.onboard.catalog_run import run_catalog
    from app.onboard.report import write_report

    catalog = tmp_path / "catalog"
    for name in ("one", "two"):
        onboard(str(build_st_dense(tmp_path / name, "mean", True, seed=len(name))), catalog,
                tune_it=False, say=quiet)
    (catalog / "gone.yaml").write_text(yaml.safe_dump({
        "id": "local/gone", "adapter": "dense", "dims": 8,
        "source": {"path": str(tmp_path / "not-here")}}))
    out = tmp_path / "report"
    lines: list[str] = []
    reports = run_catalog(catalog, out, tune_it=False, say=lines.append)
    status = {r.model: r.status for r in reports}
    assert status == {"local/one": "verified", "local/two": "verified", "local/gone": "skipped"}
    assert all(r.candidates[0].parity_ok for r in reports if r.status == "verified")
    page = write_report(reports, out, "cpu", "shoal onboard --catalog --no-tune")
    assert "local/one" in page.read_text() and "weights not here" in page.read_text()

    # Run again: unchanged weights are not verified again; changed ones are.
    build_st_dense(tmp_path / "two", "mean", True, seed=99)
    lines.clear()
    again = {r.model: r for r in run_catalog(catalog, out, tune_it=False, say=lines.append)}
    assert "local/one: unchanged since the last run, kept" in lines
    assert "local/two:" in lines
    assert again["local/two"].weights_hash != next(
        r.weights_hash for r in reports if r.model == "local/two")


def test_an_entry_read_back_renders_as_a_valid_entry(tmp_path):
    """The catalog run re-renders entries it read (empty defaults, loras, prompts
    included) for its sweeps' own catalog: that text must load again."""
    from app.onboard.detect import Detection
    from app.onboard.entry import render
    from tasks.catalog import ModelEntry

    entry = ModelEntry.model_validate({"id": "x/y", "adapter": "dense", "dims": 8,
                                       "source": {"path": str(tmp_path)}})
    fields = entry.model_dump(exclude_none=True, exclude={"profiles", "tasks"})
    path = tmp_path / "y.yaml"
    path.write_text(render(fields, Detection("dense", "catalog entry"), [],
                           ("cpu", {"precision": "fp32"}, [])))
    assert load_entry(path).profile("cpu").precision == "fp32"
