"""dpllm synthesize: release checks, label control codes, seeded resumable sampling, card and report."""

import json
import shutil

import numpy as np
import pytest

from dpllm.cli import main as dpllm_main
from dpllm.config import parse_config
from dpllm.data import DataError, load_records, pydoc_paragraphs, split_control_code
from dpllm.io import read_jsonl
from dpllm.synthetic import SynthesisError, synthesize
from dpllm.synthetic.fidelity import downstream, frechet_distance, ngram_js
from dpllm.synthetic.leakage import canary_extraction, leakage
from dpllm.train import train

TOPICS = ("assert", "if", "while", "for", "try")
FAST = ["--max_steps", "2", "--logical_batch_size", "16", "--physical_batch_size", "16", "--max_length", "48",
        "--tiny_hidden_size", "32", "--tiny_num_heads", "2", "--eval_every", "0", "--eval_max_records", "8",
        "--progress", "false", "--finetuning", "full"]
GEN = dict(temperature=1.0, top_p=0.9, max_new_tokens=12, batch_size=4, seed=3, progress=False)


def labelled_file(path):
    rows = [{"text": p, "topic": key} for key in TOPICS for p in pydoc_paragraphs(key) if len(p) >= 32][:80]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("synth")
    data = labelled_file(base / "data.jsonl")
    common = ["--dataset", str(data), "--label_column", "topic", "--label_values", ",".join(TOPICS),
              "--num_canaries", "4", *FAST]
    train(parse_config(["--output_dir", str(base / "dp"), "--target_epsilon", "4", *common]))
    train(parse_config(["--output_dir", str(base / "nodp"), "--privacy.enabled", "false", *common]))
    train(parse_config(["--output_dir", str(base / "plain"), "--target_epsilon", "4", "--max_records", "60", *FAST]))
    return base


def test_label_column_prefixes_a_control_code(tmp_path):
    data = labelled_file(tmp_path / "d.jsonl")
    cfg = parse_config(["--dataset", str(data), "--label_column", "topic", "--label_values", ",".join(TOPICS)]).data
    labels = [split_control_code(t)[0] for t in load_records(cfg)]
    assert len(set(labels)) >= 3 and set(labels) <= set(TOPICS)
    assert load_records(cfg)[0].startswith("[assert] ")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x" * 40, "topic": "a"}) + "\n"
                                        + json.dumps({"text": "y" * 40}) + "\n")
    with pytest.raises(DataError, match="record 2 has label None"):
        load_records(parse_config(["--dataset", str(tmp_path / "bad.jsonl"), "--label_column", "topic",
                                   "--label_values", "a"]).data)
    # The classes are declared, never read from the data: one not declared is refused, and so is no declaration.
    with pytest.raises(DataError, match="record 1 has label 'assert', which is not one of label_values"):
        load_records(parse_config(["--dataset", str(data), "--label_column", "topic", "--label_values", "if"]).data)
    with pytest.raises(DataError, match="needs label_values"):
        load_records(parse_config(["--dataset", str(data), "--label_column", "topic"]).data)
    (tmp_path / "d.csv").write_text("text,topic\n" + "".join(f"record number {i} of a csv file here,t{i % 2}\n"
                                                               for i in range(4)))
    csv = parse_config(["--dataset", str(tmp_path / "d.csv"), "--label_column", "topic",
                        "--label_values", "t0,t1"]).data
    assert load_records(csv)[1] == "[t1] record number 1 of a csv file here"
    with pytest.raises(DataError, match="no label column 'kind'"):
        load_records(parse_config(["--dataset", str(tmp_path / "d.csv"), "--label_column", "kind",
                                   "--label_values", "t0,t1"]).data)
    with pytest.raises(DataError, match="needs a .jsonl"):
        load_records(parse_config(["--dataset", "pydoc", "--label_column", "topic", "--label_values", "a"]).data)


def test_refuses_what_export_refuses(runs, tmp_path):
    with pytest.raises(SynthesisError, match="trained without DP.*--allow-non-private"):
        synthesize(runs / "nodp", num=2, out=tmp_path / "n.jsonl", **GEN)
    assert not (tmp_path / "n.jsonl").exists()
    card = synthesize(runs / "nodp", num=2, out=tmp_path / "n.jsonl", allow_non_private=True, **GEN)
    assert "No differential-privacy guarantee" in card["statement"] and not card["source"]["privacy"]["enabled"]
    assert not card["source"]["dp_guarantee"]
    card = synthesize(runs / "nodp", num=2, out=tmp_path / "n2.jsonl", allow_unreleasable=True, **GEN)
    assert card["statement"].startswith("NOT RELEASABLE") and "without DP" in card["source"]["refusal_overridden"]

    seeded = tmp_path / "seeded"  # as a privacy.reproducible_noise run reports itself
    shutil.copytree(runs / "dp", seeded)
    for path in (seeded / "privacy_report.json", seeded / "checkpoint" / "privacy_report.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "noise_secret": False}))
    with pytest.raises(SynthesisError, match="reproducible"):
        synthesize(seeded, num=2, out=tmp_path / "s.jsonl", **GEN)
    card = synthesize(seeded, num=2, out=tmp_path / "s.jsonl", allow_unreleasable=True, **GEN)
    assert not card["source"]["releasable"] and card["statement"].startswith("NOT RELEASABLE")
    assert "**no**" in (tmp_path / "s.card.md").read_text()

    tampered = tmp_path / "tampered"
    shutil.copytree(runs / "dp", tampered)
    ledger = tampered / "privacy_ledger.jsonl"
    lines = ledger.read_text().splitlines(keepends=True)
    entry = json.loads(lines[-1])
    entry["epsilon"] = entry["epsilon"] / 2  # a smaller ε than was spent
    ledger.write_text("".join(lines[:-1]) + json.dumps(entry) + "\n")
    with pytest.raises(SynthesisError, match="ledger does not verify"):
        synthesize(tampered, num=2, out=tmp_path / "t.jsonl", **GEN)


def test_labels_card_and_resume(runs, tmp_path):
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    card = synthesize(runs / "dp", num=10, out=whole, **GEN)
    rows = read_jsonl(whole)
    labels = card["generation"]["labels"]
    assert labels == sorted(labels) and set(labels) <= set(TOPICS) and len(labels) >= 3
    assert [r["id"] for r in rows] == list(range(10))
    assert [r["label"] for r in rows] == [labels[i % len(labels)] for i in range(10)]
    report = json.loads((runs / "dp" / "privacy_report.json").read_text())
    assert card["source"]["privacy"]["epsilon"] == report["epsilon"] and card["source"]["releasable"]
    assert "post-processing" in card["statement"] and card["complete"] and card["num_records"] == 10
    from dpllm.synthetic.card import file_sha256

    assert card["sha256"] == file_sha256(whole) and str(runs) not in json.dumps(card) and card["source"]["dp_guarantee"]
    assert f"ε = {report['epsilon']:.3f}" in (tmp_path / "whole.card.md").read_text()
    # the plain reading: the run's own trade-off bounds, as the model card states them, about the file
    from dpllm.privacy import tradeoff
    from dpllm.privacy.report import PrivacyReport

    bounds = tradeoff.for_report(PrivacyReport.read(runs / "dp")).bounds()
    assert 0.5 < bounds["auc"] < 1 and 0.01 < bounds["tpr@fpr=0.01"] < 1
    assert "from this file (or the model it was sampled from), which texts" in card["statement"]
    assert tradeoff.plain_reading(bounds, plural="texts") in card["statement"]
    assert tradeoff.plain_reading(bounds, plural="texts") in (tmp_path / "whole.card.md").read_text()

    # the releasable part loads with datasets as it is (offline: a local folder, the card's configs metadata)
    import datasets

    from dpllm.synthetic.card import release_folder

    ds = datasets.load_dataset(str(release_folder(whole, tmp_path / "release")))["train"]
    assert ds.column_names == card["columns"] == ["id", "text", "label"] and ds.num_rows == 10
    assert ds["label"] == [r["label"] for r in rows]

    # interrupted after 6 records (mid-batch) and a cut line: the rerun writes what one run would have
    synthesize(runs / "dp", num=6, out=part, **GEN)
    with open(part, "a") as fh:
        fh.write('{"id": 6, "te')
    synthesize(runs / "dp", num=10, out=part, **GEN)
    assert part.read_text() == whole.read_text()
    synthesize(runs / "dp", num=10, out=tmp_path / "other_seed.jsonl", **{**GEN, "seed": 4})
    assert read_jsonl(tmp_path / "other_seed.jsonl") != rows
    with pytest.raises(SynthesisError, match="other settings.*temperature"):
        synthesize(runs / "dp", num=12, out=whole, **{**GEN, "temperature": 0.5})
    with pytest.raises(SynthesisError, match="not in the training data's label set"):
        synthesize(runs / "dp", num=2, out=tmp_path / "x.jsonl", labels=["nope"], **GEN)
    with pytest.raises(SynthesisError, match="without data.label_column"):
        synthesize(runs / "plain", num=2, out=tmp_path / "y.jsonl", labels=["if"], **GEN)


def test_resuming_from_another_run_is_refused(runs, tmp_path):
    """Issue 46, item 4: resuming checked only the sampling settings, so samples of a non-private run were kept
    and released under a DP run's card. The output records the run and its checkpoint's digest; another run, or
    the same directory holding another checkpoint, is refused; the same run resumes."""
    from dpllm import hub, ledger
    from dpllm.synthetic.card import release_folder

    out = tmp_path / "s.jsonl"
    synthesize(runs / "nodp", num=4, out=out, allow_non_private=True, **GEN)
    before, card = out.read_bytes(), (tmp_path / "s.card.json").read_text()
    with pytest.raises(SynthesisError, match=r"holds 4 records sampled from another model \(run .*nodp vs .*dp; "
                                             r"checkpoint sha256 \w{12} vs \w{12}\).*pick a new --out"):
        synthesize(runs / "dp", num=8, out=out, **GEN)
    assert out.read_bytes() == before and (tmp_path / "s.card.json").read_text() == card  # nothing written
    from dpllm.synthetic.generate import source_path

    source = json.loads(source_path(out).read_text())
    assert source["run_dir"] == str((runs / "nodp").resolve())
    assert source["checkpoint_sha256"] == ledger.dir_sha256(runs / "nodp" / "checkpoint")
    synthesize(runs / "nodp", num=8, out=out, allow_non_private=True, **GEN)  # the same run resumes
    assert len(read_jsonl(out)) == 8 and out.read_bytes().startswith(before)

    # the same directory holding another run's checkpoint (a run overwritten in place): the digest differs
    moved = tmp_path / "patients_2024"
    shutil.copytree(runs / "dp", moved)
    card = synthesize(moved, num=2, out=tmp_path / "m.jsonl", **GEN)
    assert "patients_2024" not in json.dumps(card) + (tmp_path / "m.card.md").read_text()  # the run is not named
    shutil.rmtree(moved)
    shutil.copytree(runs / "nodp", moved)
    with pytest.raises(SynthesisError, match=r"another model \(checkpoint sha256 \w{12} vs \w{12}\)"):
        synthesize(moved, num=4, out=tmp_path / "m.jsonl", allow_non_private=True, **GEN)
    # the record of the source is private: not in the release folder, and a folder holding it is not pushed
    folder = release_folder(tmp_path / "m.jsonl", tmp_path / "release")
    assert not any(p.name.endswith(".source.json") for p in folder.iterdir())
    shutil.copy2(source_path(tmp_path / "m.jsonl"), folder)
    with pytest.raises(hub.PushError, match="stay private.*m.source.json"):
        hub.push_folder(folder, "me/synth", token="hf_test")


def test_prompts_and_unconditional(runs, tmp_path):
    synthesize(runs / "plain", num=3, out=tmp_path / "p.jsonl", prompts=["The ", "A "], **GEN)
    rows = read_jsonl(tmp_path / "p.jsonl")
    assert [r["prompt"] for r in rows] == ["The ", "A ", "The "] and rows[1]["text"].startswith("A ")
    card = synthesize(runs / "plain", num=3, out=tmp_path / "u.jsonl", **GEN)
    assert card["generation"]["conditioning"] == "unconditional" and len(read_jsonl(tmp_path / "u.jsonl")) == 3


def test_cli_help_lists_synthesize(capsys):
    assert dpllm_main(["--help"]) == 0 and "synthesize" in capsys.readouterr().out
    assert dpllm_main(["synthesize", "--help"]) == 0 and "--allow-unreleasable" in capsys.readouterr().out


def test_cli_writes_file_card_and_private_report(runs, tmp_path, capsys):
    out = tmp_path / "cli" / "synth.jsonl"
    out.parent.mkdir()
    code = dpllm_main(["synthesize", str(runs / "dp"), "--num", "8", "--out", str(out), "--max-new-tokens", "16",
                       "--batch-size", "8", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    names = sorted(p.name for p in out.parent.iterdir())
    assert names == ["synth.card.json", "synth.card.md", "synth.jsonl", "synth.report.json", "synth.report.md",
                     "synth.report.png", "synth.source.json"]
    rep = json.loads((out.parent / "synth.report.json").read_text())
    assert rep["leakage"]["n"] == 8 and rep["leakage"]["canaries"]["canaries"] == 4
    assert "downstream_accuracy" in rep["fidelity"]["synthetic"] and rep["fidelity"]["embedder"].startswith("lsa")
    md = (out.parent / "synth.report.md").read_text()
    assert "PRIVATE" in md
    # the report's numbers agree: the closest pairs are listed by the distance the table uses
    values = sorted(rep["leakage"]["nn_distance"]["train"]["values"])
    examples = rep["leakage"]["examples"]
    assert [e["distance"] for e in examples] == pytest.approx(values[:len(examples)], abs=1e-4)
    assert all(e["distance"] == pytest.approx(1 - e["similarity"], abs=1e-4) for e in examples)
    assert rep["leakage"]["nn_distance"]["train"]["min"] == pytest.approx(examples[0]["distance"], abs=1e-4)
    pairs = md.split("## Closest synthetic/training pairs")[1]
    assert [float(line[2:].split(":")[0]) for line in pairs.splitlines() if line.startswith("- ")] == pytest.approx(
        [e["distance"] for e in examples], abs=1e-3)
    # a tiny model after 2 steps writes poor text: the operator is told on the console, and in the report
    assert all((e["nearest_train"] is None) == (e["distance"] == 1.0) for e in examples)  # none is "nearest"
    assert rep["warnings"] and all(w in md for w in rep["warnings"])
    assert "warning: fidelity is poor" in capsys.readouterr().out
    assert dpllm_main(["synthesize", str(runs / "nodp"), "--num", "1", "--out", str(tmp_path / "z.jsonl")]) == 1
    assert "--allow-non-private" in capsys.readouterr().err


def test_leakage_sees_copies_and_the_heldout_control():
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(400)]
    rec = [" ".join(rng.choice(words, 16)) for _ in range(60)]
    train, heldout = rec[:40], rec[40:]
    fresh = [" ".join(rng.choice(words, 16)) for _ in range(10)]
    copied = [t[:70] for t in train[:10]]  # a token budget cut them: prefixes still count
    r = leakage(copied + fresh, train, heldout, min_chars=48)
    assert r["verbatim"]["train_all"] == 0.5 and r["verbatim"]["heldout"] == 0.0
    assert r["verbatim"]["distinct_train_records_copied"] == 10 and r["num_train_matched"] == 20
    assert r["nn_distance"]["heldout"]["min"] > 0.5
    # chunking does not change the answer
    from dpllm.synthetic.leakage import nearest_neighbours

    full, one = nearest_neighbours(copied + fresh, train), nearest_neighbours(copied + fresh, train, chunk=3)
    assert np.array_equal(full[0], one[0]) and np.array_equal(full[1], one[1]) and (full[0][:10] > 0.5).all()
    none = leakage(fresh, train, heldout)
    assert none["verbatim"]["train_all"] == 0.0 and none["near"]["train"] == 0.0
    assert 0.2 <= none["closer_to_train"] <= 0.8
    canaries = [{"id": 0, "text": "c: abcdef", "prefix": "c: ", "included": True},
                {"id": 1, "text": "c: ghijkl", "prefix": "c: ", "included": False},
                {"id": 2, "text": "c: mnopqr", "prefix": "c: ", "included": True}]
    got = canary_extraction(["xx abcdef yy", "ghijkl"], canaries)
    assert (got["extracted_included"], got["extracted_excluded"], got["extracted_ids"]) == (1, 1, [0, 1])


def test_fidelity_measures():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 3))
    assert frechet_distance(x, rng.normal(size=(4000, 3))) < 0.02
    assert frechet_distance(x, rng.normal(size=(4000, 3)) + [2.0, 0, 0]) == pytest.approx(4.0, abs=0.15)
    assert ngram_js(["a b", "c"], ["a b", "c"], n=2) == 0.0 and ngram_js(["a b"], ["c d"], n=1) == 1.0
    train = ["def f(x): return x"] * 5 + ["the cat sat on the mat"] * 5
    labels = ["code"] * 5 + ["prose"] * 5
    assert downstream(train, labels, ["def g(y): return y", "a cat on a mat"], ["code", "prose"]) == 1.0
    assert downstream(train[:5], labels[:5], ["x"], ["code"]) is None


def test_module_examples():
    import doctest

    from dpllm.synthetic import fidelity as fidelity_module
    from dpllm.synthetic import leakage as leakage_module
    from dpllm.synthetic import records as records_module

    for module in (leakage_module, fidelity_module, records_module):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_report_figure_has_no_colour_the_legend_does_not_name():
    from dpllm.synthetic.report import figure

    result = {"synthetic_file": "s.jsonl", "leakage": {"nn_distance": {
        "train": {"values": [0.2, 0.3, 0.3, 0.5]}, "heldout": {"values": [0.3, 0.3, 0.4, 0.6]}}}}
    fig = figure(result)
    ax = fig.axes[0]
    legend = {h.get_edgecolor() for h in ax.get_legend().legend_handles}
    assert ax.patches and all(not p.get_fill() for p in ax.patches)  # outlines: overlaps mix no new colour
    assert {p.get_edgecolor() for p in ax.patches} <= legend


def test_quality_warnings_thresholds():
    from dpllm.synthetic.report import FRECHET_RATIO, JS_GAP, quality_warnings

    def result(frechet, js, acc=None):
        fid = {"synthetic": {"frechet": frechet, "ngram_js_1": js},
               "real_reference": {"frechet": 1.0, "ngram_js_1": 0.3}}
        if acc is not None:
            fid["synthetic"]["downstream_accuracy"], fid["majority_accuracy"] = acc, 0.4
        return {"fidelity": fid, "leakage": {"empty_share": 0.0}}

    assert quality_warnings(result(FRECHET_RATIO * 0.99, 0.3 + JS_GAP * 0.99, acc=0.6)) == []
    got = quality_warnings(result(FRECHET_RATIO * 1.01, 0.3 + JS_GAP * 1.01, acc=0.4))
    assert len(got) == 3 and "3.0x" in got[0] and "+0.15" in got[1] and "most common label" in got[2]


def test_sampled_text_is_valid_text(runs, tmp_path):
    """The real sampler on a barely trained byte-level model, hot: no NUL, control character or broken UTF-8."""
    from dpllm.synthetic.records import NOT_TEXT

    card = synthesize(runs / "plain", num=48, out=tmp_path / "hot.jsonl",
                      **{**GEN, "temperature": 1.5, "top_p": 1.0, "max_new_tokens": 24, "batch_size": 16})
    raw = (tmp_path / "hot.jsonl").read_bytes()
    text = raw.decode("utf-8")  # strict: every byte is UTF-8
    rows = read_jsonl(tmp_path / "hot.jsonl")
    assert len(rows) == 48 and not any(NOT_TEXT.search(r["text"]) for r in rows) and "\\u0000" not in text
    assert card["samples_dropped_not_valid_text"] == rows[-1]["id"] + 1 - 48
    assert sum(len(r["text"]) for r in rows) > 48 * 5  # real text came out, not empty strings
    assert all(r["text"].strip() for r in rows)  # an empty sample is dropped and replaced, never written
