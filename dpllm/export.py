"""``dpllm export RUN_DIR --out DIR``: the part of a run that may be published, and nothing else.

A run directory holds files that are not private-safe: ``splits.json`` lists the members, ``metrics.jsonl``
has un-noised training losses, ``config.yaml`` names the data and the split seed, and ``checkpoints/`` holds
the secret state of the noise generators. The bundle gets only:

    model weights or LoRA adapter (+ base_model/ when the base has no public name), tokenizer,
    privacy_report.json (local paths removed), README.md (a model card)

It refuses a run whose ledger does not verify, a run whose noise was not secret
(``privacy.reproducible_noise: true``), and a non-private run unless ``--allow-non-private`` is given
(the card then says plainly that there is no DP guarantee). Those checks are :func:`check_releasable`, which
``dpllm synthesize`` (:mod:`dpllm.synthetic`) makes too.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from dpllm.io import atomic_directory, write_text_atomic
from dpllm.privacy.report import NOT_RELEASABLE, PrivacyReport, ReportError

# What save_pretrained writes for a model, an adapter or a tokenizer; nothing else leaves the run.
RELEASED_PATTERNS = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                     "adapter_config.json", "adapter_model*.safetensors", "tokenizer*", "special_tokens_map.json",
                     "vocab*", "merges.txt", "*.model", "added_tokens.json", "chat_template*")


class ExportError(ValueError):
    """A run that may not (or cannot) be exported; the message says why and what to do."""


def _released_files(src: Path) -> list[Path]:
    files = {p for pattern in RELEASED_PATTERNS for p in src.glob(pattern) if p.is_file()}
    return sorted(files)


def public_report(report: PrivacyReport) -> PrivacyReport:
    """The report without local file-system paths (run directories, the base model's path)."""
    data = report.to_dict()
    data["stages"] = [{k: v for k, v in s.items() if k != "run_dir"} for s in data["stages"]]
    base = dict(data.get("base_model") or {})
    if "path" in base:
        base["path"] = Path(str(base["path"])).name if base.get("kind") != "pretrained" else base["path"]
    data["base_model"] = base
    return PrivacyReport.from_dict(data)


def model_card(report: PrivacyReport, *, lora: bool, has_base: bool) -> str:
    """README.md for the bundle: the guarantee, how it was computed, the data, how to load the model."""
    if report.enabled:
        user = report.user_level or {}
        clipped = "user (the mean of its records' gradients)" if user.get("sampling") == "uls" else "record"
        source = ("the tight user-level mixture-of-Gaussians accounting (dp-accounting's PLD)" if "record_delta" in user
                  else f"the {report.accountant} accountant (Opacus)")
        guarantee = (f"**(ε = {report.epsilon:.3f}, δ = {report.delta:g})-differential privacy** at the level of one "
                     f"**{report.privacy_unit}**, from {source} over the full "
                     f"training history: noise multiplier σ = {report.noise_multiplier:.4g}, Poisson sampling rate "
                     f"q = {report.sample_rate:.4g}, {report.steps} steps, per-{clipped} clipping norm "
                     f"C = {report.max_grad_norm:g} ({report.clipping}). Noise and sampling randomness came from "
                     "the operating system's entropy and were never written to disk outside the private run "
                     "directory."
                     + (f" User level ({user['num_users']:,} users, at most "
                        f"{user['max_records_per_user'] or user['group_size']} records each): {user['group_privacy']}."
                        if user else ""))
    else:
        guarantee = "**No differential-privacy guarantee**: this model was trained without DP."
    stages = "\n".join(f"- `{s.get('name')}`: {'DP' if s.get('enabled') else 'no DP'}, {s.get('num_records')} "
                       f"records of `{s.get('dataset')}` ({s.get('train_on')} split), {s.get('steps')} steps"
                       for s in report.stages)
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
    return f"""# Model trained with dpllm

## Privacy guarantee
{guarantee}

Every stage of this model's training that touched the private records is composed into that ε
(see `privacy_report.json`, field `composition`). The guarantee covers the released weights and anything
computed from them; it does not cover files that are not in this bundle.

## Training
{stages}

Records: {report.num_records:,} in the last stage's training set; logical batch {report.logical_batch_size}.

## How to load
```python
{load}
```

## What is not here, on purpose
The member list (`splits.json`), un-noised training metrics, the run configuration (it names the data and
its split) and the resumable checkpoints (they hold the noise generators' secret state) stay in the private
run directory.
"""


def check_releasable(run_dir: str | Path, *, allow_non_private: bool = False, what: str = "export") -> PrivacyReport:
    """The checks every release path makes (``dpllm export``, ``dpllm synthesize``) before anything leaves the run.

    Args:
        run_dir: a finished dpllm run directory.
        allow_non_private: accept a run trained without DP (its release must then say there is no guarantee).
        what: the verb used in the refusal message.

    Returns:
        The run's privacy report.

    Raises:
        ExportError: no finished run, seeded noise (or a report that does not say the noise was secret), a
            non-private run without ``allow_non_private``, or a ledger that does not verify.
    """
    from dpllm import ledger

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
    checked = ledger.verify(run_dir)
    if not checked.ok:
        raise ExportError(f"refusing to {what} {run_dir}: its privacy ledger does not verify ({checked.message})")
    return report


def export(run_dir: str | Path, out: str | Path, *, allow_non_private: bool = False) -> Path:
    """Write the release bundle of ``run_dir`` to ``out`` (atomically).

    Raises:
        ExportError: no finished run, a ledger that fails to verify, seeded noise, a non-private run
            (without ``allow_non_private``), or an ``out`` that is not empty.
    """
    run_dir, out = Path(run_dir), Path(out)
    ckpt = run_dir / "checkpoint"
    report = check_releasable(run_dir, allow_non_private=allow_non_private)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not empty; pick a new directory")
    lora = (ckpt / "adapter_config.json").is_file()
    has_base = (ckpt / "base_model").is_dir()
    with atomic_directory(out) as tmp:
        for f in _released_files(ckpt):
            shutil.copy2(f, tmp / f.name)
        if has_base:
            (tmp / "base_model").mkdir()
            for f in _released_files(ckpt / "base_model"):
                shutil.copy2(f, tmp / "base_model" / f.name)
        public_report(report).write(tmp / "privacy_report.json")
        write_text_atomic(tmp / "README.md", model_card(report, lora=lora, has_base=has_base))
    return out


def cli_main(argv: list[str]) -> int:
    """``dpllm export RUN_DIR --out DIR [--allow-non-private]``; 0 on success, 1 when refused."""
    ap = argparse.ArgumentParser(prog="dpllm export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a finished dpllm run directory")
    ap.add_argument("--out", required=True, help="new directory for the release bundle")
    ap.add_argument("--allow-non-private", action="store_true", help="export a run trained without DP")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        path = export(args.run_dir, args.out, allow_non_private=args.allow_non_private)
    except ExportError as err:
        print(f"dpllm export: {err}", file=sys.stderr)
        return 1
    print(f"exported {args.run_dir} -> {path}: " + ", ".join(sorted(p.name for p in path.iterdir())))
    return 0
