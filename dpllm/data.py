"""Records, splits and batches.

The privacy unit is one record: a paragraph of the built-in corpus, a row of a dataset, or a paragraph
of a text file. Records are never packed together; a long record is truncated to ``max_length``
tokens and padding is masked out of the loss. ``splits.json`` records which records were trained on
(members) and which were held out (non-members), so that ``mia`` can audit the run later.
What the cut removed is counted (:mod:`dpllm.truncation`) for the console and the privacy report.

With ``privacy_unit: user`` every record also has a user (:func:`load_records_and_users`): a column of the
file (``user_column``), or the built-in corpus's grouping (:data:`PYDOC_USER_PARAGRAPHS`); splits are then
drawn over users, so a held-out user has no trained record (docs/user_level.md).

Every decision about a record is made by that record alone (:func:`keyed_draw`: a keyed hash of its text, or of
its user's id, under the public key ``split_seed``): which split it joins, which copy of a duplicate stands for
it, whether ``record_fraction`` keeps it (``max_records`` ranks records against each other, so a DP run on a file
of one's own refuses it: dpllm.run_data). The same file and config give the same split every time, and a file with
one record more or less, wherever it sits, changes every split by that record only: the add/remove-one relation
DP-SGD's ε is for holds on the file the user hands over, not only on the training split (issue 32). Public
records are declared (``public_dataset``), never drawn from the private file outside a study that says so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

from dpllm import truncation
from dpllm.config import DataConfig
from dpllm.errors import DataError  # defined below dpllm.sft, which raises it too; imported from here as before

log = logging.getLogger(__name__)


def pydoc_paragraphs(*keys: str) -> list[str]:
    """Whitespace-normalised paragraphs of pydoc's documentation topics ``keys`` (default: all, sorted by
    name), in order, blank ones included. pydoc_data ships with CPython: the text of Python's reference."""
    from pydoc_data.topics import topics

    return [" ".join(p.split()) for key in (keys or sorted(topics)) for p in re.split(r"\n\s*\n", topics[key])]


# pydoc's "users": each documentation topic cut into runs of at most this many consecutive paragraphs, so
# the 78 topics (1 to 246 paragraphs) become a few hundred users of 1 to 16 records each: a synthetic but
# documented grouping with the heavy tail real users have (docs/user_level.md).
PYDOC_USER_PARAGRAPHS = 16


def _pydoc_user_records() -> tuple[list[str], list[str]]:
    from pydoc_data.topics import topics

    texts, users = [], []
    for key in sorted(topics):
        for j, para in enumerate(p for p in pydoc_paragraphs(key) if p):
            texts.append(para)
            users.append(f"{key}#{j // PYDOC_USER_PARAGRAPHS}")
    return texts, users


def _pystdlib_user_records() -> tuple[list[str], list[str]]:
    # one "user" per source file
    from dpllm.scaling.corpora import chunk_lines, stdlib_files

    texts, users = [], []
    for path in stdlib_files()["private"]:
        chunks = list(chunk_lines(path.read_text(encoding="utf-8", errors="replace"), max_chars=240))
        texts += chunks
        users += [path.name if path.parent.name in ("", "lib") else f"{path.parent.name}/{path.name}"] * len(chunks)
    return texts, users


def _pystdlib_records() -> list[str]:
    # CPython's standard-library source outside its test suite (the stdlib ships with every Python): code,
    # a different kind of text from pydoc's prose, so a model pretrained on pydoc visibly learns from it.
    from dpllm.scaling.corpora import chunk_lines, stdlib_files

    out = []
    for path in stdlib_files()["private"]:
        out += chunk_lines(path.read_text(encoding="utf-8", errors="replace"), max_chars=240)
    return out


BUILTIN = {"pydoc": pydoc_paragraphs, "pystdlib": _pystdlib_records}
BUILTIN_USERS = {"pydoc": _pydoc_user_records, "pystdlib": _pystdlib_user_records}


@functools.lru_cache(maxsize=None)
def _builtin_corpus(name: str, by_user: bool) -> tuple[tuple[str, ...], Optional[tuple[str, ...]]]:
    """The texts (and users) of built-in corpus ``name``, read once per process: they come from this Python's own
    installation, which nothing a run does changes. A run, its held-out evaluation and its audits each read the
    corpus again (the stdlib corpus: ~0.4 CPU-s each, to read some 700 files and chunk them)."""
    if by_user:
        texts, users = BUILTIN_USERS[name]()
        return tuple(texts), tuple(users)
    return tuple(BUILTIN[name]()), None


def _jsonl_rows(path: Path) -> list[dict]:
    """Every row of a ``.jsonl`` dataset (parsed once: :func:`_read_raw` hands them to both readers).

    Raises:
        DataError: a line that is not a JSON object, named by file and line.
    """
    from dpllm.io import JsonlError, read_jsonl

    try:
        return read_jsonl(path)
    except JsonlError as err:
        raise DataError(f"dataset={err}; fix or remove that line") from None


def _file_records(path: Path, cfg: DataConfig,
                  rows: Optional[list[dict]] = None) -> tuple[list[str], Optional[list[str]]]:
    """The texts (and users) of a .txt/.jsonl/.json/.csv file; ``rows``: a .jsonl file's rows, already parsed."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        if cfg.privacy_unit == "user":
            raise DataError(f"dataset={path}: a .txt file names no users; privacy_unit=user needs a .jsonl/.json/.csv "
                            f"file with a {cfg.user_column!r} column")
        return [" ".join(p.split()) for p in re.split(r"\n\s*\n", path.read_text(errors="replace"))], None
    if suffix == ".jsonl":
        rows = _jsonl_rows(path) if rows is None else rows
        if not rows:
            raise DataError(f"dataset={path} is empty (no JSON lines); give a file with one record per line")
        missing = next((i for i, r in enumerate(rows, 1) if cfg.text_column not in r), None)
        if missing is not None:
            raise DataError(f"dataset {path} has no text column {cfg.text_column!r} in record {missing} (its keys: "
                            f"{sorted(rows[missing - 1])}): set text_column to one of them")
        texts = [str(r[cfg.text_column]) if r[cfg.text_column] is not None else "" for r in rows]
        if cfg.label_column:
            texts = with_control_codes(texts, [r.get(cfg.label_column) for r in rows], cfg.label_column, str(path),
                                       allowed=declared_labels(cfg))
        if cfg.privacy_unit != "user":
            return texts, None
        missing = next((i for i, r in enumerate(rows, 1) if r.get(cfg.user_column) is None), None)
        if missing is not None:
            raise DataError(f"dataset {path} has no user column {cfg.user_column!r} in record {missing} (its keys: "
                            f"{sorted(rows[missing - 1])}): set user_column, or use privacy_unit=record")
        return texts, [str(r[cfg.user_column]) for r in rows]
    if suffix in (".json", ".csv"):
        import datasets

        if path.stat().st_size == 0:
            raise DataError(f"dataset={path} is empty; give a file with records")
        try:
            ds = datasets.load_dataset("csv" if suffix == ".csv" else "json", data_files=str(path), split="train")
        except Exception as err:  # datasets wraps parse errors in long chains: keep the last, useful line
            raise DataError(f"dataset={path} could not be parsed as {suffix[1:]}: "
                            f"{str(err).strip().splitlines()[-1][:300]}") from None
        return _labelled(ds, cfg, str(path)), _users(ds, cfg, str(path))
    raise DataError(f"dataset={path}: unsupported file type {suffix!r}; use .jsonl, .json, .csv, .parquet or .txt")


def _column(ds, column: str, source: str) -> list[str]:
    if column not in ds.column_names:
        raise DataError(
            f"dataset {source} has no text column {column!r}; its columns are {ds.column_names}: "
            f"set text_column to one of them"
        )
    return [str(x) if x is not None else "" for x in ds[column]]


def control_code(label: str) -> str:
    """The control code a labelled record starts with (``data.label_column``; Yue et al. 2023)."""
    return f"[{label}] "


def split_control_code(text: str) -> tuple[Optional[str], str]:
    """``(label, text)`` of a record that starts with a control code, else ``(None, text)``."""
    m = re.match(r"\[([^\]\n]+)\] ", text)
    return (m.group(1), text[m.end():]) if m else (None, text)


def declared_labels(cfg: DataConfig) -> list[str]:
    """The public classes of ``data.label_values`` (in the order given).

    Raises:
        DataError: ``label_column`` without ``label_values``, or a value that cannot be a control code.
    """
    values = [v.strip() for v in (cfg.label_values or "").split(",") if v.strip()]
    if cfg.label_column and not values:
        raise DataError(f"label_column={cfg.label_column!r} needs label_values: the comma-separated classes, declared "
                        "public (they are not read from the data, where a class only one record has would reveal it)")
    bad = next((v for v in values if re.search(r"[\]\n]", v)), None)
    if bad is not None:
        raise DataError(f"label_values: {bad!r} cannot be a control code (no ']' or newline)")
    return values


def with_control_codes(texts: list[str], labels: Sequence, column: str, source: str, *,
                       allowed: Sequence[str]) -> list[str]:
    """Prefix each text with its label's control code.

    Raises:
        DataError: a record without a label, or a label that is not one of the declared ``allowed`` classes.
    """
    bad = next((i for i, lab in enumerate(labels, 1) if lab is None or not str(lab).strip()
                or re.search(r"[\]\n]", str(lab))), None)
    if bad is not None:
        raise DataError(f"dataset {source}: record {bad} has label {labels[bad - 1]!r} in column {column!r}; every "
                        "record needs a non-empty one-line label without ']' (or unset label_column)")
    known = set(allowed)
    bad = next((i for i, lab in enumerate(labels, 1) if str(lab).strip() not in known), None)
    if bad is not None:
        raise DataError(f"dataset {source}: record {bad} has label {str(labels[bad - 1]).strip()!r}, which is not one "
                        f"of label_values ({', '.join(allowed)}); add the class to label_values or drop the record")
    return [control_code(str(lab).strip()) + text for lab, text in zip(labels, texts)]


def _labelled(ds, cfg: DataConfig, source: str) -> list[str]:
    texts = _column(ds, cfg.text_column, source)
    if not cfg.label_column:
        return texts
    if cfg.label_column not in ds.column_names:
        raise DataError(f"dataset {source} has no label column {cfg.label_column!r}; its columns are "
                        f"{ds.column_names}: set label_column to one of them, or unset it")
    return with_control_codes(texts, ds[cfg.label_column], cfg.label_column, source, allowed=declared_labels(cfg))


def _users(ds, cfg: DataConfig, source: str) -> Optional[list[str]]:
    if cfg.privacy_unit != "user":
        return None
    if cfg.user_column not in ds.column_names:
        raise DataError(f"dataset {source} has no user column {cfg.user_column!r}; its columns are {ds.column_names}: "
                        "set user_column, or use privacy_unit=record")
    users = ds[cfg.user_column]
    if any(u is None for u in users):
        raise DataError(f"dataset {source}: column {cfg.user_column!r} has empty values; every record needs a user")
    return [str(u) for u in users]


FILE_TYPES = (".jsonl", ".json", ".csv", ".txt")


def _hub_records(cfg: DataConfig) -> tuple[list[str], Optional[list[str]]]:
    """A Hub dataset, for names that cannot be local paths; a local-looking name that is missing is an error."""
    from dpllm.io import missing_path_error, path_like

    name = cfg.dataset
    if path_like(name):
        raise DataError(missing_path_error(name, option="dataset") or f"dataset={name}: cannot be read as a file "
                        f"of records; give a {'/'.join(FILE_TYPES)} file, a .parquet file or a save_to_disk folder")
    import datasets

    try:
        ds = datasets.load_dataset(name, cfg.dataset_config_name, split=cfg.dataset_split)
    except Exception as err:
        raise DataError(f"dataset={name} is not a local file and could not be loaded from the Hub "
                        f"({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}); "
                        "check the name, or pass a local .jsonl/.json/.csv/.txt file") from None
    return _labelled(ds, cfg, name), _users(ds, cfg, name)


def load_records(cfg: DataConfig) -> list[str]:
    """All records of the configured dataset, stripped, filtered by ``min_chars`` and de-duplicated.

    Deterministic: the ids in ``splits.json`` index this list.

    Raises:
        DataError: the file or column is missing, a line cannot be parsed, or no record survives filtering.
    """
    return load_records_and_users(cfg)[0]


def load_records_and_users(cfg: DataConfig) -> tuple[list[str], Optional[list[str]]]:
    """:func:`load_records` and, with ``privacy_unit: user``, the user of each record (else None).

    At user level a text is deduplicated within each user only: a text several users wrote is a record of each
    of them (wherever the copies are in the file), so the record list can hold it more than once.

    Raises:
        DataError: as :func:`load_records`, or a missing user column.
    """
    loaded = load_records_counted(cfg)
    return loaded.records, loaded.users


@dataclass
class Loaded:
    """The records of a dataset, their users (or None), and what loading removed on the way.

    ``records`` holds the private records (file order) and then, with ``public_dataset``, the declared public
    ones; ``public`` marks which (None when nothing is declared public).
    """

    records: list[str]
    users: Optional[list[str]]
    read: int
    too_short: int
    duplicates: int
    public: Optional[list[bool]] = None
    over_max_records: int = 0  # private records beyond max_records (by keyed-hash rank)
    public_read: int = 0  # records read from public_dataset
    same_as_public: int = 0  # private records whose text the public dataset also holds (treated as public)
    sft_format: Optional[str] = None  # the file's record shape (messages / prompt_completion) by its schema; None: text
    over_record_fraction: int = 0  # private records whose keyed draw is ≥ record_fraction (left out one by one)

    def notes(self, cfg: DataConfig) -> list[str]:
        """Lines for the privacy plan's warnings: records removed as duplicates of a file's (none for the
        built-in corpora, whose repeated paragraphs are known and documented), and a max_records cut."""
        out = []
        if self.duplicates and cfg.dataset not in BUILTIN:
            out.append(f"dataset={cfg.dataset}: {self.duplicates:,} of {self.read:,} records read were exact "
                       "duplicates of another record and were removed (a text trained on twice would be both member "
                       "and non-member); N counts unique records")
        if self.over_max_records:
            out.append(f"max_records={cfg.max_records:,} kept the records that rank first by keyed hash and left out "
                       f"{self.over_max_records:,}: a file one record larger can push one of the kept records out, so "
                       "ε holds for adding or removing a record of the kept set, not of the file (allowed only for a "
                       "built-in public corpus or without DP); use record_fraction for part of a private file")
        if self.over_record_fraction:
            out.append(f"record_fraction={cfg.record_fraction:g} left out {self.over_record_fraction:,} records, each "
                       "by the keyed hash of its own text: ε holds for adding or removing a record of the file")
        return out


def keyed_draw(content: str, *, key: int, purpose: str) -> float:
    """A number in [0, 1) that depends on ``content``, the public ``key`` (``split_seed``) and ``purpose`` alone.

    The split decides each record by its own draw (:func:`make_splits`), so adding or removing one record of the
    file changes no other record's split. The key may be public: a record's split then depends on nothing but
    that record, which is all the add/remove-one guarantee on the file needs.

    Example:
        >>> keyed_draw("a record", key=0, purpose="split") == keyed_draw("a record", key=0, purpose="split")
        True
    """
    return keyed_draws([content], key=key, purpose=purpose)[0]


def keyed_draws(contents: Sequence[str], *, key: int, purpose: str) -> list[float]:
    """:func:`keyed_draw` of each of ``contents`` (the keyed hash state built once: half the cost per record, and a
    load draws for every record of the file)."""
    keyed = hashlib.blake2b(digest_size=8, key=f"dpllm:{purpose}:{int(key)}".encode()[:64])
    out = []
    for content in contents:
        h = keyed.copy()
        h.update(content.encode("utf-8"))
        out.append(int.from_bytes(h.digest(), "big") / 2.0 ** 64)
    return out


def _read_raw(cfg: DataConfig) -> tuple[list[str], Optional[list[str]], Optional[str]]:
    """The raw texts, users (or None) and SFT record shape (None: plain text) of ``cfg.dataset``.

    The shape is the table's schema (its columns, or the declared ``data_format``), one fact for the whole
    file: a text column whose values happen to be JSON stays plain text, whatever any record holds.
    """
    from dpllm import sft

    by_user = cfg.privacy_unit == "user"
    path = Path(cfg.dataset)
    jsonl = cfg.dataset not in BUILTIN and path.suffix.lower() == ".jsonl" and path.is_file()
    rows = _jsonl_rows(path) if jsonl else None  # parsed once, for both readers below (a bad line: said here)
    table = sft.read_table(cfg, rows=rows)  # chat / instruction records, Parquet, save_to_disk folders
    if table is not None:
        texts, users, shape = table
        return texts, users, (shape if shape != "text" else None)
    if cfg.dataset in BUILTIN:
        texts, users = _builtin_corpus(cfg.dataset, by_user)
        return list(texts), (list(users) if users is not None else None), None
    if path.is_file():
        return (*_file_records(path, cfg, rows=rows), None)
    if path.is_dir():
        raise DataError(f"dataset={cfg.dataset} is a directory; give a .jsonl/.json/.csv/.txt file")
    return (*_hub_records(cfg), None)


def _public_records(cfg: DataConfig, shape: Optional[str]) -> tuple[list[str], int]:
    """The declared public records (stripped, filtered, unique) and how many were read.

    Raises:
        DataError: the public data set's record shape is not the private one's ``shape``.
    """
    import dataclasses

    pcfg = dataclasses.replace(cfg, dataset=cfg.public_dataset, public_dataset=None, privacy_unit="record",
                               max_records=None)
    raw, _, public_shape = _read_raw(pcfg)
    if public_shape != shape:
        raise DataError(f"public_dataset={cfg.public_dataset} holds {public_shape or 'plain text'} records but "
                        f"dataset={cfg.dataset} holds {shape or 'plain text'} records; give both in one shape")
    texts = [t.strip() for t in raw]
    return list(dict.fromkeys(t for t in texts if len(t) >= cfg.min_chars)), len(raw)


def load_records_counted(cfg: DataConfig) -> Loaded:
    """:func:`load_records_and_users` with the counts of records read, too short and duplicated.

    Every record is kept or dropped by itself (its text, its user's name, the key ``split_seed``), never by
    its place in the file: a duplicate is one record whichever copy comes first (at user level, within one
    user: a text two users wrote is a record of each, so a user's records never depend on which other users
    exist), and ``max_records`` keeps the records whose keyed hash ranks first. The kept records stay in file
    order (``splits.json``'s ids index this list).

    Raises:
        DataError: as :func:`load_records_and_users`.
    """
    by_user = cfg.privacy_unit == "user"
    if cfg.label_column and (cfg.dataset in BUILTIN or Path(cfg.dataset).suffix.lower() == ".txt"):
        raise DataError(f"label_column={cfg.label_column!r} needs a .jsonl/.json/.csv file or a Hub dataset with that "
                        f"column; dataset={cfg.dataset} has none (unset label_column)")
    raw, raw_users, shape = _read_raw(cfg)
    public, public_read = _public_records(cfg, shape) if cfg.public_dataset else ([], 0)
    public_set = set(public)
    seen: set = set()  # record level: texts; user level: (user, text), so no user's copy decides another's
    records: list[str] = []
    users: list[str] = []
    too_short = duplicates = same_as_public = 0
    for i, text in enumerate(raw):
        text = text.strip()
        # exact duplicates would be both member and non-member: one record, whichever copy comes first
        key = (raw_users[i], text) if raw_users is not None else text
        if len(text) < cfg.min_chars:
            too_short += 1
        elif text in public_set:
            same_as_public += 1
        elif cfg.deduplicate and key in seen:
            duplicates += 1
        else:
            seen.add(key)
            records.append(text)
            if raw_users is not None:
                users.append(raw_users[i])
    if duplicates:  # a file's count also goes into the plan's warnings (Loaded.notes)
        log.info("dataset %s: %d of %d records read were exact duplicates and were removed", cfg.dataset, duplicates,
                 len(raw))
    fraction_out = 0
    if cfg.record_fraction is not None:  # each record by its own keyed draw: one record more moves no other
        draws = keyed_draws(records, key=cfg.split_seed, purpose="fraction")
        keep = [j for j, u in enumerate(draws) if u < cfg.record_fraction]
        fraction_out = len(records) - len(keep)
        records = [records[j] for j in keep]
        users = [users[j] for j in keep] if users else users
    over = 0
    if cfg.max_records is not None and len(records) > cfg.max_records:
        draws = keyed_draws(records, key=cfg.split_seed, purpose="cap")
        # ranked by draw, ties (53-bit floats: about one load in 10⁷ of 50,000 records) by text; the pairs only when
        # a tie exists (a sort of tuples costs ~10x one of floats: 0.1-0.3 s for the stdlib corpus's 53,000 records)
        key = draws.__getitem__ if len(set(draws)) == len(draws) else (lambda j: (draws[j], records[j]))
        keep = sorted(sorted(range(len(records)), key=key)[: cfg.max_records])
        over = len(records) - len(keep)
        records = [records[j] for j in keep]
        users = [users[j] for j in keep] if users else users
    if not records:
        raise DataError(
            f"dataset={cfg.dataset}: no records left ({len(raw)} read, min_chars={cfg.min_chars}); "
            "check the file and text_column, or lower min_chars"
        )
    flags = None
    if cfg.public_dataset:
        if not public:
            raise DataError(f"public_dataset={cfg.public_dataset}: no records left after min_chars={cfg.min_chars}; "
                            "check the file and text_column")
        flags = [False] * len(records) + [True] * len(public)
        records = records + public
        users = users + [""] * len(public) if by_user else users
    return Loaded(records=records, users=users if by_user else None, read=len(raw), too_short=too_short,
                  duplicates=duplicates, public=flags, over_max_records=over, public_read=public_read,
                  same_as_public=same_as_public, sft_format=shape, over_record_fraction=fraction_out)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Splits:
    public: list[int]
    train: list[int]
    heldout: list[int]
    users: Optional[dict] = None  # privacy_unit=user: {"train": [...], "heldout": [...], "public": [...]} user names
    rule: Optional[dict] = None  # how each record's split was decided (split_rule)

    def to_json(self, records: Sequence[str], cfg: DataConfig) -> dict:
        used = self.public + self.train + self.heldout
        extra = {"privacy_unit": cfg.privacy_unit, "users": self.users} if self.users is not None else {}
        if cfg.long_records == "split":  # each record trained as its first max_windows windows (dpllm.windows)
            extra.update(long_records="split", max_windows=cfg.max_windows,
                         **({"window_stride": cfg.window_stride} if cfg.window_stride else {}))
        return {**extra,
            "dataset": cfg.dataset,
            "text_column": cfg.text_column,
            "max_length": cfg.max_length,
            "num_records": len(records),
            "train_on": cfg.train_on,
            "split_rule": self.rule if self.rule is not None else split_rule(cfg),
            "public": self.public,
            "train": self.train,
            "heldout": self.heldout,
            "sha256": {str(i): sha256(records[i]) for i in used},
        }


def split_rule(cfg: DataConfig) -> dict:
    """What ``splits.json`` says about how its splits were drawn (``split_rule``)."""
    unit = "the user's id" if cfg.privacy_unit == "user" else "the record's text"
    if cfg.public_dataset:
        public = f"declared: every record of public_dataset={cfg.public_dataset} (and any private record equal to one)"
    elif cfg.public_fraction > 0:
        public = (f"SIMULATED (simulate_public_from_private): records of the private file with u < public_fraction="
                  f"{cfg.public_fraction:g}, trained on without DP")
    else:
        public = "none"
    return {"rule": "keyed hash, one record (or user) at a time",
            "draw": f"u = blake2b(key='dpllm:split:<split_seed>', {unit}) / 2^64, in [0, 1)",
            "split_seed": cfg.split_seed,
            "heldout": "u < public_fraction + heldout_fraction·(1 − public_fraction) (and not public); else train",
            "public": public,
            "deduplicate": cfg.deduplicate,
            "record_fraction": (None if cfg.record_fraction is None else
                                f"{cfg.record_fraction:g}: a record is kept iff blake2b(key='dpllm:fraction:"
                                "<split_seed>', text) / 2^64 < record_fraction"),
            "max_records": (None if cfg.max_records is None else
                            f"{cfg.max_records}: the records with the smallest blake2b(key='dpllm:cap:<split_seed>', "
                            "text)")}


def make_splits(records: Sequence[str], cfg: DataConfig, users: Optional[Sequence[str]] = None,
                public: Optional[Sequence[bool]] = None) -> Splits:
    """Public / train / held-out split of record ids, each record decided by itself.

    A record's draw u = :func:`keyed_draw` of its text (with ``users``: of its user's name, so every record of a
    user lands in the same split and a held-out record never belongs to a trained user) under the key
    ``split_seed``; a held-out user's record whose text a training user also wrote is left out of the held-out
    split (it is trained on; the training split never depends on it). Records marked in ``public`` (declared
    public, ``public_dataset``) form the public split;
    the rest are held out when u < ``public_fraction`` + ``heldout_fraction``·(1 − ``public_fraction``) and
    trained on otherwise, except that ``public_fraction`` > 0 (studies only, ``simulate_public_from_private``)
    sends u < ``public_fraction`` to the public split. Adding or removing one record of the file therefore
    changes every split by exactly that record (tests/test_split_neighbours.py).

    Raises:
        DataError: no record left to train on or to hold out.
    """
    if isinstance(records, int):
        raise TypeError("make_splits takes the records themselves (a record's split is a hash of its text)")
    pf, hf = cfg.public_fraction, cfg.heldout_fraction
    ids: dict[str, list[int]] = {"public": [], "train": [], "heldout": []}
    names: dict[str, set] = {"public": set(), "train": set(), "heldout": set()}
    draws = keyed_draws(users if users is not None else records, key=cfg.split_seed,
                        purpose="split-user" if users is not None else "split")
    for i, u in enumerate(draws):
        if public is not None and public[i]:
            ids["public"].append(i)
            continue
        role = "public" if u < pf else "heldout" if u < pf + hf * (1 - pf) else "train"
        ids[role].append(i)
        if users is not None:
            names[role].add(users[i])
    if users is not None:  # a text a training user also wrote is no non-member: neither held out nor audited
        trained = {records[i] for i in ids["train"]}
        ids["heldout"] = [i for i in ids["heldout"] if records[i] not in trained]
        names["heldout"] = {users[i] for i in ids["heldout"]}
    unit = "users" if users is not None else "records"
    n = len(names["train"] | names["heldout"]) if users is not None else len(ids["train"]) + len(ids["heldout"])
    if not ids["train"]:
        raise DataError(
            f"{n} private {unit} leave no private training record after public_fraction={pf} and heldout_fraction="
            f"{hf}; use more data")
    if not ids["heldout"]:
        raise DataError(f"{n} private {unit} leave no held-out record at heldout_fraction={hf} (each is held out "
                        f"with that probability, by a keyed hash of its {'user' if users is not None else 'text'}); "
                        "raise heldout_fraction or use more data")
    return Splits(public=ids["public"], train=ids["train"], heldout=ids["heldout"], rule=split_rule(cfg),
                  users={k: sorted(v) for k, v in names.items()} if users is not None else None)


def split_summary(loaded: Loaded, splits: Splits, cfg: DataConfig, *, canaries: Sequence[dict] = (),
                  sft_dropped: int = 0) -> str:
    """One console line saying where every record went: read, dropped (and why), train, held out, public,
    canaries. Private (counts of the user's data): printed on the operator's console, never released.

    Example:
        >>> cfg = DataConfig(heldout_fraction=0.5)
        >>> loaded = Loaded(records=["a", "b", "c"], users=None, read=5, too_short=1, duplicates=1)
        >>> splits = Splits(public=[], train=[0, 2], heldout=[1])
        >>> print(split_summary(loaded, splits, cfg))  # doctest: +NORMALIZE_WHITESPACE
        [private] data: 5 records read; dropped 1 too short (min_chars=32), 1 duplicate; 2 train, 1 held out
        (not trained on: eval and audits), 0 public (none declared); 0 canaries
    """
    dropped = [f"{loaded.too_short:,} too short (min_chars={cfg.min_chars})" if loaded.too_short else "",
               f"{loaded.duplicates:,} duplicate{'s' * (loaded.duplicates != 1)}" if loaded.duplicates else "",
               f"{loaded.same_as_public:,} equal to a public record" if loaded.same_as_public else "",
               f"{loaded.over_max_records:,} beyond max_records={cfg.max_records}" if loaded.over_max_records else "",
               f"{loaded.over_record_fraction:,} over record_fraction={cfg.record_fraction:g}"
               if loaded.over_record_fraction else "",
               f"{sft_dropped:,} whose answer max_length cuts off" if sft_dropped else ""]
    capped = len((splits.users or {}).get("dropped_records", ()))
    if capped:
        dropped.append(f"{capped:,} over max_records_per_user={cfg.max_records_per_user}")
    dropped = [x for x in dropped if x]
    read = f"{loaded.read:,} records read" + (f" (+{loaded.public_read:,} from public_dataset)"
                                              if loaded.public_read else "")
    if cfg.public_dataset:
        public = f"{len(splits.public):,} public (declared: public_dataset)"
    elif splits.public:
        public = f"{len(splits.public):,} public (SIMULATED from the private file: simulate_public_from_private)"
    else:
        public = "0 public (none declared)"
    users = ""
    if splits.users is not None:
        users = f" [users: {len(splits.users['train']):,} train, {len(splits.users['heldout']):,} held out]"
    trained = sum(bool(c.get("included")) for c in canaries)
    return (f"[private] data: {read}; " + (f"dropped {', '.join(dropped)}; " if dropped else "")
            + f"{len(splits.train):,} train, {len(splits.heldout):,} held out (not trained on: eval and audits), "
            f"{public}{users}; {len(canaries):,} canaries" + (f" ({trained:,} trained on)" if canaries else "")
            + ("; this stage trains on the public split, without DP" if cfg.train_on == "public" else ""))


def make_canaries(cfg: DataConfig) -> list[dict]:
    """``num_canaries`` canaries of ``canary_design`` (:mod:`dpllm.canaries`), each included with probability 1/2.

    The secrets are random, so they carry no private information and are stored in full.
    """
    from dpllm import canaries

    return canaries.make(cfg.num_canaries, design=cfg.canary_design, seed=cfg.canary_seed)


def check_resumed_split(path: Path, trained_hashes: set) -> None:
    """Refuse to resume a run whose ``splits.json`` lists other training records than the data and config give now.

    Raises:
        DataError: the dataset changed since the run started, or the run predates the per-record split rule.
    """
    if not Path(path).is_file():
        return
    recorded = json.loads(Path(path).read_text()).get("trained_sha256")
    if recorded is not None and set(recorded) != set(trained_hashes):
        rule = "" if "split_rule" in json.loads(Path(path).read_text()) else (
            " (the run predates dpllm's per-record split rule, which draws another split)")
        raise DataError(f"{path} lists other training records than the dataset and config give now{rule}: "
                        f"{len(set(recorded) ^ set(trained_hashes)):,} differ; resume with the original data, or start "
                        "a new run")


def load_split_texts(run_dir: str | Path, split: str) -> list[str]:
    """Texts of one split (``train``, ``heldout`` or ``public``) of a finished run, hash-checked.

    Raises:
        DataError: the run has no splits.json, or a record no longer matches its recorded hash.
    """
    from dpllm.config import load_config_file

    run_dir = Path(run_dir)
    path = run_dir / "splits.json"
    if not path.is_file():
        raise DataError(f"{run_dir} has no splits.json; is it a dpllm run directory?")
    splits = json.loads(path.read_text())
    if split not in ("train", "heldout", "public"):
        raise DataError(f"split={split!r}: choose train, heldout or public")
    cfg = load_config_file(run_dir / "config.yaml").data
    records = load_records(cfg)
    texts = []
    for i in splits[split]:
        if i >= len(records) or sha256(records[i]) != splits["sha256"][str(i)]:
            raise DataError(f"record {i} of {cfg.dataset} changed since the run; the audit needs the original data")
        texts.append(records[i])
    return texts


def _longest_token_chars(tokenizer) -> int:
    """The most characters one vocabulary entry spells (≥ the characters of text one token can cover)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def truncated_ids(texts: Sequence[str], tokenizer, max_length: int) -> tuple[list[list[int]], list[bool]]:
    """Each record's first ``max_length`` token ids, and whether the record has more tokens than that.

    Exactly ``tokenizer(text, truncation=True, max_length=max_length)``, without tokenizing all of a long record
    (a 5 MB record took a minute): a record longer than W = 2·(max_length + 16)·(longest token in characters)
    characters is tokenized in its first W and 2W characters; when both prefixes hold more than max_length + 16
    tokens and agree on the first max_length, those are the record's (the cut changes only tokens near it, far
    past max_length). Otherwise, the whole record is tokenized.
    """
    ids, full, _ = _cut(texts, tokenizer, max_length)
    return ids, [n > max_length for n in full]


def _ids(tokenizer, texts: Sequence[str], **kwargs) -> list[list[int]]:
    """``tokenizer(texts, **kwargs)["input_ids"]`` (the byte tokenizer's by arithmetic: :func:`.models.byte_ids`)."""
    from dpllm.models import byte_ids

    found = byte_ids(tokenizer, texts, **kwargs)
    return found if found is not None else tokenizer(list(texts), **kwargs)["input_ids"]


def _cut(texts: Sequence[str], tokenizer, max_length: int) -> tuple[list[list[int]], list[int], int]:
    """:func:`truncated_ids`' ids, each record's untruncated token count, and how many counts are estimates (a
    record past the shortcut's window is counted in pieces of W characters, never tokenized whole)."""
    margin = 16
    window = 2 * (max_length + margin) * max(1, _longest_token_chars(tokenizer))
    short = [i for i, t in enumerate(texts) if len(t) <= window]
    ids: list = [None] * len(texts)
    full = [0] * len(texts)
    estimated = 0
    if short:  # one pass; only the records over the limit are tokenized again, truncated (special tokens kept)
        for i, f in zip(short, _ids(tokenizer, [texts[i] for i in short], truncation=False)):
            ids[i], full[i] = f, len(f)
        long = [i for i in short if full[i] > max_length]
        if long:
            for i, c in zip(long, _ids(tokenizer, [texts[i] for i in long], truncation=True, max_length=max_length)):
                ids[i] = c
    for i, text in enumerate(texts):
        if ids[i] is not None:
            continue
        heads = _ids(tokenizer, [text[:w] for w in (window, 2 * window)], truncation=False)
        cuts = _ids(tokenizer, [text[:w] for w in (window, 2 * window)], truncation=True, max_length=max_length)
        if min(len(h) for h in heads) > max_length + margin and cuts[0] == cuts[1]:
            ids[i] = cuts[0]
            pieces = [text[j: j + window] for j in range(0, len(text), window)]
            specials = len(heads[0]) - len(_ids(tokenizer, [text[:window]], add_special_tokens=False)[0])
            full[i] = specials + sum(len(x) for x in _ids(tokenizer, pieces, add_special_tokens=False))
            estimated += 1
        else:  # few tokens for many characters (a normalizer drops them): no shortcut is safe
            ids[i] = _ids(tokenizer, [text], truncation=True, max_length=max_length)[0]
            full[i] = len(_ids(tokenizer, [text], truncation=False)[0])
    return ids, full, estimated


class TokenizedRecords(Dataset):
    """One tokenized record per item (a 1-D LongTensor of at most ``max_length`` ids)."""

    def __init__(self, texts: Sequence[str], tokenizer, max_length: int):
        if not texts:
            raise DataError("no records to tokenize")
        enc, full, estimated = _cut(texts, tokenizer, max_length)
        self.truncation = truncation.summarize(full, max_length=max_length, estimated=estimated)  # issue 49
        self.items = [torch.tensor(ids, dtype=torch.long) for ids in enc]
        short = sum(len(x) < 2 for x in self.items)
        if short:
            log.warning("%d records have < 2 tokens and add no loss", short)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.items)


def make_collate(pad_token_id: int):
    """Right-pad a list of records (token id tensors, or rows ``{"input_ids", "labels"}`` whose labels are kept);
    labels are -100 on padding so it never enters the loss."""

    def collate(batch: list) -> dict[str, torch.Tensor]:
        if not batch:  # Opacus builds the empty structure itself from the first batch
            return {}
        rows = [(x["input_ids"], x["labels"]) if isinstance(x, dict) else (x, x) for x in batch]
        T = max(len(x) for x, _ in rows)
        ids = torch.full((len(batch), T), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        labels = torch.full((len(batch), T), -100, dtype=torch.long)
        for i, (x, lab) in enumerate(rows):
            ids[i, : len(x)] = x
            mask[i, : len(x)] = 1
            labels[i, : len(x)] = lab
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def select(records: Sequence[str], ids: Sequence[int]) -> list[str]:
    return [records[i] for i in ids]
