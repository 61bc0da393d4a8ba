"""The user-level study recipe runs end to end (--quick) and writes its results and summary."""

import json

import pytest

from tests.helpers import load_recipe


@pytest.mark.slow
def test_user_level_study_quick(tmp_path):
    res = load_recipe("user_level_study").main(["--out", str(tmp_path), "--quick"])
    arms = {r["arm"]: r for r in res["runs"]}
    assert set(arms) == {"record", "els", "uls", "none"}
    assert arms["record"]["privacy_unit"] == "record" and arms["record"]["group_size"] == 16
    for name in ("els", "uls"):
        assert arms[name]["user_epsilon"] <= 8.0 and arms[name]["num_records"] < arms["record"]["num_records"]
    assert {b["arm"] for b in res["benchmark"]} == {"record hooks", "record ghost", "record bk", "uls hooks",
                                                      "uls bk"}
    assert json.loads((tmp_path / "results.json").read_text())["quick"]
    assert "| uls |" in (tmp_path / "summary.md").read_text()
