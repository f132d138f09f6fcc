"""`bench.same_run` reads any benchmark's JSON by dotted paths and names its rows."""

from bench.same_run import label, pick

FEED = {"loads": [{"clients": 64, "texts": 1, "texts_per_s": 1485.0,
                   "cpu_us_per_text": {"total": 950.0, "gateway": 422}},
                  {"clients": 16, "texts": 16, "texts_per_s": 6831,
                   "cpu_us_per_text": {"total": 220.5}}]}
BASELINES = {"in_process": {"1": 120.0, "32": 900.0},
             "levels": [{"name": "shoal", "items_per_request": 1, "items_per_s": 810.0,
                         "ok": True}]}


def test_a_star_takes_every_element_and_a_missing_key_is_skipped():
    assert pick(FEED, "loads.*.cpu_us_per_text.total") == {
        "loads.0.cpu_us_per_text.total": 950.0, "loads.1.cpu_us_per_text.total": 220.5}
    assert pick(FEED, "loads.*.cpu_us_per_text.gateway") == {
        "loads.0.cpu_us_per_text.gateway": 422.0}
    assert pick(FEED, "loads.1.texts_per_s") == {"loads.1.texts_per_s": 6831.0}
    assert pick(FEED, "loads.7.texts_per_s") == {}


def test_only_numbers_are_picked_never_a_flag():
    assert pick(BASELINES, "levels.*.ok") == {}
    assert pick(BASELINES, "in_process.32") == {"in_process.32": 900.0}


def test_rows_are_named_by_their_load_or_their_level():
    assert label(FEED, "loads.1.texts_per_s") == "loads[16x16].texts_per_s"
    assert label(BASELINES, "levels.0.items_per_s") == "levels[shoal x1].items_per_s"


def test_the_rows_asked_for_are_drawn(tmp_path) -> None:
    from bench.same_run import draw

    row = {"before": 400.0, "after": 320.0, "before_range": [380.0, 410.0],
           "after_range": [300.0, 480.0], "ratio": 0.8}
    data = {"command": "python -m bench.same_run --before abc -- bench.device_feed --rounds 1",
            "before": "abc", "after": "def", "rounds": 3,
            "rows": [{**row, "field": "loads[64x1].cpu_us_per_text.total"},
                     {**row, "field": "loads[64x1].texts_per_s"}]}
    path = draw(tmp_path / "plot.png", data, "cpu_us_per_text", "µs per text")
    assert path.read_bytes().startswith(b"\x89PNG")
