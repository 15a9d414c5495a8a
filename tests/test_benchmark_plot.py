"""benchmarks/plot.py: grouping a results table into series, and drawing every committed table."""
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def test_series_from_the_case_names_last_word(bench_tool):
    plot = bench_tool("plot")
    rows = [{"case": "m b1 fp16 xla", "r": 0.5}, {"case": "m b1 fp16 one_launch", "r": 0.7},
            {"case": "m b2 fp16 xla", "r": 0.6}, {"case": "m b2 fp16 fused", "r": "n/a"}]
    groups, series = plot.series_table(rows, ["r"], series_from_case=True)
    assert groups == ["m b1 fp16", "m b2 fp16"]
    assert list(series) == ["xla", "one_launch"]  # a series without a number is left out
    assert series["xla"] == [0.5, 0.6]
    assert series["one_launch"][0] == 0.7 and math.isnan(series["one_launch"][1])
    assert plot._split_case("llama-2-7b_b1_ctx1024_fp16") == ("llama-2-7b_b1_ctx1024", "fp16")
    assert plot._split_case("single") == ("single", "")


def test_columns_as_series_and_default_metrics(bench_tool):
    plot = bench_tool("plot")
    rows = [{"case": "a", "x_floor_fraction": 0.5, "y_floor_fraction": 0.8, "speedup_vs_z": 2.0}]
    assert plot.default_metrics(list(rows[0])) == ["x_floor_fraction", "y_floor_fraction"]
    assert plot.default_metrics(["case", "speedup_vs_z", "us"]) == ["speedup_vs_z"]
    groups, series = plot.series_table(rows, ["x_floor_fraction", "speedup_vs_z"], series_from_case=False)
    assert groups == ["a"] and series == {"x_floor_fraction": [0.5], "speedup_vs_z": [2.0]}


@pytest.mark.parametrize("table", RESULTS, ids=[p.stem for p in RESULTS])
def test_every_committed_table_draws_or_asks_for_a_metric(table, tmp_path, bench_tool):
    pytest.importorskip("matplotlib")
    plot = bench_tool("plot")
    out = tmp_path / f"{table.stem}.png"
    try:
        assert plot.plot(table, out=out) == out
    except ValueError as e:
        assert "--metric" in str(e)  # no fraction or speedup column: the user names one
        return
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_metric_and_bad_file_are_one_line_errors(tmp_path, capsys, bench_tool):
    pytest.importorskip("matplotlib")
    plot = bench_tool("plot")
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"device": "cpu", "rows": [{"case": "a b", "speedup_vs_x": 1.5}]}))
    assert plot.main([str(table), "--metric", "nope", "--out", str(tmp_path / "t.png")]) == 2
    assert "no column ['nope']" in capsys.readouterr().err
    assert plot.main([str(table), "--metric", "speedup_vs_x,nope2", "--series-from-case"]) == 2
    (tmp_path / "empty.json").write_text("{}")
    assert plot.main([str(tmp_path / "empty.json")]) == 2
    assert "not a results table" in capsys.readouterr().err
    assert plot.main([str(table), "--series-from-case", "--out", str(tmp_path / "ok.png")]) == 0
    assert (tmp_path / "ok.png").exists()
