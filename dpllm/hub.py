"""Hugging Face Hub cards and the guarded push of a release (``dpllm export|synthesize ... --push-to-hub``).

Two things live here, both built on ``huggingface_hub`` rather than by hand:

1. **Card metadata.** The YAML block the Hub reads at the top of a ``README.md`` (library, base model,
   pipeline, tags, license), written with :class:`huggingface_hub.ModelCardData` /
   :class:`huggingface_hub.DatasetCardData` from the *released* privacy report only
   (:func:`dpllm.export.release_report`). The guarantee is a ``differential_privacy:`` mapping a reader
   can parse (:func:`dp_metadata`): ε, δ, the privacy unit, the neighbouring relation, the accountant and
   the mechanism's public parameters (σ, q, steps, C). Every value is one the released report already
   carries, so the neighbour property of the bundle (two data sets differing in one record give byte-equal
   non-weight files) holds for the card too. The base model is named only by a public Hub id: one the run
   was loaded from, or one the publisher declares (``--base-model``); a local path never enters it.
2. **The push.** :func:`push_folder` uploads one release folder, exactly its files, in one commit
   (``HfApi.create_repo`` + ``HfApi.upload_folder``). It refuses a folder that is, or lies inside, a
   private run directory, or that holds a file only a run directory has; a missing token
   (:func:`require_token`, read by ``huggingface_hub.get_token``: ``HF_TOKEN`` or ``hf auth login``) and an
   unreachable Hub are one line each (:class:`PushError`), and the callers check the token before they
   write anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from huggingface_hub import HfApi, get_token

TAGS = ("differential-privacy", "dp-sgd", "dpllm")

# Files only a private run directory (or a synthetic set's private report) has; a folder holding one is not a bundle.
PRIVATE_NAMES = ("splits.json", "privacy_ledger.jsonl", "metrics.jsonl", "config.yaml", "dpllm_config.yaml",
                 "canaries.json", "records.jsonl", "generations.jsonl", "run_summary.json", ".dpllm_run", ".lock",
                 "rng_state.pt")
PRIVATE_PATTERNS = ("*.report.json", "*.report.md", "*.report.png", "*.source.json", "checkpoints")


class PushError(ValueError):
    """A push that cannot or may not happen; the message says what to do."""


def dp_metadata(report) -> dict:
    """The ``differential_privacy:`` mapping of a card, from a *released* :class:`PrivacyReport`.

    >>> from dpllm.privacy.report import PrivacyReport
    >>> dp_metadata(PrivacyReport.from_dict({"enabled": False, "num_records": None, "steps": 10}))
    {'enabled': False, 'guarantee': 'none: trained without differential privacy'}
    """
    if not report.enabled:
        return {"enabled": False, "guarantee": "none: trained without differential privacy"}
    release = report.release or {}
    user = report.user_level or {}
    out = {"enabled": True, "guarantee": "(epsilon, delta)-differential privacy",
           "epsilon": float(report.epsilon), "delta": float(report.delta), "unit": report.privacy_unit,
           "neighbouring_relation": release.get("neighbouring_relation"),
           "accountant": ("pld (user-level mixture of Gaussians, dp-accounting)" if "record_delta" in user
                          else report.accountant),
           "mechanism": ("BLT correlated noise over cyclic groups, one Gaussian mechanism (no sampling credit)"
                         if (report.correlated_noise or {}).get("accounting") == "gaussian_mechanism" else
                         "DP-SGD with Poisson sampling" if report.poisson_sampling is not False else "DP-SGD"),
           "noise_multiplier": float(report.noise_multiplier), "sampling_rate": float(report.sample_rate),
           "steps": int(report.steps), "max_grad_norm": float(report.max_grad_norm), "clipping": report.clipping,
           "composition": report.composition}
    if report.noise_schedule:  # σ varied: noise_multiplier is the first piece's, the pieces are (σ, steps)
        out["noise_schedule"] = [[float(s), int(n)] for s, n in report.noise_schedule.get("pieces_sigma_steps", [])]
    if report.adaptive_clipping:  # clipping: quantile: C moved from max_grad_norm to its final value
        out["adaptive_clipping"] = dict(report.adaptive_clipping)
    if user.get("max_records_per_user"):
        out["max_records_per_user"] = int(user["max_records_per_user"])
    seq = report.sequence_level or {}
    if seq.get("tokens_per_sequence"):  # privacy_unit: sequence (declared): the block, and a record cut across two
        out["tokens_per_sequence"] = int(seq["tokens_per_sequence"])
        out["epsilon_group_of_2_sequences"] = seq.get("group_epsilon")
    if report.num_records is not None:  # declared public by the publisher (--declare-public num_records)
        out["num_records_declared_public"] = int(report.num_records)
    if release.get("exported_despite_failed_audit"):  # dpllm export --allow-failed-audit: the reader must see it
        out["exported_despite_failed_audit"] = release["exported_despite_failed_audit"]
    return {k: v for k, v in out.items() if v is not None}


def public_base_model(private_base: dict, declared: Optional[str] = None) -> Optional[str]:
    """The base model's public Hub id: ``declared`` (checked not to be a path), else the Hub id the run loaded.

    ``private_base`` is the *private* report's ``base_model`` (the released one has local paths cut to their
    last component, which could pass for a Hub id). A local directory, an earlier run or a tiny model built from
    a config has no public name: None, unless the publisher declares one.

    Raises:
        PushError: a declared name that looks like a local path.
    """
    from dpllm.io import looks_local

    if declared:
        if looks_local(declared) or declared.count("/") > 1:
            raise PushError(f"--base-model {declared}: give the base model's public Hub id (org/name), not a path")
        return declared
    path = str((private_base or {}).get("path") or "")
    if (private_base or {}).get("kind") == "pretrained" and path and not looks_local(path):
        return path
    return None


def model_card_data(report, *, lora: bool, base_model: Optional[str], license: Optional[str] = None):
    """:class:`huggingface_hub.ModelCardData` of a bundle: peft for an adapter, transformers otherwise."""
    from huggingface_hub import ModelCardData

    tags = list(TAGS) if report.enabled else ["dpllm"]
    if lora:
        tags.append("lora")
    return ModelCardData(library_name="peft" if lora else "transformers", base_model=base_model,
                         pipeline_tag="text-generation", tags=tags, license=license,
                         differential_privacy=dp_metadata(report))


def card_text(data, body: str) -> str:
    """A card's full text: ``data``'s YAML block, then ``body`` (both card kinds; ``ModelCard.load`` reads it)."""
    return f"---\n{data.to_yaml()}\n---\n\n{body.lstrip()}"


def require_token() -> str:
    """The Hub token ``huggingface_hub`` would use.

    Raises:
        PushError: none (no ``HF_TOKEN``, no ``hf auth login``).
    """
    token = get_token()
    if not token:
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access), "
                        "then run the command again; nothing was uploaded")
    return token


def _private_files(folder: Path) -> list[str]:
    found = {p.relative_to(folder).as_posix() for name in PRIVATE_NAMES for p in folder.rglob(name)}
    found |= {p.relative_to(folder).as_posix() for pat in PRIVATE_PATTERNS for p in folder.rglob(pat)}
    return sorted(found)


def check_folder(folder: str | Path) -> list[str]:
    """The files a push of ``folder`` uploads (relative, sorted), after checking it is a release folder.

    Raises:
        PushError: no such folder, an empty one, a run directory or a folder inside one, or private files in it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder}: no such folder to push")
    for d in (folder.resolve(), *folder.resolve().parents):
        if (d / ".dpllm_run").exists() or ((d / "splits.json").is_file() and (d / "privacy_ledger.jsonl").is_file()):
            raise PushError(f"refusing to push {folder}: it is {'' if d == folder.resolve() else 'inside '}a private "
                            f"run directory ({d}); push the folder dpllm export or dpllm synthesize wrote")
    private = _private_files(folder)
    if private:
        raise PushError(f"refusing to push {folder}: it holds files that stay private ({', '.join(private[:5])}); "
                        "push only the release folder")
    refused = _not_releasable(folder)
    if refused:
        raise PushError(f"refusing to push {folder}: {refused}")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    if not files:
        raise PushError(f"{folder} is empty: nothing to push")
    return files


def _not_releasable(folder: Path) -> Optional[str]:
    """Why a release folder's own card says it is no release (a synthetic set sampled from a run the release
    checks refused: seeded noise, a study run, a failed audit), or None."""
    import json

    for card in sorted(folder.glob("*.card.json")):
        try:
            source = json.loads(card.read_text()).get("source") or {}
        except (OSError, ValueError, AttributeError):
            return f"{card.name} is not a readable data card; write the folder again with dpllm synthesize"
        if source.get("releasable") is False:
            return (f"{card.name} says NOT RELEASABLE ({source.get('refusal_overridden')}); it stays with the data "
                    "owner")
    return None


def _network_errors() -> tuple[type, ...]:
    errors: list[type] = [OSError]  # HfHubHTTPError, OfflineModeIsEnabled and socket errors are OSErrors
    for module in ("httpx2", "httpx", "requests"):
        try:
            errors.append(__import__(module).HTTPError if module != "requests" else
                          __import__("requests").exceptions.RequestException)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def push_folder(folder: str | Path, repo_id: str, *, private: bool = False, repo_type: str = "model",
                token: Optional[str] = None, commit_message: str = "dpllm release",
                retry: Optional[str] = None) -> dict:
    """Upload exactly the files of the release ``folder`` to ``repo_id`` in one commit.

    Args:
        folder: what ``dpllm export`` (or ``dpllm synthesize --release-dir``) wrote.
        repo_id: ``org/name`` on the Hub; created if missing (``private`` applies then).
        private: create the repository private.
        repo_type: ``model`` or ``dataset``.
        token: a Hub token; default :func:`require_token`.
        commit_message: the commit's title.
        retry: what the message on an unreachable Hub tells the user to do later (default: ``hf upload`` the
            folder).

    Returns:
        ``{"repo_id", "repo_type", "private", "files", "url"}``.

    Raises:
        PushError: a bad repo id, a folder that is not a release folder, no token, or a Hub that cannot be
            reached or refuses (the message is one line; the repository then got no commit).
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise PushError(f"--push-to-hub {repo_id}: not a Hub repository id ({str(err).splitlines()[0][:160]}); "
                        "give org/name") from None
    files = check_folder(folder)
    token = token or require_token()
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type=repo_type)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type=repo_type,
                                 commit_message=commit_message)
    except _network_errors() as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise PushError(f"could not push {folder} to the Hugging Face Hub repository {repo_id} "
                        f"({type(err).__name__}: {first}); nothing was committed there. "
                        + (retry or f"The folder is complete: push it again when the Hub is reachable, e.g. "
                                    f"`hf upload {repo_id} {folder} . --repo-type {repo_type}"
                                    f"{' --private' if private else ''}`")) from None
    return {"repo_id": repo_id, "repo_type": repo_type, "private": private, "files": files,
            "url": str(getattr(info, "commit_url", "") or getattr(info, "repo_url", "") or info or "")}


def size_category(n: int) -> str:
    """The Hub's ``size_categories`` bucket of a data set with ``n`` records.

    >>> size_category(10), size_category(1000), size_category(25_000)
    ('n<1K', '1K<n<10K', '10K<n<100K')
    """
    for bound, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
                        (10_000_000, "1M<n<10M")):
        if n < bound:
            return name
    return "n>1M" if n < 1_000_000_000 else "n>1T"


def dataset_card_data(report, *, refusal: Optional[str], file: str, num_records: int, columns: Sequence[str],
                      license: Optional[str] = None, dropped: Optional[int] = None):
    """:class:`huggingface_hub.DatasetCardData` of a synthetic set (its file is the ``train`` split)."""
    from huggingface_hub import DatasetCardData

    dp = dp_metadata(report) if refusal is None else {"enabled": False, "guarantee": f"none: {refusal}"}
    if dp.get("enabled"):
        dp["post_processing"] = ("every record is a sample of a model trained with this guarantee, so the file "
                                 "inherits it (post-processing)")
    tags = (["synthetic", *TAGS] if dp.get("enabled") else ["synthetic", "dpllm"])
    extra = {"synthetic": {"num_records": num_records, "columns": list(columns)}}
    if dropped is not None:
        extra["synthetic"]["samples_dropped_not_valid_text"] = dropped
    return DatasetCardData(license=license, task_categories=["text-generation"], tags=tags,
                           size_categories=[size_category(num_records)], pretty_name=f"Synthetic data ({file})",
                           configs=[{"config_name": "default", "data_files": [{"split": "train", "path": file}]}],
                           differential_privacy=dp, **extra)
