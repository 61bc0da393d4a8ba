"""Supervised fine-tuning (SFT) data: instruction and chat records, rendered and masked for DP training.

The dataset shapes TRL's ``SFTTrainer`` users have, on the same private path as plain text:

    shape               columns                                   the answer (trained on by default)
    ``messages``        ``messages``: [{role, content}, ...]        every assistant turn
    ``prompt_completion`` ``prompt``, ``completion`` (strings, or     the completion (its assistant turns)
                        lists of messages: conversational)
    ``text``            ``text_column``                           everything (dpllm.data's plain path)

The map, in the order a run uses it; three modules, one per job, each with its own map:

    records.py  record shapes and detection
      read_table          data.load_records_and_users → rows of a .jsonl/.json/.csv/.parquet file, a
                          ``datasets.save_to_disk`` folder, a Hub id or a built-in set (:data:`BUILTIN`) → one
                          canonical JSON string per record (splits, hashes and audits treat it as any text)
      format_of, parse    a record string → its dict; one shape per dataset
    render.py   rendering with templates
      prepare_tokenizer   the chat template: ``data.chat_template``, else the tokenizer's own, else (the tiny
                          byte tokenizer only) :data:`SIMPLE_TEMPLATE`; none at all is a one-line error
      segments            a record → [(text, is_answer)], rendered by the template (messages) or concatenated
      generate_answers    greedy answers to a few held-out prompts, saved (``generations.jsonl``, private)
    masking.py  masking to the answer
      encode              segments → input_ids and labels: -100 on every prompt token (``loss_on: answer``),
                          or on none (``loss_on: all``); truncated to ``max_length`` on the right
      drop_cut_answers    before the privacy plan: a record whose answer ``max_length`` cuts off entirely is
                          reported and leaves the train and held-out splits (never trained on zero tokens)
      SFTRecords          the encoded records, batched by :class:`PadRecords`

Every name is imported from here (``from dpllm.sft import encode``) as from the modules.

Why the privacy accounting does not change: the unit is still one record (one conversation, never split
across records and never packed with another), and its loss is still one number, the mean over its
labelled tokens (:func:`dpllm.privacy.engine.sequence_loss`, Opacus's ghost criterion and bk all divide by
the count of labels ≠ -100). Masking the prompt changes *which* function of the record is differentiated,
not how many records a step samples nor the clipped sensitivity C, so ε is the same function of
(N, q, steps, σ) as for plain text. The prompt still conditions the answer's loss, so its tokens shape the
gradient as context; a prompt token's own next-token prediction never enters it (tests/test_sft.py
checks that its gradient contribution is exactly zero, under ghost, bk and hooks).
"""

from dpllm.sft.masking import PadRecords, SFTRecords, answer_fits, drop_cut_answers, encode, make_datasets
from dpllm.sft.records import (
                               BUILTIN,
                               FORMATS,
                               ROLES,
                               STDLIB_QA_MODULES,
                               SFTArguments,
                               canary_record,
                               canonical,
                               format_of,
                               is_untokenized_sft,
                               needs_template,
                               parse,
                               read_table,
                               rows_to_records,
                               shape_of,
                               stdlib_qa_rows,
)
from dpllm.sft.render import (
                               SIMPLE_TEMPLATE,
                               adds_bos,
                               generate_answers,
                               is_byte_tokenizer,
                               load_tokenizer,
                               prepare_tokenizer,
                               prompt_and_reference,
                               render_chat,
                               segments,
)

__all__ = [
    "BUILTIN", "FORMATS", "ROLES", "SIMPLE_TEMPLATE", "STDLIB_QA_MODULES", "PadRecords", "SFTArguments", "SFTRecords",
    "adds_bos", "answer_fits", "canary_record", "canonical", "drop_cut_answers", "encode", "format_of",
    "generate_answers", "is_byte_tokenizer", "is_untokenized_sft", "load_tokenizer", "make_datasets",
    "needs_template", "parse", "prepare_tokenizer", "prompt_and_reference", "read_table", "render_chat",
    "rows_to_records", "segments", "shape_of", "stdlib_qa_rows",
]
