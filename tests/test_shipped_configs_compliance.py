"""Every shipped DP config, run as shipped, meets the compliance checklist's automatic items that the config
decides (dpllm.compliance): one expected pass over the private records, secret noise, DP-compatible gradient
checkpointing. The plan is the one training makes (the Trainer's own data and plan stages, nothing loaded);
configs for the user's own data are planned over data sets of 2,000 and 200,000 records."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dpllm.compliance import _single_epoch
from dpllm.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "recipes" / "configs").rglob("*.yaml"))


def _private(path: Path) -> bool:
    raw = yaml.safe_load(path.read_text()) or {}
    if "privacy" not in raw and "data" not in raw:  # a sweep's own format, not a run config
        return False
    privacy, data = raw.get("privacy") or {}, raw.get("data") or {}
    return privacy.get("enabled", True) and data.get("train_on", "private") == "private"


SHIPPED_DP = [p for p in CONFIGS if _private(p)]


def _plan(path: Path, out: Path, records: Path | None):
    from dpllm.train import Trainer

    argv = ["--config", str(path), "--output_dir", str(out), "--progress", "false"]
    if records is not None:
        argv += ["--dataset", str(records)]
    trainer = Trainer(parse_config(argv))
    trainer.setup_process()
    trainer.setup_data()
    trainer.setup_plan()
    return trainer


def test_the_shipped_dp_configs_are_found():
    names = {p.relative_to(ROOT / "recipes" / "configs").as_posix() for p in SHIPPED_DP}
    assert {"tiny/sft_stdlib_qa_dp.yaml", "tiny/llama_lora_cpu.yaml", "llama3_8b/lora_eps8.yaml",
            "gpt2/full_eps3.yaml"} <= names


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
    """The user's data for the configs that read their own file: distinct records, as many as a real data set might
    have, 2,000 and 200,000 of them (below 1/δ = 10⁶ of these configs; above it a plan is refused). Written once for
    every config: nothing a plan does changes them."""
    folder = tmp_path_factory.mktemp("own_data")
    files = {}
    for n in (2_000, 200_000):
        files[n] = folder / f"records_{n}.jsonl"
        files[n].write_text("".join(f'{{"text": "record {i} of a user\'s own data set"}}\n' for i in range(n)))
    return files


@pytest.mark.parametrize("path", SHIPPED_DP, ids=[p.relative_to(ROOT / "recipes" / "configs").as_posix()
                                                   for p in SHIPPED_DP])
def test_a_shipped_config_meets_the_automatic_items(path, tmp_path, own_data):
    raw = yaml.safe_load(path.read_text())
    dataset = (raw.get("data") or {}).get("dataset", "pydoc")
    reads_a_file = str(dataset).endswith((".jsonl", ".csv", ".parquet", ".json"))
    for n, records in (own_data.items() if reads_a_file else [(None, None)]):
        trainer = _plan(path, tmp_path / f"run_{n}", records)
        plan = trainer.plan
        assert plan is not None, "a DP config must plan privacy"

        class Report:  # what the checklist reads from privacy_report.json
            enabled, sample_rate, steps = True, plan.sample_rate, trainer.steps
            correlated_noise = None  # the shipped configs keep independent noise

        item = _single_epoch(Report)
        assert item.status == "met", f"{path.name} at N={len(trainer.data.train_texts)}: {item.evidence}"
        assert not trainer.cfg.privacy.reproducible_noise
        assert not trainer.cfg.train.gradient_checkpointing or trainer.cfg.privacy.grad_sample_mode in ("auto", "bk")
