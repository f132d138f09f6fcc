"""bench/lib's shared pieces: the --env option and its pairs, the GPU checks' texts and
catalog."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from bench.lib.args import add_env, env_of
from bench.lib.minilm import MINILM, texts, write_catalog


def test_env_pairs_repeat_and_keep_an_equals_sign_in_the_value() -> None:
    parser = argparse.ArgumentParser()
    add_env(parser, "settings for the stack")
    args = parser.parse_args(["--env", "A=1", "--env", "B=x=y", "--env", "A=2"])
    assert env_of(args.env) == {"A": "2", "B": "x=y"}
    assert env_of(parser.parse_args([]).env) == {}


def test_a_pair_without_an_equals_sign_is_refused() -> None:
    with pytest.raises(ValueError):
        env_of(["A"])


def test_texts_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    first = texts(20, seed=3)
    assert first == texts(20, seed=3) and first != texts(20, seed=4)
    assert all(5 <= len(t.split()) <= 40 for t in first)
    assert all(len(t.split()) == 2 for t in texts(5, seed=0, words=(2, 2)))


def test_the_catalog_has_a_dense_entry_per_model_with_its_width(tmp_path: Path) -> None:
    for name, width in ((MINILM, 384), ("shoal-check/wide", 768)):
        folder = tmp_path / name.replace("/", "_")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"hidden_size": width}))
    catalog = write_catalog(tmp_path / "catalog", {
        MINILM: tmp_path / MINILM.replace("/", "_"),
        "shoal-check/wide": tmp_path / "shoal-check_wide"})
    entries = {e["id"]: e for e in (yaml.safe_load(p.read_text())
                                    for p in sorted(catalog.glob("*.yaml")))}
    assert entries[MINILM]["dims"] == 384 and entries[MINILM]["pooling"] == "mean"
    assert entries["shoal-check/wide"]["dims"] == 768
    assert entries["shoal-check/wide"]["pooling"] == "cls"
