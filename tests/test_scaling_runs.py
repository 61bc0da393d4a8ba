"""The runs table: append/load round trip, clear errors, privacy grouping."""

from __future__ import annotations

import json
import math

import pytest

from dpllm.scaling import RUN_FIELDS, ScalingError, append_run, group_label, load_runs, runs_to_points
from dpllm.scaling.runs import epsilon_key, parse_epsilon


def _row(**over):
    row = {"run_dir": "runs/a", "model": "tiny", "params_total": 2000, "params_trainable": 500,
           "tokens_seen": 1e6, "steps": 100, "logical_batch_size": 256, "epsilon": 7.993, "delta": 1e-6,
           "noise_multiplier": 0.8, "privacy_enabled": True, "final_eval_loss": 3.0,
           "final_eval_ppl": math.exp(3.0), "seed": 0}
    row.update(over)
    return row


def test_append_then_load_round_trips(tmp_path):
    path = tmp_path / "sweep" / "runs.jsonl"
    append_run(path, _row())
    append_run(path, _row(run_dir="runs/b", seed=1, privacy_enabled=False, epsilon=None))
    rows = load_runs(path)
    assert [r["run_dir"] for r in rows] == ["runs/a", "runs/b"]
    assert set(rows[0]) == set(RUN_FIELDS)
    assert path.read_text().count("\n") == 2


def test_append_refuses_incomplete_row(tmp_path):
    row = _row()
    del row["tokens_seen"]
    with pytest.raises(ScalingError, match="missing tokens_seen"):
        append_run(tmp_path / "runs.jsonl", row)


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(ScalingError, match="does not exist"):
        load_runs(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ScalingError, match="is empty"):
        load_runs(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_row()) + "\n\n{not json\n")
    with pytest.raises(ScalingError, match=r"bad.jsonl:3: not valid JSON"):
        load_runs(bad)
    arr = tmp_path / "arr.jsonl"
    arr.write_text("[1, 2]\n")
    with pytest.raises(ScalingError, match=r"arr.jsonl:1: expected a JSON object"):
        load_runs(arr)


def test_grouping_rounds_epsilon_to_two_significant_figures():
    assert epsilon_key(7.993) == 8.0 and epsilon_key(0.497) == 0.5 and epsilon_key(15.09) == 15.0
    assert group_label(_row()) == "eps=8"
    assert group_label(_row(privacy_enabled=False, epsilon=None)) == "non-private"
    assert parse_epsilon("8") == "eps=8" and parse_epsilon("inf") == "non-private"
    with pytest.raises(ScalingError, match="not a number"):
        parse_epsilon("eight")


def test_points_use_trainable_by_default_and_sigma_bar():
    rows = [_row(), _row(privacy_enabled=False, epsilon=None, noise_multiplier=0.0)]
    p = runs_to_points(rows)
    assert list(p["N"]) == [500.0, 500.0]
    assert p["sigma_bar"][0] == pytest.approx(0.8 / 256) and p["sigma_bar"][1] == 0.0
    assert list(runs_to_points(rows, params="total")["N"]) == [2000.0, 2000.0]
    assert list(runs_to_points(rows, group="non-private")["group"]) == ["non-private"]
    with pytest.raises(ScalingError, match="no runs in group eps=2; groups present: eps=8, non-private"):
        runs_to_points(rows, group="eps=2")


@pytest.mark.parametrize("field, value", [("final_eval_loss", float("nan")), ("tokens_seen", 0),
                                          ("params_trainable", -5), ("noise_multiplier", 0.0)])
def test_points_reject_bad_values_naming_the_run(field, value):
    with pytest.raises(ScalingError, match=rf"run runs/a: {field}=.* must be a finite positive number"):
        runs_to_points([_row(**{field: value})])
