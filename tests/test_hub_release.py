"""Releases the Hugging Face Hub understands (issue 40): card metadata, dataset cards, the guarded push.

No network: the push is tested against a stand-in for ``huggingface_hub.HfApi`` that records what would be
uploaded, to which repository, with which files.
"""

import json

import pytest
from huggingface_hub import DatasetCard, ModelCard

from dpllm import hub
from dpllm.cli import main as dpllm_main
from dpllm.config import parse_config
from dpllm.export import ExportError, export
from dpllm.train import train

FAST = ["--max_steps", "2", "--logical_batch_size", "16", "--physical_batch_size", "16", "--max_length", "32",
        "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--eval_every", "0", "--eval_max_records", "8",
        "--progress", "false", "--max_records", "120", "--accountant", "rdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    train(parse_config(["--output_dir", str(base / "full"), *FAST, "--finetuning", "full"]))
    train(parse_config(["--output_dir", str(base / "lora"), *FAST, "--finetuning", "lora"]))
    return base


class FakeHub:
    """Stands in for ``huggingface_hub.HfApi``: records the calls; ``fail`` raises what an unreachable Hub raises."""

    calls: list = []
    fail = None

    def __init__(self, token=None):
        FakeHub.calls.append(("init", token))

    def create_repo(self, repo_id, *, private=None, exist_ok=False, repo_type=None, **kw):
        if FakeHub.fail is not None:
            raise FakeHub.fail
        FakeHub.calls.append(("create_repo", repo_id, private, exist_ok, repo_type))

    def upload_folder(self, *, folder_path, repo_id, repo_type=None, **kw):
        from pathlib import Path

        files = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file())
        FakeHub.calls.append(("upload_folder", repo_id, repo_type, files))
        return f"https://huggingface.co/{repo_id}/commit/0"


@pytest.fixture
def fake_hub(monkeypatch):
    FakeHub.calls, FakeHub.fail = [], None
    monkeypatch.setattr(hub, "HfApi", FakeHub)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    return FakeHub


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no_stored_tokens"))
    from huggingface_hub import get_token

    assert get_token() is None


def test_model_card_metadata_round_trips(runs, tmp_path):
    out = export(runs / "full", tmp_path / "bundle", license="apache-2.0")
    card = ModelCard.load(out / "README.md")
    released = json.loads((out / "privacy_report.json").read_text())
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"differential-privacy", "dp-sgd", "dpllm"} <= set(meta["tags"]) and meta["license"] == "apache-2.0"
    assert "base_model" not in meta  # a tiny model built from a config has no public name
    dp = meta["differential_privacy"]
    assert dp["epsilon"] == released["epsilon"] and dp["delta"] == released["delta"] == 1e-5
    assert (dp["unit"], dp["neighbouring_relation"], dp["accountant"]) == ("record", "add or remove one record", "rdp")
    assert (dp["noise_multiplier"], dp["sampling_rate"], dp["steps"]) == (
        released["noise_multiplier"], released["sample_rate"], released["steps"])
    # the YAML block comes first, then the body as before (its plain-language guarantee line)
    text = (out / "README.md").read_text()
    assert text.startswith("---\n") and "## Privacy guarantee" in card.text
    assert f"ε = {released['epsilon']:.3f}" in card.text and str(runs) not in text
    # what the Hub's reader sees is what was written: a second round trip changes nothing
    assert ModelCard(str(card)).data.to_dict() == meta
    no_license = ModelCard.load(export(runs / "full", tmp_path / "b2") / "README.md").data.to_dict()
    assert "license" not in no_license


def test_adapter_card_names_a_public_base_only(runs, tmp_path):
    out = export(runs / "lora", tmp_path / "bundle")
    meta = ModelCard.load(out / "README.md").data.to_dict()
    assert meta["library_name"] == "peft" and "base_model" not in meta and "lora" in meta["tags"]
    declared = ModelCard.load(export(runs / "lora", tmp_path / "declared", base_model="org/tiny-base")
                              / "README.md").data.to_dict()
    assert declared["base_model"] == "org/tiny-base"
    with pytest.raises(ExportError, match="public Hub id"):
        export(runs / "lora", tmp_path / "bad", base_model=str(tmp_path / "models" / "base"))
    assert not (tmp_path / "bad").exists()
    # the run loaded a Hub id: named; a local directory, an earlier run or a tiny model: withheld
    assert hub.public_base_model({"kind": "pretrained", "path": "meta-llama/Llama-3.2-1B"}) == "meta-llama/Llama-3.2-1B"
    assert hub.public_base_model({"kind": "pretrained", "path": "/home/alice/llama"}) is None
    assert hub.public_base_model({"kind": "run_checkpoint", "path": "/runs/a/checkpoint"}) is None
    assert hub.public_base_model({"kind": "tiny", "name": "tiny-llama"}) is None
    assert hub.public_base_model({"kind": "pretrained", "path": "/home/alice/llama"}, "meta-llama/x") == "meta-llama/x"


def test_export_pushes_exactly_the_bundle(runs, tmp_path, fake_hub, capsys):
    out = tmp_path / "bundle"
    code = dpllm_main(["export", str(runs / "full"), "--out", str(out), "--push-to-hub", "me/dp-model", "--private",
                       "--license", "mit"])
    assert code == 0, capsys.readouterr().err
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert ("create_repo", "me/dp-model", True, True, "model") in fake_hub.calls
    assert ("upload_folder", "me/dp-model", "model", files) in fake_hub.calls
    assert ("init", "hf_test_token") in fake_hub.calls
    assert {"README.md", "privacy_report.json", "config.json", "model.safetensors"} <= set(files)
    assert "pushed" in capsys.readouterr().out
    assert dpllm_main(["export", str(runs / "full"), "--out", str(tmp_path / "x"), "--private"]) == 2


def test_the_run_directory_is_never_pushed(runs, tmp_path, fake_hub):
    with pytest.raises(hub.PushError, match="private run directory"):
        hub.push_folder(runs / "full", "me/run")
    with pytest.raises(hub.PushError, match="inside a private run directory"):
        hub.push_folder(runs / "full" / "checkpoint", "me/run")
    copied = tmp_path / "looks_like_a_bundle"
    copied.mkdir()
    (copied / "README.md").write_text("hi\n")
    (copied / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(hub.PushError, match="files that stay private.*metrics.jsonl"):
        hub.push_folder(copied, "me/run")
    with pytest.raises(hub.PushError, match="not a Hub repository id"):
        hub.push_folder(copied, "not a repo id!")
    with pytest.raises(ExportError, match="inside the private run directory"):
        export(runs / "full", runs / "full" / "release")
    assert not (runs / "full" / "release").exists()
    assert [c for c in fake_hub.calls if c[0] != "init"] == []


def test_no_token_is_one_line_and_nothing_is_written(runs, tmp_path, no_token, monkeypatch, capsys):
    monkeypatch.setattr(hub, "HfApi", lambda *a, **k: pytest.fail("the Hub client was reached without a token"))
    code = dpllm_main(["export", str(runs / "full"), "--out", str(tmp_path / "b"), "--push-to-hub", "me/m"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "no Hugging Face token" in err and "HF_TOKEN" in err
    assert not (tmp_path / "b").exists()


def test_unreachable_hub_is_one_line_and_nothing_is_uploaded(runs, tmp_path, fake_hub, capsys):
    import httpx2

    fake_hub.fail = httpx2.ConnectError("[Errno -3] Temporary failure in name resolution")
    code = dpllm_main(["export", str(runs / "full"), "--out", str(tmp_path / "b"), "--push-to-hub", "me/m"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "could not push" in err and "ConnectError" in err
    assert "hf upload me/m" in err and not any(c[0] == "upload_folder" for c in fake_hub.calls)
    assert (tmp_path / "b" / "README.md").is_file()  # the bundle is complete, for a later upload


def test_dp_metadata_of_a_non_private_run():
    from dpllm.privacy.report import PrivacyReport

    meta = hub.model_card_data(PrivacyReport.from_dict({"enabled": False, "num_records": None, "steps": 3}),
                               lora=False, base_model=None).to_dict()
    assert meta["differential_privacy"] == {"enabled": False, "guarantee": "none: trained without differential privacy"}
    assert "differential-privacy" not in meta["tags"]  # nobody searching for DP models should find it


def test_module_examples():
    import doctest

    result = doctest.testmod(hub)
    assert result.attempted > 0 and result.failed == 0
