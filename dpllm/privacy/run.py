"""One run's privacy state, kept apart from the loop that spends it: unit, plan, history, report.

:class:`dpllm.train.Trainer` holds one :class:`RunPrivacy` and asks it at these stages:

    stage           call                      what it decides or reads
    setup_data      bound_contributions       privacy_unit=user: at most k records per user (a secret choice),
                                              each record's user and each user's records
    setup_plan      make_plan                 earlier stages (composition), q, steps and σ, from the data alone
    setup_model     set_windows               long_records=split: each row's source record, the unit (dpllm.windows)
    setup_privacy   attach                    the engine (make_private) whose accountant every later call reads
    steps, saves    epsilon, now              (ε, δ) so far for the unit; the privacy fields of ledger lines
    finish          check_history, report     the accountant holds exactly the plan; the privacy report

The unit is a record, a declared packed block of tokens (``privacy_unit: sequence``, DPTrainer only:
:mod:`dpllm.privacy.sequence_level`), or a user (``privacy_unit: user``): ULS samples users and clips each one's mean
gradient once; ELS samples records and states the user-level ε over the declared cap k by the mixture
accounting; ``record`` keeps the record-level guarantee (a user's only by group privacy). Composition of
earlier stages lives in :mod:`dpllm.privacy.composition`, the plan in :mod:`dpllm.privacy.plan`, users in
:mod:`dpllm.privacy.user_level`, the report type in :mod:`dpllm.privacy.report`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

from dpllm.checkpoint import library_versions
from dpllm.config import ConfigError, RunConfig
from dpllm.errors import DataError, TrainingError
from dpllm.privacy import clipping, correlated, sequence_level, user_level
from dpllm.privacy.accounting import PrivacyPlanError, check_delta, method_note
from dpllm.privacy.composition import Lineage, lineage, set_digest
from dpllm.privacy.engine import count_noise_multiplier, make_private
from dpllm.privacy.plan import PrivacyPlan, plan_privacy, sample_rate_for, steps_for
from dpllm.privacy.quantile import check_count_noise
from dpllm.privacy.report import PrivacyReport, sampling_record
from dpllm.privacy.schedule import noise_schedule

log = logging.getLogger(__name__)


class RecurrenceState:
    """The noise recurrence as an entry of the run's generators: a resumable checkpoint saves its state with the
    generators' (owner-only ``rng_state.pt`` under ``checkpoints/``, :mod:`dpllm.resume`) and restores it."""

    def __init__(self, recurrence):
        self.recurrence = recurrence

    def get_state(self) -> dict:
        return self.recurrence.state_dict()

    def set_state(self, state: dict) -> None:
        self.recurrence.load_state_dict(state)


class RunPrivacy:
    """The privacy bookkeeping of one training stage configured by ``cfg`` (see the module docstring)."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.p = cfg, cfg.privacy
        self.dp = cfg.privacy.enabled
        self.out = Path(cfg.train.output_dir)
        self.user_unit = False  # privacy_unit=user (set by bound_contributions; data of its own keeps records)
        self.user_column: Optional[str] = None  # the users' column, for the report (None: a built-in grouping)
        self.user_cap: dict = {}  # what capping users kept and dropped (dpllm.privacy.user_level.cap_users)
        self.record_user: list[int] = []  # each training record's user (dataset position → user index)
        self.user_records: list[list[int]] = []  # each user's dataset positions
        self.user_names: list[str] = []  # each user's id (index = user index): ULS's cyclic groups key on it
        self.users_per_batch: Optional[int] = None  # ULS: expected users per logical batch
        self.windowed = False  # long_records=split: a unit is one source record's windows (set_windows)
        self.lineage: Optional[Lineage] = None
        self.plan: Optional[PrivacyPlan] = None
        self.steps = 0
        self.private = None  # dpllm.privacy.engine.PrivateTraining under DP, set by the trainer's setup_privacy
        self.noise = None  # dpllm.privacy.correlated.CorrelatedNoise under DP: sampler, recurrence, event (make_plan)

    # ---- the unit ------------------------------------------------------------------------------------

    @property
    def sequence_unit(self) -> bool:
        """privacy_unit=sequence (DPTrainer): the unit is one packed block of max_length tokens (dpllm.privacy.
        sequence_level); the accounting is record-level over the blocks."""
        return self.cfg.data.privacy_unit == "sequence"

    @property
    def uls(self) -> bool:
        return self.dp and self.user_unit and self.p.user_sampling == "uls"

    @property
    def per_unit(self) -> bool:
        """Rows grouped into units that are sampled together and clipped once: ULS's users, or the windows of
        one long record (``long_records: split``, :mod:`dpllm.windows`)."""
        return self.uls or (self.dp and self.windowed)

    @property
    def unit_reduction(self) -> str:
        """How a unit's rows make its gradient before the clip: a user's mean (ULS), a record's windows' sum."""
        return "sum" if self.windowed else "mean"

    def set_windows(self, record_of: list[int]) -> None:
        """``long_records: split``: each training row is a window of source record ``record_of[row]``; the
        record is the unit. The plan stays the record level's over the source records (:mod:`dpllm.windows`:
        one record's windows are sampled together and clipped as one, so its sensitivity is C)."""
        self.windowed = True
        self.record_user = list(record_of)
        self.user_records = [[] for _ in range(max(record_of, default=-1) + 1)]
        for pos, r in enumerate(record_of):
            self.user_records[r].append(pos)
        largest, physical = max((len(r) for r in self.user_records), default=0), self.cfg.train.physical_batch_size
        if self.dp and largest > physical:  # the config checks max_windows ≤ physical; this is the data's bound
            raise ConfigError(f"a record has {largest} windows > physical_batch_size={physical}; lower max_windows")

    @property
    def els(self) -> bool:
        return self.dp and self.user_unit and self.p.user_sampling == "els"

    @property
    def group_size(self) -> Optional[int]:
        """k of the group-privacy accounting (ELS, record): the declared cap ``max_records_per_user``, never a
        statistic of the data (a neighbour may add a user of k records, whatever the largest user here keeps).
        None for ``record`` without a cap (unbounded; ELS without one is refused by the config); 1 otherwise."""
        if self.dp and self.user_unit and self.p.user_sampling in ("els", "record"):
            return self.cfg.data.max_records_per_user
        return 1

    def bound_contributions(self, train_ids: list[int], *, users: list[str], texts: list[str], splits,
                            canaries: list[dict], resumed: bool, stage: str, world,
                            user_column: Optional[str]) -> list[int]:
        """privacy_unit=user: keep at most k records per user (secret random choice); return the kept ids.

        A resumed run trains on the records its splits.json lists: the choice was secret and is not redrawn.

        Args:
            stage: the key of this run's config (:func:`dpllm.resume.config_key`) that the secret choice derives from.
            user_column: the users' column the report names (None for a built-in corpus's own grouping).
            texts: every record's text (by id): a user keeps the k records whose keyed hash of (user, text) is
                smallest, so one user's choice never depends on another user's records.
        """
        d = self.cfg.data
        self.user_unit, self.user_column = True, user_column
        cap = self._cap(train_ids, users, texts, resumed=resumed, stage=stage, world=world)
        # splits.json lists the kept records as the trained ones; dropped records are neither member nor held out
        splits.users["dropped_records"] = sorted(set(train_ids) - set(cap["kept"]))
        splits.train = cap["kept"]
        self.user_cap = cap
        names = sorted(cap["by_user"]) + [f"canary#{i}" for i, c in enumerate(canaries) if c["included"]]
        index = {u: j for j, u in enumerate(names)}
        self.user_names = names
        self.record_user = [index[users[i]] for i in cap["kept"]]
        self.record_user += [index[f"canary#{i}"] for i, c in enumerate(canaries) if c["included"]
                             for _ in range(d.canary_records_per_user)]
        self.user_records = [[] for _ in names]  # dataset positions of each user's records
        for pos, u in enumerate(self.record_user):
            self.user_records[u].append(pos)
        largest, physical = max(len(r) for r in self.user_records), self.cfg.train.physical_batch_size
        if self.dp and self.p.user_sampling == "uls" and largest > physical:
            raise ConfigError(
                f"user_sampling=uls keeps a user's records in one physical batch, but a user keeps {largest} records > "
                f"physical_batch_size={physical}; set max_records_per_user ≤ {physical} or raise physical_batch_size")
        log.info("users: %d training users, %d records kept (k=%s, %s users trimmed, %s records dropped)",
                 len(names), len(self.record_user), d.max_records_per_user, cap["users_trimmed"],
                 cap["records_dropped"])
        return cap["kept"]

    def _cap(self, train_ids: list[int], users: list[str], texts: list[str], *, resumed: bool, stage: str,
             world) -> dict:
        if resumed and (self.out / "splits.json").is_file():
            kept = json.loads((self.out / "splits.json").read_text())["train"]
            if not set(kept) <= set(train_ids):
                raise DataError(f"{self.out}/splits.json lists records outside this run's training users")
            cap = user_level.cap_users(kept, users, None, None)
            dropped = sorted(set(train_ids) - set(kept))
            cap.update(users_trimmed=len({users[i] for i in dropped}), records_dropped=len(dropped),
                       largest_user=max(len(r) for r in user_level.group_by_user(train_ids, users).values()))
            return cap
        gen = user_level.cap_generator(reproducible=self.p.reproducible_noise, seed=self.cfg.train.seed, stage=stage,
                                       world=world)
        return user_level.cap_users(train_ids, users, self.cfg.data.max_records_per_user, gen, texts=texts)

    # ---- the plan ------------------------------------------------------------------------------------

    def make_plan(self, *, source: dict, num_records: int, trained: set[str], heldout: set[str],
                  data_notes: list[str]) -> int:
        """Earlier stages, steps and σ, all decided from the data alone (before any model is loaded).

        Returns:
            The number of steps (also ``self.steps``); under DP ``self.plan`` holds q and σ.
        """
        t, p = self.cfg.train, self.p
        self.lineage = lineage(source, private=trained, heldout=heldout, dp=self.dp,
                               declared_disjoint=self.cfg.data.earlier_stages_disjoint)
        if self.dp and self.sequence_unit and self.lineage.history:
            raise PrivacyPlanError("privacy_unit=sequence cannot compose with earlier private stages on the same "
                                   "records (their ε is for another unit); start from a model that never saw them")
        if self.dp and self.user_unit and self.lineage.history:
            raise PrivacyPlanError("privacy_unit=user cannot yet compose with earlier private stages on the same "
                                   "records (their ε is record-level); start from a model that never saw them")
        n, batch = num_records, t.logical_batch_size
        target, delta = p.target_epsilon, p.target_delta
        if self.dp and self.user_unit:
            check_delta(delta, len(self.user_records))  # δ < 1/U: the unit is the user
        if self.uls:
            # ULS samples users: B_u users per step so that a step holds B records in expectation.
            n, batch = len(self.user_records), max(1, round(batch * len(self.user_records) / n))
            self.users_per_batch = batch
        self.steps = steps_for(num_records=n, batch=batch, epochs=t.epochs,
                               steps=None if t.epochs is not None else t.max_steps)
        sigma = p.noise_multiplier
        if self.els and self.group_size > 1 and (sigma is not None or target is not None):
            sigma, target, delta = self._els_sigma(sigma, sample_rate_for(n, batch))
        if self.dp:  # the noise mechanism first: banded noise changes q and the steps accounted (privacy.correlated)
            self.noise = correlated.build(p.noise, p.bands, steps=self.steps, num_records=n, batch=batch,
                                          target_epsilon=target, delta=delta, accountant=p.accountant,
                                          noise_multiplier=sigma, prior_history=self.lineage.history,
                                          buffers=p.buffers)
            self.plan = plan_privacy(num_records=n, logical_batch_size=batch, steps=self.steps,
                                     target_epsilon=target, delta=delta, accountant=p.accountant,
                                     noise_multiplier=sigma, prior_history=self.lineage.history,
                                     data_notes=data_notes, schedule=noise_schedule(p), noise=self.noise)
            if p.clipping == "quantile":  # σ_b > σ/2 at every step's σ, or the gradient's noise would be infinite:
                check_count_noise(self.plan.largest_sigma(), count_noise_multiplier(p, self.plan))  # before loading
        for note in self.lineage.notes:
            log.info("stages: %s", note)
        return self.steps

    def _els_sigma(self, sigma: Optional[float], q: float) -> tuple[float, None, float]:
        """ELS: σ from the user-level target by the tight mixture accounting; the record-level plan then
        carries δ/k (< 1/N, as δ < 1/U) only to state a record-level ε beside the user-level one."""
        k, target, delta = self.group_size, self.p.target_epsilon, self.p.target_delta
        if sigma is None:  # calibrated: meets the target by construction
            sigma = user_level.calibrate_mixture(target_epsilon=target, delta=delta, sample_rate=q,
                                                 steps=self.steps, group_size=k)
        elif target is not None:  # a given σ must still meet a given target
            eps_u = user_level.mixture_epsilon(history=[(sigma, q, self.steps)], delta=delta, group_size=k)
            if eps_u > target:
                raise PrivacyPlanError(f"noise_multiplier={sigma:g} gives user-level ε={eps_u:.4g} > "
                                       f"target_epsilon={target:g} for users of {k} records; raise the noise or "
                                       "unset it")
        return sigma, None, delta / k

    def check_noise_memory(self, model, *, world, device) -> None:
        """Correlated noise: log what its recurrence keeps per process, and refuse (ConfigError, every process alike)
        a run where it cannot fit in free memory (:mod:`dpllm.privacy.correlated.memory`). Call it once the model is
        built and wrapped (FSDP2's shards are then known), before anything is written."""
        if not self.dp or self.noise is None or not self.noise.correlated:
            return
        from dpllm import distributed
        from dpllm.privacy.correlated import memory

        line = memory.check_fits(self.noise, [p for p in model.parameters() if p.requires_grad], world=world,
                                 device=device, lora=self.cfg.model.finetuning != "full",
                                 gather=lambda obj: distributed.gather_objects(obj, world))
        if world.is_main:
            log.info("privacy: %s", line)

    def attach(self, *, model, optimizer, dataset, collate_fn, generators: dict, world,
               texts: Optional[list[str]] = None):
        """Wrap ``model`` and ``optimizer`` for this plan (:func:`dpllm.privacy.engine.make_private`).

        ``texts`` (each training row's record text) group the records for correlated noise's cyclic sampling; under
        ULS the users are grouped instead, each by its id.

        Returns:
            ``(model, optimizer, criterion, sampler)``: what the loop steps, the loss reduction under ghost
            clipping (else None) and the Poisson logical batches.
        """
        t = self.cfg.train
        self.private = make_private(
            model=model, optimizer=optimizer, dataset=dataset, collate_fn=collate_fn, cfg=self.p, plan=self.plan,
            logical_batch_size=t.logical_batch_size, noise_generator=generators["noise"],
            sampling_generator=generators["sampling"], rank=world.rank, world_size=world.size,
            physical_batch_size=t.physical_batch_size, max_length=self.cfg.data.max_length,
            noise=self.noise, texts=self.user_names if self.uls else texts, group_key=self.cfg.data.split_seed,
            **({"user_records": self.user_records} if self.per_unit else {}))
        if self.private.recurrence is not None:  # its state (past noise) is secret: saved with the generators'
            generators["noise_recurrence"] = RecurrenceState(self.private.recurrence)
        log.info("privacy: σ=%.4g q=%.4g steps=%d target ε=%s δ=%g (%s), %d process(es)",
                 self.plan.noise_multiplier, self.plan.sample_rate, self.steps, self.p.target_epsilon,
                 self.p.target_delta, self.p.accountant, world.size)
        return self.private.model, self.private.optimizer, self.private.criterion, self.private.sampler

    # ---- while training ------------------------------------------------------------------------------

    def epsilon(self) -> tuple[float, float]:
        """(ε, δ) so far for the privacy unit: a record, or a user (ULS directly; ELS by the mixture accounting)."""
        if self.els and self.group_size > 1:
            return user_level.mixture_epsilon(history=self.private.history(), delta=self.p.target_delta,
                                              group_size=self.group_size), self.p.target_delta
        return self.private.epsilon(), self.plan.delta

    def user_level_info(self) -> Optional[dict]:
        """The user-level part of the report and the ledger lines (None for record-level runs)."""
        if not (self.dp and self.user_unit):
            return None
        cap, k = self.user_cap, self.group_size
        info = {"unit": "user", "sampling": self.p.user_sampling, "num_users": len(self.user_records),
                "users_per_batch": self.users_per_batch if self.uls else None,
                "max_records_per_user": self.cfg.data.max_records_per_user, "group_size": k,
                "largest_user_records": cap["largest_user"], "users_trimmed": cap["users_trimmed"],
                "users_dropped": cap["users_dropped"], "records_dropped": cap["records_dropped"],
                "user_column": self.user_column,
                "group_privacy": user_level.ULS_UNIT if self.uls else
                "k = 1: the user-level guarantee is the record-level one" if k == 1 else user_level.GROUP_PRIVACY}
        if self.p.user_sampling == "record":  # the guarantee is per record; the user level only by group privacy
            eps_u = math.inf if k is None else user_level.mixture_epsilon(
                history=self.private.history(), delta=self.p.target_delta, group_size=k)
            info.update(user_epsilon=eps_u if math.isfinite(eps_u) else None, user_delta=self.p.target_delta,
                        group_privacy=user_level.UNCAPPED if k is None else user_level.GROUP_PRIVACY + (
                            "" if math.isfinite(eps_u) else "; unbounded at this δ (user_epsilon = null)"))
        elif k > 1:  # ELS: the record-level ε at δ/k, for comparison only (the guarantee is the user-level one)
            info.update(record_epsilon=self.private.epsilon(), record_delta=self.plan.delta)
        return info

    def now(self) -> dict:
        """ε so far (earlier stages on the same records included) and the parameters behind it ({} without DP)."""
        if not self.dp:
            return {}
        eps, delta = self.epsilon()
        out = {"epsilon": eps, "delta": delta, "noise_multiplier": self.plan.noise_multiplier,
               "sample_rate": self.plan.sample_rate, "accountant": self.plan.accountant,
               "history": [list(h) for h in self.private.history()]}
        info = self.user_level_info()
        if info is not None:
            out["user_level"] = info
        adaptive = self.adaptive_clipping()
        if adaptive is not None:
            out["adaptive_clipping"] = adaptive
        if self.plan.noise:
            out["correlated_noise"] = self.plan.noise
        return out

    def adaptive_clipping(self) -> Optional[dict]:
        """``clipping: quantile``: γ, η, σ_b, σ_g and C from its start to now (None otherwise). C is a function of
        the noised counts alone, so it may be released (dpllm.privacy.quantile)."""
        q = self.private.quantile if self.dp and self.private is not None else None
        if q is None:
            return None
        return q.info(sigma=self.plan.noise_multiplier,
                      schedule=[h[0] for h in self.plan.stage_history()] if self.plan.schedule else None)

    def clipping_state(self) -> Optional[dict]:
        """What a resumable checkpoint keeps of the clipping (``clipping: quantile``'s C), or None."""
        q = self.private.quantile if self.dp and self.private is not None else None
        return None if q is None else q.state_dict()

    def restore_clipping(self, state: Optional[dict]) -> None:
        """Put back :meth:`clipping_state` from a checkpoint.

        Raises:
            ConfigError: the checkpoint and this run disagree on whether C adapts.
        """
        q = self.private.quantile if self.dp and self.private is not None else None
        if (q is None) != (state is None):
            raise ConfigError("cannot resume: the checkpoint " + ("has no" if state is None else "has an") +
                              " adaptive clipping norm and this run " + ("adapts C" if q is not None else "does not") +
                              "; resume with the clipping the run started with")
        if q is not None:
            q.load_state_dict(state)

    # ---- at the end ----------------------------------------------------------------------------------

    def check_history(self, steps_taken: int) -> None:
        """The accountant must hold exactly the planned (σ, q) for exactly the steps taken.

        Raises:
            TrainingError: it does not (a dpllm bug; the caller writes no checkpoint).
        """
        if not self.dp:
            return
        got = [(float(s), float(q), int(n)) for s, q, n in self.private.history()]
        want = list(self.lineage.history) + self.plan.stage_history(steps_taken)
        merged: list = []
        for h in got:  # Opacus records one entry per (σ, q) run of steps
            if merged and merged[-1][:2] == h[:2] and len(merged) > len(self.lineage.history):
                merged[-1] = (h[0], h[1], merged[-1][2] + h[2])
            else:
                merged.append(h)
        if merged != [(float(s), float(q), int(n)) for s, q, n in want] or steps_taken != self.steps:
            raise TrainingError(f"the accountant recorded {merged}, the plan says {want} over {self.steps} steps; "
                                "this is a dpllm bug (no checkpoint was written)")

    def report(self, *, num_records: int, steps: int, trained: set[str], adjustments: list[str],
               base_model: dict, public_data: str, data_summary: Optional[dict] = None,
               packing: Optional[dict] = None) -> PrivacyReport:
        """The privacy report: ε with everything needed to recompute it (``public_data``: which records were
        declared public and by what rule, :func:`dpllm.data.split_rule`; ``data_summary``: what ``max_length``
        cut off the training records, :mod:`dpllm.truncation`; ``packing``: the rows and records of
        ``data.packing``, :mod:`dpllm.packing`)."""
        common = self._report_common(num_records=num_records, steps=steps, trained=trained, adjustments=adjustments,
                                     base_model=base_model, public_data=public_data)
        common["data"] = data_summary
        common["packing"] = packing
        if not self.dp:
            return PrivacyReport(**common)
        p, plan = self.p, self.plan
        eps, delta = self.epsilon()
        history = [list(h) for h in self.private.history()]
        # what the sampler did and what ε credits: Poisson (q), cyclic Poisson (q_b, ⌈T/b⌉), BLT's cyclic groups (none)
        sampling = sampling_record(plan.noise, sample_rate=plan.sample_rate, steps=common["steps"], history=history)
        return PrivacyReport(
            **common, epsilon=eps, delta=delta, accountant=plan.accountant,
            accountant_method=(None if self.els and self.group_size > 1 else  # the mixture's: user_level says
                               method_note(history=self.private.history(), delta=delta, accountant=plan.accountant)),
            privacy_unit="sequence" if self.sequence_unit else
            "user" if self.user_unit and p.user_sampling != "record" else "record",
            user_level=self.user_level_info(),
            sequence_level=sequence_level.sequence_level_info(history=history, delta=delta,
                                                              tokens=self.cfg.data.max_length)
            if self.sequence_unit else None,
            target_epsilon=p.target_epsilon, noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate, expected_batch_size=plan.expected_batch_size,
            max_grad_norm=p.max_grad_norm, clipping=p.clipping,
            # quantile: the sensitivity moved with C; the last C is in adaptive_clipping
            sensitivity=None if p.clipping == "quantile" else clipping.get(p.clipping).sensitivity(p),
            adaptive_clipping=self.adaptive_clipping(), correlated_noise=plan.noise,
            grad_sample_mode=self.private.grad_sample_mode,
            grad_sample_mode_reason=self.private.grad_sample_mode_reason or None,
            poisson_sampling=sampling["credited"], sampling=sampling, secure_mode=p.secure_mode,
            noise_secret=not p.reproducible_noise, history=history,
            noise_schedule=({**plan.schedule, "pieces_sigma_steps": [[s, n] for s, _, n in plan.stage_history()]}
                            if plan.schedule else None),
            composition=("; ".join(self.lineage.notes) if self.lineage.notes else "single stage"),
            warnings=list(plan.warnings))

    def _report_common(self, *, num_records: int, steps: int, trained: set[str], adjustments: list[str],
                       base_model: dict, public_data: str) -> dict:
        """The fields of the report with or without DP, this stage's entry among the stages included."""
        t, d = self.cfg.train, self.cfg.data
        stage = {"name": self.out.name, "run_dir": str(self.out.resolve()), "enabled": self.dp,
                 "dataset": d.dataset, "train_on": d.train_on,
                 # a count kept by rank (a built-in corpus only, under DP): the released relation says so (export)
                 "max_records": d.max_records,
                 "public_data": public_data,  # which records were declared public, and how
                 "num_records": num_records, "steps": steps,
                 "records_sha256": set_digest(trained),
                 "history": [list(h) for h in self.private.history()[len(self.lineage.history):]] if self.dp else []}
        return dict(enabled=self.dp, num_records=num_records, steps=steps,
                    logical_batch_size=t.logical_batch_size, physical_batch_size=t.physical_batch_size,
                    model_adjustments=adjustments, base_model=base_model, versions=library_versions(),
                    stages=self.lineage.stages + [stage])
