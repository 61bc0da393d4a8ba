"""What a synthetic record looks like: the run's record shape, and text that is safe to open.

**Shape.** A run on chat data (``messages`` records, :mod:`dpllm.sft`) synthesizes chat records, a
prompt/completion run prompt/completion records, a plain run text (:func:`run_shape`, read from the run's
``splits.json`` ``sft.format``: the data's schema, not its content). A chat record is sampled through the
checkpoint's chat template, in two draws: the user turn is a public prompt, or is sampled after the
template's user header (up to the end of a user turn); the answer is then sampled after the template's
generation prompt for that user turn (:func:`chat_markers` finds the template's text around turns by
rendering placeholder turns). A model trained on answers only (``loss_on: answer``) never learned to write
user turns, so public prompts give it better conversations.

**Valid text.** A sample never carries a NUL, a control character other than ``\\n`` and ``\\t``, or bytes
that are not UTF-8 (decoded as U+FFFD). Three layers: tokens that decode to such characters are never
sampled (:func:`banned_token_ids`, passed to ``generate`` as ``suppress_tokens``); a byte-level tokenizer is
held to valid UTF-8 sequences (:class:`Utf8Only`); and :func:`clean` drops what still slips through (a token
sequence that decodes to U+FFFD) and trims a character the token budget cut in two. Dropped samples are
replaced by further draws; the card counts them (a function of the samples only, so public).

Example:
    >>> clean("ok\\ttext\\n"), clean("a\\x00b"), clean("caf\\ufffd"), clean("x\\ufffdy")
    ('ok\\ttext\\n', None, 'caf', None)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# C0 controls but \t and \n, DEL, C1 controls, and the replacement character (bytes that were not UTF-8)
NOT_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd]")


def clean(text: str) -> Optional[str]:
    """``text`` without a cut last character, or None when it holds characters that are not valid text."""
    text = text.rstrip("\ufffd")  # a multi-byte character the token budget cut off at the end
    return None if NOT_TEXT.search(text) else text


def run_shape(run_dir: Path) -> str:
    """``messages``, ``prompt_completion`` or ``text``: the record shape the run trained on."""
    path = Path(run_dir) / "splits.json"
    if not path.is_file():
        return "text"
    return (json.loads(path.read_text()).get("sft") or {}).get("format") or "text"


def banned_token_ids(tok) -> list[int]:
    """Ids of ordinary tokens whose text holds a control character other than ``\\n``, ``\\t`` (never sampled)."""
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    texts = tok.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return [i for i, t in zip(ids, texts) if re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", t)]


def byte_values(tok) -> Optional[dict[int, int]]:
    """``{token id: byte}`` for a byte-level tokenizer (ByT5's: one token per byte), else None."""
    from dpllm.sft import is_byte_tokenizer

    if not is_byte_tokenizer(tok):
        return None
    offset = getattr(tok, "offset", 3)
    return {b + offset: b for b in range(256)}


class Utf8Only:
    """A ``generate`` logits processor that lets a byte-level model write only valid UTF-8 sequences.

    After a lead byte of an n-byte character only continuation bytes may follow until it is complete; elsewhere
    a continuation byte, and a byte that never starts a character (0xC0, 0xC1, 0xF5-0xFF), is masked.
    """

    def __init__(self, byte_of: dict[int, int], vocab_size: int):
        import torch

        self.byte_of = byte_of
        cont = [i for i, b in byte_of.items() if 0x80 <= b <= 0xBF]
        never = [i for i, b in byte_of.items() if b in (0xC0, 0xC1) or b >= 0xF5]
        self.mask_free = torch.zeros(vocab_size, dtype=torch.bool)
        self.mask_free[cont + never] = True  # not allowed between characters
        self.mask_cont = torch.ones(vocab_size, dtype=torch.bool)
        self.mask_cont[cont] = False  # inside a character: only continuation bytes

    def _needs_continuation(self, row: list[int]) -> bool:
        trailing = 0
        for tid in reversed(row[-4:]):
            b = self.byte_of.get(tid)
            if b is not None and 0x80 <= b <= 0xBF:
                trailing += 1
                continue
            length = 2 if b is not None and 0xC2 <= b <= 0xDF else 3 if b is not None and 0xE0 <= b <= 0xEF else \
                4 if b is not None and 0xF0 <= b <= 0xF4 else 1
            return trailing < length - 1
        return False

    def __call__(self, input_ids, scores):
        for r, row in enumerate(input_ids.tolist()):
            mask = self.mask_cont if self._needs_continuation(row) else self.mask_free
            scores[r, mask[: scores.shape[1]].to(scores.device)] = -float("inf")
        return scores


@dataclass
class ChatMarkers:
    """The text a chat template puts around turns: ``user_prefix`` + user + ``between`` + answer + ``end``."""

    user_prefix: str
    user_end: str
    between: str
    end: str


def chat_markers(tok) -> ChatMarkers:
    """Render placeholder turns with ``tok``'s chat template and read off the text around them.

    Raises:
        ValueError: no template, or one that does not render a user turn, then the answer, in that order.
    """
    from dpllm.sft import render_chat

    u, a = "\u2063USER\u2063", "\u2063ANSWER\u2063"
    one = render_chat(tok, [{"role": "user", "content": u}], generation_prompt=False)
    prompt = render_chat(tok, [{"role": "user", "content": u}], generation_prompt=True)
    full = render_chat(tok, [{"role": "user", "content": u}, {"role": "assistant", "content": a}],
                   generation_prompt=False)
    if u not in one or not prompt.startswith(one[: one.index(u)]) or a not in full or u not in prompt:
        raise ValueError("the chat template does not render a user turn followed by the answer")
    prefix = one[: one.index(u)]
    between = prompt[prompt.index(u) + len(u):]
    end = full[full.index(a) + len(a):]
    return ChatMarkers(user_prefix=prefix, user_end=one[one.index(u) + len(u):], between=between, end=end)


def split_turn(text: str, end: str) -> str:
    """``text`` up to the first ``end`` marker (whitespace around it ignored; all of ``text`` when absent).

    >>> split_turn("What is 2?\\n<|assistant|>\\n4", "\\n"), split_turn("4.</s>", "</s>"), split_turn("x", "")
    ('What is 2?', '4.', 'x')
    """
    marker = end.strip() or end
    return text[: text.index(marker)] if marker and marker in text else text


def as_text(record) -> str:
    """A record's words as one text, for leakage and fidelity: a chat's turns, prompt then completion, or the text.

    Takes a synthetic row (a dict) or a training record (a plain string or an SFT record's canonical JSON).
    """
    if isinstance(record, str):
        if not record.startswith('{"'):
            return record
        try:
            record = json.loads(record)
        except json.JSONDecodeError:
            return record
        if not isinstance(record, dict):
            return json.dumps(record)

    def flat(v) -> str:
        return "\n".join(m.get("content", "") for m in v) if isinstance(v, list) else str(v or "")

    if "messages" in record:
        return flat(record["messages"])
    if "completion" in record:
        return "\n".join(x for x in (flat(record.get("prompt")), flat(record["completion"])) if x)
    return str(record.get("text", ""))
