"""Load a target model and its member / non-member records, run the attacks, score canaries.

Two ways to name what is audited:

* a run directory (see ``docs/run_directory.md``): members are its ``train`` split, non-members its
  ``heldout`` split (via ``dpllm.data.load_split_texts``), the model is ``RUN_DIR/checkpoint`` and
  records are truncated to the run's ``max_length``;
* a checkpoint (full model directory, LoRA adapter directory or hub id) plus member and
  non-member JSONL files.

Example:
    >>> model, tok = load_target("runs/x/checkpoint")  # doctest: +SKIP
    >>> report, scores = run_audit(model, tok, members, nonmembers, attacks=["loss", "zlib"])  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mia import attacks as attacks_mod
from mia.canaries import one_run_audit
from mia.metrics import DEFAULT_FPRS, evaluate
from mia.signals import GUESS, compute_signals

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json",
                   "spiece.model")


def resolve_dtype(dtype: str, device: str):
    """``"auto"`` is float32 on CPU (exact) and bfloat16 on accelerators (memory)."""
    import torch

    if dtype == "auto":
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if not hasattr(torch, dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return getattr(torch, dtype)


def load_target(path: str | Path, *, device: str = "cpu", dtype: str = "auto"):
    """Load a causal LM and its tokenizer from a full checkpoint, a LoRA adapter or a hub id.

    Args:
        path: A directory with ``adapter_config.json`` (loaded by :func:`dpllm.checkpoint.load_model` over
            its ``base_model/`` or the base it names), a full model directory, or a hub id.
        device: Where to put the model.
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: If no tokenizer was saved with the checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    local = path.is_dir()
    if local and not any((path / f).exists() for f in TOKENIZER_FILES):
        raise ValueError(f"checkpoint {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         f"save it next to the model with tokenizer.save_pretrained('{path}')")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # transformers raises OSError/ValueError/... depending on the cause
        if not local:
            raise ValueError(f"{path} is not a local directory and could not be loaded as a hub "
                             f"id ({err}); check the path") from err
        raise ValueError(f"could not load a tokenizer from {path}: {err}; save the training "
                         f"tokenizer with tokenizer.save_pretrained('{path}')") from err
    torch_dtype = resolve_dtype(dtype, device)
    if local and (path / "adapter_config.json").exists():
        # dpllm's own loader: a LoRA checkpoint over a base with no public name carries it under base_model/
        # (its adapter_config names no base); the base it names is used otherwise.
        from dpllm.checkpoint import CheckpointError, load_model

        try:
            model, _ = load_model(path, device=device, dtype=torch_dtype)
        except CheckpointError as err:
            raise ValueError(str(err)) from err
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    return model.to(device).eval(), tokenizer


def read_texts(path: str | Path, *, text_column: str = "text") -> list[str]:
    """Texts from a JSONL file: one object per line with ``text_column``, or one JSON string; rows with
    ``messages`` (or ``prompt`` and ``completion``) become dpllm chat records, scored on their answers.

    Raises:
        ValueError: If a line lacks the column.
    """
    texts = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({err.msg}); write one JSON "
                                 f"object per line, e.g. {{\"text\": \"...\"}}") from None
            if isinstance(row, str):
                texts.append(row)
            elif isinstance(row, dict) and isinstance(row.get(text_column), str):
                texts.append(row[text_column])
            elif isinstance(row, dict) and ("messages" in row or {"prompt", "completion"} <= set(row)):
                from dpllm.sft import canonical  # a chat / instruction record: scored on its answer

                texts.append(canonical(row, "messages" if "messages" in row else "prompt_completion",
                                       where=f"{path}:{lineno}"))
            else:
                raise ValueError(f"{path}:{lineno} has no string field {text_column!r}; "
                                 f"pass --text-column with the right field name")
    return texts


def check_member_sets(members: list[str], nonmembers: list[str]) -> None:
    """Raise ValueError for an empty set or a text that is both member and non-member."""
    if not members or not nonmembers:
        raise ValueError(f"need members and non-members (got {len(members)} members, "
                         f"{len(nonmembers)} non-members); pass non-empty --members/--nonmembers "
                         f"files or a run directory with train and heldout splits")
    shared = set(members) & set(nonmembers)
    if shared:
        example = next(iter(shared))
        raise ValueError(f"{len(shared)} text(s) are both members and non-members, e.g. "
                         f"{example[:60]!r}; remove them from one set (the labels are ambiguous)")


def _subsample(texts: list[str], n: int | None, rng) -> list[str]:
    if n is None or len(texts) <= n:
        return texts
    keep = np.sort(rng.choice(len(texts), size=n, replace=False))
    return [texts[i] for i in keep]


def is_run_dir(path: str | Path) -> bool:
    """A run directory is recognised by its ``splits.json``."""
    return (Path(path) / "splits.json").is_file()


def run_max_length(run_dir: str | Path) -> int | None:
    """The training truncation length recorded in the run's ``splits.json``."""
    path = Path(run_dir) / "splits.json"
    return json.loads(path.read_text()).get("max_length") if path.is_file() else None


def run_max_windows(run_dir: str | Path) -> int | None:
    """The run's window cap when it split long records (``splits.json``'s ``long_records: split``), else None:
    such a record is scored as the unit it trained as, all its trained windows together."""
    path = Path(run_dir) / "splits.json"
    rec = json.loads(path.read_text()) if path.is_file() else {}
    return rec.get("max_windows") if rec.get("long_records") == "split" else None


def run_window_stride(run_dir: str | Path) -> int:
    """The overlap between a split run's windows (``splits.json``'s ``window_stride``; 0 when none)."""
    path = Path(run_dir) / "splits.json"
    rec = json.loads(path.read_text()) if path.is_file() else {}
    return int(rec.get("window_stride") or 0) if rec.get("long_records") == "split" else 0


def load_run_model(run_dir: str | Path, *, device: str = "cpu", dtype: str = "auto"):
    """``RUN_DIR/checkpoint`` via ``dpllm.checkpoint.load_model`` when present, else :func:`load_target`."""
    ckpt = Path(run_dir) / "checkpoint"
    if not ckpt.is_dir():
        raise ValueError(f"run directory {run_dir} has no checkpoint/; was the run finished?")
    try:
        from dpllm.checkpoint import load_model
    except ImportError:
        return load_target(ckpt, device=device, dtype=dtype)
    model, tokenizer = load_model(ckpt)
    return model.to(device).eval(), tokenizer


def load_run_records(run_dir: str | Path) -> tuple[list[str], list[str]]:
    """Members (``train`` split) and non-members (``heldout`` split) of a run directory."""
    try:
        from dpllm.data import load_split_texts
    except ImportError as err:
        raise ValueError("auditing a run directory needs dpllm.data.load_split_texts; pass "
                         "--members/--nonmembers JSONL files instead") from err
    return load_split_texts(run_dir, "train"), load_split_texts(run_dir, "heldout")


def run_audit(model, tokenizer, members: list[str], nonmembers: list[str], *,
              attacks=("loss", "zlib", "mink", "minkpp"), reference=None, max_length=None,
              batch_size: int = 8, device=None, attack_params: dict | None = None,
              n_bootstrap: int = 1000, seed: int = 0, max_records: int | None = None,
              progress: bool = True, blind: bool = True, record_format: str | None = GUESS,
              max_windows: int | None = None, window_stride: int = 0) -> tuple[dict, dict]:
    """Compute signals once, score each attack and evaluate it.

    Args:
        model: Target causal LM.
        tokenizer: Its tokenizer.
        members: Texts trained on.
        nonmembers: Texts not trained on, from the same distribution.
        attacks: Attack names (see :data:`mia.attacks.ATTACKS`) or a comma-separated string.
        reference: ``(model, tokenizer)`` of a reference model, needed by ``ref``.
        max_length: Training truncation length (None: no truncation).
        batch_size: Records per forward pass.
        device: Device for the forward passes (default: the model's).
        attack_params: Extra attack parameters, e.g. ``{"k": 0.1}``.
        n_bootstrap: Bootstrap replicates for CIs.
        seed: Seed of record subsampling and bootstrap.
        max_records: Audit at most this many members and this many non-members.
        progress: Show progress bars.
        blind: Also run the model-free blind baseline (:mod:`mia.blind`) on the same texts; its
            verdict (``report["blind"]["shifted"]``) says whether the sets are distribution-shifted.
        record_format: The records' shape as trained (a run's :func:`run_sft_format`); by default guessed
            from the texts (files of records with no run behind them).
        max_windows: a run that split long records (:func:`run_max_windows`): each record is scored over its
            first ``max_windows`` windows of ``max_length`` tokens, as one unit.
        window_stride: that run's overlap between windows (:func:`run_window_stride`).

    Returns:
        ``(report, scores)``: the report dict written to ``mia_report.json`` and
        ``{attack: (member_scores, nonmember_scores)}``.

    Raises:
        ValueError: Unknown attack, ``ref`` without a reference, empty or overlapping sets.
    """
    names = attacks_mod.parse_attacks(attacks)
    if any(attacks_mod.ATTACKS[n].needs_reference for n in names) and reference is None:
        raise ValueError("attack 'ref' needs a reference model; pass --reference PATH "
                         "(e.g. the base model before fine-tuning) or drop 'ref' from --attacks")
    check_member_sets(members, nonmembers)
    rng = np.random.default_rng(seed)
    members, nonmembers = _subsample(members, max_records, rng), _subsample(nonmembers, max_records, rng)
    texts = members + nonmembers
    common = dict(max_length=max_length, batch_size=batch_size, device=device, progress=progress,
                  record_format=record_format, max_windows=max_windows, window_stride=window_stride)
    sig = compute_signals(model, tokenizer, texts, desc="target", **common)
    ref_sig = None
    if reference is not None and any(attacks_mod.ATTACKS[n].needs_reference for n in names):
        ref_sig = compute_signals(reference[0], reference[1], texts, desc="reference", **common)
    n_m = len(members)
    report = {"n_members": n_m, "n_nonmembers": len(nonmembers), "max_length": max_length,
              **({"max_windows": max_windows} if max_windows else {}),
              **({"window_stride": window_stride} if max_windows and window_stride else {}),
              "fprs": list(DEFAULT_FPRS), "attack_params": attack_params or {}, "seed": seed,
              "n_bootstrap": n_bootstrap, "ci_confidence": 0.95,
              "mean_loss": {"members": float(sig.loss[:n_m].mean()),
                            "nonmembers": float(sig.loss[n_m:].mean())},
              "attacks": {}}
    scores = {}
    for name in names:
        s = attacks_mod.score(name, sig, reference=ref_sig, **(attack_params or {}))
        scores[name] = (s[:n_m], s[n_m:])
        report["attacks"][name] = evaluate(s[:n_m], s[n_m:], member_losses=sig.loss[:n_m],
                                           nonmember_losses=sig.loss[n_m:],
                                           n_bootstrap=n_bootstrap, seed=seed)
    if blind:
        from mia.blind import blind_baseline

        report["blind"] = blind_baseline(members, nonmembers, seed=seed)
    return report, scores


def read_canaries(run_dir: str | Path, *, with_prefixes: bool = False):
    """Canary texts and inclusion flags from ``RUN_DIR/canaries.json``.

    Format: ``{"canaries": [{"text": str, "included": bool, "prefix"?: str}, ...], "seed": int, ...}``.
    ``prefix`` (optional) is the public start of the canary; the secret is the rest.

    Returns:
        ``(texts, included)``, plus the list of prefixes ("" where absent) if ``with_prefixes``.
    """
    path = Path(run_dir) / "canaries.json"
    if not path.is_file():
        raise ValueError(f"{path} not found; train with data.num_canaries > 0 to audit with canaries")
    rows = json.loads(path.read_text()).get("canaries", [])
    if not rows or any("text" not in r or "included" not in r for r in rows):
        raise ValueError(f"{path} must hold a non-empty 'canaries' list of {{'text', 'included'}}")
    texts = [r["text"] for r in rows]
    included = np.array([bool(r["included"]) for r in rows])
    check_member_sets([t for t, i in zip(texts, included) if i],
                      [t for t, i in zip(texts, included) if not i])
    if with_prefixes:
        prefixes = [r.get("prefix") or "" for r in rows]
        if any(not t.startswith(p) for t, p in zip(texts, prefixes)):
            raise ValueError(f"{path}: a canary's 'prefix' is not the start of its 'text'")
        return texts, included, prefixes
    return texts, included


def check_canary_vocabulary(run_dir: str | Path, tokenizer) -> None:
    """Refuse a tokenizer that lacks the tokens of the run's ``new_token`` canaries (it would split each
    into characters and score something training never saw)."""
    from dpllm.canaries import added_tokens

    rows = json.loads((Path(run_dir) / "canaries.json").read_text())["canaries"]
    need = added_tokens([r for r in rows if "design" in r and "prefix" in r])
    vocab = tokenizer.get_vocab()
    missing = [t for t in need if t not in vocab]
    if missing:
        raise ValueError(f"{len(missing)} of the run's {len(need)} new-token canaries (e.g. {missing[0]}) are not in "
                         "the model's vocabulary; audit the checkpoint this run trained, whose tokenizer holds them")


def run_sft_format(run_dir: str | Path) -> str | None:
    """The record shape of a run trained on instruction / chat data (``splits.json``'s ``sft``), else None."""
    path = Path(run_dir) / "splits.json"
    return (json.loads(path.read_text()).get("sft") or {}).get("format") if path.is_file() else None


def read_privacy_report(run_dir: str | Path) -> dict:
    """``privacy_report.json`` of a run (top level, else the checkpoint's copy), read by dpllm's one report type.

    Raises:
        ValueError: no report, or a damaged one (the message names the file).
    """
    from dpllm.privacy.report import PrivacyReport, ReportError

    try:
        return PrivacyReport.read(run_dir).to_dict()
    except ReportError as err:
        raise ValueError(f"{err}; the canary audit compares against the accountant's ε and needs it") from err


def accounted_as(privacy: dict) -> str:
    """How a run's noise was made and the events its ε was computed from, in words (beside the ε in a canary report).

    Correlated noise (``privacy.noise: banded``, ``blt``) is accounted by a reduction, so its history holds that
    reduction's event, not (σ, q, T): e.g. BandMF's DP-SGD event at the group's rate q_b over ⌈T/b⌉ steps.

    Example:
        >>> accounted_as({"history": [[1.2, 0.25, 3]], "correlated_noise": {"mechanism": "banded", "bands": 4,
        ...                                                                  "steps": 12}})
        'banded correlated noise (b = 4, T = 12 steps); ε from σ = 1.2, q = 0.25, 3 steps'
    """
    events = "; ".join(f"σ = {s:.4g}, q = {q:.4g}, {int(n)} steps" for s, q, n in privacy.get("history") or [])
    c = privacy.get("correlated_noise") or {}
    if c.get("mechanism") in (None, "independent"):
        how = "independent noise (DP-SGD)"
    else:
        parts = [f"b = {c.get('bands', c.get('groups'))}"] + ([f"d = {c['buffers']}"] if c.get("buffers") else []) \
            + ([f"T = {c['steps']} steps"] if c.get("steps") else [])
        how = f"{c['mechanism']} correlated noise ({', '.join(parts)})"
    return f"{how}; ε from {events}" if events else how


def privacy_bounds(run_dir: str | Path, attacks: dict, *, fprs=DEFAULT_FPRS, unit: str | None = None) -> dict | None:
    """The most any attack can reach against the run's mechanism (:mod:`dpllm.privacy.tradeoff`, from its privacy
    history), and whether this audit's values exceed it beyond sampling error.

    Args:
        run_dir: the audited run directory.
        attacks: ``{attack: metrics}`` (:func:`mia.metrics.evaluate`).
        fprs: the FPRs at which TPR is bounded.
        unit: ``record`` or ``user``; default ``user`` for a run with users (its split keeps users whole, so a
            record-level audit is a test of users), else ``record``.

    Returns:
        None without a privacy report; ``{"unavailable": why}`` for a run without a bound (no DP, users with no
        cap); else the bounds (``auc``, ``tpr@fpr=b``), ``plain_reading``, ``per_attack`` comparisons, ``exceeded``.
    """
    from dpllm.privacy import tradeoff
    from dpllm.privacy.report import PrivacyReport, ReportError

    try:
        report = PrivacyReport.read(run_dir)
    except ReportError:
        return None
    try:
        curve = tradeoff.for_report(report, unit=unit or ("user" if report.user_level else "record"))
    except tradeoff.TradeoffError as err:
        return {"unavailable": str(err)}
    checked = tradeoff.check_audit(attacks, curve, fprs=fprs)
    plural = "users" if curve.unit == "user" else "records"
    grid = np.logspace(-6, 0, 61)  # the upper trade-off curve itself, for the ROC plot (mechanism only: public)
    return {**checked["bounds"], "plain_reading": tradeoff.plain_reading(checked["bounds"], plural=plural),
            "confidence": checked["confidence"], "per_attack": checked["per_attack"],
            "exceeded": [list(x) for x in checked["exceeded"]],
            "curve": {"fpr": grid.tolist(), "tpr": [float(t) for t in curve.max_tpr(grid)]}}


def prefix_token_counts(tokenizer, texts: list[str], prefixes: list[str]) -> np.ndarray:
    """Tokens of each text that belong to its public prefix (leading special tokens included)."""
    counts = []
    for text, prefix in zip(texts, prefixes):
        if not prefix:
            counts.append(0)
            continue
        full = tokenizer(text)["input_ids"]
        bare = tokenizer(text, add_special_tokens=False)["input_ids"]
        lead = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        counts.append(lead + len(tokenizer(prefix, add_special_tokens=False)["input_ids"]))
    return np.asarray(counts)


def secret_scores(sig, n_prefix: np.ndarray) -> np.ndarray:
    """Mean log-probability of each canary's tokens after its prefix (higher = more likely member).

    ``sig.token_logprobs[i][t]`` scores token ``t + 1``, so the secret starts at index ``n_prefix - 1``.
    A canary truncated inside its prefix falls back to all its tokens.
    """
    out = np.empty(len(sig))
    for i, lp in enumerate(sig.token_logprobs):
        tail = lp[max(int(n_prefix[i]) - 1, 0):]
        out[i] = float(np.mean(tail if tail.size else lp))
    return out


def canary_audit(run_dir: str | Path, model, tokenizer, *, attack: str = "loss", reference=None,
                 max_length=None, batch_size: int = 8, device=None, confidence: float = 0.95,
                 tokens: str = "secret", audit_delta: float = 1e-5, seed: int = 0,
                 progress: bool = True) -> dict:
    """Score a run's canaries and compare the one-run ε lower bound with the accountant's ε.

    The bound (``report["epsilon_lower"]``) is the f-DP one-run bound for the (ε, δ) family
    (:func:`mia.canaries.one_run_audit`): valid with probability ``confidence`` over the canary
    coins for any (ε, δ)-DP training, so it can be compared with the accountant's ε at the same δ.
    It takes the better of the f-DP and the ε-DP (Steinke et al.) analysis of each guess count,
    paid for by Bonferroni. Reported beside it, never combined with it: the Gaussian-DP reading
    (``gdp``: μ and its ε at δ).

    Args:
        attack: Attack scoring the canaries; with ``loss`` and ``tokens="secret"`` only the tokens
            after each canary's public prefix count (when ``canaries.json`` records prefixes).
        tokens: ``"secret"`` or ``"all"``.
        audit_delta: δ used when the run has none (a non-private run).

    Returns:
        The canary report; ``report["privacy_bug"]`` is True when the bound exceeds the accountant's ε.
    """
    attacks_mod.parse_attacks([attack])
    if attacks_mod.ATTACKS[attack].needs_reference and reference is None:
        raise ValueError(f"attack {attack!r} needs --reference PATH")
    if tokens not in ("secret", "all"):
        raise ValueError(f"tokens={tokens!r}; use 'secret' or 'all'")
    texts, included, prefixes = read_canaries(run_dir, with_prefixes=True)
    check_canary_vocabulary(run_dir, tokenizer)
    fmt = run_sft_format(run_dir)
    if fmt:  # planted as answers: the prefix was the prompt, and the signals score the secret (the answer) only
        from dpllm.sft import canary_record

        texts = [canary_record({"prefix": p, "text": t}, fmt) for t, p in zip(texts, prefixes)]
    privacy = read_privacy_report(run_dir)
    eps = privacy.get("epsilon")
    private = bool(privacy.get("enabled", True) and eps is not None and np.isfinite(float(eps)))
    delta = float(privacy.get("delta") or 0.0) if private else 0.0
    delta = delta or float(audit_delta)
    common = dict(max_length=max_length, batch_size=batch_size, device=device, progress=progress,
                  record_format=fmt)  # the run's shape, as the canaries were trained
    sig = compute_signals(model, tokenizer, texts, desc="canaries", **common)
    secret = attack == "loss" and tokens == "secret" and any(prefixes)
    if secret:
        scores = secret_scores(sig, np.zeros(len(texts), dtype=int) if fmt else
                               prefix_token_counts(tokenizer, texts, prefixes))
        scored = ("mean log-probability of the secret tokens (the answer, given the prefix as prompt)" if fmt else
                  "mean log-probability of the secret tokens (after each canary's prefix)")
    else:
        ref_sig = compute_signals(*reference, texts, desc="reference", **common) if reference else None
        scores = attacks_mod.score(attack, sig, reference=ref_sig)
        scored = f"attack {attack!r} on the whole canary"
    primary = one_run_audit(scores, included, delta=delta, confidence=confidence, seed=seed)
    gdp = one_run_audit(scores, included, delta=delta, confidence=confidence, family="gdp", seed=seed)
    lower = primary["epsilon_lower"]
    bug = bool(private and lower > float(eps))
    conf = f"{confidence:.0%}"
    if not private:
        verdict = "not private"
        msg = (f"The run has no finite accountant ε; ε ≥ {lower:.3f} at δ = {delta:g} ({conf} confidence) "
               f"measures how much the audit can see.")
    elif bug:
        verdict = "PRIVACY BUG"
        msg = (f"Empirical ε lower bound {lower:.3f} ({conf} confidence over the canary coins) exceeds the "
               f"accountant's ε = {float(eps):.3f} at δ = {delta:g}: the training leaks more than its "
               f"guarantee allows. Check the noise multiplier, sampling, clipping and accounting before "
               f"using this model.")
    else:
        verdict = "consistent"
        msg = (f"Empirical ε lower bound {lower:.3f} ({conf} confidence) <= accountant ε = {float(eps):.3f} "
               f"at δ = {delta:g} (no evidence of a privacy bug; a low bound does not prove the guarantee "
               f"is tight).")
    return {"run_dir": str(run_dir), "attack": attack, "scored": scored, "m": int(included.size),
            "n_included": int(included.sum()), "delta": delta, "confidence": confidence,
            "accountant_epsilon": float(eps) if eps is not None else None,
            "accounted_as": accounted_as(privacy) if private else None,
            "epsilon_lower": lower,
            "bound": (f"one-run ε lower bound for (ε, δ)-DP: top-k guesses, each of {len(primary['grid'])} "
                      f"guess counts analysed by f-DP (Mahloujifar et al. 2024) and ε-DP (Steinke et al. "
                      f"2023), Bonferroni over all {primary['n_tests']} tests; holds with probability "
                      f">= {conf} over the canaries' inclusion coins"),
            "one_run": primary, "gdp": gdp,
            "privacy_bug": bug, "verdict": verdict, "message": msg, "max_length": max_length,
            "scores": scores.tolist(), "included": included.tolist()}
