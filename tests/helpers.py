"""Small builders shared by tests: tiny models and tokenized batches, no downloads."""

from __future__ import annotations

import torch

from dpllm.config import ModelConfig
from dpllm.data import make_collate
from dpllm.models import build_tiny, byte_tokenizer, prepare_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Differential privacy bounds what one record can change.",
    "def f(x):\n    return x + 1",
    "Ghost clipping computes per-sample norms without materialising gradients.",
    "short one",
    "Poisson sampling includes each record independently with probability q.",
]


def tiny_model(kind: str = "tiny-llama", finetuning: str = "full", *, dp: bool = True, seed: int = 0, hidden: int = 32):
    torch.manual_seed(seed)
    cfg = ModelConfig(model_name_or_path=kind, finetuning=finetuning, tiny_hidden_size=hidden, tiny_num_layers=2,
                      tiny_num_heads=2, tiny_intermediate_size=64, tiny_max_positions=128, lora_r=4)
    tok = byte_tokenizer()
    model = build_tiny(cfg, tok, 64)
    if finetuning == "lora":
        # LoRA B starts at zero, which makes A's gradient zero: perturb so every parameter gets signal.
        model, _ = prepare_model(model, cfg, dp=dp)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    else:
        model, _ = prepare_model(model, cfg, dp=dp)
    return model, tok


def batch_of(tok, texts=TEXTS, max_length: int = 48) -> dict:
    items = [torch.tensor(x) for x in tok(list(texts), truncation=True, max_length=max_length)["input_ids"]]
    return make_collate(tok.pad_token_id)(items)


def explicit_grads(model, batches) -> torch.Tensor:
    """One row per batch: the flattened gradient of the trainable parameters for that batch's own mean token loss,
    by plain autograd, one backward pass per batch (the reference the engines' clipped sums are checked against)."""
    from dpllm.models import position_ids_for
    from dpllm.privacy.engine import sequence_loss

    grads = []
    for b in batches:
        model.zero_grad()
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                    position_ids=position_ids_for(b["input_ids"]))
        sequence_loss(out.logits, b["labels"]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]).clone())
    model.zero_grad()
    return torch.stack(grads)


def load_recipe(name: str):
    """Import ``recipes/<name>.py`` as a module (recipes are scripts, not a package).

    ``recipes/`` goes on ``sys.path`` as it does for ``python recipes/<name>.py``, so a recipe's imports of
    its sibling helpers (``mlp_study``) resolve the same way in tests.
    """
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    recipes = os.path.join(root, "recipes")
    if recipes not in sys.path:
        sys.path.insert(0, recipes)
    spec = importlib.util.spec_from_file_location(name, os.path.join(recipes, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_reproduces_committed(res: dict, name: str, *, metric_abs: float) -> None:
    """A full (not --quick) study ``res`` gives the runs committed in ``docs/results/<name>/results.json``.

    Same grid and settings, ε to 1e-6 (the accountants are deterministic) and every run's metrics to
    ``metric_abs`` (same seeds, so the same batches and noise; only float summation order may differ).
    """
    import json
    import os

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "results", name, "results.json")) as fh:
        committed = json.load(fh)
    res = json.loads(json.dumps(res, default=str))  # as written to results.json: tuples become lists
    assert not res["quick"] and res["settings"] == committed["settings"]
    assert [r["config"] for r in res["runs"]] == [r["config"] for r in committed["runs"]]
    for ours, theirs in zip(res["runs"], committed["runs"]):
        for key in ("epsilon_prv", "epsilon_rdp", "noise_multiplier", "sample_rate", "steps"):
            if key in theirs:
                assert ours[key] == (None if theirs[key] is None else pytest.approx(theirs[key], rel=1e-6)), key
        for key, value in theirs["metrics"].items():
            assert ours["metrics"][key] == pytest.approx(value, abs=metric_abs), (ours["config"], key)


def in_process(main, argv: list[str], capsys=None):
    """A command's entry point (``main(argv)``, what its console script or ``python -m`` calls) run in this process;
    returns what ``subprocess.run`` would: ``returncode``, ``stdout``, ``stderr`` (read from ``capsys``, or, in a
    fixture without it, from ``sys.stdout``/``sys.stderr`` redirected for the call). A process of its own would add
    only its start-up, ~13 s of CPU for torch, transformers and opacus."""
    import contextlib
    import io
    from types import SimpleNamespace

    out, err = io.StringIO(), io.StringIO()
    if capsys is not None:
        capsys.readouterr()
    with contextlib.ExitStack() as stack:
        if capsys is None:
            stack.enter_context(contextlib.redirect_stdout(out))
            stack.enter_context(contextlib.redirect_stderr(err))
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    if capsys is not None:
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def tiny_dptrainer(out, *, max_steps: int = 4, **privacy):
    """A ``DPTrainer`` on the tiny LoRA Llama and 24 distinct records (:data:`TEXTS` ×4, 48 tokens at most), on
    the CPU: ``max_steps`` steps of physical batch 4, logical batch 8, ε 8 at δ 1e-3 (RDP) unless ``privacy`` (more
    ``PrivacyArguments``) says otherwise; writes to ``out``."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from dpllm.hf import DPTrainer, PrivacyArguments

    model, tok = tiny_model(finetuning="lora")
    texts = [f"{t} (record {i})" for i in range(4) for t in TEXTS]
    ds = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"], truncation=True, max_length=48), batched=True)
    args = TrainingArguments(output_dir=str(out), report_to="none", disable_tqdm=True, use_cpu=True,
                             max_steps=max_steps, per_device_train_batch_size=4, seed=1, save_strategy="no")
    privacy = {"target_epsilon": 8.0, "target_delta": 1e-3, "accountant": "rdp", "logical_batch_size": 8, **privacy}
    return DPTrainer(model=model, args=args, privacy_args=PrivacyArguments(**privacy), train_dataset=ds,
                     processing_class=tok)


# Modules a training run imports, loaded once by the fork server of :func:`forked_recipe` (~10 CPU-s: torch,
# transformers, opacus, peft, accelerate and what a run imports lazily), after bitsandbytes is hidden as the recipe's
# own process hides it (tests/fork_preload.py).
_FORK_PRELOAD = ["tests.fork_preload", "tests.helpers", "dpllm.train", "dpllm.privacy.bk", "opacus", "peft",
                 "accelerate", "transformers.models.llama.modeling_llama", "transformers.models.byt5.tokenization_byt5",
                 "transformers.optimization", "transformers.hf_argparser"]


def _recipe_process(argv: list[str], stderr_path: str) -> None:
    """The body of a :func:`forked_recipe` process: what ``python recipes/finetune_llm.py ARGV`` runs after its
    imports, stdout to nowhere and stderr to ``stderr_path``."""
    import multiprocessing
    import os
    import signal
    import sys

    multiprocessing.set_start_method(None, force=True)  # a fresh interpreter's default, not the fork server's
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    out, err = os.open(os.devnull, os.O_WRONLY), os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.argv = [os.path.join(root, "recipes", "finetune_llm.py"), *argv]
    recipe = load_recipe("finetune_llm")
    recipe.follow_launcher()
    sys.exit(recipe.finish_process(recipe.cli(command=True)))


def forked_recipe(argv: list[str], stderr_path):
    """``python recipes/finetune_llm.py ARGV`` as a process of its own, forked from a server process that imported
    the training stack once (multiprocessing's forkserver, shared by every call in this test process): a real
    process to SIGKILL or signal mid-run, without ~13 CPU-s of imports at each start. Returns the started
    ``multiprocessing.Process`` (``kill()``, ``is_alive()``, ``exitcode``: -9 after a SIGKILL, the recipe's exit
    status otherwise); its stderr goes to ``stderr_path``. The files that use it run on one worker
    (tests/conftest.py's ``SAME_WORKER``), whose session end calls :func:`stop_fork_server`."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_FORK_PRELOAD)
    proc = ctx.Process(target=_recipe_process, args=(list(argv), str(stderr_path)), daemon=True)
    proc.start()
    return proc


def signal_when(proc, stderr_path, ready, signum: int, *, within: float, what: str,
                join: float | None = None) -> str:
    """Send ``signum`` to :func:`forked_recipe`'s ``proc`` once ``ready()`` holds, wait for the process to end
    (at most ``join`` seconds; None: however long) and return its stderr. ``within`` seconds is a liveness guard
    for a loaded machine, not a timing; the process dying first fails the test with ``what`` and its stderr."""
    import os
    import time
    from pathlib import Path

    deadline = time.time() + within
    while not ready():
        assert time.time() < deadline and proc.is_alive(), f"{what}: " + Path(stderr_path).read_text()[-3000:]
        time.sleep(0.01)
    os.kill(proc.pid, signum)
    proc.join(join)
    return Path(stderr_path).read_text()


def stop_fork_server() -> None:
    """End :func:`forked_recipe`'s server (and wait for it, so that its CPU time counts as this process's child's)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own stopper (its tests use it)
    if stop is not None:
        stop()
