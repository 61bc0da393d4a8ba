"""``dpllm export RUN_DIR --out DIR``: the part of a run that may be published, and nothing else.

A run directory holds files that are not private-safe: ``splits.json`` lists the members, ``metrics.jsonl``
has un-noised training and held-out losses, ``config.yaml`` names the data and the split seed, and
``checkpoints/`` holds the secret state of the noise generators. The bundle gets only:

    model weights or LoRA adapter (+ base_model/ when the base has no public name), tokenizer,
    privacy_report.json (the public fields only, :func:`release_report`), README.md (a model card built
    from that released report, :func:`model_card`, under the Hub's YAML metadata block: :mod:`dpllm.hub`)

``--push-to-hub REPO_ID [--private]`` uploads exactly that bundle afterwards (:func:`dpllm.hub.push_folder`).

**What the released report may say** is decided here, by allow-lists (:data:`RELEASED_FIELDS`,
:data:`RELEASED_STAGE_FIELDS`, :data:`RELEASED_USER_FIELDS`): the mechanism's public parameters (σ, q,
steps, C, B, clipping, accountant, δ), ε, the composed history, the engine and library versions, and facts
the user declares public (:data:`PUBLIC_FACTS`, ``--declare-public``). Everything else in the private
report stays in the run directory: content digests (``records_sha256``, a set digest anyone who knows all
records but one can recompute for each candidate), exact record and user counts, per-user statistics
(largest user, users trimmed, records dropped), local paths, and ``expected_batch_size`` (⌊q·N⌋).

**Neighbouring relation: add or remove one unit** (a record, or under ``privacy_unit: user`` one user with
at most ``max_records_per_user`` records). That is the relation Opacus's RDP and PRV accountants bound for
Poisson-sampled DP-SGD and the one dp-accounting's PLD uses for the user-level mixture. Under it the dataset
size N is itself private (N and N + 1 are neighbours: publishing N exactly tells whether a record is in),
so N is released only when the user declares it public. q = 1/⌈N/B⌉ and ``steps`` are released (ε cannot
be checked without them); they reveal ⌈N/B⌉, i.e. N to within B records (under ULS q = 1/⌈U/B_u⌉ with
B_u = round(B·U/N) users per step: U and U/N likewise to within a batch), and like every DP-SGD report
they are treated as fixed public parameters of the mechanism. A neighbour that moves ⌈N/B⌉ (N within one
record of a multiple of B) would publish another q; the guarantee is for neighbours with the same q and
steps, and the model card says so.

It refuses a run whose ledger does not verify, a run whose noise was not secret
(``privacy.reproducible_noise: true``), a study run (a public split simulated from the private file:
``data.simulate_public_from_private``; no ε covers what it trained on without DP), a run whose membership
audit found more than its ε allows unless ``--allow-failed-audit`` is given (the card then says so first),
and a non-private run unless ``--allow-non-private`` is given (the card then says plainly that there is no
DP guarantee). Those checks are :func:`check_releasable`, which ``dpllm synthesize`` (:mod:`dpllm.synthetic`)
makes too. ``dpllm export`` also refuses a run with a compliance item not met (:mod:`dpllm.compliance`) unless
``--accept-unmet ITEM`` accepts each; the checklist it computes is recorded in the bundle
(``release.compliance``) and rendered on the card, the one verdict ``dpllm report BUNDLE --compliance`` prints too.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from dpllm.io import atomic_directory, load_yaml, looks_local, write_text_atomic
from dpllm.privacy.report import (
    NOT_RELEASABLE,
    PrivacyReport,
    ReportError,
    blt_mu,
    blt_noise,
    sampling_of,
    sampling_words,
    sequence_unit_words,
)

# What save_pretrained writes for a model, an adapter or a tokenizer; nothing else leaves the run.
RELEASED_PATTERNS = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                     "adapter_config.json", "adapter_model*.safetensors", "tokenizer*", "special_tokens_map.json",
                     "vocab*", "merges.txt", "*.model", "added_tokens.json", "chat_template*",
                     "base_quantization.json")  # QLoRA: the base's BitsAndBytesConfig (public settings, no data)

# The privacy report's fields a bundle carries: the mechanism's public parameters, ε and how it was computed.
RELEASED_FIELDS = ("enabled", "steps", "logical_batch_size", "physical_batch_size", "privacy_unit", "epsilon", "delta",
                   "accountant", "accountant_method", "target_epsilon", "noise_multiplier", "sample_rate",
                   "max_grad_norm", "clipping", "sensitivity", "grad_sample_mode", "poisson_sampling", "secure_mode",
                   "noise_secret", "history", "model_adjustments", "versions", "noise_schedule", "sequence_level",
                   "adaptive_clipping",  # clipping: quantile: γ, η, σ_b, σ_g and C, a function of noised counts
                   "correlated_noise",  # noise: banded: b, coefficients, q_b, ⌈T/b⌉ (functions of q and T, released)
                   "sampling")  # the scheme, q or q_b, b, what ε credits (and BLT's μ): functions of the above
# Not "note" (free text, could say anything) and not "warnings": they quote data-dependent counts (records removed as
# duplicates, the expected batch q·N, a logical batch capped at N) for the operator, who reads them in the private run.
# A stage's name is its output directory's (it may name the data: "runs/patients_2024"): released as "stage i".
RELEASED_STAGE_FIELDS = ("enabled", "train_on", "steps", "history")
# user_level: the declared cap and how ε became user-level; never counts of users or records
RELEASED_USER_FIELDS = ("unit", "sampling", "max_records_per_user", "group_size", "users_per_batch", "group_privacy",
                        "record_epsilon", "record_delta", "user_epsilon", "user_delta")
# Facts computed from the private data that the user may declare public (they then appear exactly).
PUBLIC_FACTS = {"num_records": "N, the number of records the last stage trained on",
                "num_users": "U, the number of users the last stage trained on (privacy_unit: user)",
                "dataset": "the dataset's name or local path, per stage",
                "truncation": "how many training records max_length cut, and how many tokens they lost"}
WITHHELD = ("exact record and user counts (unless declared public), content digests of the training set, per-user "
            "statistics, local paths, the stages' names (their output directories) and the data sets' names or Hub "
            "ids (unless declared public), un-noised losses, the member list and the generators' state")
PRIVATE_DATASET = "private data set"  # what a release says for a data set not built in and not declared public


class ExportError(ValueError):
    """A run that may not (or cannot) be exported; the message says why and what to do."""


def _released_files(src: Path) -> list[Path]:
    files = {p for pattern in RELEASED_PATTERNS for p in src.glob(pattern) if p.is_file()}
    return sorted(files)


def neighbouring_relation(report: PrivacyReport) -> str:
    """The relation the released ε is for, in words."""
    user = report.user_level or {}
    if report.privacy_unit == "user":
        cap = user.get("max_records_per_user")
        return ("add or remove one user" + (f" (with at most {cap} records)" if cap else "")
                + ("" if user.get("sampling") == "uls" else "; a user is a group of at most that many records"))
    if report.privacy_unit == "sequence" and report.sequence_level:
        return (f"add or remove one sequence (a block of {report.sequence_level['tokens_per_sequence']:,} tokens of "
                "the concatenated training texts)")
    return "add or remove one record" + _ranked_count(report)


def _ranked_count(report: PrivacyReport) -> str:
    """What ``max_records`` means for the relation (issue 46): it keeps a count of records ranked by keyed hash,
    so a corpus one record larger can push a kept record out. A DP run allows it only on a built-in public corpus
    (or a file no neighbour pushes past the cut, where add/remove holds as stated); on a built-in corpus the ε is
    for adding or removing a record of the kept set, and relative to the whole corpus a neighbour is a replaced
    record, for which no ε is computed."""
    from dpllm import data, sft

    for s in report.stages:
        cap, name = s.get("max_records"), s.get("dataset")
        if s.get("enabled") and cap is not None and (name in data.BUILTIN or name in sft.BUILTIN):
            return (f" of the at most {cap:,} that max_records kept (by keyed-hash rank) from the built-in public "
                    f"corpus {name}; relative to the whole corpus a neighbour replaces a kept record, and no ε is "
                    "stated for that")
    return ""


def _dataset_name(name, *, public: bool):
    from dpllm.data import BUILTIN

    # a built-in corpus is public; a local path or a Hub id only when declared so (a Hub data set may be private,
    # and its id can name the people in it: "acme/patients-2024")
    if name is None or public or name in BUILTIN:
        return name
    return PRIVATE_DATASET


def release_report(report: PrivacyReport, *, declare_public: Sequence[str] = (),
                   failed_audit: Optional[str] = None) -> PrivacyReport:
    """The report a bundle carries: only :data:`RELEASED_FIELDS` (and the declared :data:`PUBLIC_FACTS`).

    Stages are named by their place ("stage 1", ...), never by their output directory; a data set by
    :data:`PRIVATE_DATASET` unless built in or declared public. ``failed_audit`` (the publisher exported
    despite a failed membership audit, :func:`dpllm.compliance.failed_audit`) goes into ``release``.

    Raises:
        ExportError: a fact that is not one of :data:`PUBLIC_FACTS`, or ``num_users`` for a record-level run.
    """
    unknown = sorted(set(declare_public) - set(PUBLIC_FACTS))
    if unknown:
        raise ExportError(f"--declare-public {', '.join(unknown)}: not a fact dpllm can release; choose from "
                          f"{', '.join(PUBLIC_FACTS)}")
    private = report.to_dict()
    if "num_users" in declare_public and not private.get("user_level"):
        raise ExportError("--declare-public num_users: this run has no users (privacy_unit: record)")
    data = {k: private[k] for k in RELEASED_FIELDS if k in private}
    data["num_records"] = report.num_records if "num_records" in declare_public else None
    data["stages"] = [dict(name=f"stage {i}", **{k: s[k] for k in RELEASED_STAGE_FIELDS if k in s},
                           dataset=_dataset_name(s.get("dataset"), public="dataset" in declare_public))
                      for i, s in enumerate(report.stages, start=1)]
    if report.user_level:
        user = {k: v for k, v in report.user_level.items() if k in RELEASED_USER_FIELDS}
        if "num_users" in declare_public:
            user["num_users"] = report.user_level.get("num_users")
        data["user_level"] = user
    # Entries before this stage's own (a noise schedule gives this stage one entry per piece).
    prior = len(report.history) - len((report.stages[-1] if report.stages else {}).get("history") or [None])
    data["composition"] = ("single stage" if prior <= 0 else
                           f"{prior} (σ, q, steps) entries of earlier private stages that trained on these records "
                           "composed before this stage's") if report.enabled else None
    base = dict(report.base_model or {})
    if base.get("path") and (base.get("kind") != "pretrained" or looks_local(str(base["path"]))):
        base["path"] = Path(str(base["path"])).name
    data["base_model"] = base
    if "truncation" in declare_public:
        data["data"] = report.data
    data["release"] = {"neighbouring_relation": neighbouring_relation(report) if report.enabled else None,
                       "declared_public": sorted(set(declare_public)), "withheld": WITHHELD}
    if failed_audit:
        data["release"]["exported_despite_failed_audit"] = failed_audit
    return PrivacyReport.from_dict(data)


def _strip_local_base(path: Path) -> None:
    """peft writes the base's path into adapter_config.json; a local path names the publisher's directories (a Hub
    id, or a base shipped as base_model/, is how the bundle is loaded), so only its last component is kept."""
    import json

    cfg = json.loads(path.read_text())
    base = cfg.get("base_model_name_or_path")
    if base and looks_local(str(base)):
        cfg["base_model_name_or_path"] = Path(str(base)).name
        write_text_atomic(path, json.dumps(cfg, indent=2) + "\n")


def declared_record_kind(run_dir: Path) -> str | None:
    """The record shape the run's config declares (``data.data_format``), None for ``auto`` (detected from the data)."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    try:
        cfg = load_yaml(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    kind = (cfg.get("data") or {}).get("data_format")
    return kind if kind in ("messages", "prompt_completion", "text") else None


def published_head(run_dir: Path, verified) -> str | None:
    """The ledger's head hash for the card, or None when publishing it could tell something about the records.

    Every line hashes private facts (counts, content digests of checkpoints holding the private report), some of
    them guessable by an attacker who knows all records but one; a chain whose first line holds a secret random
    ``salt`` (:func:`dpllm.ledger.append`, since issue 49) makes every hash after it a hiding commitment, so only
    such a head is published.
    """
    from dpllm import ledger

    entries = ledger.read(run_dir)
    return verified.head if verified.ok and entries and entries[0].get("salt") else None


def compliance_section(source, *, verified=None) -> str:
    """The model card's compliance checklist (:mod:`dpllm.compliance`): every item's status; the evidence only where
    it is a public parameter (items decided on private files say so instead).

    Args:
        source: the released report (:func:`release_report` with ``release.compliance`` recorded by
            :func:`export`), rendered as recorded (what ``dpllm report BUNDLE --compliance`` prints); or a run
            directory, checked here.
        verified: with a run directory, its :func:`dpllm.ledger.verify` result when the caller has it.
    """
    from dpllm import compliance

    if isinstance(source, PrivacyReport):
        items, release = compliance.recorded(source), source.release or {}
    else:
        items, release = compliance.public_items(compliance.check(source, verified=verified)), {}
    unmet = [it.name for it in items if it.status == compliance.NOT_MET]
    head = release.get("ledger_head")
    return ("\n## Compliance checklist\n\nChecked by `dpllm report --compliance` on the private run directory when "
            "this bundle was exported. The status of the items decided on private files (the ledger, earlier stages) "
            "is one bit each about the private run, released by the publisher's choice; the membership audit's result "
            "is computed on the training records and is not released, only that the final model was audited.\n\n"
            + compliance.format_table(items) + "\n"
            + (f"\nNot met when this bundle was exported, released by the publisher's choice: {', '.join(unmet)}.\n"
               if unmet else "")
            + ("" if not release else
               f"\nPrivacy ledger head (the hash of the ledger's last line; keep it with this release record): "
               f"`{head}`.\n" if head else "\nPrivacy ledger head: not published (this run's ledger has no secret "
               "salt, so its hashes could be tested against guesses about the records).\n"))


def unmet_items(items, *, accept: Sequence[str]) -> str | None:
    """The refusal for checklist items not met and not in ``accept`` (``--accept-unmet``), or None."""
    from dpllm import compliance

    unmet = [it for it in items if it.status == compliance.NOT_MET and it.name not in accept]
    if not unmet:
        return None
    return ("compliance item(s) not met: " + "; ".join(f"{it.name} ({it.evidence})" for it in unmet)
            + ". Fix them, or pass " + " ".join(f"--accept-unmet {it.name}" for it in unmet)
            + " to release anyway (the model card then lists them as not met)")


def record_unit(report: PrivacyReport, record_kind: str | None = None) -> str:
    """What one protected unit of the released guarantee is, in words a non-specialist reads.

    Args:
        report: the released report.
        record_kind: the record shape the publisher *declared* (``data.data_format``: ``messages``,
            ``prompt_completion`` or ``text``); None when it was detected from the data (``auto``), which is a
            fact about the private file and stays on the operator's console.
    """
    user = report.user_level or {}
    if report.privacy_unit == "sequence" and report.sequence_level:
        return "In plain words, " + sequence_unit_words(report.sequence_level, report.epsilon) + "."
    if report.privacy_unit == "user":
        cap = user.get("max_records_per_user")
        return ("One protected unit is one **person** (a user of the training data): everything they contributed "
                "together, " + (f"at most {cap} records (records beyond the cap were left out before training)."
                                if cap else "however many records that is."))
    if record_kind in ("messages", "prompt_completion"):
        return ("One protected unit is one **conversation** (one record of chat or instruction data): all of its turns "
                "together, prompts and answers; a conversation is never split across records or packed with another. "
                "Someone who wrote many conversations is protected per conversation, not as a person.")
    if record_kind == "text":
        return "One protected unit is one **text** (one record of the training data)."
    return ("One protected unit is one **record** of the training data: one whole conversation for chat or instruction "
            "data (all of its turns together), one text for plain-text data. Someone who contributed many records is "
            "protected per record, not as a person.")


def truncation_note(report: PrivacyReport) -> str:
    """What ``max_length`` cut off the training records: the counts where the publisher declared them public
    (``--declare-public truncation``), else that they are withheld ('' for the sequence unit: blocks are not cut)."""
    from dpllm import truncation

    if report.privacy_unit == "sequence":
        return ""
    if report.data:
        return f"\n\n**Long records** (declared public by the publisher): {truncation.describe(report.data)}."
    return ("\n\n**Long records.** A record longer than the run's max_length tokens was trained on its first "
            "max_length tokens only, and the guarantee covers what was trained. How many records that cut (possibly "
            "none) is a statistic of the private data and is withheld; `dpllm report RUN_DIR` shows it to the "
            "operator, and `dpllm export --declare-public truncation` releases it.")


def plain_reading(report: PrivacyReport, record_kind: str | None, *, source: str = "this model") -> str:
    """The guarantee as limits on membership attacks (:mod:`dpllm.privacy.tradeoff`), from the released history;
    ``source`` names what the attacker holds (the model, or data sampled from it). Empty without a DP history."""
    from dpllm.privacy import tradeoff

    try:
        bounds = tradeoff.for_report(report).bounds()
    except tradeoff.TradeoffError:
        return ""
    plural = ("people" if report.privacy_unit == "user" else "sequences" if report.privacy_unit == "sequence" else
              "conversations" if record_kind in ("messages", "prompt_completion") else
              "texts" if record_kind == "text" else "records")
    return (f"\n\n**What ε means here, in plain words.** Take anyone who tries to tell, from {source}, which "
            f"{plural} the model was trained on. {tradeoff.plain_reading(bounds, plural=plural)} These limits hold "
            f"for every attack, however clever, and for everything computed from {source}; they follow from the "
            "noise, sampling rate and number of steps below (the trade-off curve of the whole training history, "
            "computed with dp-accounting as an upper bound). Real attacks usually reach much less. What many "
            f"{plural} have in common (the patterns the model is meant to learn) is not protected, only what sets one "
            "apart.")


def correlated_note(report: PrivacyReport) -> str:
    """The card's sentence on correlated noise (``privacy.noise: banded``), or "" for DP-SGD's independent noise."""
    c = report.correlated_noise
    if not c or c["mechanism"] == "independent":
        return ""
    # user-level sampling (ULS) puts each user, by a keyed hash of its id, in a group (dpllm.privacy.correlated.groups)
    unit, key = ("users", "user's id") if report.privacy_unit == "user" else ("records", "record's own text")
    if blt_noise(c):
        return (f" The noise was correlated across steps (BLT matrix factorization, {c['buffers']} buffer(s)): the "
                f"{unit} were split into {c['bands']} groups by a keyed hash of each {key}, step t "
                f"trained on group t mod {c['bands']} (each of its {unit} at the rate q above), so a {unit[:-1]} took "
                f"part in at most ⌈{report.steps}/{c['bands']}⌉ steps, {c['bands']} apart; ε is that of one Gaussian "
                f"mechanism with μ = sens/σ = {blt_mu(report.history):.4g} over the whole run, with no credit for "
                "sampling (McMahan et al. 2024, arXiv 2408.08868).")
    return (f" The noise was correlated across steps ({c['bands']}-banded matrix factorization): the {unit} were "
            f"split into {c['bands']} groups by a keyed hash of each {key}, each step Poisson-sampled one "
            f"group in turn at the rate q above, and ε is that of DP-SGD over ⌈{c['steps']}/{c['bands']}⌉ = "
            f"{c['accounted_steps']} steps at that rate (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 1).")


def model_card(report: PrivacyReport, *, lora: bool, has_base: bool, record_kind: str | None = None) -> str:
    """README.md for the bundle, written from the *released* report (:func:`release_report`) only: the
    guarantee, what one protected unit is (:func:`record_unit`; ``record_kind`` is the record shape the publisher
    declared, None when detected), what ε means for attacks, its neighbouring relation, how it was computed, the
    training stages, how to load the model."""
    release = report.release or {}
    if report.enabled:
        user = report.user_level or {}
        clipped = "user (the mean of its records' gradients)" if user.get("sampling") == "uls" else "record"
        source = ("the tight user-level mixture-of-Gaussians accounting (dp-accounting's PLD)" if "record_delta" in user
                  else f"the {report.accountant} accountant (Opacus)")
        cap = user.get("max_records_per_user")
        guarantee = (f"**(ε = {report.epsilon:.3f}, δ = {report.delta:g})-differential privacy** at the level of one "
                     f"**{report.privacy_unit}**, for neighbouring datasets that "
                     f"**{release.get('neighbouring_relation')}**, from {source} over the full "
                     f"training history: noise multiplier σ = {report.noise_multiplier:.4g}, {sampling_words(report)}, "
                     f"{report.steps} steps, per-{clipped} clipping norm "
                     f"C = {report.max_grad_norm:g} ({report.clipping}). Noise and sampling randomness came from "
                     "the operating system's entropy and were never written to disk outside the private run "
                     "directory."
                     + (" User level ("
                        f"{'at most ' + str(cap) + ' records per user' if cap else 'no cap on records per user'}"
                        f"): {user['group_privacy']}." if user else "")
                     + correlated_note(report)
                     + "\n\n" + record_unit(report, record_kind) + truncation_note(report))
        size = ("" if report.num_records is None else f" N = {report.num_records:,} records was declared public by the "
                "publisher; an adversary learns it exactly, which is only harmless if it was public already.")
        unit, units = (("user", "users") if user.get("sampling") == "uls" else
                       ("sequence", "sequences") if report.privacy_unit == "sequence" else ("record", "records"))
        rate = (f"q = 1/⌈N/B⌉ with a logical batch of B = {report.logical_batch_size} records" if unit == "record" else
                f"q = 1/⌈U/B_u⌉ over U users, with B_u = round(B·U/N) = {user.get('users_per_batch')} users per step "
                f"(B = {report.logical_batch_size} records)")
        groups = (sampling_of(report) or {}).get("groups", 1) if unit == "record" else 1
        cyclic = " of its group" if groups > 1 else ""  # correlated noise: b cyclic groups, q = q_b = b/⌈N/B⌉
        if groups > 1:
            rate = f"q = {groups}/⌈N/B⌉ over {groups} cyclic groups, with a logical batch of B = " \
                   f"{report.logical_batch_size} records"
        params = (f"\n\n**What is published about the data's size.** The guarantee also hides whether a {unit} was in "
                  f"the data at all, so the exact number of {units} is not published (someone who knew every other "
                  f"{unit} could read the missing one off the count), unless the publisher declares it public.{size} "
                  f"Two numbers that depend on it are published, because nobody could check ε without them: the "
                  f"sampling rate q = {report.sample_rate:.4g}, the chance that any one {unit} is used in a given "
                  f"training step{cyclic} ({rate}), and the number of steps, {report.steps}. Together they give the "
                  f"data's size only roughly, to within one batch ({report.logical_batch_size} records). Like every "
                  "DP-SGD guarantee, this one treats the noise σ, "
                  "q, the number of steps and the clipping norm C as fixed settings of the training: it compares "
                  "datasets that lead to the same settings, which adding or removing one "
                  f"{unit} does except when it changes the number of batches per pass (a count of {units} within one "
                  "of a multiple of the batch size).")
        reading = plain_reading(report, record_kind)
        if reading:
            params = reading + params
    else:
        guarantee, params = "**No differential-privacy guarantee**: this model was trained without DP.", ""
    if release.get("exported_despite_failed_audit"):
        guarantee = (f"**Exported despite a failed audit:** {release['exported_despite_failed_audit']}. The publisher "
                     "released it anyway (`dpllm export --allow-failed-audit`): the implementation may not deliver "
                     "the guarantee below, so do not rely on it.\n\n" + guarantee)
    stages = "\n".join(f"- {s.get('name')}: {'DP' if s.get('enabled') else 'no DP'}, {s.get('dataset')} "
                       f"({s.get('train_on')} split), {s.get('steps')} steps" for s in report.stages)
    if lora:
        base = "AutoModelForCausalLM.from_pretrained(\"THIS_DIR/base_model\")" if has_base else (
            f"AutoModelForCausalLM.from_pretrained(\"{report.base_model.get('path', 'BASE_MODEL')}\")")
        load = ("from peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"base = {base}\nmodel = PeftModel.from_pretrained(base, \"THIS_DIR\")\n"
                "tokenizer = AutoTokenizer.from_pretrained(\"THIS_DIR\")")
    else:
        load = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                "model = AutoModelForCausalLM.from_pretrained(\"THIS_DIR\")\n"
                "tokenizer = AutoTokenizer.from_pretrained(\"THIS_DIR\")")
    declared = ", ".join(release.get("declared_public") or []) or "nothing"
    return f"""# Model trained with dpllm

## Privacy guarantee
{guarantee}{params}

Every stage of this model's training that touched the private records is composed into that ε
(see `privacy_report.json`, fields `history` and `composition`). The guarantee covers the released weights
and anything computed from them; it does not cover files that are not in this bundle.

## Training
{stages}

Logical batch B = {report.logical_batch_size} (expected records per step).

## What is not here, on purpose
Withheld: {release.get('withheld', WITHHELD)}. Declared public by the publisher: {declared}. The member list
(`splits.json`), un-noised training and held-out metrics, the run configuration (it names the data and its
split) and the resumable checkpoints (they hold the noise generators' secret state) stay in the private run
directory.

## How to load
```python
{load}
```
"""


def qlora_section(report: PrivacyReport, ckpt: Path, *, has_base: bool) -> str:
    """The card's QLoRA section: the adapters were trained over a quantized base, and how to load that base the
    same way (its ``BitsAndBytesConfig``, recorded in the checkpoint). Empty for any other run."""
    kind = (report.base_model or {}).get("quantization")
    if not kind:
        return ""
    import json

    from dpllm.checkpoint import BASE_QUANTIZATION

    f = ckpt / BASE_QUANTIZATION
    q = json.loads(f.read_text()) if f.is_file() else {}
    if q.get("load_in_8bit") or kind == "int8":
        args = f"load_in_8bit=True, llm_int8_threshold={q.get('llm_int8_threshold', 0.0)!r}"
    else:
        args = (f"load_in_4bit=True, bnb_4bit_quant_type=\"{q.get('bnb_4bit_quant_type', kind)}\", "
                f"bnb_4bit_use_double_quant={q.get('bnb_4bit_use_double_quant', True)!r}, "
                f"bnb_4bit_compute_dtype=torch.{q.get('bnb_4bit_compute_dtype') or 'float32'}")
    base = "THIS_DIR/base_model" if has_base else str((report.base_model or {}).get("path", "BASE_MODEL"))
    return f"""
## Quantized base (QLoRA)
The adapters were trained with DP over a frozen base quantized to {kind} by bitsandbytes (`{BASE_QUANTIZATION}`
holds its settings); load the base the same way, so the adapters run on the weights they were trained with:
```python
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

base = AutoModelForCausalLM.from_pretrained("{base}", quantization_config=BitsAndBytesConfig({args}))
model = PeftModel.from_pretrained(base, "THIS_DIR")
```
"""


def check_releasable(run_dir: str | Path, *, allow_non_private: bool = False, what: str = "export",
                     verified=None, allow_failed_audit: bool = False) -> PrivacyReport:
    """The checks every release path makes (``dpllm export``, ``dpllm synthesize``) before anything leaves the run.

    Args:
        run_dir: a finished dpllm run directory.
        allow_non_private: accept a run trained without DP (its release must then say there is no guarantee).
        what: the verb used in the refusal message.
        verified: the run's :func:`dpllm.ledger.verify` result, when the caller has it already (verifying hashes
            every checkpoint file, gigabytes for a large model); computed here otherwise.
        allow_failed_audit: accept a run whose membership audit shows the guarantee broken
            (:func:`dpllm.compliance.failed_audit`; the release must then say so).

    Returns:
        The run's privacy report.

    Raises:
        ExportError: no finished run, seeded noise (or a report that does not say the noise was secret), a
            non-private run without ``allow_non_private``, a study run (a public split simulated from the
            private file), a failed membership audit without ``allow_failed_audit``, or a ledger that does not
            verify.
    """
    from dpllm import compliance, ledger

    run_dir = Path(run_dir)
    if not (run_dir / "checkpoint").is_dir():
        raise ExportError(f"{run_dir} has no checkpoint/; {what} a finished dpllm run directory")
    try:
        report = PrivacyReport.read(run_dir)
    except ReportError as err:
        raise ExportError(str(err)) from err
    if report.enabled and report.noise_secret is not True:
        raise ExportError(f"refusing to {what} {run_dir}: " + (NOT_RELEASABLE if report.noise_secret is False else
                          "its report does not say the noise was secret (a run from before dpllm recorded it)"))
    if not report.enabled and not allow_non_private:
        raise ExportError(f"refusing to {what} {run_dir}: it was trained without DP; pass --allow-non-private to "
                          "release it anyway (the card will say there is no DP guarantee)")
    study = report.study_stages()
    if study:
        raise ExportError(f"refusing to {what} {run_dir}: it is a study run: stage(s) {', '.join(study)} trained "
                          "without DP on a public split drawn from the private file (data.simulate_public_from_private:"
                          " true), and no ε covers a record that lands there; retrain with real public data in "
                          "data.public_dataset to release")
    checked = verified if verified is not None else ledger.verify(run_dir)
    if not checked.ok:
        raise ExportError(f"refusing to {what} {run_dir}: its privacy ledger does not verify ({checked.message})")
    failed = compliance.failed_audit(run_dir)
    if failed and not allow_failed_audit:
        raise ExportError(f"refusing to {what} {run_dir}: {failed}, so the implementation may not deliver the "
                          "accounted ε; find the cause, or pass --allow-failed-audit to release it anyway (the card "
                          "will say it was exported despite a failed audit)")
    return report


def export(run_dir: str | Path, out: str | Path, *, allow_non_private: bool = False,
           declare_public: Sequence[str] = (), base_model: Optional[str] = None,
           license: Optional[str] = None, accept_unmet: Optional[Sequence[str]] = None,
           allow_failed_audit: bool = False) -> Path:
    """Write the release bundle of ``run_dir`` to ``out`` (atomically).

    Args:
        run_dir: a finished dpllm run directory.
        out: a new (or empty) directory for the bundle.
        allow_non_private: export a run trained without DP (the card says there is no guarantee).
        declare_public: facts of :data:`PUBLIC_FACTS` the publisher declares public (released exactly).
        base_model: the base model's public Hub id, for the card's metadata when the run loaded it from a local
            path (:func:`dpllm.hub.public_base_model`; a Hub id the run loaded is named without it).
        license: the card's ``license`` (a Hub license id such as ``apache-2.0``); none when not given.
        accept_unmet: the compliance items (:mod:`dpllm.compliance` names) the publisher releases unmet; any
            other item not met is refused (``dpllm export`` passes ``--accept-unmet``). None: no refusal (the
            card lists every item not met either way).
        allow_failed_audit: export a run whose membership audit shows the guarantee broken; the card and
            ``release.exported_despite_failed_audit`` say so (and the ``mia_audit`` item counts as accepted).

    Raises:
        ExportError: no finished run, a ledger that fails to verify, seeded noise, a non-private run
            (without ``allow_non_private``), a study run, a failed membership audit (without
            ``allow_failed_audit``), an unknown fact, a base model given as a path, an ``out`` that
            is not empty or lies inside the run directory, or a compliance item not met and not accepted.
    """
    from dpllm import compliance, hub

    run_dir, out = Path(run_dir), Path(out)
    ckpt = run_dir / "checkpoint"
    from dpllm import ledger

    verified = ledger.verify(run_dir)  # once, for the release checks and the card's checklist
    report = check_releasable(run_dir, allow_non_private=allow_non_private, verified=verified,
                              allow_failed_audit=allow_failed_audit)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not empty; pick a new directory")
    if out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents:
        raise ExportError(f"--out {out} is inside the private run directory {run_dir}; pick a folder outside it")
    try:
        base_name = hub.public_base_model(report.base_model, base_model)
    except hub.PushError as err:
        raise ExportError(str(err)) from None
    released = release_report(report, declare_public=declare_public,
                              failed_audit=compliance.failed_audit(run_dir) if allow_failed_audit else None)
    items = compliance.check(run_dir, verified=verified)
    # --allow-non-private and --allow-failed-audit already accepted the one item each stands for
    accepted = [*(accept_unmet or ()), *(["differential_privacy"] if allow_non_private else []),
                *(["mia_audit"] if allow_failed_audit else [])]
    refusal = None if accept_unmet is None else unmet_items(items, accept=accepted)
    if refusal:
        raise ExportError(f"refusing to export {run_dir}: {refusal}")
    # The one verdict the card and `dpllm report BUNDLE --compliance` both render (dpllm.compliance).
    released.release.update(compliance=compliance.to_json(compliance.public_items(items)),
                            ledger_head=published_head(run_dir, verified))
    lora = (ckpt / "adapter_config.json").is_file()
    has_base = (ckpt / "base_model").is_dir()
    with atomic_directory(out) as tmp:
        # copyfile, not copy2: a file gets the mode of any file written under the umask (0644 under 022) rather
        # than the owner-only mode of the private run it came from; a release is for others to read.
        for f in _released_files(ckpt):
            shutil.copyfile(f, tmp / f.name)
        if lora:
            _strip_local_base(tmp / "adapter_config.json")
        if has_base:
            (tmp / "base_model").mkdir()
            for f in _released_files(ckpt / "base_model"):
                shutil.copyfile(f, tmp / "base_model" / f.name)
        released.write(tmp / "privacy_report.json")
        body = (model_card(released, lora=lora, has_base=has_base, record_kind=declared_record_kind(run_dir))
                + qlora_section(released, ckpt, has_base=has_base)
                + compliance_section(released))
        meta = hub.model_card_data(released, lora=lora, base_model=base_name, license=license)
        write_text_atomic(tmp / "README.md", hub.card_text(meta, body))
    return out


def cli_main(argv: list[str], *, command: bool = False) -> int:
    """``dpllm export RUN_DIR --out DIR [--allow-non-private] [--declare-public FACT ...]``; 0, or 1 when refused.
    ``command``: the ``dpllm`` command's own process (:func:`dpllm.quantization.quiet_command` for the run)."""
    from dpllm import compliance

    ap = argparse.ArgumentParser(prog="dpllm export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a finished dpllm run directory")
    ap.add_argument("--out", required=True, help="new directory for the release bundle")
    ap.add_argument("--allow-non-private", action="store_true", help="export a run trained without DP")
    ap.add_argument("--allow-failed-audit", action="store_true",
                    help="export a run whose membership audit (RUN/audit) found more than its ε allows; the card "
                         "then says it was exported despite a failed audit")
    ap.add_argument("--declare-public", action="append", default=[], choices=sorted(PUBLIC_FACTS), metavar="FACT",
                    help="release this fact exactly, declaring it public (repeatable): "
                         + "; ".join(f"{k}: {v}" for k, v in PUBLIC_FACTS.items())
                         + ". Under add/remove neighbours N is private unless it was public already")
    ap.add_argument("--base-model", metavar="HUB_ID",
                    help="the base model's public Hub id for the card's metadata, when the run loaded it from a local "
                         "path (a Hub id the run loaded is named anyway; a local path is never written)")
    ap.add_argument("--license", help="the card's license, a Hub license id (e.g. apache-2.0, llama3.1, other)")
    ap.add_argument("--push-to-hub", metavar="REPO_ID",
                    help="after exporting, upload exactly the bundle to this Hugging Face Hub model repository "
                         "(needs HF_TOKEN or `hf auth login`)")
    ap.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    ap.add_argument("--accept-unmet", action="append", default=[], metavar="ITEM", choices=compliance.ITEM_NAMES,
                    help="release although this compliance item (a name `dpllm report RUN_DIR --compliance --json` "
                         "prints, e.g. mia_audit) is not met (repeatable); without it export refuses a run with an "
                         "item not met. The model card lists the items not met either way")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if command:  # before anything imports peft: bitsandbytes stays unimported unless the run's model needs it
        from dpllm.quantization import quiet_command

        quiet_command(args.run_dir)
    from dpllm import hub

    if args.private and not args.push_to_hub:
        print("dpllm export: --private applies to --push-to-hub REPO_ID; add it or drop --private", file=sys.stderr)
        return 2
    try:
        if args.push_to_hub:  # before anything is written: a missing token is fixed and the command rerun as is
            hub.require_token()
        path = export(args.run_dir, args.out, allow_non_private=args.allow_non_private,
                      declare_public=args.declare_public, base_model=args.base_model, license=args.license,
                      accept_unmet=args.accept_unmet, allow_failed_audit=args.allow_failed_audit)
    except (ExportError, hub.PushError) as err:
        print(f"dpllm export: {err}", file=sys.stderr)
        return 1
    print(f"exported {args.run_dir} -> {path}: " + ", ".join(sorted(p.name for p in path.iterdir())))
    accepted = [it.name for it in compliance.recorded(PrivacyReport.read(path)) if it.status == compliance.NOT_MET]
    if accepted:
        print(f"dpllm export: released with compliance item(s) not met (--accept-unmet): {', '.join(accepted)}; "
              "the model card lists them", file=sys.stderr)
    if args.push_to_hub:
        try:
            pushed = hub.push_folder(path, args.push_to_hub, private=args.private, repo_type="model",
                                     commit_message="dpllm export")
        except hub.PushError as err:
            print(f"dpllm export: {err}", file=sys.stderr)
            return 1
        print(f"pushed {len(pushed['files'])} files to https://huggingface.co/{args.push_to_hub}"
              + (" (private)" if args.private else ""))
    return 0
