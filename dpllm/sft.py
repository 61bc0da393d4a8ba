"""Supervised fine-tuning (SFT) data: instruction and chat records, rendered and masked for DP training.

The dataset shapes TRL's ``SFTTrainer`` users have, on the same private path as plain text:

    shape               columns                                   the answer (trained on by default)
    ``messages``        ``messages``: [{role, content}, ...]        every assistant turn
    ``prompt_completion`` ``prompt``, ``completion`` (strings, or     the completion (its assistant turns)
                        lists of messages: conversational)
    ``text``            ``text_column``                           everything (dpllm.data's plain path)

The map, in the order a run uses it:

    read_table          data.load_records_and_users → rows of a .jsonl/.json/.csv/.parquet file, a
                        ``datasets.save_to_disk`` folder, a Hub id or a built-in set (:data:`BUILTIN`) → one
                        canonical JSON string per record (splits, hashes and audits treat it as any text)
    format_of, parse    a record string → its dict; one shape per dataset
    prepare_tokenizer   the chat template: ``data.chat_template``, else the tokenizer's own, else (the tiny
                        byte tokenizer only) :data:`SIMPLE_TEMPLATE`; none at all is a one-line error
    segments            a record → [(text, is_answer)], rendered by the template (messages) or concatenated
    encode              segments → input_ids and labels: -100 on every prompt token (``loss_on: answer``),
                        or on none (``loss_on: all``); truncated to ``max_length`` on the right
    drop_cut_answers    before the privacy plan: a record whose answer ``max_length`` cuts off entirely is
                        reported and leaves the train and held-out splits (never trained on zero tokens)
    SFTRecords          the encoded records, batched by :class:`PadRecords`
    generate_answers    greedy answers to a few held-out prompts, printed and saved (``generations.jsonl``)

Why the privacy accounting does not change: the unit is still one record (one conversation, never split
across records and never packed with another), and its loss is still one number, the mean over its
labelled tokens (:func:`dpllm.privacy.engine.sequence_loss`, Opacus's ghost criterion and bk all divide by
the count of labels ≠ -100). Masking the prompt changes *which* function of the record is differentiated,
not how many records a step samples nor the clipped sensitivity C, so ε is the same function of
(N, q, steps, σ) as for plain text. The prompt still conditions the answer's loss, so its tokens shape the
gradient as context; a prompt token's own next-token prediction never enters it (tests/test_sft.py
checks that its gradient contribution is exactly zero, under ghost, bk and hooks).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.utils.data import Dataset

from dpllm.config import DataConfig, ModelConfig
from dpllm.errors import DataError

log = logging.getLogger(__name__)

FORMATS = ("messages", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")

# dpllm's built-in template: the tiny byte tokenizer has none, and tests need one that ships with the project.
# The end-of-text token closes each assistant turn, so a trained model learns where an answer stops (nothing
# follows it on the line: byte-level tokenizers strip whitespace after a special token).
SIMPLE_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
                   "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


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
                sig = str(inspect.signature(obj))
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


def read_table(cfg: DataConfig) -> Optional[tuple[list[str], Optional[list[str]]]]:
    """The records of an SFT dataset, or of any table dpllm.data cannot read itself (Parquet, a folder).

    Returns None for the plain-text datasets :mod:`dpllm.data` reads as before (its built-in corpora,
    .txt files, tables with only a text column).

    Raises:
        DataError: unreadable data, a missing column, a malformed record.
    """
    name, fmt = cfg.dataset, cfg.data_format
    if name in BUILTIN:
        return rows_to_records(BUILTIN[name](), cfg, name)[:2]
    path = Path(name)
    if name in ("pydoc", "pystdlib") or path.suffix.lower() == ".txt":
        if fmt in FORMATS:
            raise DataError(f"dataset={name} is plain text; data_format={fmt} needs a table with "
                            f"{'a messages column' if fmt == 'messages' else 'prompt and completion columns'}")
        return None
    if path.suffix.lower() == ".jsonl" and path.is_file():
        from dpllm.io import JsonlError, read_jsonl

        try:
            rows = read_jsonl(path)
        except JsonlError:
            return None  # dpllm.data reports the bad line
        if not rows or not all(isinstance(r, dict) for r in rows[:1]):
            return None
        texts, users, shape = rows_to_records(rows, cfg, name)
        return (texts, users) if shape != "text" else None
    if path.suffix.lower() == ".csv" and path.is_file():
        import csv

        # Python's csv keeps every cell as written (datasets would turn " 6" into the integer 6)
        with open(path, newline="", encoding="utf-8", errors="replace") as fh:
            rows = list(csv.DictReader(fh))
        if not rows or shape_of(list(rows[0]), cfg) == "text":
            return None
        return rows_to_records(rows, cfg, name)[:2]
    table = _load_dataset(cfg)
    if table is None:
        return None
    cols = table.column_names
    shape = shape_of(cols, cfg)
    if shape == "text" and (path.suffix.lower() == ".json" or not (path.is_dir() or path.suffix == ".parquet")):
        return None  # dpllm.data reads its own kinds of text tables (and words their errors)
    return rows_to_records(table.to_list() if hasattr(table, "to_list") else list(table), cfg, name)[:2]


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
    """``messages`` or ``prompt_completion`` when every record is a canonical SFT record, else None (text)."""
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


# ---- rendering and masks ------------------------------------------------------------------------------------

def is_byte_tokenizer(tokenizer) -> bool:
    from transformers import ByT5Tokenizer

    return isinstance(tokenizer, ByT5Tokenizer)


def prepare_tokenizer(tokenizer, chat_template: Optional[str], *, needed: bool) -> None:
    """Give ``tokenizer`` the chat template the run renders with (saved with the checkpoint).

    Args:
        chat_template: ``data.chat_template``: a Jinja template, a file holding one, or ``simple``
            (:data:`SIMPLE_TEMPLATE`); None keeps the tokenizer's own.
        needed: whether the records need a template (conversational records).

    Raises:
        DataError: a template is needed and neither the option nor the tokenizer supplies one.
    """
    if chat_template:
        if chat_template == "simple":
            template = SIMPLE_TEMPLATE
        elif "{{" in chat_template or "{%" in chat_template:
            template = chat_template
        elif Path(chat_template).is_file():
            template = Path(chat_template).read_text()
        else:
            raise DataError(f"chat_template={chat_template!r} is neither a Jinja template, a file, nor 'simple'")
        tokenizer.chat_template = template
    elif getattr(tokenizer, "chat_template", None):
        return
    elif is_byte_tokenizer(tokenizer):
        tokenizer.chat_template = SIMPLE_TEMPLATE
    elif needed:
        raise DataError(f"the tokenizer ({type(tokenizer).__name__}) has no chat template to render messages "
                        "with; set data.chat_template (a Jinja template, a .jinja file, or 'simple' for dpllm's "
                        "built-in one)")


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def segments(record: dict, tokenizer) -> list[tuple[str, bool]]:
    """The record's text as ``(piece, is_answer)`` pieces, in order.

    Conversations are rendered by the chat template; an answer turn is what the template adds between the
    conversation so far with the generation prompt and the conversation including that turn.

    Raises:
        DataError: a template that does not render a conversation as the concatenation of its turns.
    """
    if "messages" in record or isinstance(record.get("prompt"), list):
        msgs = record.get("messages") or record["prompt"] + record["completion"]
        first = 0 if "messages" in record else len(record["prompt"])
        full = _render(tokenizer, msgs, generation_prompt=False)
        out, at = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant" or i < first:
                continue
            before = _render(tokenizer, msgs[:i], generation_prompt=True) if i else ""
            upto = _render(tokenizer, msgs[: i + 1], generation_prompt=False)
            if not (full.startswith(upto) and upto.startswith(before) and len(before) >= at):
                raise DataError("the chat template does not render a conversation as the concatenation of its "
                                "turns (it rewrites earlier turns), so answer tokens cannot be told apart; give "
                                "data.chat_template another template")
            start, end = len(before), len(upto)
            out += [(full[at:start], False), (full[start:end], True)]
            at = end
        out.append((full[at:], False))
        return [(t, a) for t, a in out if t]
    eos = tokenizer.eos_token or ""
    return [(t, a) for t, a in ((record["prompt"], False), (record["completion"] + eos, True)) if t]


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


def encode(record: dict, tokenizer, *, max_length: int, loss_on: str = "answer") -> dict:
    """``{"input_ids", "labels", "answer_tokens"}`` of one record, truncated to ``max_length`` on the right.

    Each piece is tokenized on its own (no special tokens added; a plain prompt/completion gets the
    tokenizer's BOS in front when it adds one), so no token straddles the prompt/answer boundary.
    ``answer_tokens`` counts the answer tokens that are predicted (position ≥ 1) after truncation.
    """
    pieces = segments(record, tokenizer)
    ids: list[int] = []
    answer: list[bool] = []
    if "messages" not in record and not isinstance(record.get("prompt"), list) and _adds_bos(tokenizer):
        ids, answer = [tokenizer.bos_token_id], [False]
    for text, is_answer in pieces:
        t = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += t
        answer += [is_answer] * len(t)
    ids, answer = ids[:max_length], answer[:max_length]
    input_ids = torch.tensor(ids, dtype=torch.long)
    mask = torch.tensor(answer, dtype=torch.bool)
    labels = input_ids.clone() if loss_on == "all" else input_ids.masked_fill(~mask, -100)
    return {"input_ids": input_ids, "labels": labels, "answer_tokens": int(mask[1:].sum())}


def answer_fits(records: Sequence[str], tokenizer, *, max_length: int) -> list[bool]:
    """Whether each record keeps at least one predicted answer token within ``max_length``."""
    return [encode(parse(r), tokenizer, max_length=max_length)["answer_tokens"] > 0 for r in records]


def drop_cut_answers(records: Sequence[str], splits, tokenizer, *, max_length: int,
                     chat_template: Optional[str] = None) -> list[int]:
    """Remove records whose answer ``max_length`` cuts off entirely from ``splits.train`` and ``.heldout``.

    They are reported (a warning, and ``splits.json``'s ``sft.dropped_no_answer``) and are neither members
    nor held out: training on them would train on zero tokens, and they have no answer to evaluate.

    Returns:
        The dropped record ids.

    Raises:
        DataError: conversations and no chat template (see :func:`prepare_tokenizer`), or no record left.
    """
    prepare_tokenizer(tokenizer, chat_template, needed=needs_template(records, format_of(records)))
    ids = sorted(set(splits.train) | set(splits.heldout))
    fits = answer_fits([records[i] for i in ids], tokenizer, max_length=max_length)
    dropped = [i for i, ok in zip(ids, fits) if not ok]
    if dropped:
        gone = set(dropped)
        splits.train = [i for i in splits.train if i not in gone]
        splits.heldout = [i for i in splits.heldout if i not in gone]
        log.warning("sft: %d record(s) lose their whole answer to max_length=%d and are dropped before training "
                    "(e.g. record %d); raise max_length to keep them", len(dropped), max_length, dropped[0])
        if not splits.train:
            raise DataError(f"every training record loses its answer to max_length={max_length}; raise max_length")
    return dropped


class SFTRecords(Dataset):
    """Encoded SFT records: ``{"input_ids", "labels"}`` per item, as :class:`PadRecords` batches.

    Raises:
        DataError: a record with no answer token left (:func:`drop_cut_answers` should have removed it).
    """

    def __init__(self, records: Sequence[str], tokenizer, *, max_length: int, loss_on: str = "answer"):
        self.records = list(records)
        self.items = []
        for i, r in enumerate(self.records):
            enc = encode(parse(r), tokenizer, max_length=max_length, loss_on=loss_on)
            if enc["answer_tokens"] == 0:
                raise DataError(f"record {i} has no answer token within max_length={max_length}; raise max_length")
            self.items.append({"input_ids": enc["input_ids"], "labels": enc["labels"]})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    @property
    def num_tokens(self) -> int:
        return sum(len(x["input_ids"]) for x in self.items)


@dataclass
class PadRecords:
    """Right-pad records into a batch; labels are -100 on padding, as :func:`dpllm.data.make_collate`."""

    pad_token_id: int

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if not rows:
            return {}
        T = max(1, max(len(r["input_ids"]) for r in rows))
        ids = torch.full((len(rows), T), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], mask[i, :n], labels[i, :n] = r["input_ids"], 1, r["labels"]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def make_datasets(train_texts, eval_texts, tokenizer, cfg: DataConfig):
    """``(train_ds, eval_ds, collate)`` of a run: training labels as ``loss_on`` says; held-out ones
    always answer-only (the held-out metric is the answer's loss)."""
    fmt = format_of(list(train_texts) + list(eval_texts))
    prepare_tokenizer(tokenizer, cfg.chat_template, needed=needs_template(train_texts, fmt))
    train = SFTRecords(train_texts, tokenizer, max_length=cfg.max_length, loss_on=cfg.loss_on)
    heldout = SFTRecords(eval_texts, tokenizer, max_length=cfg.max_length, loss_on="answer") if eval_texts else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return train, heldout, PadRecords(pad if pad is not None else 0)


def needs_template(records, fmt) -> bool:
    return fmt == "messages" or (fmt == "prompt_completion" and bool(records) and
                                 isinstance(parse(records[0])["prompt"], list))


def load_tokenizer(model_cfg: ModelConfig):
    """The tokenizer a run will use, without loading the model (to find cut-off answers before the plan)."""
    from dpllm.models import TINY_MODELS, byte_tokenizer, source_of

    if model_cfg.model_name_or_path in TINY_MODELS:
        tok = byte_tokenizer()
    else:
        from transformers import AutoTokenizer

        src = source_of(model_cfg)
        tok = AutoTokenizer.from_pretrained(src.get("path", model_cfg.model_name_or_path),
                                            trust_remote_code=model_cfg.trust_remote_code)
    return tok


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


# ---- held-out generations -----------------------------------------------------------------------------------

def prompt_and_reference(record: dict, tokenizer) -> tuple[str, str]:
    """The prompt text a deployed model would see (up to its last answer) and that answer."""
    if "messages" in record or isinstance(record.get("prompt"), list):
        msgs = record.get("messages") or record["prompt"] + record["completion"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        return _render(tokenizer, msgs[:last], generation_prompt=True), msgs[last]["content"]
    return record["prompt"], record["completion"]


@torch.no_grad()
def generate_answers(model, tokenizer, records: Sequence[str], *, max_new_tokens: int = 64) -> list[dict]:
    """Greedy answers to the prompts of ``records``: ``[{"prompt", "reference", "generated"}]``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for r in records:
        rec = parse(r)
        prompt, reference = prompt_and_reference(rec, tokenizer)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if "messages" not in rec and not isinstance(rec.get("prompt"), list) and _adds_bos(tokenizer):
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
        ids = ids.to(device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        out.append({"prompt": prompt, "reference": reference,
                    "generated": tokenizer.decode(new[0, ids.shape[1]:], skip_special_tokens=True)})
    model.train(was_training)
    return out
