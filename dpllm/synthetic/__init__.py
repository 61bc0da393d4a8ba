"""Synthetic text from a DP run: a shareable data set, its data card, and a private report on it.

A DP model's samples inherit its (ε, δ) by post-processing (Yue et al. 2023; Kurakin et al. 2023), so a
synthetic copy of the private data can leave the run as freely as the model can. The pieces, in order:

=================  ==================================================================================
``cli``            ``dpllm synthesize RUN --num N --out synth.jsonl``: the steps below in one command
``generate``       :func:`synthesize`: the release checks of ``dpllm export``
                   (:func:`dpllm.export.check_releasable`: seeded noise, a ledger that does not verify,
                   a study run, a failed audit, no DP are refused unless overridden), then batched, seeded,
                   resumable sampling from the checkpoint (resumed only from the same run and checkpoint:
                   ``synth.source.json``, **private**), unconditional, on public prompts, or on labels
                   (control codes, ``data.label_column``)
``records``        the record shape of the run (chat, prompt/completion, text) and the valid-text guard:
                   no NUL, control character or broken UTF-8 reaches the file
``card``           ``synth.card.json`` / ``synth.card.md``: the source's (ε, δ) and privacy unit, the
                   generation settings, the post-processing statement (**releasable**, with the file);
                   the ``.md`` opens with the Hub's dataset metadata (:mod:`dpllm.hub`), and
                   ``release_folder`` copies the releasable files into a folder ``datasets`` loads
``leakage``        verbatim / near-duplicate rates and nearest-neighbour distances against training
                   vs held-out records, planted canaries found or not (**private**)
``fidelity``       n-gram JS divergence, Fréchet distance of embeddings, a downstream classifier
                   trained on synthetic vs on real records (**private**: it reads the held-out data)
``report``         ``synth.report.json`` / ``.md`` / ``.png`` beside the file (**private**), with plain
                   warnings when fidelity is poor (``quality_warnings``)
=================  ==================================================================================

Python::

    from dpllm.synthetic import synthesize, evaluate, write_report
    card = synthesize("runs/dp", num=1000, out="synth.jsonl", temperature=0.9)
    write_report(evaluate("synth.jsonl", "runs/dp"), "synth.jsonl")

The study on the built-in data is ``recipes/synthetic_study.py`` (docs/results/synthetic/).
"""

from dpllm.synthetic.generate import SynthesisError, synthesize
from dpllm.synthetic.report import evaluate, write_report

__all__ = ["SynthesisError", "evaluate", "synthesize", "write_report"]
