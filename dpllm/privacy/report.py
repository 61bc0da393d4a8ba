"""``privacy_report.json``: one type that writes and reads it.

Every reader (``dpllm report``, ``dpllm ledger verify``, ``dpllm export``, resume, a later stage, ``mia``)
goes through :meth:`PrivacyReport.read`, which turns a missing, cut or non-JSON file into a
:class:`ReportError` that names the file, instead of a traceback.

The report holds ε with everything needed to recompute it: δ, the accountant, and the full
``(noise_multiplier, sample_rate, steps)`` history (earlier stages composed first). ``noise_secret``
says whether the noise and sampling randomness came from the operating system's entropy (a releasable
run) or from a seed (``privacy.reproducible_noise: true``, tests and debugging only).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dpllm.io import write_json_atomic

FILENAME = "privacy_report.json"
# How a stage's ``public_data`` (dpllm.data.split_rule) begins when its public split was records of the private file
SIMULATED_PUBLIC = "SIMULATED"


class ReportError(ValueError):
    """A privacy report that is missing or cannot be read; the message names the file and the fix."""


@dataclass
class PrivacyReport:
    """What a run spent and how; written beside the run and inside its ``checkpoint/``."""

    enabled: bool
    num_records: Optional[int]  # None in a release bundle unless declared public (dpllm.export: add/remove one)
    steps: int
    logical_batch_size: int
    physical_batch_size: int
    privacy_unit: str = "record"  # "user": all records of one user (see user_level); "sequence": one packed block
    epsilon: Optional[float] = None
    delta: Optional[float] = None
    accountant: Optional[str] = None
    # how that accountant composed the history and what it allowed for float rounding (dpllm.privacy.accounting.
    # method_note: for PLD, the measured margin or the tilted composition's certified bound); absent before 2026-11-27
    accountant_method: Optional[str] = None
    target_epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    sample_rate: Optional[float] = None
    expected_batch_size: Optional[int] = None
    max_grad_norm: Optional[float] = None
    clipping: Optional[str] = None
    sensitivity: Optional[float] = None
    grad_sample_mode: Optional[str] = None
    grad_sample_mode_reason: Optional[str] = None  # why that engine ran (grad_sample_mode: auto's choice)
    poisson_sampling: Optional[bool] = None
    secure_mode: Optional[bool] = None
    noise_secret: Optional[bool] = None
    history: list = field(default_factory=list)
    composition: Optional[str] = None
    stages: list = field(default_factory=list)
    model_adjustments: list = field(default_factory=list)
    base_model: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    note: Optional[str] = None
    # privacy_unit=user: {"unit", "sampling" (uls|els), "num_users", "max_records_per_user", "group_size" (k of the
    # group-privacy accounting: the declared cap; 1 for ULS; None for record sampling without a cap), "users_trimmed",
    # "users_dropped", "records_dropped", "group_privacy" (which accounting), for ELS "record_epsilon", "record_delta"
    # (record level at δ/k, for comparison), for record sampling "user_epsilon", "user_delta"}: dpllm.privacy.user_level
    user_level: Optional[dict] = None
    # release bundles only (dpllm.export): {"neighbouring_relation", "declared_public", "withheld"}
    release: Optional[dict] = None
    # A non-constant noise schedule: {"kind", "end", "pieces", "pieces_sigma_steps": [[σ, steps], ...]};
    # noise_multiplier is then its first piece's σ (dpllm.privacy.schedule). The history holds the pieces.
    noise_schedule: Optional[dict] = None
    # privacy_unit=sequence: {"unit", "tokens_per_sequence", "group_size" (2), "group_epsilon", "group_delta",
    # "group_privacy"}: the ε of a record cut across two sequences (dpllm.privacy.sequence_level)
    sequence_level: Optional[dict] = None
    # What max_length cut off the training records (dpllm.truncation.summarize): "max_length", "records",
    # "truncated_records", "tokens_total", "tokens_kept", "tokens_lost_median", "tokens_lost_max",
    # "max_length_for_95pct", "max_length_for_all"; or "truncated_records": null and "unknown" (why)
    data: Optional[dict] = None
    # clipping: quantile (dpllm.privacy.quantile): {"kind", "target_quantile", "quantile_lr",
    # "count_noise_multiplier" (σ_b), "gradient_noise_multiplier" (σ_g; σ₀'s under a noise schedule, whose pieces'
    # σ_g are then in "gradient_noise_multipliers"), "initial_max_grad_norm",
    # "final_max_grad_norm", "steps"}; noise_multiplier is the pair's σ, the one accounted
    adaptive_clipping: Optional[dict] = None
    # privacy.noise: banded (dpllm.privacy.correlated): {"mechanism", "bands" (b), "coefficients", "group_sample_rate"
    # (q_b, also sample_rate), "steps" (T), "accounted_steps" (⌈T/b⌉), "prefix_sum_rmse", "reduction", "auto" (the
    # comparison bands: auto made)}; the history holds the DP-SGD event (σ, q_b, ⌈T/b⌉) that ε is computed from.
    # privacy.noise: blt: {"mechanism", "accounting" ("gaussian_mechanism"), "bands" = "groups" (b), "buffers" (d),
    # "theta", "omega" (C's decays and scales), "steps" (T), "max_participations" (⌈T/b⌉), "sensitivity" (sens(C, b,
    # ⌈T/b⌉)), "group_sample_rate" (q_b, not credited), "reduction", ...}; the history holds the one Gaussian mechanism
    # (σ/sens(C, b, ⌈n/b⌉), 1.0, 1) of the n steps run, σ the draw's noise_multiplier
    correlated_noise: Optional[dict] = None
    # data.packing (dpllm.packing): {"tokens_per_row" (max_length), "rows", "records" (segments trained, a window of
    # a split record counted as one), "real_tokens", "row_tokens" (rows × each batch's row length)}
    packing: Optional[dict] = None

    @property
    def releasable(self) -> bool:
        """A private run whose noise was secret; a non-private run is never 'releasable under DP'."""
        return bool(self.enabled and self.noise_secret)

    def study_stages(self) -> list[str]:
        """The stages (names) that trained on a public split simulated from a file a private stage of this lineage
        protects (``public_fraction`` with ``simulate_public_from_private``, :func:`dpllm.data.split_rule`).

        Such a lineage is a study, not a release: one record added to that file lands in the simulated public
        split with probability ``public_fraction`` and is then trained on without DP, which no ε covers. A
        simulated split of *another* file (a public corpus standing in for public data, as the demo's
        pretraining on pydoc) leaves the private stages' files alone. Files are compared by name (a path as
        normalised by :func:`os.path.realpath`, a built-in corpus or Hub id as given).
        """
        import os

        def file(stage: dict) -> str:
            name = str(stage.get("dataset"))
            return os.path.realpath(os.path.expanduser(name)) if "/" in name or os.path.exists(name) else name

        protected = {file(s) for s in self.stages if s.get("enabled") and s.get("train_on", "private") == "private"}
        return [str(s.get("name")) for s in self.stages
                if str(s.get("public_data") or "").startswith(SIMULATED_PUBLIC) and s.get("train_on") == "public"
                and file(s) in protected]

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("note", "user_level", "release", "noise_schedule", "grad_sample_mode_reason", "accountant_method",
                    "sequence_level", "data", "adaptive_clipping", "correlated_noise"):
            if out[key] is None:
                del out[key]
        return out

    def write(self, path: str | Path) -> Path:
        """Write atomically to ``path`` (a file, or a directory that gets ``privacy_report.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / FILENAME
        eps = self.epsilon
        if eps is not None and not math.isfinite(eps):
            raise ReportError(f"refusing to write ε={eps} into {path}: not a finite number (a dpllm bug)")
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "privacy report") -> "PrivacyReport":
        if not isinstance(data, dict):
            raise ReportError(f"{source}: not a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in ("enabled", "num_records", "steps") if n not in data]
        if missing:
            raise ReportError(f"{source}: missing {', '.join(missing)}; not a dpllm privacy report")
        known = {k: v for k, v in data.items() if k in names}
        known.setdefault("logical_batch_size", 0)
        known.setdefault("physical_batch_size", 0)
        return cls(**known)

    @classmethod
    def read(cls, path: str | Path) -> "PrivacyReport":
        """Read a report from a file, a checkpoint directory or a run directory.

        Raises:
            ReportError: no report there, or a file that is cut, not UTF-8 or not JSON.
        """
        path = Path(path)
        candidates = [path] if path.suffix == ".json" else [path / FILENAME, path / "checkpoint" / FILENAME]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise ReportError(f"{path} has no {FILENAME}; is it a dpllm run or checkpoint directory?")
        try:
            data = json.loads(found.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ReportError(f"{found} is not UTF-8 text (byte {err.start}); the file is damaged") from err
        except json.JSONDecodeError as err:
            raise ReportError(f"{found} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                              "the file is damaged or was cut short — restore it from the run's checkpoint/") from err
        return cls.from_dict(data, source=str(found))

    def summary(self) -> str:
        """One line a person reads: (ε, δ) and everything needed to recompute it."""
        if not self.enabled:
            return "privacy: disabled (no DP guarantee for this run)"
        secret = "" if self.noise_secret is not False else "; NOT RELEASABLE: reproducible (seeded) noise"
        u = self.user_level
        if u:
            how = (f"tight group privacy over k = {u['group_size']} records (mixture accounting); record-level ε = "
                   f"{u['record_epsilon']:.3f} at δ = {u['record_delta']:.3g}" if "record_delta" in u
                   else "user-level sampling" if u.get("sampling") == "uls" else
                   f"record-level DP; by group privacy over k = {u['group_size'] or 'any number of'} records the "
                   "user-level ε is "
                   + ("UNBOUNDED" if u.get("user_epsilon") is None else f"{u['user_epsilon']:.3f}")
                   if u.get("sampling") == "record" else "k = 1")
            counts = ("" if "users_trimmed" not in u else  # a release bundle withholds per-user counts
                      f"; {u['users_trimmed']} users trimmed, {u['records_dropped']} records dropped")
            users = f"U = {u['num_users']:,} users, " if u.get("num_users") is not None else ""
            secret = (f"; USER-LEVEL: {users}k = {u['max_records_per_user']}, {u['sampling']} ({how}){counts}"
                      + secret)
        via = (f"the user-level mixture accounting (dp-accounting PLD; records: {self.accountant})"
               if u and "record_delta" in u else f"{self.accountant} accountant")
        sigma = (f"σ = {self.noise_multiplier:.4g}" if not self.noise_schedule else
                 f"σ = {self.noise_multiplier:.4g} → {self.noise_schedule['pieces_sigma_steps'][-1][0]:.4g} "
                 f"({self.noise_schedule['kind']} schedule, {len(self.noise_schedule['pieces_sigma_steps'])} pieces)")
        seq = self.sequence_level
        if seq:
            eps2 = seq.get("group_epsilon")
            secret = (f"; a sequence is {seq['tokens_per_sequence']:,} tokens, a record cut across 2 of them has "
                      + (f"ε = {eps2:.3f}" if eps2 is not None else "an unbounded ε") + secret)
        c = self.correlated_noise
        steps = (f"steps = {self.steps} (BLT correlated noise, {c['buffers']} buffer(s), cyclic sampling over "
                 f"{c['bands']} groups: one Gaussian mechanism, μ = sens/σ = {blt_mu(self.history):.4g}, "
                 "no amplification)" if blt_noise(c) else
                 f"steps = {self.steps} ({c['bands']}-banded correlated noise, cyclic sampling over {c['bands']} "
                 f"groups: accounted as {c['accounted_steps']} DP-SGD steps at the group's q)"
                 if c and c["mechanism"] != "independent" else
                 f"steps = {self.steps}" + (" (bands=auto chose independent noise)" if c else ""))
        return (f"(ε = {self.epsilon:.3f}, δ = {self.delta:g}) via {via}; "
                f"{sigma}, q = {self.sample_rate:.4g}, {steps}, "
                f"C = {self.max_grad_norm:g}, clipping = {self.clipping}, "
                + (f"N = {self.num_records:,} {'sequences' if seq else 'records'} " if self.num_records is not None
                   else "N not released ")
                + f"(unit: {self.privacy_unit}){secret}")

    def details(self) -> list[str]:
        """Lines that follow :meth:`summary` in ``dpllm report``: what one unit is (sequence level) and what
        ``max_length`` cut off the training records."""
        from dpllm import truncation

        lines = []
        if self.sequence_level and self.epsilon is not None:
            lines.append("unit: " + sequence_unit_words(self.sequence_level, self.epsilon))
        if self.data:
            lines.append("data: " + truncation.describe(self.data))
        c = self.correlated_noise
        if blt_noise(c):
            mu = blt_mu(self.history)
            lines.append(f"noise: BLT (buffered linear Toeplitz) matrix factorization, {c['buffers']} buffer(s), "
                         f"b = {c['bands']} cyclic groups (each {'user' if self.privacy_unit == 'user' else 'record'} "
                         f"in at most ⌈{self.steps}/{c['bands']}⌉ = "
                         f"{-(-self.steps // c['bands'])} steps, {c['bands']} apart; q_b = "
                         f"{c['group_sample_rate']:.4g}, not credited); sensitivity of the steps run "
                         f"{self.noise_multiplier * mu:.4g} (planned {c['steps']} steps: {c['sensitivity']:.4g}), "
                         f"μ = sens/σ = {mu:.4g}; ε by the reduction: {c['reduction']}")
        elif c and c["mechanism"] == "independent":
            lines.append("noise: independent (DP-SGD): bands=auto found no b with a smaller expected error")
        elif c:
            lines.append(f"noise: {c['mechanism']} matrix factorization, b = {c['bands']} bands (coefficients "
                         f"{', '.join(f'{v:.4g}' for v in c['coefficients'][:6])}{', ...' if c['bands'] > 6 else ''}), "
                         f"prefix-sum RMSE {c['prefix_sum_rmse']:.4g} per unit of noise over {c['steps']} steps; "
                         f"ε by the reduction: {c['reduction']}")
        if self.packing:
            lines.append("packing: " + packing_words(self.packing))
        a = self.adaptive_clipping
        if a:
            if a.get("gradient_noise_multipliers"):  # a noise schedule: each step's pair split from its own σ_t
                split = (f"at each step the gradient (σ_g = {a['gradient_noise_multiplier']:.4g} at σ₀ = "
                         f"{self.noise_multiplier:.4g}, following the schedule) and the count under C (σ_b = "
                         f"{a['count_noise_multiplier']:.4g}) are one Gaussian mechanism of that step's σ, the σ "
                         "accounted")
            else:
                split = (f"the gradient (σ_g = {a['gradient_noise_multiplier']:.4g}) and the count under C (σ_b = "
                         f"{a['count_noise_multiplier']:.4g}) are one Gaussian mechanism of σ = "
                         f"{self.noise_multiplier:.4g}, the σ accounted")
            lines.append(f"clipping: C adapted to the {a['target_quantile']:g} quantile of the per-record norms "
                         f"(η = {a['quantile_lr']:g}), {a['initial_max_grad_norm']:.4g} → "
                         f"{a['final_max_grad_norm']:.4g} over {a['steps']} steps; " + split)
        return lines

    def as_ledger_privacy(self) -> dict[str, Any]:
        """The fields a ledger line records."""
        out = {"epsilon": self.epsilon, "delta": self.delta, "noise_multiplier": self.noise_multiplier,
               "sample_rate": self.sample_rate, "accountant": self.accountant,
               "history": [list(h) for h in self.history]}
        if self.user_level:
            out["user_level"] = self.user_level
        if self.adaptive_clipping:
            out["adaptive_clipping"] = self.adaptive_clipping
        if self.correlated_noise:
            out["correlated_noise"] = self.correlated_noise
        return out


def blt_noise(correlated: Optional[dict]) -> bool:
    """A report's ``correlated_noise`` is BLT's (the run is one Gaussian mechanism, not amplified DP-SGD)."""
    return bool(correlated) and correlated.get("accounting") == "gaussian_mechanism"


def blt_mu(history: list) -> float:
    """μ = sens/σ of a BLT run from its history, whose last entry is the run as one Gaussian mechanism (σ/sens, 1,
    1)."""
    return 1.0 / float(history[-1][0]) if history else 0.0


def sequence_unit_words(info: dict, epsilon: float) -> str:
    """A report's ``sequence_level`` in plain words, the group's ε beside the unit's (``dpllm report``, the card)."""
    t = info["tokens_per_sequence"]
    eps2 = info.get("group_epsilon")
    group = f"ε = {eps2:.3f}" if eps2 is not None else "ε unbounded at this δ"
    return (f"one protected unit is one sequence of {t:,} consecutive tokens (a packed block of the training texts, "
            f"not a record): ε = {epsilon:.3f} protects one sequence. A record of up to {t:,} tokens may be cut "
            f"across 2 sequences and is protected as a group of 2 ({group} at δ = {info['group_delta']:g}, "
            f"dpllm.privacy.sequence_level); a record of L tokens spans up to ⌈L/{t:,}⌉ + 1 sequences and is "
            "protected less")


NOT_RELEASABLE = ("this run used reproducible (seeded) noise (privacy.reproducible_noise: true): anyone with its "
                  "config can regenerate the noise and batches, so it carries no DP guarantee; retrain without "
                  "reproducible_noise before releasing anything")


def packing_words(info: dict) -> str:
    """One sentence on ``data.packing`` for ``dpllm report`` and the card."""
    k = info
    fill = k["real_tokens"] / max(1, k["row_tokens"])
    return (f"{k['records']:,} records (segments) were packed into {k['rows']:,} rows of at most "
            f"{k['tokens_per_row']:,} tokens ({fill:.0%} of the rows' positions real tokens), per step from the "
            "records sampled; each record attended only to its own tokens (block-diagonal mask, positions from 0) "
            "and its gradient was clipped alone, so the unit is the record")
