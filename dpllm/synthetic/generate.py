"""Sample a synthetic data set from a run's checkpoint: batched, seeded, resumable, with its data card.

Record ``i`` is conditioned on ``labels[i % L]`` (the control code ``[label] `` the model was trained
with, ``data.label_column``), on ``prompts[i % P]``, or on nothing (the tokenizer's BOS token, else its
EOS token as a start-of-text marker). Batch ``b`` holds samples ``b·B … b·B + B - 1`` (always a full
batch) and draws from its own generator seeded by ``(seed, b)``. A sample that is not valid text (or empty), or not a
record of the run's shape (:mod:`dpllm.synthetic.records`: chat runs give ``messages``, prompt/completion
runs ``prompt``/``completion``), is dropped and the next ids replace it, until the file holds ``num`` records
(at most :func:`_max_draws` samples). Each line keeps its sample's id, so an interrupted run continued later,
or a file extended to a larger ``num``, holds exactly the lines one uninterrupted run would have written: a
rerun reads the file, keeps its complete lines, and samples on from the id after the last one. The settings
must be the same (the card records them), and so must the model: ``synth.source.json`` (private: it names
the run directory) records the run and its final checkpoint's sha256 (the ledger's ``checkpoint_sha256``),
and a rerun from any other run or checkpoint is refused, so one card never covers samples of two models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

from dpllm.io import write_json_atomic, write_text_atomic
from dpllm.synthetic.card import card_markdown, card_paths, file_sha256, make_card
from dpllm.synthetic.records import (
    ChatMarkers,
    Utf8Only,
    banned_token_ids,
    byte_values,
    chat_markers,
    clean,
    run_shape,
    split_turn,
)


class SynthesisError(ValueError):
    """Settings or a run that cannot be sampled from as asked; the message says what to change."""


def run_labels(run_dir: Path) -> Optional[list[str]]:
    """The classes a labelled run declared public (``data.label_values``), sorted; None for an unlabelled run.

    Read from the config, never from the data: the set of labels found in the records would depend on them.
    """
    from dpllm.config import load_config_file
    from dpllm.data import declared_labels

    cfg = load_config_file(run_dir / "config.yaml").data
    if not cfg.label_column:
        return None
    return sorted(declared_labels(cfg))


def _existing(out: Path) -> tuple[int, int]:
    """``(records, next id)`` already in ``out``; a last line cut by a crash is removed.

    Ids are consecutive but for samples dropped as not valid text, so the next id is the last one's + 1.
    """
    if not out.exists():
        return 0, 0
    data = out.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(out, "r+b") as fh:
            fh.truncate(len(keep))
    lines = keep.count(b"\n")
    if not lines:
        return 0, 0
    last = keep[keep.rfind(b"\n", 0, len(keep) - 1) + 1:]
    try:
        return lines, int(json.loads(last)["id"]) + 1
    except (ValueError, KeyError, TypeError):
        raise SynthesisError(f"--out {out}: its last line is not a dpllm synthesize record; pick a new --out") from None


def _start_ids(tok) -> list[int]:
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    if start is None:
        raise SynthesisError("the tokenizer has neither a BOS nor an EOS token to start unconditional samples; "
                             "give --prompt or --prompts-file")
    return [start]


def _batch_seed(seed: int, batch: int, *phase: int) -> int:
    import numpy as np

    return int(np.random.SeedSequence([seed, batch, *phase]).generate_state(1)[0])


def synthesize(run_dir: str | Path, *, num: int, out: str | Path, temperature: float = 1.0, top_p: float = 1.0,
               max_new_tokens: int = 128, batch_size: int = 32, seed: int = 0,
               prompts: Optional[Sequence[str]] = None, labels: Optional[Sequence[str]] = None,
               allow_non_private: bool = False, allow_unreleasable: bool = False, progress: bool = True,
               license: Optional[str] = None) -> dict:
    """Write ``num`` synthetic records of ``run_dir``'s model to ``out`` (JSONL) and its card beside it.

    Args:
        run_dir: a finished dpllm run directory.
        num: records wanted in ``out`` (already present ones are kept: resume).
        out: the JSONL file; ``*.card.json`` and ``*.card.md`` are written beside it.
        temperature, top_p, max_new_tokens: sampling controls (``model.generate``).
        batch_size: records sampled together.
        seed: seeds the sampling only (it reads nothing private).
        prompts: public prompts, used in turn; exclusive with ``labels``.
        labels: classes to condition on in turn; default: every label of a run trained with
            ``data.label_column`` (unconditional otherwise).
        allow_non_private: accept a run trained without DP (the card says there is no guarantee).
        allow_unreleasable: accept a run that ``dpllm export`` refuses (seeded noise, a ledger that does not
            verify, no DP without ``allow_non_private``); the card marks the file NOT RELEASABLE with the reason.
        progress: show a tqdm bar.
        license: the data card's license (a Hub license id); none when not given.

    Returns:
        The card (as written to ``*.card.json``).

    Raises:
        SynthesisError: bad settings, a refused run, or an ``out`` written with other settings.
    """
    from dpllm.export import ExportError, check_releasable
    from dpllm.privacy.report import PrivacyReport, ReportError

    run_dir, out = Path(run_dir), Path(out)
    refusal = None
    try:
        report = check_releasable(run_dir, allow_non_private=allow_non_private, what="synthesize from")
    except ExportError as err:
        try:
            report = PrivacyReport.read(run_dir)
        except ReportError:
            report = None
        if report is None or not (run_dir / "checkpoint").is_dir():
            raise SynthesisError(str(err)) from None
        if not allow_unreleasable:
            raise SynthesisError(f"{err}; or pass --allow-unreleasable to sample anyway (the card will say the file "
                                 "is not releasable)") from None
        refusal = str(err).split(": ", 1)[-1]
    if num < 1 or batch_size < 1 or max_new_tokens < 1:
        raise SynthesisError(f"num={num}, batch_size={batch_size}, max_new_tokens={max_new_tokens}: each must be ≥ 1")
    if not temperature > 0 or not 0 < top_p <= 1:
        raise SynthesisError(f"temperature={temperature} must be > 0 and top_p={top_p} in (0, 1]")
    if prompts and labels:
        raise SynthesisError("give prompts or labels, not both")
    shape = run_shape(run_dir)
    trained_labels = run_labels(run_dir)
    if labels and shape != "text":
        raise SynthesisError(f"labels={list(labels)[:3]}: {run_dir} trained on {shape} records, which carry no control "
                             "codes; sample unconditionally or with prompts")
    if labels and trained_labels is None:
        raise SynthesisError(f"labels={list(labels)[:3]}: {run_dir} was trained without data.label_column, so its "
                             "model knows no control codes; sample unconditionally or with prompts")
    if labels:
        unknown = sorted(set(labels) - set(trained_labels))
        if unknown:
            raise SynthesisError(f"labels {unknown} were not in the training data's label set {trained_labels}")
    elif not prompts and trained_labels and shape == "text":
        labels = trained_labels
    settings = {"shape": shape, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                "batch_size": batch_size, "seed": seed, "conditioning": "labels" if labels else
                "prompts" if prompts else "unconditional", "labels": list(labels or []), "prompts": list(prompts or [])}
    card_json, card_md = card_paths(out)
    source = run_identity(run_dir, verified=refusal is None)
    done, next_id = _check_resume(out, card_json, settings, source)

    def write_card(complete: bool) -> dict:
        n, drawn = _existing(out)
        card = make_card(report=report, refusal=refusal, settings=settings,
                         file=out.name, num_records=n, complete=complete,
                         sha256=file_sha256(out) if out.exists() else None, drawn=drawn, license=license)
        write_json_atomic(card_json, card)
        write_text_atomic(card_md, card_markdown(card))
        return card

    if not done:  # which model the samples come from, on disk before the first one
        write_json_atomic(source_path(out), source)
    write_card(done >= num)  # the settings are on disk before the first sample
    if done < num:
        _sample(run_dir, out, start=next_id, have=done, num=num, settings=settings, progress=progress)
    card = write_card(_existing(out)[0] >= num)
    markers_needed = shape == "messages" and not prompts
    if not card["complete"]:
        raise SynthesisError(f"only {card['num_records']} of {num} samples were valid text after drawing "
                             f"{_max_draws(num, batch_size)} (the rest held NUL or control characters or bytes "
                             f"that are not UTF-8, or were empty): the model does not write clean text "
                             "yet; train it longer, or lower --temperature / --top-p"
                             + (", or give public prompts (--prompt) for the user turns" if markers_needed else ""))
    return card


def _max_draws(num: int, batch_size: int) -> int:
    """How many samples are drawn at most for ``num`` records (dropped ones are replaced, up to 3 in 4 of them)."""
    return max(4 * num, num + 4 * batch_size)


def source_path(out: str | Path) -> Path:
    """``synth.source.json`` beside the synthetic file ``out``: the run and checkpoint it was sampled from (private)."""
    out = Path(out)
    stem = out.name[: -len(out.suffix)] if out.suffix else out.name
    return out.with_name(f"{stem}.source.json")


def run_identity(run_dir: Path, *, verified: bool) -> dict:
    """Which model samples come from: the run directory (resolved) and its final checkpoint's sha256.

    ``verified``: the run passed the release checks, so its ledger verified and the final line's
    ``checkpoint_sha256`` is the digest of ``checkpoint/`` as it is on disk (no second pass over the weights);
    otherwise the digest is computed here (:func:`dpllm.ledger.dir_sha256`).
    """
    from dpllm import ledger

    digest = None
    if verified:
        entries = ledger.read(run_dir)
        digest = entries[-1].get("checkpoint_sha256") if entries else None
    return {"schema": "dpllm.synthetic.source/1", "run_dir": str(run_dir.resolve()),
            "checkpoint_sha256": digest or ledger.dir_sha256(run_dir / "checkpoint")}


def _check_resume(out: Path, card_json: Path, settings: dict, source: dict) -> tuple[int, int]:
    done, next_id = _existing(out)
    if not done:
        return 0, 0
    if not card_json.is_file():
        raise SynthesisError(f"--out {out} exists with {done} lines but has no {card_json.name} beside it: not a "
                             "dpllm synthesize file; pick a new --out")
    src = source_path(out)
    try:
        old_source = json.loads(src.read_text())
    except (OSError, ValueError):
        raise SynthesisError(f"--out {out} holds {done} records but no readable {src.name} saying which run and "
                             "checkpoint they were sampled from, so they cannot be continued under one card; pick a "
                             "new --out") from None
    differs = [f"{what} {old_source.get(key)!s:.{width}} vs {source[key]!s:.{width}}"
               for key, what, width in (("run_dir", "run", 400), ("checkpoint_sha256", "checkpoint sha256", 12))
               if old_source.get(key) != source[key]]
    if differs:
        raise SynthesisError(f"--out {out} holds {done} records sampled from another model ({'; '.join(differs)}); "
                             "resuming would release them under this run's card: pick a new --out")
    old = json.loads(card_json.read_text()).get("generation", {})
    diff = sorted(k for k in settings if old.get(k) != settings[k])
    if diff:
        raise SynthesisError(f"--out {out} was written with other settings "
                             f"({', '.join(f'{k}={old.get(k)!r}' for k in diff)}"
                             f"); resuming needs the same ones, or pick a new --out")
    return done, next_id


def _sample(run_dir: Path, out: Path, *, start: int, have: int, num: int, settings: dict, progress: bool) -> None:
    """Append records to ``out`` from id ``start`` on (``have`` already there) until it holds ``num``."""
    import torch
    from tqdm.auto import tqdm

    from dpllm.checkpoint import load_model
    from dpllm.data import control_code
    from dpllm.models import context_length
    from dpllm.sft import adds_bos, render_chat

    model, tok = load_model(run_dir, merge=True)
    labels, prompts, shape = settings["labels"], settings["prompts"], settings["shape"]
    B, mnt = settings["batch_size"], settings["max_new_tokens"]
    markers: Optional[ChatMarkers] = None
    if shape == "messages":
        try:
            markers = chat_markers(tok)
        except Exception as err:  # a template that needs other turns, or none at all
            raise SynthesisError(f"{run_dir} trained on chat records but its tokenizer's chat template cannot render "
                                 f"one user turn and its answer ({str(err).splitlines()[0][:160]})") from None

    def condition(i: int) -> tuple[list[int], dict]:
        if labels:
            lab = labels[i % len(labels)]
            return tok(control_code(lab), add_special_tokens=False)["input_ids"], {"label": lab}
        if shape == "messages":  # the user turn: a public prompt, or sampled first (see the loop)
            if prompts:
                return chat_prompt(prompts[i % len(prompts)]), {"prompt": prompts[i % len(prompts)]}
            return user_header, {}
        if prompts:
            p = prompts[i % len(prompts)]
            ids = tok(p, add_special_tokens=False)["input_ids"]
            if shape == "prompt_completion" and adds_bos(tok):  # as dpllm.sft.encode trained it
                ids = [tok.bos_token_id] + ids
            return ids or _start_ids(tok), {"prompt": p}
        return _start_ids(tok), {}

    def chat_prompt(user: str) -> list[int]:
        text = render_chat(tok, [{"role": "user", "content": user}], generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    def cut(row: list[int]) -> list[int]:
        return row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row

    user_header = []
    if markers is not None:
        user_header = tok(markers.user_prefix, add_special_tokens=False)["input_ids"] or _start_ids(tok)

    def record(i: int, extra: dict, row: list[int]) -> Optional[dict]:
        row = cut(row)
        if shape == "messages":
            user = extra.get("prompt") or extra.get("user")
            answer = tok.decode(row, skip_special_tokens=True)
            answer = clean(split_turn(answer, markers.end).strip())
            if not user or not answer:
                return None
            return {"id": i, "messages": [{"role": "user", "content": user},
                                          {"role": "assistant", "content": answer}]}
        text = clean(tok.decode(row, skip_special_tokens=True))
        if text is None or not text.strip():  # an empty sample is no record: dropped and replaced, as an empty turn
            return None
        if shape == "prompt_completion":
            return {"id": i, "prompt": extra.get("prompt", ""), "completion": text.strip()}
        text = extra["prompt"] + text.rstrip() if "prompt" in extra else text.strip()
        return {"id": i, "text": text, **extra}

    longest = max(len(condition(i)[0]) for i in range(min(num, max(len(labels), len(prompts), 1))))
    limit = context_length(model)
    if limit is not None and longest + mnt > limit:
        raise SynthesisError(f"max_new_tokens={mnt} plus a {longest}-token prompt exceeds the model's context of "
                             f"{limit} tokens; lower max_new_tokens")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    banned = banned_token_ids(tok)
    byte_of = byte_values(tok)
    processors = None
    if byte_of is not None:
        from transformers import LogitsProcessorList

        processors = LogitsProcessorList([Utf8Only(byte_of, len(tok))])
    def draw(prompts_ids: list[list[int]], seed: int) -> list[list[int]]:
        """The new tokens of one seeded batch, each row after its prompt (left-padded: generation starts together)."""
        T = max(len(p) for p in prompts_ids)
        input_ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts_ids])
        mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts_ids])
        with torch.random.fork_rng():  # the caller's global generator is left as it was
            torch.manual_seed(seed)
            with torch.no_grad():
                gen = model.generate(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device),
                                     do_sample=True, temperature=settings["temperature"], top_p=settings["top_p"],
                                     top_k=0, max_new_tokens=mnt, pad_token_id=pad, eos_token_id=tok.eos_token_id,
                                     suppress_tokens=banned or None, logits_processor=processors)
        return gen[:, T:].tolist()

    limit_ids = _max_draws(num, B)
    bar = tqdm(total=num, initial=have, desc="synthesize", unit="rec", disable=not progress)
    b = start // B
    while have < num and b * B < limit_ids:
        # always a full batch (the draws of a row depend on its batch's shape); samples dropped as not valid text
        # are replaced by the next ids, so a file holds the same lines however often it was interrupted
        ids = range(b * B, (b + 1) * B)
        conds = [condition(i) for i in ids]
        if markers is not None and not prompts:  # a chat without public prompts: sample the user turns first
            users = [clean(split_turn(tok.decode(cut(row), skip_special_tokens=False), markers.user_end).strip())
                     for row in draw([c[0] for c in conds], _batch_seed(settings["seed"], b, 1))]
            conds = [(chat_prompt(u), {"user": u}) if u else (user_header, {}) for u in users]
        lines = []
        for i, (_, extra), row in zip(ids, conds, draw([c[0] for c in conds], _batch_seed(settings["seed"], b))):
            if i < start or i >= limit_ids or have + len(lines) >= num:  # on disk already (same seed, same sample)
                continue
            rec = record(i, extra, row)
            if rec is not None:
                lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
        with open(out, "a", encoding="utf-8") as fh:  # one append per batch, fsynced: a crash loses one batch
            fh.write("".join(lines))
            fh.flush()
            os.fsync(fh.fileno())
        have += len(lines)
        bar.update(len(lines))
        b += 1
    bar.close()
