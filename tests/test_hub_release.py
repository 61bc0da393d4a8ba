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
        "--progress", "false", "--max_records", "120"]
# The LoRA run's output directory and data file have names that say whose data it is (issue 46, item 7b).
LORA, DATA = "patients_2024", "acme_patient_notes"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dpllm.data import pydoc_paragraphs

    base = tmp_path_factory.mktemp("hub")
    data = base / f"{DATA}.jsonl"
    # 119 records: FAST's max_records=120 cuts no neighbour of this file (run_data refuses a file that meets it)
    texts = list(dict.fromkeys(t for t in pydoc_paragraphs() if len(t) >= 40))[:119]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    train(parse_config(["--output_dir", str(base / "full"), *FAST, "--finetuning", "full"]))
    train(parse_config(["--output_dir", str(base / LORA), *FAST, "--finetuning", "lora", "--dataset", str(data)]))
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
    assert (dp["unit"], dp["accountant"]) == ("record", "prv")
    # this run kept 120 records of the built-in pydoc corpus by rank (max_records): the relation says so (issue 46)
    assert dp["neighbouring_relation"].startswith("add or remove one record of the at most 120 that max_records kept")
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
    out = export(runs / LORA, tmp_path / "bundle")
    meta = ModelCard.load(out / "README.md").data.to_dict()
    assert meta["library_name"] == "peft" and "base_model" not in meta and "lora" in meta["tags"]
    declared = ModelCard.load(export(runs / LORA, tmp_path / "declared", base_model="org/tiny-base")
                              / "README.md").data.to_dict()
    assert declared["base_model"] == "org/tiny-base"
    with pytest.raises(ExportError, match="public Hub id"):
        export(runs / LORA, tmp_path / "bad", base_model=str(tmp_path / "models" / "base"))
    assert not (tmp_path / "bad").exists()
    # the run loaded a Hub id: named; a local directory, an earlier run or a tiny model: withheld
    assert hub.public_base_model({"kind": "pretrained", "path": "meta-llama/Llama-3.2-1B"}) == "meta-llama/Llama-3.2-1B"
    assert hub.public_base_model({"kind": "pretrained", "path": "/home/alice/llama"}) is None
    assert hub.public_base_model({"kind": "run_checkpoint", "path": "/runs/a/checkpoint"}) is None
    assert hub.public_base_model({"kind": "tiny", "name": "tiny-llama"}) is None
    assert hub.public_base_model({"kind": "pretrained", "path": "/home/alice/llama"}, "meta-llama/x") == "meta-llama/x"


def test_the_bundle_names_neither_the_stage_nor_a_private_data_set(runs, tmp_path):
    """Issue 46, item 7b: the card and report released the stage's name (its output directory, "patients_2024")
    and the data set's Hub id. Every file of the bundle now holds neither; the private run keeps both."""
    from dpllm.export import model_card, release_report
    from dpllm.privacy.report import PrivacyReport

    out = export(runs / LORA, tmp_path / "bundle")
    for path in (p for p in out.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert LORA.encode() not in data and DATA.encode() not in data, path.name
    released = json.loads((out / "privacy_report.json").read_text())
    assert [(s["name"], s["dataset"]) for s in released["stages"]] == [("stage 1", "private data set")]
    assert "- stage 1: DP, private data set (private split)" in (out / "README.md").read_text()
    private = PrivacyReport.read(runs / LORA)
    assert private.stages[0]["name"] == LORA and DATA in private.stages[0]["dataset"]
    # a Hub id names a data set that may be private: withheld unless the publisher declares it public
    hub_id = "acme/patients-2024-notes"
    private.stages = [dict(s, dataset=hub_id, name="runs/patients_2024") for s in private.stages]
    shown = release_report(private)
    text = json.dumps(shown.to_dict()) + model_card(shown, lora=True, has_base=False) + json.dumps(
        hub.dp_metadata(shown))
    assert hub_id not in text and "patients_2024" not in text
    assert release_report(private, declare_public=["dataset"]).stages[0]["dataset"] == hub_id
    assert release_report(private).stages[0]["dataset"] == "private data set"


def test_export_pushes_exactly_the_bundle(runs, tmp_path, fake_hub, capsys):
    out = tmp_path / "bundle"
    code = dpllm_main(["export", str(runs / "full"), "--out", str(out), "--push-to-hub", "me/dp-model", "--private",
                       "--license", "mit", "--accept-unmet", "mia_audit"])  # not audited: released by choice
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
    code = dpllm_main(["export", str(runs / "full"), "--out", str(tmp_path / "b"), "--push-to-hub", "me/m",
                       "--accept-unmet", "mia_audit"])
    err = capsys.readouterr().err.split("\n", 1)[1]  # after the line naming the item released unmet
    assert code == 1 and err.count("\n") == 1 and "could not push" in err and "ConnectError" in err
    assert "hf upload me/m" in err and not any(c[0] == "upload_folder" for c in fake_hub.calls)
    assert (tmp_path / "b" / "README.md").is_file()  # the bundle is complete, for a later upload


def test_dp_metadata_of_a_non_private_run():
    from dpllm.privacy.report import PrivacyReport

    meta = hub.model_card_data(PrivacyReport.from_dict({"enabled": False, "num_records": None, "steps": 3}),
                               lora=False, base_model=None).to_dict()
    assert meta["differential_privacy"] == {"enabled": False, "guarantee": "none: trained without differential privacy"}
    assert "differential-privacy" not in meta["tags"]  # nobody searching for DP models should find it


def test_dp_metadata_of_a_user_level_run_and_a_noise_schedule():
    from dpllm.privacy.report import PrivacyReport

    report = PrivacyReport.from_dict({
        "enabled": True, "num_records": None, "steps": 30, "privacy_unit": "user", "epsilon": 3.5, "delta": 1e-6,
        "accountant": "prv", "noise_multiplier": 1.2, "sample_rate": 0.05, "max_grad_norm": 1.0, "clipping": "flat",
        "poisson_sampling": True, "composition": "single stage",
        "noise_schedule": {"kind": "step", "pieces_sigma_steps": [[1.2, 10], [0.9, 20]]},
        "user_level": {"unit": "user", "sampling": "els", "max_records_per_user": 8, "record_delta": 1e-7},
        "release": {"neighbouring_relation": "add or remove one user (with at most 8 records)"}})
    dp = hub.dp_metadata(report)
    assert (dp["unit"], dp["max_records_per_user"], dp["epsilon"], dp["delta"]) == ("user", 8, 3.5, 1e-6)
    assert dp["neighbouring_relation"] == "add or remove one user (with at most 8 records)"
    assert dp["accountant"].startswith("pld") and dp["noise_schedule"] == [[1.2, 10], [0.9, 20]]
    assert "num_records_declared_public" not in dp


def test_module_examples():
    import doctest

    result = doctest.testmod(hub)
    assert result.attempted > 0 and result.failed == 0


# ---- synthetic data: shapes, valid text, dataset cards ---------------------------------------------------------

CHATS = [[{"role": "user", "content": f"What is {i} times 3?"}, {"role": "assistant", "content": f"{3 * i}."}]
         for i in range(48)]
SFT = ["--max_steps", "2", "--logical_batch_size", "8", "--physical_batch_size", "8", "--finetuning", "lora",
       "--max_length", "48", "--min_chars", "1", "--eval_every", "0", "--progress", "false", "--tiny_hidden_size",
       "32", "--num_generations", "0", "--eval_max_records", "8", "--target_epsilon", "8"]
GEN = dict(temperature=1.0, top_p=1.0, max_new_tokens=16, batch_size=8, seed=1, progress=False)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("sft")
    chat, pc = base / "chat.jsonl", base / "pc.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    pc.write_text("".join(json.dumps({"prompt": m[0]["content"], "completion": m[1]["content"]}) + "\n" for m in CHATS))
    train(parse_config(["--dataset", str(chat), "--output_dir", str(base / "chat"), *SFT]))
    train(parse_config(["--dataset", str(pc), "--output_dir", str(base / "pc"), *SFT]))
    return base


def test_a_chat_run_synthesizes_chat_records(sft_runs, tmp_path):
    from dpllm.io import read_jsonl
    from dpllm.synthetic import synthesize

    card = synthesize(sft_runs / "chat", num=6, out=tmp_path / "chat.jsonl", prompts=["What is 7 times 3?"], **GEN)
    rows = read_jsonl(tmp_path / "chat.jsonl")
    assert card["columns"] == ["id", "messages"] and card["generation"]["shape"] == "messages" and len(rows) == 6
    for r in rows:
        assert set(r) == {"id", "messages"} and [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][0]["content"] == "What is 7 times 3?" and r["messages"][1]["content"].strip()
    assert card["samples_drawn"] == rows[-1]["id"] + 1
    assert card["samples_dropped_not_valid_text"] == card["samples_drawn"] - 6
    pc = synthesize(sft_runs / "pc", num=4, out=tmp_path / "pc.jsonl", prompts=["What is 5 times 3?"], **GEN)
    assert pc["columns"] == ["id", "prompt", "completion"]
    assert all(set(r) == {"id", "prompt", "completion"} and r["prompt"] == "What is 5 times 3?"
               for r in read_jsonl(tmp_path / "pc.jsonl"))
    plain = synthesize(sft_runs / "chat", num=4, out=tmp_path / "u.jsonl", **GEN)  # user turns sampled too
    assert plain["generation"]["conditioning"] == "unconditional"
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] and all(m["content"] for m in r["messages"])
               for r in read_jsonl(tmp_path / "u.jsonl"))
    with pytest.raises(ValueError, match="carry no control codes"):
        synthesize(sft_runs / "chat", num=2, out=tmp_path / "x.jsonl", labels=["a"], **GEN)


class Scripted(__import__("torch").nn.Module):
    """A stand-in model that 'samples' scripted byte strings (the byte tokenizer: id = byte + 3): row r of a batch
    writes ``users[r % len]`` after a user header and ``answers[r % len]`` after the assistant header."""

    def __init__(self, model, users, answers):
        super().__init__()
        self.config, self.users, self.answers = model.config, users, answers

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def generate(self, input_ids, max_new_tokens, eos_token_id, **kw):
        import torch

        out = []
        for r, row in enumerate(input_ids.tolist()):
            header = bytes(i - 3 for i in row[-14:] if 3 <= i < 259).decode("latin-1")
            script = self.answers if header.endswith("<|assistant|>\n") else self.users
            ids = [b + 3 for b in script[r % len(script)]][:max_new_tokens]
            out.append(ids + [eos_token_id] * (max_new_tokens - len(ids)))
        return torch.cat([input_ids, torch.tensor(out)], 1)


def scripted_load(monkeypatch, users, answers):
    import dpllm.checkpoint as checkpoint

    real = checkpoint.load_model

    def load(path, **kw):
        model, tok = real(path, **kw)
        return Scripted(model, users, answers), tok

    monkeypatch.setattr(checkpoint, "load_model", load)


def test_bytes_that_are_not_text_never_reach_the_file(sft_runs, tmp_path, monkeypatch, capsys):
    """A chat sampled in two draws (user turn, then answer); NUL and control characters in either turn, or an empty
    turn, drop the sample and the next ids replace it; a character cut at the end is trimmed."""
    from dpllm.io import read_jsonl
    from dpllm.synthetic import synthesize

    scripted_load(monkeypatch, users=[b"2 times 3?", b"\x00\x01hi", "ça va?\nnot the user turn".encode(), b"z?"],
                  answers=[b"6.", b"x", "oui, très ".encode() + b"\xe2\x82", b"\x07bell"])
    card = synthesize(sft_runs / "chat", num=6, out=tmp_path / "s.jsonl", **{**GEN, "batch_size": 4})
    rows = read_jsonl(tmp_path / "s.jsonl")
    assert [r["id"] for r in rows] == [0, 2, 4, 6, 8, 10]
    assert [[m["content"] for m in r["messages"]] for r in rows[:2]] == [["2 times 3?", "6."], ["ça va?", "oui, très"]]
    text = (tmp_path / "s.jsonl").read_text(encoding="utf-8")
    assert not any(c in text for c in "\x00\x01\x07\ufffd") and "\\u0000" not in text
    assert (card["samples_drawn"], card["samples_dropped_not_valid_text"]) == (11, 5)
    assert DatasetCard.load(tmp_path / "s.card.md").data.to_dict()["synthetic"]["samples_dropped_not_valid_text"] == 5
    assert "5 of the 11 samples drawn were dropped" in (tmp_path / "s.card.md").read_text()
    capsys.readouterr()
    assert dpllm_main(["synthesize", str(sft_runs / "chat"), "--num", "6", "--out", str(tmp_path / "c.jsonl"),
                       "--batch-size", "4", "--max-new-tokens", "16", "--no-progress", "--no-report"]) == 0
    assert "warning: 5 of 11 samples were not valid text" in capsys.readouterr().out


def test_a_model_that_writes_no_text_is_a_one_line_error(sft_runs, tmp_path, monkeypatch):
    from dpllm.synthetic import SynthesisError, synthesize

    scripted_load(monkeypatch, users=[b"\x00"], answers=[b"x"])
    with pytest.raises(SynthesisError, match=r"only 0 of 3 samples were valid text after drawing 35"):
        synthesize(sft_runs / "chat", num=3, out=tmp_path / "z.jsonl", **GEN)


def test_the_sampler_keeps_byte_models_to_valid_utf8():
    import torch

    from dpllm.models import byte_tokenizer
    from dpllm.synthetic.records import Utf8Only, banned_token_ids, byte_values

    tok = byte_tokenizer()
    banned = banned_token_ids(tok)
    assert {0 + 3, 7 + 3, 0x1B + 3, 0x7F + 3} <= set(banned) and not {9 + 3, 10 + 3, ord("a") + 3} & set(banned)
    proc = Utf8Only(byte_values(tok), len(tok))
    allowed = lambda *bs: {i - 3 for i in torch.nonzero(proc(torch.tensor([[b + 3 for b in bs]]),  # noqa: E731
                                                               torch.zeros(1, len(tok)))[0] == 0).ravel().tolist()}
    assert allowed(ord("a")) >= set(range(0x80)) and not allowed(ord("a")) & set(range(0x80, 0xC2))
    assert allowed(0xE2) == set(range(0x80, 0xC0)) == allowed(0xE2, 0x82)  # inside a 3-byte character
    assert 0x41 in allowed(0xE2, 0x82, 0xAC) and 0x80 not in allowed(0xE2, 0x82, 0xAC)  # complete again


def test_synthetic_release_folder_loads_with_datasets_and_pushes(sft_runs, tmp_path, fake_hub, monkeypatch, capsys):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "synth" / "chat.jsonl"
    out.parent.mkdir()
    code = dpllm_main(["synthesize", str(sft_runs / "chat"), "--num", "5", "--out", str(out), "--prompt", "What is 2?",
                       "--max-new-tokens", "12", "--batch-size", "8", "--no-progress", "--no-report",
                       "--release-dir", str(tmp_path / "release"), "--license", "cc-by-4.0",
                       "--push-to-hub", "me/synth", "--private"])
    assert code == 0, capsys.readouterr().err
    release = tmp_path / "release"
    files = sorted(p.name for p in release.iterdir())
    assert files == ["README.md", "chat.card.json", "chat.jsonl"]
    assert ("create_repo", "me/synth", True, True, "dataset") in fake_hub.calls
    assert ("upload_folder", "me/synth", "dataset", files) in fake_hub.calls
    card = DatasetCard.load(release / "README.md")
    meta = card.data.to_dict()
    report = json.loads((sft_runs / "chat" / "privacy_report.json").read_text())
    assert meta["differential_privacy"]["epsilon"] == report["epsilon"] and meta["license"] == "cc-by-4.0"
    assert meta["size_categories"] == ["n<1K"] and meta["synthetic"]["num_records"] == 5
    assert meta["synthetic"]["columns"] == ["id", "messages"] and "post_processing" in meta["differential_privacy"]
    assert {"synthetic", "differential-privacy", "dp-sgd", "dpllm"} <= set(meta["tags"])
    assert "post-processing" in card.text and str(sft_runs) not in (release / "README.md").read_text()
    ds = datasets.load_dataset(str(release))
    assert list(ds) == ["train"] and ds["train"].num_rows == 5 and ds["train"].column_names == ["id", "messages"]
    assert ds["train"][0]["messages"][0] == {"role": "user", "content": "What is 2?"}
    # the private report never goes: a folder holding it is refused
    (release / "chat.report.json").write_text("{}")
    with pytest.raises(hub.PushError, match="stay private"):
        hub.push_folder(release, "me/synth", repo_type="dataset")


def test_synthesize_push_without_token_samples_nothing(sft_runs, tmp_path, no_token, capsys):
    code = dpllm_main(["synthesize", str(sft_runs / "chat"), "--num", "2", "--out", str(tmp_path / "s.jsonl"),
                       "--no-progress", "--push-to-hub", "me/synth"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "no Hugging Face token" in err
    assert not (tmp_path / "s.jsonl").exists()


def test_synthesize_push_to_an_unreachable_hub_is_rerun_as_is(sft_runs, tmp_path, fake_hub, capsys):
    import httpx2

    out = tmp_path / "s.jsonl"
    cmd = ["synthesize", str(sft_runs / "chat"), "--num", "3", "--out", str(out), "--prompt", "What is 4?",
           "--max-new-tokens", "12", "--batch-size", "8", "--no-progress", "--no-report", "--push-to-hub", "me/s"]
    fake_hub.fail = httpx2.ConnectError("[Errno 101] Network is unreachable")
    assert dpllm_main(cmd) == 1
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("dpllm")]  # (transformers prints a loading bar)
    assert len(ours) == 1 and "could not push" in ours[0] and "Rerun the same command" in ours[0]
    before = out.read_bytes()
    fake_hub.fail = None
    assert dpllm_main(cmd) == 0, capsys.readouterr().err
    assert out.read_bytes() == before  # nothing sampled again
    assert ("upload_folder", "me/s", "dataset", ["README.md", "s.card.json", "s.jsonl"]) in fake_hub.calls
