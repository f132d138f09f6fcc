"""app.onboard.report: the page and plots an onboarding run leaves, from hand-built reports."""

from __future__ import annotations

import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest

from app.onboard.report import (
    figure_text,
    headline,
    headline_text,
    image_stems,
    num,
    slug,
    write_report,
)
from app.onboard.results import Candidate, CurvePoint, ModelReport
from tests.stack import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMMAND = "shoal onboard --catalog models/"


def curve(*rows: tuple[float, float, float]) -> list[CurvePoint]:
    """(load, throughput, p99) rows; p50 is half the p99."""
    return [CurvePoint(load, tput, p99 / 2, p99) for load, tput, p99 in rows]


def tuned() -> ModelReport:
    """A dense model, PyTorch fp32 chosen over ONNX int8 (faster, but outside tolerance)."""
    fp32 = Candidate("pytorch", "fp32", {"cosine_min": 0.99998, "norm_diff_max": 1e-6},
                     parity_ok=True, tolerance="cosine >= 0.9999",
                     knee_throughput=812.4, knee_p99_ms=38.2, knee_load=16,
                     curve=curve((1, 90, 11), (4, 350, 14), (16, 812.4, 38.2),
                                 (32, 830, 160)),
                     chosen=True)
    int8 = Candidate("onnx", "int8", {"cosine_min": 0.9912}, parity_ok=False,
                     tolerance="cosine >= 0.99", knee_throughput=1490, knee_p99_ms=21.5,
                     knee_load=32, curve=curve((1, 140, 7), (8, 900, 9), (32, 1490, 21.5)),
                     note="parity | below tolerance")
    return ModelReport("sentence-transformers/all-MiniLM-L6-v2", "dense", "tuned",
                       weights_hash="ab12cd", device="NVIDIA H100", seconds=184.3,
                       candidates=[fp32, int8],
                       choices=["pooling=mean (1_Pooling/config.json)",
                                "normalize=true (modules.json)"])


def refused() -> ModelReport:
    return ModelReport("acme/remote-code-model", "unknown", "refused",
                       reason="needs trust_remote_code (auto_map in config.json)", seconds=0.4)


def skipped() -> ModelReport:
    return ModelReport("BAAI/bge-reranker-base", "cross_encoder", "skipped",
                       reason="unchanged since the last run (weights hash matches)")


def verified_only() -> ModelReport:
    """Parity measured, never tuned: figures but no curve."""
    return ModelReport("cardiffnlp/twitter-roberta-sentiment", "classifier", "verified",
                       seconds=12.0,
                       candidates=[Candidate("pytorch", "bf16", {"labels_agree": 1.0},
                                             parity_ok=True, tolerance="labels 100%",
                                             chosen=True)])


def write(tmp_path: Path, reports: list[ModelReport]) -> str:
    path = write_report(reports, tmp_path, "NVIDIA H100", COMMAND, today=date(2025, 3, 4))
    assert path == tmp_path / "README.md"
    return path.read_text(encoding="utf-8")


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the table rows whose first cell is `first_cell`."""
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("| ")]
    return [r for r in rows if r[0] == first_cell]


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


# ---- pure helpers ----------------------------------------------------------------------

def test_slug_lowercases_and_turns_runs_of_other_characters_into_one_dash():
    assert (slug("sentence-transformers/all-MiniLM-L6-v2")
            == "sentence-transformers-all-minilm-l6-v2")
    assert slug("BAAI/bge_reranker..base") == "baai-bge-reranker-base"
    assert slug("/Org/Model/") == "org-model"
    assert slug("///") == "model"


def test_image_stems_keep_colliding_slugs_and_the_overview_apart():
    assert image_stems(["a_b", "a-b", "A/B", "parity", "c"]) == [
        "a-b", "a-b-2", "a-b-3", "parity-2", "c"]


def test_headline_prefers_cosine_then_score_then_labels_then_tokens_then_the_first():
    assert headline({"tokens_agree": 1.0, "labels_agree": 0.9, "score_max_abs_diff": 1e-4,
                     "cosine_min": 0.999}) == ("cosine_min", 0.999)
    assert headline({"tokens_agree": 1.0, "labels_agree": 0.9,
                     "score_max_abs_diff": 1e-4}) == ("score_max_abs_diff", 1e-4)
    assert headline({"tokens_agree": 1.0, "labels_agree": 0.9}) == ("labels_agree", 0.9)
    assert headline({"other": 3.0, "tokens_agree": 1.0}) == ("tokens_agree", 1.0)
    assert headline({"zeta": 3.0, "alpha": 1.0}) == ("zeta", 3.0)
    assert headline({}) is None


def test_figures_read_as_the_page_shows_them():
    assert figure_text("cosine_min", 0.99998) == "cosine min 0.99998"
    # The distance from 1 is what parity is judged on: never rounded away.
    assert figure_text("cosine_min", 0.9999999) == "cosine min 0.9999999"
    assert figure_text("cosine_min", 0.97) == "cosine min 0.9700"
    assert figure_text("labels_agree", 1.0) == "labels 100%"
    assert figure_text("labels_agree", 0.875) == "labels 87.5%"
    assert figure_text("tokens_agree", 0.999999) == "tokens >99.99%"
    assert figure_text("score_max_abs_diff", 0.000031) == "score max abs diff 3.1e-05"
    assert figure_text("cosine_min", float("nan")) == "cosine min n/a"
    assert headline_text({}) == "-"


def test_num_keeps_about_three_significant_digits_and_no_exponent():
    assert [num(v) for v in (12345.6, 812.4, 38.24, 1.234, 0.01234, 0.0, -3.5)] == [
        "12346", "812", "38.2", "1.23", "0.0123", "0", "-3.5"]
    assert [num(v) for v in (16.0, 0.4, 100.0, 0.1004)] == ["16", "0.4", "100", "0.1"]
    assert num(None) == "-" and num(float("nan")) == "-" and num(None, missing="n/a") == "n/a"


# ---- the page and plots ----------------------------------------------------------------

def test_the_page_has_a_summary_row_per_model_and_a_section_each(tmp_path):
    text = write(tmp_path, [tuned(), refused(), skipped()])

    assert text.startswith("# shoal onboarding: NVIDIA H100, 2025-03-04\n")
    assert f"```sh\n{COMMAND}\n```" in text
    assert "3 models: 1 tuned, 1 refused, 1 skipped." in text
    assert table_rows(text, "sentence-transformers/all-MiniLM-L6-v2") == [
        ["sentence-transformers/all-MiniLM-L6-v2", "dense", "tuned", "pytorch fp32", "812",
         "38.2", "cosine min 0.99998", "184"]]
    assert table_rows(text, "acme/remote-code-model") == [
        ["acme/remote-code-model", "unknown", "refused", "-", "-", "-", "-", "0.4"]]
    assert table_rows(text, "BAAI/bge-reranker-base")[0][2] == "skipped"
    for model in ("sentence-transformers/all-MiniLM-L6-v2", "acme/remote-code-model",
                  "BAAI/bge-reranker-base"):
        assert f"\n## {model}\n" in text

    assert "> refused: needs trust_remote_code (auto_map in config.json)" in text
    assert "> skipped: unchanged since the last run (weights hash matches)" in text
    assert "- pooling=mean (1_Pooling/config.json)" in text


def test_every_candidate_has_a_row_and_the_chosen_one_is_bold(tmp_path):
    text = write(tmp_path, [tuned()])

    assert table_rows(text, "**pytorch**") == [
        ["**pytorch**", "**fp32**", "cosine min 0.99998, norm diff max 1e-06",
         "cosine >= 0.9999", "yes", "812", "38.2", "16", "-"]]
    # A pipe in a note would split the cell; it is escaped.
    assert table_rows(text, "onnx") == [
        ["onnx", "int8", "cosine min 0.9912", "cosine >= 0.99", "no", "1490", "21.5", "32",
         "parity \\| below tolerance"]]


def test_plots_are_pngs_linked_from_the_page(tmp_path):
    text = write(tmp_path, [tuned(), refused(), skipped()])

    stem = "sentence-transformers-all-minilm-l6-v2"
    assert is_png(tmp_path / f"{stem}.png")
    assert is_png(tmp_path / "parity.png")
    assert f"]({stem}.png)" in text and "](parity.png)" in text
    # Models without a curve get no plot.
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["parity.png", f"{stem}.png"]


def test_a_run_without_curves_draws_no_model_plot_and_still_writes_the_page(tmp_path):
    text = write(tmp_path, [verified_only(), refused(), skipped()])

    assert [p.name for p in tmp_path.glob("*.png")] == ["parity.png"]
    assert table_rows(text, "cardiffnlp/twitter-roberta-sentiment")[0][6] == "labels 100%"
    assert "![cardiffnlp" not in text


def test_a_run_with_no_figures_at_all_writes_no_png(tmp_path):
    text = write(tmp_path, [refused(), skipped()])

    assert list(tmp_path.glob("*.png")) == []
    assert ".png)" not in text
    assert "> refused:" in text


def test_without_matplotlib_the_page_is_still_written_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    text = write(tmp_path, [tuned()])

    assert list(tmp_path.glob("*.png")) == []
    assert "Plots left out: matplotlib is not installed" in text
    assert "1 model: 1 tuned." in text
    assert table_rows(text, "onnx")


def test_an_empty_run_is_a_page_that_says_so(tmp_path):
    text = write(tmp_path / "new" / "dir", [])
    assert "0 models." in text


def test_importing_the_report_does_not_import_matplotlib():
    probe = "import sys, app.onboard.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("cosine_min", [1.0, 1.0000001, float("nan")])
def test_a_perfect_or_missing_cosine_still_plots_on_the_log_axis(tmp_path, cosine_min):
    report = tuned()
    report.candidates[0].parity = {"cosine_min": cosine_min}
    write(tmp_path, [report])
    assert is_png(tmp_path / "parity.png")

