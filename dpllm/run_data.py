"""The records one run trains and evaluates on, decided from the data file and the config alone.

:class:`dpllm.train.Trainer` makes one :class:`RunData` in ``setup_data`` (:func:`prepare`), before the privacy
plan and before any model loads; ``DPTrainer`` (:mod:`dpllm.hf`) builds one from the datasets handed to it:

    step                        what                                          where
    read                        records, users, what reading removed          data.load_records_counted
    split                       public / train / held out, keyed per record   data.make_splits
    SFT records                 record shape; answers max_length cuts off     Loaded.sft_format, sft.drop_cut_answers
    canaries                    num_canaries secrets, each trained on or not  data.make_canaries
    users (privacy_unit=user)   at most k records per user, a secret choice   RunPrivacy.bound_contributions
    members                     training texts (records, then canaries),      data.select; the resumed run's
                                held-out texts, both sets' hashes             splits.json must agree
    datasets                    token ids and labels for the model's          RunData.datasets
                                tokenizer (SFT: labels on the answer;         (long_records=split:
                                split: one row per window of a record)        dpllm.windows)

Nothing here writes: :func:`dpllm.rundir.describe` records the result in ``splits.json`` once every check passed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dpllm import config, data, sft, windows
from dpllm.config import DataConfig, RunConfig
from dpllm.distributed import World
from dpllm.privacy.run import RunPrivacy

log = logging.getLogger("dpllm.train")  # the Trainer's lines: same logger name in consoles and filters as before


@dataclass
class RunData:
    """A run's records (``records``, indexed by the splits), its members and its held-out records.

    ``train_texts`` are the training set's records and then the canaries trained on; the privacy plan's N is
    their count. ``eval_texts`` are the held-out records evaluated (``eval_max_records`` of them at most).
    """

    records: list[str]
    splits: data.Splits
    train_texts: list[str]
    eval_texts: list[str]
    trained_hashes: set[str]
    heldout_hashes: set[str]
    users: Optional[list[str]] = None  # each record's user (privacy_unit=user), else None
    canaries: list[dict] = field(default_factory=list)
    sft_format: Optional[str] = None  # the record shape of instruction / chat data (dpllm.sft), None for text
    sft_dropped: Optional[list[int]] = None  # SFT records whose answer max_length cuts off
    notes: list[str] = field(default_factory=list)  # what reading removed, for the privacy plan's warnings

    def datasets(self, tokenizer, cfg: DataConfig):
        """``(train_ds, eval_ds, collate)``: token ids and labels (-100 on padding, and on prompts of SFT records)."""
        if self.sft_format:  # the template is set on the tokenizer saved with the model
            return sft.make_datasets(self.train_texts, self.eval_texts, tokenizer, cfg, fmt=self.sft_format)
        if cfg.long_records == "split":  # every window of a long record trains; held-out loss stays per record
            return (windows.WindowedRecords(self.train_texts, tokenizer, cfg.max_length, cfg.max_windows,
                                            cfg.window_stride),
                    data.TokenizedRecords(self.eval_texts, tokenizer, cfg.max_length),
                    data.make_collate(tokenizer.pad_token_id))
        return (data.TokenizedRecords(self.train_texts, tokenizer, cfg.max_length),
                data.TokenizedRecords(self.eval_texts, tokenizer, cfg.max_length),
                data.make_collate(tokenizer.pad_token_id))


def prepare(cfg: RunConfig, *, privacy: RunPrivacy, world: World, stage: str, resume_from: Optional[Path]) -> RunData:
    """Read, split and select a run's records (the table above); log where every record went (console only).

    Args:
        stage: the run's config key (:func:`dpllm.resume.config_key`): the secret per-user choice derives from it.
        resume_from: the checkpoint a resumed run starts from; its ``splits.json`` must list the same members.

    Raises:
        DataError: no data, too few records, ``train_on: public`` without public records, or a resumed run whose
            file and config no longer give the members it trained on.
        ConfigError: ``privacy_unit: sequence``, which only DPTrainer takes (its rows are the blocks).
    """
    d = cfg.data
    if d.privacy_unit == "sequence":
        raise config.ConfigError("privacy_unit=sequence protects one packed block of tokens, which only DPTrainer "
                                 "takes (PrivacyArguments(privacy_unit='sequence') over group_texts-style blocks); "
                                 "this recipe trains one record per row: use privacy_unit: record (or user)")
    loaded, splits, sft_format, sft_dropped = _read_and_split(cfg)
    if sft_format and d.long_records == "split":
        raise config.ConfigError(f"long_records=split of {sft_format} records (a conversation cut between windows) "
                                 "is planned (issue 48); use long_records: truncate, or raise max_length")
    if d.train_on == "public" and not splits.public:
        raise data.DataError("train_on=public but no record is public; declare public records with "
                             "public_dataset: FILE")
    train_ids = splits.public if d.train_on == "public" else splits.train
    canaries = data.make_canaries(d) if d.train_on == "private" else []
    if loaded.users is not None and d.train_on == "private":  # privacy_unit=user: at most k records per user
        train_ids = privacy.bound_contributions(
            train_ids, users=loaded.users, texts=loaded.records, splits=splits, canaries=canaries,
            resumed=resume_from is not None, stage=stage, world=world,
            user_column=None if d.dataset in data.BUILTIN else d.user_column)
    m = d.canary_records_per_user if privacy.user_unit else 1  # a canary user writes its canary m times
    train_texts = data.select(loaded.records, train_ids) + [
        sft.canary_record(c, sft_format) if sft_format else c["text"]  # SFT: the secret is the answer
        for c in canaries if c["included"] for _ in range(m)]
    heldout = data.select(loaded.records, splits.heldout)
    run = RunData(records=loaded.records, splits=splits, train_texts=train_texts,
                  eval_texts=heldout if cfg.train.eval_max_records is None else heldout[: cfg.train.eval_max_records],
                  trained_hashes={data.sha256(x) for x in train_texts},
                  heldout_hashes={data.sha256(x) for x in heldout},
                  users=loaded.users, canaries=canaries, sft_format=sft_format, sft_dropped=sft_dropped,
                  notes=loaded.notes(d))
    if resume_from is not None:  # the same file and config must still give the same members
        data.check_resumed_split(Path(cfg.train.output_dir) / "splits.json", run.trained_hashes)
    if world.is_main:  # where every record went, on the operator's console only (issue 35)
        log.info("%s", data.split_summary(loaded, splits, d, canaries=canaries, sft_dropped=len(sft_dropped or ())))
    return run


def _read_and_split(cfg: RunConfig) -> tuple[data.Loaded, data.Splits, Optional[str], Optional[list[int]]]:
    """The records read, their splits, the SFT record shape (or None) and the SFT records dropped from the splits."""
    d = cfg.data
    loaded = data.load_records_counted(d)
    _check_max_records(cfg, loaded)
    try:
        splits = data.make_splits(loaded.records, d, loaded.users, loaded.public)
    except data.DataError as err:  # say why so few are left: duplicates are easy to miss in a file
        raise data.DataError(f"{err}" + (f" ({loaded.duplicates:,} of {loaded.read:,} records read were exact "
                                         "duplicates and were removed)" if loaded.duplicates else "")) from None
    sft_format = loaded.sft_format  # the file's schema (or data_format), never a vote of the records (issue 46)
    log.info("[private] data format: %s", f"{sft_format} records, loss on {d.loss_on} tokens" if sft_format
             else "plain text, loss on all tokens")  # detected from the private file: the console only
    dropped = None
    if sft_format:  # before the plan: N counts only records that keep an answer token
        dropped = sft.drop_cut_answers(loaded.records, splits, sft.load_tokenizer(cfg.model), fmt=sft_format,
                                       max_length=d.max_length, chat_template=d.chat_template)
    return loaded, splits, sft_format, dropped


def _check_max_records(cfg: RunConfig, loaded: data.Loaded) -> None:
    """Refuse ``max_records`` where it would turn add/remove-one into replace-one on a private file (issue 46).

    ``max_records`` keeps a count (the records whose keyed hash ranks first): on a file of at least that many
    records, one record more can push a kept record out, and the released card states add/remove of one record.
    Under DP it is allowed on the built-in corpora (public text that no one can hand a neighbour of) and on a
    file too small for any neighbour to reach the cut; ``record_fraction`` decides each record by itself.

    Raises:
        DataError: DP, a data set of one's own, and ``max_records`` ≤ its records.
    """
    d = cfg.data
    if not cfg.privacy.enabled or d.max_records is None or d.dataset in data.BUILTIN or d.dataset in sft.BUILTIN:
        return
    private = sum(not p for p in loaded.public) if loaded.public is not None else len(loaded.records)
    if private + loaded.over_max_records >= d.max_records:  # this file, or one record more, meets the cut
        raise data.DataError(
            f"max_records={d.max_records:,} keeps a count: on this file one record more would push a kept record "
            "out, so a neighbour differs in two records and the (ε, δ) for adding or removing one would not hold. "
            "Use record_fraction (each record kept by a keyed hash of its own text; e.g. record_fraction: "
            f"{min(1.0, d.max_records / max(1, private + loaded.over_max_records)):.2g} for about as many), or "
            "unset max_records")
