"""Which earlier stages a new stage must compose with, decided by record content, not by names.

A stage that starts from an earlier dpllm run inherits that run's stages (its privacy report lists
them). Each stage's trained records are known by their sha256 (``splits.json: trained_sha256``, a private
file of the earlier run directory; the report only carries a digest of the set). For this stage's
private records P (its training set, and for the non-private check also its held-out records):

- an earlier **private** stage is composed: its ``(σ, q, steps)`` history goes before this stage's in the
  accountant. Whether it is composed must not depend on the data: if it were decided by overlap, adding one
  record that the earlier stage trained on would switch the released history and ε, and so tell anyone who
  knows every other record whether that one is in this stage's set. So it is composed unless the user
  *declares* the stages disjoint (``data.earlier_stages_disjoint: true``, a fact about how the data was
  collected); the declaration is then checked by content and a run whose records overlap (or cannot be
  checked) is refused before any work, so the declaration, not the data, decides what is released (parallel
  composition: the earlier stage's ε protects its own records);
- an earlier **non-private** stage that trained on any record of P makes a DP guarantee for P impossible:
  refused before any work, naming the stage and the overlap; so is one whose records cannot be checked.

Content, not names: ``d.jsonl`` and ``./d.jsonl``, or two files holding the same texts, are the same
records. Records are compared after the loader's normalisation (stripped text); near-duplicates that
differ by a character are different records to this check.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from dpllm.privacy.accounting import PrivacyPlanError
from dpllm.privacy.report import PrivacyReport, ReportError


def set_digest(hashes: Iterable[str]) -> str:
    """sha256 over the sorted record hashes: names a set of records without listing them."""
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()


def trained_hashes(run_dir: str | Path) -> Optional[set[str]]:
    """The sha256 of every record a run trained on, from its ``splits.json`` (None if unavailable)."""
    path = Path(run_dir) / "splits.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    hashes = data.get("trained_sha256")
    return set(hashes) if isinstance(hashes, list) else None


@dataclass
class Lineage:
    """Earlier stages of the model being trained and what this stage inherits from them."""

    stages: list = field(default_factory=list)  # earlier stage records, for this run's report
    history: list = field(default_factory=list)  # composed (σ, q, steps) of earlier private stages
    notes: list = field(default_factory=list)


def _describe(stage: dict) -> str:
    return f"stage {stage.get('name', '?')!r} ({stage.get('run_dir') or 'location unknown'})"


def lineage(source: dict, *, private: set[str], heldout: set[str], dp: bool,
            declared_disjoint: bool = False) -> Lineage:
    """Decide composition for a stage trained from ``source`` (see the module docstring).

    Args:
        source: where the model comes from (:func:`dpllm.models.source_of`).
        private: sha256 of this stage's training records.
        heldout: sha256 of this stage's held-out private records.
        dp: whether this stage is private (a non-private stage only records the lineage).
        declared_disjoint: the user declares earlier private stages disjoint from this stage's records
            (``data.earlier_stages_disjoint``): they are then checked, and not composed.

    Raises:
        PrivacyPlanError: an earlier non-private stage trained on (or cannot be proven disjoint from)
            this stage's private records; an earlier private stage declared disjoint is not; or the earlier
            run's report cannot be read.
    """
    if source.get("kind") != "run_checkpoint":
        return Lineage()
    try:
        report = PrivacyReport.read(source["path"])
    except ReportError as err:
        raise PrivacyPlanError(f"model_name_or_path is an earlier dpllm run, but {err}") from err
    out = Lineage(stages=list(report.stages))
    here = Path(source["path"]).parent  # the run directory of the checkpoint, wherever it was moved
    for i, stage in enumerate(report.stages):
        trained = trained_hashes(stage["run_dir"]) if stage.get("run_dir") else None
        if trained is None and i == len(report.stages) - 1:
            trained = trained_hashes(here)
        if trained is not None and stage.get("records_sha256") not in (None, set_digest(trained)):
            trained = None  # splits.json no longer matches what the stage recorded
        if stage.get("enabled"):
            if declared_disjoint and dp:
                overlap = None if trained is None else len(trained & private)
                if overlap != 0:
                    raise PrivacyPlanError(
                        f"data.earlier_stages_disjoint is set, but earlier private {_describe(stage)} "
                        + (f"trained on {overlap} of this stage's training records" if overlap else
                           "cannot be checked (its splits.json is missing or changed)")
                        + "; unset earlier_stages_disjoint to compose its ε, or train on records it never saw")
                out.notes.append(f"{_describe(stage)} declared disjoint from this stage's records (checked by "
                                 "content hash); its ε is not composed into this one")
                continue
            out.history += [tuple(h) for h in stage.get("history", [])]
            out.notes.append(f"{_describe(stage)} composed (earlier private stages always are unless "
                             "data.earlier_stages_disjoint declares otherwise)")
        elif dp:
            if trained is None:
                raise PrivacyPlanError(
                    f"cannot prove that earlier non-private {_describe(stage)} did not train on this stage's "
                    "private records: its splits.json is missing or changed. Start from the original run "
                    "directory, or from a model that never saw private data")
            overlap = len(trained & (private | heldout))
            if overlap:
                raise PrivacyPlanError(
                    f"earlier non-private {_describe(stage)} trained on {overlap} of this stage's private records "
                    f"({len(trained & private)} training, {len(trained & heldout)} held-out): no DP guarantee can "
                    "hold for them. Pretrain on records disjoint from the private set (data.train_on: public), or "
                    "start from another model")
    return out
