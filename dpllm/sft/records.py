"""SFT records: their shapes, how a dataset's shape is detected, and one canonical JSON string per record.

    shape_of, read_table    a table's columns → its shape (``data_format: auto`` detects it); the rows of a
                            file, ``save_to_disk`` folder, Hub id or built-in set (:data:`BUILTIN`) → records
    canonical, parse        a row ↔ the canonical JSON string splits, hashes and audits treat as any text
    format_of               a guess of the shape from record strings (audits of bare texts; never training)
    canary_record           a canary as a record of the run's shape (the secret is the answer)
    needs_template          whether rendering needs a chat template (conversational records)
    SFTArguments            how DPTrainer reads an untokenized dataset (:func:`is_untokenized_sft`)
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from dpllm.config import DataConfig
from dpllm.errors import DataError

FORMATS = ("messages", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")


# ---- the built-in instruction set ---------------------------------------------------------------------------

# Pure-Python standard-library modules present on every platform: their functions' signatures and
# docstrings ship with CPython, so the set is the same wherever this Python version runs.
STDLIB_QA_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "codecs", "colorsys", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "heapq", "hmac", "html", "http.client",
    "http.cookies", "imaplib", "inspect", "ipaddress", "json", "keyword", "linecache", "logging", "mailbox",
    "mimetypes", "netrc", "numbers", "operator", "optparse", "pathlib", "pickle", "pkgutil", "platform", "plistlib",
    "poplib", "pprint", "queue", "quopri", "random", "reprlib", "runpy", "sched", "secrets", "selectors", "shlex",
    "shutil", "smtplib", "socket", "socketserver", "statistics", "string", "subprocess", "tabnanny", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "webbrowser", "zipapp", "zipfile",
    "xml.dom.minidom", "xml.etree.ElementTree",
)


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _stable(value) -> bool:
    """A default whose repr is the same in every process: a literal, a type, or a tuple of those."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, type)):
        return True
    return isinstance(value, tuple) and all(_stable(v) for v in value)


def _signature(sig) -> str:
    """The signature's text with every other default shown as ``...``.

    An object's repr can name its address (``<object object at 0x7f...>``) or its current state
    (``logging.shutdown``'s list of live handlers), which change from process to process: the record's text,
    and so its keyed hash, its split and ``max_records``'s choice, would change with them.
    """
    import inspect

    params = [p if p.default is inspect.Parameter.empty or _stable(p.default) else p.replace(default=_Elided())
              for p in sig.parameters.values()]
    return str(sig.replace(parameters=params))


def stdlib_qa_rows() -> list[dict]:
    """``stdlib_qa``: see :func:`_stdlib_qa_rows` (built once per process: it imports ~90 modules)."""
    return [json.loads(r) for r in _stdlib_qa_cached()]


@functools.lru_cache(maxsize=1)
def _stdlib_qa_cached() -> tuple[str, ...]:
    return tuple(json.dumps(r) for r in _stdlib_qa_rows())


def _stdlib_qa_rows() -> list[dict]:
    """``stdlib_qa``: "What does ``module.name(signature)`` do?" → the first paragraph of its docstring.

    One chat record per public function or class of :data:`STDLIB_QA_MODULES` with a signature and a
    docstring whose first paragraph has 24 to 400 characters; ``user`` is the module (privacy_unit=user).
    The same Python builds the same records in every process (see :func:`_signature`; torch, which this
    package imports first, replaces ``inspect.getfile`` with its own function, so that name is never a record).
    """
    import importlib
    import inspect

    rows = []
    for mod_name in STDLIB_QA_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # a module a minimal build leaves out (e.g. no _ssl): skip it
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != mod_name:
                continue
            doc = inspect.getdoc(obj)
            try:
                sig = _signature(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            answer = " ".join(re.split(r"\n\s*\n", doc)[0].split()) if doc else ""
            if 24 <= len(answer) <= 400:
                rows.append({"messages": [{"role": "user", "content": f"What does {mod_name}.{name}{sig} do?"},
                                          {"role": "assistant", "content": answer}], "user": mod_name})
    return rows


BUILTIN = {"stdlib_qa": stdlib_qa_rows}


# ---- reading ------------------------------------------------------------------------------------------------

def shape_of(columns: Sequence[str], cfg: DataConfig) -> str:
    """The record shape of a table with these columns: ``data_format``, or detected when it is ``auto``.

    Raises:
        DataError: the configured shape's columns are missing, or ``auto`` finds two shapes.
    """
    cols = set(columns)
    found = [f for f, need in (("messages", {"messages"}), ("prompt_completion", {"prompt", "completion"}))
             if need <= cols]
    fmt = cfg.data_format
    if fmt == "auto":
        if len(found) > 1 or (found and cfg.text_column in cols and cfg.text_column not in ("prompt", "completion")):
            shapes = found + ([cfg.text_column] if cfg.text_column in cols else [])
            raise DataError(f"dataset={cfg.dataset} has columns for several record shapes ({', '.join(shapes)}); "
                            "set data_format to messages, prompt_completion or text")
        return found[0] if found else "text"
    need = {"messages": ["messages"], "prompt_completion": ["prompt", "completion"], "text": [cfg.text_column]}[fmt]
    if not set(need) <= cols:
        raise DataError(f"dataset={cfg.dataset}: data_format={fmt} needs the column(s) {need}; its columns are "
                        f"{sorted(cols)}: rename them, or set data_format (auto detects messages / "
                        "prompt+completion / text)")
    return fmt


def canonical(row: dict, fmt: str, *, where: str) -> str:
    """One record as a canonical JSON string (what splits.json hashes), validated.

    Raises:
        DataError: a malformed message list, or a conversation without an answer.
    """
    need = ("messages",) if fmt == "messages" else ("prompt", "completion")
    missing = [k for k in need if k not in row]
    if missing:  # auto detection reads the first record's fields; one file holds one record shape
        fields = ", ".join(sorted(row)) or "none"
        raise DataError(
            f"{where} has no {' / '.join(repr(k) for k in missing)} field (its fields: {fields}) but the data set's "
            f"records are {fmt.replace('_', '/')} records: one file holds one record shape; convert every record "
            "to one shape (messages, or prompt and completion), or split the file")
    if fmt == "messages":
        rec = {"messages": _messages(row["messages"], where)}
        if not any(m["role"] == "assistant" for m in rec["messages"]):
            raise DataError(f"{where} has no assistant turn: nothing to train on; drop it or add the answer")
    else:
        p, c = row["prompt"], row["completion"]
        if isinstance(p, list) != isinstance(c, list):
            raise DataError(f"{where}: prompt and completion must both be strings or both message lists")
        rec = ({"prompt": _messages(p, where), "completion": _messages(c, where)} if isinstance(p, list) else
               {"prompt": "" if p is None else str(p), "completion": "" if c is None else str(c)})
        if isinstance(c, list) and not any(m["role"] == "assistant" for m in rec["completion"]):
            raise DataError(f"{where}: the completion has no assistant turn")
    return json.dumps(rec, ensure_ascii=False, sort_keys=True)


def _messages(value, where: str) -> list[dict]:
    if isinstance(value, str):  # CSV cells hold JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where}: messages is a string that is not JSON; give a list of "
                            "{role, content}") from None
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}, "
                        f"got {type(value).__name__}")
    out = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: each message needs a role in {ROLES} and a string content, got {m!r:.80}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def rows_to_records(rows, cfg: DataConfig, source: str) -> tuple[list[str], Optional[list[str]], str]:
    """Records (canonical strings; plain text for ``text``), users (privacy_unit=user) and the shape."""
    rows = list(rows)
    fmt = shape_of(list(rows[0]) if rows else [], cfg)
    texts = ([canonical(r, fmt, where=f"dataset {source} record {i}") for i, r in enumerate(rows, 1)]
             if fmt != "text" else [str(r[cfg.text_column]) if r.get(cfg.text_column) is not None else ""
                                    for r in rows])
    users = None
    if cfg.privacy_unit == "user":
        missing = next((i for i, r in enumerate(rows, 1) if r.get(cfg.user_column) is None), None)
        if missing is not None:
            raise DataError(f"dataset {source} has no user column {cfg.user_column!r} in record {missing}: set "
                            "user_column, or use privacy_unit=record")
        users = [str(r[cfg.user_column]) for r in rows]
    return texts, users, fmt


def read_table(cfg: DataConfig,
               rows: Optional[list[dict]] = None) -> Optional[tuple[list[str], Optional[list[str]], str]]:
    """The records of an SFT dataset, or of any table dpllm.data cannot read itself (Parquet, a folder).

    Returns ``(records, users, shape)``, the shape decided by the table's columns (or the declared
    ``data_format``, :func:`shape_of`), never by what the records hold; None for the plain-text datasets
    :mod:`dpllm.data` reads as before (its built-in corpora, .txt files, tables with only a text column).
    ``rows``: a .jsonl dataset's rows, when the caller has parsed the file already.

    Raises:
        DataError: unreadable data, a missing column, a malformed record.
    """
    name, fmt = cfg.dataset, cfg.data_format
    if name in BUILTIN:
        return rows_to_records(BUILTIN[name](), cfg, name)
    path = Path(name)
    if name in ("pydoc", "pystdlib") or path.suffix.lower() == ".txt":
        if fmt in FORMATS:
            raise DataError(f"dataset={name} is plain text; data_format={fmt} needs a table with "
                            f"{'a messages column' if fmt == 'messages' else 'prompt and completion columns'}")
        return None
    if path.suffix.lower() == ".jsonl" and path.is_file():
        from dpllm.io import JsonlError, read_jsonl

        try:
            rows = read_jsonl(path) if rows is None else rows
        except JsonlError:
            return None  # dpllm.data reports the bad line
        if not rows or not all(isinstance(r, dict) for r in rows[:1]):
            return None
        texts, users, shape = rows_to_records(rows, cfg, name)
        return (texts, users, shape) if shape != "text" else None
    if path.suffix.lower() == ".csv" and path.is_file():
        import csv

        # Python's csv keeps every cell as written (datasets would turn " 6" into the integer 6)
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            rows = list(csv.DictReader(fh))
        if not rows or shape_of(list(rows[0]), cfg) == "text":
            return None
        return rows_to_records(rows, cfg, name)
    table = _load_dataset(cfg)
    if table is None:
        return None
    cols = table.column_names
    shape = shape_of(cols, cfg)
    if shape == "text" and (path.suffix.lower() == ".json" or not (path.is_dir() or path.suffix == ".parquet")):
        return None  # dpllm.data reads its own kinds of text tables (and words their errors)
    return rows_to_records(table.to_list() if hasattr(table, "to_list") else list(table), cfg, name)


def _load_dataset(cfg: DataConfig):
    import datasets

    name, path = cfg.dataset, Path(cfg.dataset)
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as err:
            raise DataError(f"dataset={name} is a folder but not a datasets.save_to_disk one "
                            f"({str(err).strip().splitlines()[-1][:160]}); give a .jsonl/.json/.csv/.parquet "
                            "file or a saved dataset") from None
        if isinstance(ds, datasets.DatasetDict):
            if cfg.dataset_split not in ds:
                raise DataError(f"dataset={name} has splits {list(ds)}; set dataset_split to one of them")
            ds = ds[cfg.dataset_split]
        return ds
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".json"):
        if not path.is_file():
            return None
        try:
            return datasets.load_dataset(suffix[1:], data_files=str(path), split="train")
        except Exception as err:
            if suffix == ".parquet":
                raise DataError(f"dataset={name} could not be parsed as parquet: "
                                f"{str(err).strip().splitlines()[-1][:300]}") from None
            return None  # dpllm.data words the error for its own kinds
    from dpllm.io import path_like

    if path_like(name) or cfg.data_format == "text":  # a path is never a Hub id (no network for a typo)
        return None
    try:
        return datasets.load_dataset(name, cfg.dataset_config_name, split=cfg.dataset_split)
    except Exception:
        return None  # dpllm.data tries again and words the error


def parse(record: str) -> dict:
    return json.loads(record)


def format_of(records: Sequence[str]) -> Optional[str]:
    """``messages`` or ``prompt_completion`` when every record is a canonical SFT record, else None (text).

    A guess from the records' contents, for readers that have nothing else (an audit of texts alone): one
    record changes it for all. A run's shape is the data set's schema (:func:`read_table`, ``data_format``),
    carried in :class:`dpllm.data.Loaded` and ``splits.json``; training never calls this (issue 46)."""
    def shape(r: str) -> Optional[str]:
        if not r.startswith('{"'):
            return None
        try:
            keys = set(json.loads(r))
        except json.JSONDecodeError:
            return None
        return {frozenset({"messages"}): "messages",
                frozenset({"prompt", "completion"}): "prompt_completion"}.get(frozenset(keys))
    shapes = {shape(r) for r in records}
    return shapes.pop() if len(shapes) == 1 else None


def canary_record(canary: dict, fmt: str) -> str:
    """A canary planted as an answer: its public prefix is the prompt, its secret the answer."""
    prefix, secret = canary.get("prefix", ""), canary["text"][len(canary.get("prefix", "")):]
    if fmt == "messages":
        row = {"messages": [{"role": "user", "content": prefix}, {"role": "assistant", "content": secret}]}
    else:
        row = {"prompt": prefix, "completion": secret}
    return canonical(row, fmt, where="canary")


def needs_template(records, fmt) -> bool:
    return fmt == "messages" or (fmt == "prompt_completion" and bool(records) and
                                 isinstance(parse(records[0])["prompt"], list))


# ---- DPTrainer: untokenized datasets ------------------------------------------------------------------------

@dataclass
class SFTArguments:
    """How ``DPTrainer`` turns an untokenized ``messages`` / ``prompt``+``completion`` dataset into records
    (TRL's ``SFTConfig`` names in brackets): ``DPTrainer(..., sft_args=SFTArguments(max_length=512))``."""

    max_length: int = field(default=1024, metadata={"help": "Tokens per record, truncated on the right "
                                                             "[max_length]; a record left without answer is dropped."})
    loss_on: str = field(default="answer", metadata={"help": "'answer' (assistant turns / the completion) "
                                                              "[completion_only_loss, assistant_only_loss] or 'all'."})
    chat_template: Optional[str] = field(default=None, metadata={"help": "Jinja template, a file, or 'simple' "
                                                                          "[chat_template_path]."})
    num_generations: int = field(default=4, metadata={"help": "Greedy answers to this many held-out prompts, saved "
                                                               "to output_dir/generations.jsonl."})


def is_untokenized_sft(dataset) -> bool:
    """A dataset whose rows are chat / instruction records rather than token ids."""
    if dataset is None or not len(dataset):
        return False
    row = dataset[0]
    return (isinstance(row, dict) and "input_ids" not in row
            and ("messages" in row or {"prompt", "completion"} <= set(row)))
