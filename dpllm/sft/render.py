"""Rendering SFT records with a chat template: the tokenizer's template, the text pieces of a record
(prompt or answer), and greedy answers to held-out prompts.

    prepare_tokenizer       the template a run renders with: ``data.chat_template``, else the tokenizer's own,
                            else (the tiny byte tokenizer only) :data:`SIMPLE_TEMPLATE`; none is an error
    segments                a record → [(text, is_answer)], rendered by the template (conversations) or
                            concatenated (plain prompt and completion)
    load_tokenizer          a run's tokenizer without its model (to find cut-off answers before the plan)
    generate_answers        greedy answers to a few held-out prompts (``generations.jsonl``)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from dpllm.config import ModelConfig
from dpllm.errors import DataError
from dpllm.sft.records import parse

# dpllm's built-in template: the tiny byte tokenizer has none, and tests need one that ships with the project.
# The end-of-text token closes each assistant turn, so a trained model learns where an answer stops (nothing
# follows it on the line: byte-level tokenizers strip whitespace after a special token).
SIMPLE_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}"
                   "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


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


def render_chat(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    """The conversation as the chat template renders it (ending with the assistant's turn header when
    ``generation_prompt``)."""
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
        full = render_chat(tokenizer, msgs, generation_prompt=False)
        out, at = [], 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant" or i < first:
                continue
            before = render_chat(tokenizer, msgs[:i], generation_prompt=True) if i else ""
            upto = render_chat(tokenizer, msgs[: i + 1], generation_prompt=False)
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


def adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a")["input_ids"][:1] == [bos]


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


# ---- held-out generations -----------------------------------------------------------------------------------

def prompt_and_reference(record: dict, tokenizer) -> tuple[str, str]:
    """The prompt text a deployed model would see (up to its last answer) and that answer."""
    if "messages" in record or isinstance(record.get("prompt"), list):
        msgs = record.get("messages") or record["prompt"] + record["completion"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        return render_chat(tokenizer, msgs[:last], generation_prompt=True), msgs[last]["content"]
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
        if "messages" not in rec and not isinstance(rec.get("prompt"), list) and adds_bos(tokenizer):
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
        ids = ids.to(device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        out.append({"prompt": prompt, "reference": reference,
                    "generated": tokenizer.decode(new[0, ids.shape[1]:], skip_special_tokens=True)})
    model.train(was_training)
    return out
