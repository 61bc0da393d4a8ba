"""`dpllm report --compliance`: each checklist item decided from a real run directory, and flipped by the change
that should flip it (more passes, a tampered ledger, a missing or stale audit, seeded noise)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from dpllm import compliance

ROOT = Path(__file__).resolve().parents[1]


def _heldout_for(n_train: int, max_records: int = 60) -> str:
    """The held-out fraction that trains on exactly ``n_train`` of the first ``max_records`` pydoc records: a record
    is held out when its keyed hash u < heldout_fraction, so a fraction between two neighbouring u's."""
    from dpllm.config import DataConfig
    from dpllm.data import keyed_draw, load_records

    u = sorted(keyed_draw(t, key=0, purpose="split") for t in load_records(DataConfig(max_records=max_records)))
    k = len(u) - n_train
    return repr((u[k - 1] + u[k]) / 2)


def _train(out, *extra):
    """``python recipes/finetune_llm.py ...`` through its entry point, in this process (a process of its own would
    add only start-up)."""
    from tests.helpers import load_recipe

    assert load_recipe("finetune_llm").cli([
        "--max_records", "60", "--max_length", "32", "--heldout_fraction", _heldout_for(48), "--tiny_hidden_size",
        "32", "--logical_batch_size", "16", "--physical_batch_size", "16", "--eval_every", "0", "--progress", "false",
        "--target_epsilon", "8", "--output_dir", str(out), *extra]) == 0
    return out


def _status(run):
    return {it.name: it.status for it in compliance.check(run)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("compliance")
    # 48 training records at B = 16: q = 1/3, so 3 steps are one expected pass and 4 are more than one.
    one = _train(base / "one", "--max_steps", "3", "--save_every", "1")
    more = _train(base / "more", "--max_steps", "4")
    return one, more


def test_a_finished_single_pass_run(runs):
    one, _ = runs
    s = _status(one)
    assert s["differential_privacy"] == s["epsilon_fixed"] == s["single_epoch"] == compliance.MET
    assert s["dp_gradient_checkpointing"] == s["epsilon_logged"] == s["noise_secret"] == compliance.MET
    assert s["sensitivity_tiers"] == compliance.NA and s["data_sovereignty"] == compliance.MANUAL
    assert s["mia_audit"] == compliance.NOT_MET  # not audited yet
    logged = next(it for it in compliance.check(one) if it.name == "epsilon_logged")
    assert "checkpoint" in logged.evidence and "verifies" in logged.evidence


def test_more_than_one_pass_is_not_met(runs):
    _, more = runs
    item = next(it for it in compliance.check(more) if it.name == "single_epoch")
    assert item.status == compliance.NOT_MET and "1.33 expected passes" in item.evidence
    # Training warned at plan time too (the log and the private report's warnings).
    warned = json.loads((more / "privacy_report.json").read_text())["warnings"]
    assert any("1.33 expected passes over the private records" in w for w in warned)
    one = json.loads((runs[0] / "privacy_report.json").read_text())["warnings"]
    assert not any("expected passes" in w for w in one)


def test_audit_then_stale_audit(runs, tmp_path, capsys):
    from dpllm.export import compliance_section
    from mia.__main__ import main as mia
    from tests.helpers import in_process

    one, _ = runs
    run = tmp_path / "run"
    shutil.copytree(one, run)
    r = in_process(mia, ["audit", "--checkpoint", str(run), "--attacks", "loss", "--n-bootstrap", "20",
                         "--no-progress"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _status(run)["mia_audit"] == compliance.MET
    # The audit reports the run's bounds next to what it measured (JSON, table and a plain reading).
    bounds = json.loads((run / "audit" / "mia_report.json").read_text())["privacy_bounds"]
    assert bounds["unit"] == "record" and 0.5 < bounds["auc"] <= 1 and bounds["exceeded"] == []
    assert 0.01 < bounds["tpr@fpr=0.01"] <= 1 and "loss" in bounds["per_attack"]
    assert "| **bound: any attack** (record level) |" in r.stdout and "can find at most" in r.stdout
    item = next(it for it in compliance.check(run) if it.name == "mia_audit")
    assert "the most any attack can reach against this run's mechanism (record level" in item.evidence
    # An audit above what the run's trade-off curve allows (edited in: every member found at FPR ≤ 0.1%, on enough
    # records that sampling error cannot explain it) fails the item: the implementation is broken.
    path = run / "audit" / "mia_report.json"
    rep = json.loads(path.read_text())
    loss = rep["attacks"]["loss"]
    loss.update({"n_members": 20000, "n_nonmembers": 20000, "tpr@fpr=0.001": 1.0})
    path.write_text(json.dumps(rep))
    item = next(it for it in compliance.check(run) if it.name == "mia_audit")
    assert item.status == compliance.NOT_MET and "exceeds what the mechanism allows" in item.evidence
    failed_card = compliance_section(run)
    loss.update({"tpr@fpr=0.001": 0.0, "tpr@fpr=0.01": 0.0, "auc": 0.5})
    path.write_text(json.dumps(rep))
    assert _status(run)["mia_audit"] == compliance.MET
    # The model card's checklist is the same whatever the audit found (its verdict is a function of the members):
    # it says that the final model was audited and where the private report is.
    assert compliance_section(run) == failed_card and "audited (result private)" in failed_card
    assert "audit/mia_report.json in the private run directory" in failed_card
    # A model changed after the audit was not audited.
    weights = next((run / "checkpoint").glob("adapter_model.*"))
    os.utime(weights, (path.stat().st_mtime + 10, path.stat().st_mtime + 10))
    assert _status(run)["mia_audit"] == compliance.NOT_MET


def test_a_tampered_ledger_fails_logging_and_fixing(runs, tmp_path):
    one, _ = runs
    run = tmp_path / "run"
    shutil.copytree(one, run)
    path = run / "privacy_ledger.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[-1]["noise_multiplier"] = lines[-1]["noise_multiplier"] * 2
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = _status(run)
    assert s["epsilon_logged"] == compliance.NOT_MET and s["epsilon_fixed"] == compliance.NOT_MET


def test_cli_exit_code_and_json(runs, capsys):
    """`dpllm report` through its entry point (``dpllm.cli.main``, which the console script calls and exits with)."""
    from dpllm.cli import main as dpllm
    from tests.helpers import in_process

    one, _ = runs
    r = in_process(dpllm, ["report", str(one), "--compliance", "--json"], capsys)
    assert r.returncode == 1  # the audit is missing
    items = json.loads(r.stdout)
    assert [i["name"] for i in items] == ["differential_privacy", "epsilon_fixed", "single_epoch",
                                          "dp_gradient_checkpointing", "epsilon_logged", "noise_secret",
                                          "sensitivity_tiers", "data_sovereignty", "mia_audit"]
    r = in_process(dpllm, ["report", str(one), "--json"], capsys)
    assert r.returncode == 2 and "usage" in r.stderr


def test_public_table_hides_private_evidence(runs):
    one, _ = runs
    table = compliance.public_table(compliance.check(one))
    assert "privacy_ledger.jsonl: verifies" not in table and "checked on the private run directory" in table
    assert "expected passes" in table  # public mechanism parameters stay


def test_export_puts_the_checklist_in_the_model_card(runs, tmp_path):
    from dpllm.export import export

    one, _ = runs
    card = (export(one, tmp_path / "bundle") / "README.md").read_text()
    assert "## Compliance checklist" in card and "| single-epoch training" in card
    assert "checked on the private run directory" in card and "privacy_ledger.jsonl: verifies" not in card


def _commands(text: str) -> list[list[str]]:
    """Every command ``text`` recommends: each backticked span that starts with ``python -m mia`` or ``dpllm``."""
    import re
    import shlex

    found = [shlex.split(c) for c in re.findall(r"`((?:python -m mia|dpllm) [^`]*)`", text)]
    # An unquoted mention would be a command this test cannot tell from prose: every mia command is backticked.
    assert text.count("python -m mia") == sum(c[:3] == ["python", "-m", "mia"] for c in found), text
    return found


def _check_command(cmd: list[str]) -> None:
    """Parse ``cmd`` with the real parser of the command it names and check its target is of the kind it takes."""
    from mia.__main__ import build_parser
    from mia.audit import is_run_dir

    if cmd[:3] == ["python", "-m", "mia"]:
        args = build_parser().parse_args(cmd[3:])
        assert args.command == "audit" and (is_run_dir(args.checkpoint) or (args.members and args.nonmembers)), cmd
    else:
        assert cmd[:2] == ["dpllm", "report"], cmd
        args = compliance._report_parser().parse_args(cmd[2:])
        assert (Path(args.run_dir) / "privacy_report.json").is_file(), cmd


def _report(target, *flags, capsys):
    code = compliance.cli_main([str(target), "--compliance", *flags])
    out = capsys.readouterr().out
    return code, out


def _card_statuses(card: str) -> dict:
    table = card.split("## Compliance checklist", 1)[1]
    rows = [r.split(" | ") for r in table.splitlines() if r.startswith("| ") and not r.startswith("| item")]
    return {r[0].strip("| "): r[1].strip("*") for r in rows}


def test_bundle_card_and_report_agree_and_every_recommended_command_runs(runs, tmp_path, capsys):
    from dpllm import ledger
    from dpllm.export import export

    one, _ = runs
    bundle = export(one, tmp_path / "bundle")
    card = (bundle / "README.md").read_text()
    code, out = _report(bundle, "--json", capsys=capsys)
    items = json.loads(out)
    assert [i["name"] for i in items] == list(compliance.ITEM_NAMES)
    # One verdict: the card's table and `dpllm report BUNDLE --compliance` agree item by item.
    assert _card_statuses(card) == {i["requirement"]: i["status"] for i in items}
    assert code == 1 and [i["name"] for i in items if i["status"] == compliance.NOT_MET] == ["mia_audit"]
    assert {i["name"]: i["status"] for i in items}["epsilon_logged"] == compliance.MET
    code, text = _report(bundle, capsys=capsys)
    assert compliance.format_table(compliance.check(bundle)) in card  # the very table the card renders
    # The ledger head the docs tell users to record is on the card (and in the report), from a salted chain.
    head = ledger.head(one)
    assert ledger.read(one)[0]["salt"] and f"`{head}`" in card and f"privacy ledger head {head}" in text
    # Every command either output recommends is valid for its input: the audit names the run directory.
    for target in (one, one / "checkpoint", bundle):
        _, text = _report(target, capsys=capsys)
        for cmd in _commands(text):
            _check_command(cmd)
    _, text = _report(one, capsys=capsys)
    assert _commands(text) == [["python", "-m", "mia", "audit", "--checkpoint", str(one)]]
    # A run's checkpoint/ is checked as the run it belongs to.
    assert _status(one / "checkpoint") == _status(one)


def test_export_refuses_unmet_items_unless_accepted(runs, tmp_path, capsys):
    from dpllm.cli import main as dpllm_main

    one, _ = runs
    assert dpllm_main(["export", str(one), "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mia_audit" in err and "--accept-unmet mia_audit" in err
    assert f"`python -m mia audit --checkpoint {one}`" in err and not (tmp_path / "b").exists()
    assert dpllm_main(["export", str(one), "--out", str(tmp_path / "b"), "--accept-unmet", "mia_audit"]) == 0
    assert "not met (--accept-unmet): mia_audit" in capsys.readouterr().err
    card = (tmp_path / "b" / "README.md").read_text()
    assert "Not met when this bundle was exported, released by the publisher's choice: mia_audit." in card
    assert dpllm_main(["export", str(one), "--out", str(tmp_path / "c"), "--accept-unmet", "mia_audti"]) == 2


def test_bundle_files_are_readable_by_others(runs, tmp_path):
    from dpllm.export import export

    one, _ = runs
    run = tmp_path / "run"
    shutil.copytree(one, run)
    for p in (run / "checkpoint").rglob("*"):
        os.chmod(p, 0o700 if p.is_dir() else 0o600)  # an owner-only run directory stays so; its release does not
    old = os.umask(0o022)
    try:
        bundle = export(run, tmp_path / "bundle")
    finally:
        os.umask(old)
    modes = {p.relative_to(bundle).as_posix(): oct(p.stat().st_mode & 0o777) for p in [bundle, *bundle.rglob("*")]}
    assert set(modes.values()) == {oct(0o755), oct(0o644)} and modes["."] == oct(0o755), modes
    assert all(v == oct(0o755 if (bundle / k).is_dir() else 0o644) for k, v in modes.items()), modes
    assert (run / "checkpoint" / "adapter_config.json").stat().st_mode & 0o777 == 0o600


def test_a_bundle_without_a_recorded_checklist_is_one_line(runs, tmp_path, capsys):
    from dpllm.export import export

    one, _ = runs
    bundle = export(one, tmp_path / "bundle")
    path = bundle / "privacy_report.json"
    data = json.loads(path.read_text())
    del data["release"]["compliance"]  # as a bundle exported before the checklist was recorded
    path.write_text(json.dumps(data))
    assert compliance.cli_main([str(bundle), "--compliance"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recorded no compliance checklist" in err and "export it again" in err


def _audited(run, tmp_path, *, tpr_at_0_1: float):
    """A copy of ``run`` with a loss audit of its final model (written after it), on 20,000 members and as many
    non-members, whose TPR at FPR 0.1% is ``tpr_at_0_1``: 1.0 is far above any ε-DP bound beyond sampling error."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "audit").mkdir()
    loss = {"auc": 0.5, "n_members": 20000, "n_nonmembers": 20000, "tpr@fpr=0.001": tpr_at_0_1}
    (copy / "audit" / "mia_report.json").write_text(json.dumps({"attacks": {"loss": loss}}))
    return copy


def test_a_failed_audit_blocks_export_unless_forced_and_the_card_says_so(runs, tmp_path, capsys):
    """Issue 46, item 7a: an audit measuring more than ε allows did not stop `dpllm export`. It is refused now,
    and exported only with --allow-failed-audit, whose card and released report say it was."""
    from huggingface_hub import ModelCard

    from dpllm.cli import main as dpllm_main
    from dpllm.export import ExportError, export

    run = _audited(runs[0], tmp_path, tpr_at_0_1=1.0)
    assert _status(run)["mia_audit"] == compliance.NOT_MET
    with pytest.raises(ExportError, match=r"membership audit of the final model \(audit/mia_report.json, attack "
                                          r"loss\) measured tpr@fpr=0.001 above.*--allow-failed-audit"):
        export(run, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()
    assert dpllm_main(["export", str(run), "--out", str(tmp_path / "bundle"), "--allow-failed-audit"]) == 0
    card = (tmp_path / "bundle" / "README.md").read_text()
    assert "**Exported despite a failed audit:** the membership audit of the final model" in card
    released = json.loads((tmp_path / "bundle" / "privacy_report.json").read_text())["release"]
    assert released["exported_despite_failed_audit"].startswith("the membership audit of the final model")
    meta = ModelCard.load(tmp_path / "bundle" / "README.md").data.to_dict()["differential_privacy"]
    assert meta["exported_despite_failed_audit"] == released["exported_despite_failed_audit"]
    assert "1.0000" not in card  # the measured value is a statistic of the members: not released
    # an audit within the bound blocks nothing
    path = run / "audit" / "mia_report.json"
    path.write_text(path.read_text().replace('"tpr@fpr=0.001": 1.0', '"tpr@fpr=0.001": 0.0'))
    assert compliance.failed_audit(run) is None and _status(run)["mia_audit"] == compliance.MET
