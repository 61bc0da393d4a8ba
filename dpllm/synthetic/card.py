"""The data card of a synthetic set: what it was sampled from, how, and what guarantee it carries.

Written beside the synthetic file (``synth.jsonl`` → ``synth.card.json`` and ``synth.card.md``) and
released with it. It holds only public facts: the source run's privacy report without local paths
as a release bundle carries it (:func:`dpllm.export.release_report`: no
record counts, digests or local paths), the generation settings (public prompts and the public set of labels
included) and the file's sha256. It never holds a training record, a split or a metric of the training data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from dpllm.export import plain_reading, release_report
from dpllm.privacy.report import PrivacyReport

PRIVACY_FIELDS = ("enabled", "epsilon", "delta", "privacy_unit", "accountant", "noise_multiplier", "sample_rate",
                  "steps", "max_grad_norm", "clipping", "noise_schedule", "noise_secret", "user_level", "release",
                  "poisson_sampling", "sampling", "composition")


def card_paths(out: str | Path) -> tuple[Path, Path]:
    """``(card.json, card.md)`` beside the synthetic file ``out``."""
    out = Path(out)
    stem = out.name[: -len(out.suffix)] if out.suffix else out.name
    return out.with_name(f"{stem}.card.json"), out.with_name(f"{stem}.card.md")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def statement(report: PrivacyReport, refusal: Optional[str], shape: Optional[str] = None) -> str:
    """The guarantee in words: post-processing of a DP model, or plainly none; under DP, what it means for
    membership attacks on the file (:func:`dpllm.export.plain_reading`; ``shape`` is the records' shape)."""
    if refusal is not None:
        return (f"NOT RELEASABLE: the source run failed dpllm's release checks ({refusal}); the checks were "
                "overridden, so this file carries no DP guarantee and must stay with the data owner.")
    if not report.enabled:
        return ("No differential-privacy guarantee: the source model was trained without DP, and its samples may "
                "copy training records verbatim.")
    return (f"Every record was sampled from a model trained with (ε = {report.epsilon:.3f}, δ = {report.delta:g})-"
            f"differential privacy at the level of one {report.privacy_unit}. Sampling reads only the model's "
            "weights, public prompts and the public set of labels, never the training data, so by the "
            "post-processing property of differential privacy this file, any number of further samples and any "
            f"analysis of them are (ε = {report.epsilon:.3f}, δ = {report.delta:g})-DP with respect to the training "
            f"data at no further cost. DP bounds what the file reveals about any one {report.privacy_unit}; it does "
            "not hide patterns shared by many records, nor anything in the public pretraining data."
            + plain_reading(report, shape, source="this file (or the model it was sampled from)"))


def columns(settings: dict) -> list[str]:
    """The fields of every line of a synthetic file sampled with ``settings``."""
    shape = settings.get("shape", "text")
    if shape == "messages":
        return ["id", "messages"]
    if shape == "prompt_completion":
        return ["id", "prompt", "completion"]
    return ["id", "text"] + (["label"] if settings.get("labels") else ["prompt"] if settings.get("prompts") else [])


def make_card(*, report: PrivacyReport, refusal: Optional[str], settings: dict, file: str,
              num_records: int, complete: bool, sha256: Optional[str], drawn: Optional[int] = None,
              license: Optional[str] = None) -> dict:
    """The card as JSON-serialisable data (schema ``dpllm.synthetic.card/1``).

    ``drawn`` is how many samples were drawn up to the file's last record; ``drawn - num_records`` of them were
    dropped as not valid text (:mod:`dpllm.synthetic.records`). Both are functions of the samples only. The
    source run is not named (its directory's name may name the data); ``*.source.json``, private, names it.
    """
    from dpllm.checkpoint import library_versions

    public = release_report(report).to_dict()
    return {
        "schema": "dpllm.synthetic.card/1",
        "file": file,
        "num_records": num_records,
        "columns": columns(settings),
        "samples_drawn": drawn,
        "samples_dropped_not_valid_text": None if drawn is None else drawn - num_records,
        "complete": complete,
        "license": license,
        "sha256": sha256,
        "source": {"privacy": {k: public.get(k) for k in PRIVACY_FIELDS if k in public},
                   "releasable": refusal is None, "dp_guarantee": refusal is None and report.enabled,
                   "refusal_overridden": refusal},
        "generation": settings,
        "statement": statement(report, refusal, settings.get("shape", "text")),
        "versions": {k: v for k, v in library_versions().items() if k in ("dpllm", "torch", "transformers")},
    }


def card_markdown(card: dict) -> str:
    """The data card a reader and the Hub see: ``DatasetCardData``'s YAML block (:mod:`dpllm.hub`), then the
    README-style view of ``card``."""
    from dpllm import hub

    released = PrivacyReport.from_dict({"num_records": None, "steps": 0, **card["source"]["privacy"]})
    meta = hub.dataset_card_data(released, refusal=card["source"]["refusal_overridden"], file=card["file"],
                                 num_records=card["num_records"], columns=card.get("columns", ["id", "text"]),
                                 license=card.get("license"), dropped=card.get("samples_dropped_not_valid_text"))
    return hub.card_text(meta, _card_body(card))


def _card_body(card: dict) -> str:
    p, g = card["source"]["privacy"], card["generation"]
    if p.get("enabled"):
        guarantee = (f"(ε = {p['epsilon']:.3f}, δ = {p['delta']:g}) at the level of one {p['privacy_unit']} "
                     f"({p['accountant']} accountant; σ = {p['noise_multiplier']:.4g}, q = {p['sample_rate']:.4g}, "
                     f"{p['steps']} steps, C = {p['max_grad_norm']:g}; neighbouring relation: "
                     f"{(p.get('release') or {}).get('neighbouring_relation') or 'add/remove one unit'})")
    else:
        guarantee = "none (trained without DP)"
    cond = (f"labels (control codes, uniformly in turn): {', '.join(g['labels'])}" if g.get("labels") else
            f"{len(g['prompts'])} public prompt(s), in turn" if g.get("prompts") else "unconditional")
    records = f"{card['num_records']:,}" + ("" if card["complete"] else
                                            " (incomplete: generation was interrupted; rerun the command to finish)")
    sampling = (f"temperature {g['temperature']:g}, top-p {g['top_p']:g}, at most {g['max_new_tokens']} new tokens, "
                f"batch {g['batch_size']}, sampling seed {g['seed']}")
    return f"""# Synthetic data: `{card['file']}`

{card['statement']}

| | |
|---|---|
| records | {records} |
| sha256 | `{card['sha256']}` |
| source model's DP guarantee | {guarantee} |
| releasable | {'yes' if card['source']['releasable'] else '**no**: ' + str(card['source']['refusal_overridden'])} |
| conditioning | {cond} |
| sampling | {sampling} |

Each line of the file is one JSON object with the fields {_columns(card)}{_dropped(card)}
The sampling seed seeds only the sampling, which reads nothing private; the DP
training noise was secret (see `source.privacy.noise_secret` in the JSON card).

Written by `dpllm synthesize` (dpllm {card['versions'].get('dpllm')}). The leakage and fidelity report that
comes with it (`*.report.*`) is computed against the training records and stays with the data owner.
"""


def _columns(card: dict) -> str:
    return ", ".join(f"`{c}`" for c in card.get("columns", ["id", "text"]))


def _dropped(card: dict) -> str:
    n = card.get("samples_dropped_not_valid_text")
    return ("." if not n else f"; {n} of the {card['samples_drawn']} samples drawn were dropped as not valid text "
            "(NUL or control characters, bytes that are not UTF-8, or empty) and replaced by further samples.")


def release_folder(synth: str | Path, dest: str | Path) -> Path:
    """Write the releasable part of a synthetic set into the new folder ``dest``: the data file, its JSON card and
    the data card as ``README.md`` (``datasets.load_dataset(dest)`` reads the file as the ``train`` split).

    Raises:
        FileExistsError: ``dest`` exists and is not empty.
        FileNotFoundError: no synthetic file or card.
    """
    import shutil

    from dpllm.io import atomic_directory

    synth, dest = Path(synth), Path(dest)
    card_json, card_md = card_paths(synth)
    for p in (synth, card_json, card_md):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing; run dpllm synthesize first")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} exists and is not empty; pick a new folder")
    with atomic_directory(dest) as tmp:
        shutil.copy2(synth, tmp / synth.name)
        shutil.copy2(card_json, tmp / card_json.name)
        shutil.copy2(card_md, tmp / "README.md")
    return dest
