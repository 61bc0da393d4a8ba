"""The leakage and fidelity report of a synthetic file: JSON first, then markdown and a plot.

``synth.jsonl`` gets ``synth.report.json``, ``synth.report.md`` and ``synth.report.png`` beside it. The
report is computed against the run's training and held-out records (``splits.json``) and shows the
closest synthetic/training pairs, so it is **private**: it stays with the data owner, unlike the synthetic
file and its card (docs/run_directory.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from dpllm.io import read_jsonl, write_json_atomic, write_text_atomic


def report_paths(synth: str | Path) -> dict[str, Path]:
    synth = Path(synth)
    stem = synth.name[: -len(synth.suffix)] if synth.suffix else synth.name
    return {ext: synth.with_name(f"{stem}.report.{ext}") for ext in ("json", "md", "png")}


def default_embedder(run_dir: Path) -> Optional[str]:
    """The run's base model when it is a local directory (a public pretrained model or an earlier stage)."""
    from dpllm.privacy.report import PrivacyReport

    base = PrivacyReport.read(run_dir).base_model or {}
    path = base.get("path")
    return path if base.get("kind") in ("pretrained", "run_checkpoint") and path and Path(path).is_dir() else None


def evaluate(synth: str | Path, run_dir: str | Path, *, embedder: str = "auto", near: float = 0.6,
             min_chars: int = 48, seed: int = 0, canaries: Optional[list[dict]] = None) -> dict:
    """Leakage and fidelity of the synthetic file ``synth`` against the run it was sampled from.

    Args:
        synth: a ``dpllm synthesize`` JSONL file.
        run_dir: its source run (reads ``splits.json``, ``config.yaml``, ``canaries.json`` and the data).
        embedder: ``auto`` (the run's local base model, else ``lsa``), ``lsa``, or a model directory.
        near, min_chars: :func:`dpllm.synthetic.leakage.leakage`'s thresholds.
        seed: size-matched subsamples and the classifier.
        canaries: canaries to look for (``{"id", "text", "prefix", "included"}``, as :func:`dpllm.canaries.make`);
            default: the run's ``canaries.json``, if any.

    Returns:
        ``{"synthetic_file", "run", "leakage", "fidelity"}``.
    """
    from dpllm.data import load_split_texts, split_control_code
    from dpllm.synthetic.fidelity import fidelity, lsa_embedder, model_embedder
    from dpllm.synthetic.leakage import leakage
    from dpllm.synthetic.records import as_text

    synth, run_dir = Path(synth), Path(run_dir)
    rows = read_jsonl(synth)
    texts = [as_text(r) for r in rows]  # a chat's turns or a prompt and its completion, compared as plain text
    train = [split_control_code(as_text(t)) for t in load_split_texts(run_dir, "train")]
    heldout = [split_control_code(as_text(t)) for t in load_split_texts(run_dir, "heldout")]
    if canaries is None and (run_dir / "canaries.json").is_file():
        canaries = json.loads((run_dir / "canaries.json").read_text())["canaries"]
    tr, ho = [t for _, t in train], [t for _, t in heldout]
    leak = leakage(texts, tr, ho, canaries=canaries, near=near, min_chars=min_chars, seed=seed)
    name = default_embedder(run_dir) if embedder == "auto" else embedder
    if name in (None, "lsa"):
        embed, name = lsa_embedder(tr + ho, seed=seed), "lsa (TF-IDF word 1-2-grams + SVD, fitted on the real records)"
    else:
        embed = model_embedder(name)
    labelled = all("label" in r for r in rows) and all(lab is not None for lab, _ in train + heldout)
    fid = fidelity(texts, tr, ho, embed=embed, embedder=str(name), seed=seed,
                   **({"synthetic_labels": [r["label"] for r in rows], "train_labels": [lab for lab, _ in train],
                       "heldout_labels": [lab for lab, _ in heldout]} if labelled else {}))
    result = {"synthetic_file": synth.name, "run": run_dir.resolve().name, "leakage": leak, "fidelity": fid}
    result["warnings"] = quality_warnings(result)
    return result


# Fidelity the operator is warned about (a console line and the report), each against the size-matched real set
# scored the same way: on the built-in study the real set scores Fréchet 0.83 and DP sets 6.9-8.2.
FRECHET_RATIO = 3.0  # Fréchet distance to held-out records above 3x the real set's
JS_GAP = 0.15  # word-unigram JS divergence (bits) more than 0.15 above the real set's
EMPTY_SHARE = 0.2  # more than 20% of synthetic records empty


def quality_warnings(result: dict) -> list[str]:
    """Plain sentences for each fidelity figure past its threshold (:data:`FRECHET_RATIO`, :data:`JS_GAP`,
    :data:`EMPTY_SHARE`, a classifier no better than the majority class); empty when none is."""
    fd = result["fidelity"]
    s, r = fd["synthetic"], fd["real_reference"]
    out = []
    if s["frechet"] > FRECHET_RATIO * max(r["frechet"], 1e-9):
        out.append(f"fidelity is poor: the synthetic records' Fréchet distance to held-out records is "
                   f"{s['frechet']:.3f}, {s['frechet'] / max(r['frechet'], 1e-9):.1f}x that of as many real records "
                   f"({r['frechet']:.3f}; warned above {FRECHET_RATIO:g}x)")
    if s["ngram_js_1"] > r["ngram_js_1"] + JS_GAP:
        out.append(f"fidelity is poor: the synthetic records' word distribution is far from the held-out records' "
                   f"(unigram JS divergence {s['ngram_js_1']:.3f} vs {r['ngram_js_1']:.3f} for real records; warned "
                   f"above +{JS_GAP:g})")
    acc, majority = s.get("downstream_accuracy"), fd.get("majority_accuracy")
    if acc is not None and majority is not None and acc <= majority:
        out.append(f"a classifier trained on the synthetic records is no better than always guessing the most "
                   f"common label ({100 * acc:.1f}% vs {100 * majority:.1f}% on held-out records)")
    empty = result["leakage"].get("empty_share")
    if empty is not None and empty > EMPTY_SHARE:
        out.append(f"{100 * empty:.0f}% of the synthetic records are empty (warned above {100 * EMPTY_SHARE:.0f}%)")
    return out


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: Optional[float], d: int = 3) -> str:
    return "–" if x is None else f"{x:.{d}f}"


def markdown(result: dict) -> str:
    """The human view of :func:`evaluate`'s result."""
    lk, fd = result["leakage"], result["fidelity"]
    s, r = fd["synthetic"], fd["real_reference"]
    lines = [f"# Leakage and fidelity of `{result['synthetic_file']}` (PRIVATE: computed on the training data)", "",
             f"Source run `{result['run']}`: {lk['n']} synthetic records against {lk['num_train']} training records "
             f"(size-matched sample of {lk['num_train_matched']}) and {lk['num_heldout']} held-out records.", "",
             "## Leakage (synthetic vs training records, against the held-out control)", "",
             "| measure | vs training | vs held-out |", "|---|---|---|",
             f"| verbatim copy (≥ {lk['settings']['min_chars']} chars) | {_pct(lk['verbatim']['train'])} "
             f"(all {lk['num_train']} records: {_pct(lk['verbatim']['train_all'])}, "
             f"{lk['verbatim']['distinct_train_records_copied']} distinct) | {_pct(lk['verbatim']['heldout'])} |",
             f"| near duplicate (5-gram Jaccard ≥ {lk['settings']['near']}) | {_pct(lk['near']['train'])} | "
             f"{_pct(lk['near']['heldout'])} |",
             f"| median nearest-neighbour distance | {_num(lk['nn_distance']['train']['median'])} | "
             f"{_num(lk['nn_distance']['heldout']['median'])} |",
             f"| 5th percentile of that distance | {_num(lk['nn_distance']['train']['p05'])} | "
             f"{_num(lk['nn_distance']['heldout']['p05'])} |", "",
             f"Closer to a training record than to any held-out record: {_pct(lk['closer_to_train'])} of synthetic "
             "records (50% when nothing is copied)."]
    if "canaries" in lk:
        c = lk["canaries"]
        lines += ["", f"Canaries: {c['extracted_included']} of {c['included']} trained-on canaries appear verbatim, "
                      f"and {c['extracted_excluded']} of {c['excluded']} canaries that were not trained on (control)."]
    lines += ["", "## Fidelity (distance to held-out real records; lower is closer)", "",
              "| | synthetic | real training records (same size) |", "|---|---|---|",
              f"| word unigram JS divergence | {_num(s['ngram_js_1'])} | {_num(r['ngram_js_1'])} |",
              f"| word bigram JS divergence | {_num(s['ngram_js_2'])} | {_num(r['ngram_js_2'])} |",
              f"| Fréchet distance ({fd['embedder']}) | {_num(s['frechet'])} | {_num(r['frechet'])} |"]
    if "downstream_accuracy" in s:
        lines += [f"| label classifier trained here, accuracy on held-out | {_pct(s['downstream_accuracy'])} | "
                  f"{_pct(r['downstream_accuracy'])} (all training records: {_pct(fd['real_train_all_accuracy'])}; "
                  f"majority class {_pct(fd['majority_accuracy'])}) |"]
    if result.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in result["warnings"]]
    lines += ["", "## Closest synthetic/training pairs", "",
              "Nearest-neighbour distance (as in the table: 1 - char 5-gram Jaccard; 0 is a copy), synthetic record, "
              "its nearest record of the size-matched training sample.", ""]
    lines += [f"- {_distance(e):.3f}: `{e['synthetic'][:120]!r}` ~ "
              + (f"`{e['nearest_train'][:120]!r}`" if e.get("nearest_train") is not None else
                 f"(no training record shares a {lk['settings']['ngram']}-character sequence with it)")
              for e in lk["examples"]]
    return "\n".join(lines) + "\n"


def _distance(example: dict) -> float:
    return example["distance"] if "distance" in example else 1 - example["similarity"]


def figure(result: dict):
    """The histogram figure: nearest-neighbour distances to training and to held-out records, as outlines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lk = result["leakage"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bins = np.linspace(0, 1, 41)
    # outlines, not translucent fills: where two fills overlap they make a third colour the legend does not name
    for side, colour, style in (("train", "tab:red", "-"), ("heldout", "tab:blue", "--")):
        ax.hist(lk["nn_distance"][side]["values"], bins=bins, histtype="step", linewidth=1.8, linestyle=style,
                color=colour, label=f"to nearest {'training' if side == 'train' else 'held-out'} record")
    ax.set(xlabel="nearest-neighbour distance (1 - char 5-gram Jaccard)", ylabel="synthetic records",
           title=f"{result['synthetic_file']}: closer to training = copied")
    ax.legend()
    fig.tight_layout()
    return fig


def plot(result: dict, path: str | Path) -> Path:
    """Write :func:`figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(result: dict, synth: str | Path) -> dict[str, Path]:
    """Write the JSON, markdown and PNG views of ``result`` beside ``synth`` (each atomically)."""
    paths = report_paths(synth)
    write_json_atomic(paths["json"], result)
    write_text_atomic(paths["md"], markdown(result))
    tmp = paths["png"].with_name(f".{paths['png'].name}.tmp.png")
    plot(result, tmp).replace(paths["png"])
    return paths
