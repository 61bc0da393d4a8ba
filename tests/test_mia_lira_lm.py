"""``python -m mia lira`` end to end on a tiny memorising run, plus the shadow design and bad input.

The target is a tiny Llama trained for 15 epochs on 20 records (20 more held out): it memorises, so
LiRA with 4 shadows must separate members from non-members clearly (AUC 0.99 seen at 15 epochs, 1.00 at 30).
"""

import json
import os

import numpy as np
import pytest

from mia.__main__ import main
from mia.shadows import FILLER, balanced_inclusion, check_n_shadows, write_shadow_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = ["--max_records", "40", "--heldout_fraction", "0.5", "--max_length", "48", "--tiny_hidden_size", "32",
          "--tiny_num_heads", "2", "--finetuning", "full", "--privacy.enabled", "false", "--epochs", "15",
          "--logical_batch_size", "16", "--physical_batch_size", "16", "--eval_every", "0", "--progress", "false",
          "--learning_rate", "0.003"]


@pytest.fixture(scope="module")
def lira_run(tmp_path_factory):
    """The recipe and ``python -m mia lira`` through their entry points (``cli``, ``main``) in this process: a
    process of their own would add only start-up (imports, ~13 s of CPU each)."""
    from tests.helpers import load_recipe

    base = tmp_path_factory.mktemp("lira")
    target, out = base / "target", base / "lira"
    assert load_recipe("finetune_llm").cli([*TARGET, "--output_dir", str(target)]) == 0
    assert main(["lira", "--run", str(target), "--shadows", "4", "--out", str(out), "--n-bootstrap", "200",
                 "--no-progress"]) == 0
    return target, out


def test_lira_catches_memorising_run(lira_run):
    from dpllm.data import load_split_texts

    target, out = lira_run
    report = json.loads((out / "lira_report.json").read_text())
    assert (out / "lira_report.md").is_file() and (out / "lira_roc.png").stat().st_size > 1000
    assert report["variant"] == "online" and report["n_shadows"] == 4
    # each record held out by its own keyed hash at heldout_fraction 0.5: 40 records, members ≈ 20
    assert report["n_members"] == len(load_split_texts(target, "train")) and report["n_members"] + report[
        "n_nonmembers"] == 40 and report["n_nonmembers"] == len(load_split_texts(target, "heldout"))
    assert report["attacks"]["lira"]["auc"] > 0.8  # seen: 0.99 (the loss attack on the same run: 0.72)


def test_inclusion_mask_is_what_shadows_trained_on(lira_run):
    from dpllm.data import load_split_texts

    target, out = lira_run
    pool = load_split_texts(target, "train") + load_split_texts(target, "heldout")
    inputs = json.loads((out / "lira_scores.json").read_text())["lira_inputs"]
    mask = np.array(inputs["shadow_in"], dtype=bool)
    assert mask.shape == (4, 40) and inputs["n_members"] == len(load_split_texts(target, "train"))
    assert (mask.sum(axis=0) == 2).all()  # the filler took the held-out slot: balanced exactly
    for s in range(4):
        sdir = out / "shadows" / f"shadow_{s:02d}"
        trained = set(load_split_texts(sdir, "train"))
        assert load_split_texts(sdir, "heldout") == [FILLER]
        assert trained == {pool[i] for i in np.flatnonzero(mask[s])}


@pytest.mark.parametrize("n_records", [10, 11])
def test_balanced_inclusion(n_records):
    mask = balanced_inclusion(n_records, 6, np.random.default_rng(0))
    assert mask.shape == (6, n_records)
    assert (mask.sum(axis=0) == 3).all()  # each record IN for exactly half of the shadows
    assert (mask[0::2] ^ mask[1::2]).all()  # pairs are complementary
    assert set(mask.sum(axis=1)) <= {n_records // 2, (n_records + 1) // 2}
    assert len({row.tobytes() for row in mask[0::2]}) > 1  # pairs use different random halves


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
def test_bad_shadow_counts(n):
    with pytest.raises(ValueError, match="even number >= 4"):
        check_n_shadows(n)


def test_filler_lands_in_heldout(tmp_path):
    from dpllm.config import DataConfig
    from dpllm.data import load_records, make_splits

    cfg = DataConfig(dataset=str(tmp_path / "d.jsonl"), heldout_fraction=1e-9, min_chars=1)
    texts = [f"record number {i}" for i in range(13)]
    write_shadow_dataset(cfg.dataset, texts, cfg)
    records = load_records(cfg)
    splits = make_splits(records, cfg)
    assert [records[i] for i in splits.heldout] == [FILLER]
    assert sorted(records[i] for i in splits.train) == sorted(texts)


def test_cli_errors(tmp_path, capsys):
    for bad in ("3", "2"):
        assert main(["lira", "--run", str(tmp_path), "--shadows", bad]) == 2
        assert "even number >= 4" in capsys.readouterr().err
    assert main(["lira", "--run", str(tmp_path), "--shadows", "4"]) == 2
    assert "no splits.json" in capsys.readouterr().err
