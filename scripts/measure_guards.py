"""Figures behind the per-mode refusals (docs/engines.md): what the attacker's toys do, and what the guards cost.

    python scripts/measure_guards.py toys    # each toy in each mode: ‖update‖/C per step, or the refusal
    OMP_NUM_THREADS=1 python scripts/measure_guards.py cost [--rounds 9]   # per-step cost of the gradient-path
                                             # guard (interleaved CPU time) and the one-off independence check
    python scripts/measure_guards.py rope [--copies 4 --init 0.5]   # one long record vs 8 × copies short ones
                                             # under each rope type (LoRA, bk): ‖Δ clipped sum‖/C, and the refusals

``toys`` runs the models of tests/test_gradient_paths.py and tests/test_record_independence.py (σ = 0, C = 1e-3)
through :func:`dpllm.privacy.engine.make_private` as the checkout has it: on a commit without the guards it prints
how far one record moved the model, with them the refusals. ``cost`` steps the same model with and without
:mod:`dpllm.privacy.paths` in one process, alternating (a slow spell of a shared machine hits both alike), and
reports the median per-round ratio of process CPU time; then times :func:`~dpllm.privacy.independence.
check_record_independence` against one step. Prints figures; not a timed test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]


def _update(make, mode, step, *, physical_batch_size=None, steps=1):
    """‖update‖/C of each of ``steps`` steps (``step(pt)`` runs one), or the refusal's first words."""
    import test_gradient_paths as g
    import torch

    from dpllm.config import PrivacyConfig
    from dpllm.privacy.engine import PrivacyPlan, make_private

    torch.manual_seed(0)
    model = make()
    plan = PrivacyPlan(num_records=8, sample_rate=0.125, steps=steps, noise_multiplier=0.0, delta=1e-5,
                       accountant="rdp", expected_batch_size=1)
    try:
        pt = make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), dataset=list(range(8)),
                          collate_fn=lambda b: b, cfg=PrivacyConfig(grad_sample_mode=mode, max_grad_norm=g.C),
                          plan=plan, logical_batch_size=1, physical_batch_size=physical_batch_size)
    except (NotImplementedError, RuntimeError, ValueError) as err:  # the setup refused: show it
        return "refused at setup: " + str(err)[:60], None
    out = []
    for _ in range(steps):
        before = g._params(model)
        try:
            step(pt)
        except RuntimeError as err:
            out.append("refused: " + str(err)[:60])
            break
        out.append(round(float((g._params(model) - before).norm()) / g.C, 3))
    return out, pt.grad_sample_mode


def toys() -> None:
    import test_gradient_paths as g
    import test_record_independence as r
    import torch

    from dpllm.train import forward_loss

    warnings.filterwarnings("ignore")
    print("# unclipped paths (tests/test_gradient_paths.py): ‖update‖/C per step, batch 1, bound 1")
    cases = [("view before training", g.ViewBeforeTraining, {}, False, 2),
             ("hook copy", g.HookCopy, {}, False, 2),
             ("hook copy + GroupNorm, hooks 'too large'", lambda: g.HookCopy(True), {"physical_batch_size": 10**15},
              False, 2),
             ("late tie (step 2)", lambda: g.LateTie("emb"), {}, False, 3),
             ("late use of a cached autocast cast (step 2)", lambda: g.LateTie("head"), {}, True, 3)]
    for name, make, kw, autocast, steps in cases:
        for mode in ("auto", "bk", "hooks", "ghost"):
            res, ran = _update(make, mode, lambda pt, a=autocast: g._step(pt, a), steps=steps, **kw)
            print(f"{name:<45} {mode:<6} ({ran}) {res}")

    print("# records that reach each other (tests/test_record_independence.py): sensitivity / C")
    ids = torch.randint(0, r.V, (3, 5), generator=torch.Generator().manual_seed(1))

    def lm_step(batch):
        def step(pt):
            r._lm_loss(pt.model(batch), batch, pt.criterion).backward()
            pt.optimizer.step()
        return step

    for name, make in [("h + h.mean(0)", lambda: r.Mixing("mean")), ("batch-statistics norm", lambda: r.Mixing("bn"))]:
        for mode in ("auto", "bk", "hooks", "ghost"):
            worst = None
            for j in range(3):
                res = _sensitivity(make, mode, lm_step(ids), lm_step(ids[[i for i in range(3) if i != j]]))
                if isinstance(res, str):
                    worst = res
                    break
                worst = max(worst or 0.0, res)
            print(f"{name:<45} {mode:<6} add/remove {worst}")
    one = torch.randint(0, r.V, (1, 5), generator=torch.Generator().manual_seed(1))
    for mode in ("auto", "bk", "hooks", "ghost"):
        res, ran = _update(r.SequenceFirst, mode, lm_step(one))
        print(f"{'sequence-first, one record (T = 5)':<45} {mode:<6} ({ran}) ‖update‖/C {res}")
    ids5 = torch.randint(0, r.V, (5, 5), generator=torch.Generator().manual_seed(0))
    other = ids5.clone()
    other[0] = torch.randint(0, r.V, (5,), generator=torch.Generator().manual_seed(1004))
    for mode in ("auto", "bk", "hooks", "ghost"):
        print(f"{'sequence-first, T = B = 5':<45} {mode:<6} replace-one "
              f"{_sensitivity(r.SequenceFirst, mode, lm_step(ids5), lm_step(other))}")
    pid = torch.randint(1, r.V, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(pid)
    mask[0, 4:], mask[1, 3:] = 0, 0

    def hf_step(i, m):
        def step(pt):
            forward_loss(pt.model, {"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)},
                         pt.criterion).backward()
            pt.optimizer.step()
        return step

    for mode in ("auto", "bk", "hooks", "ghost"):  # the longest record (row 2) removed: the others lose padding
        sensitivity = _sensitivity(r.PaddingDependent, mode, hf_step(pid, mask),
                                   hf_step(pid[:2, :4].contiguous(), mask[:2, :4].contiguous()))
        print(f"{'mean over padded positions':<45} {mode:<6} add/remove {sensitivity}")


def _sensitivity(make, mode, step_a, step_b):
    """‖update(a) − update(b)‖/C from the same initial weights, or the refusal."""
    import test_gradient_paths as g
    import torch

    from dpllm.config import PrivacyConfig
    from dpllm.privacy.engine import PrivacyPlan, make_private

    updates = []
    for step in (step_a, step_b):
        torch.manual_seed(0)
        model = make()
        plan = PrivacyPlan(num_records=8, sample_rate=0.125, steps=1, noise_multiplier=0.0, delta=1e-5,
                           accountant="rdp", expected_batch_size=1)
        pt = make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), dataset=list(range(8)),
                          collate_fn=lambda b: b, cfg=PrivacyConfig(grad_sample_mode=mode, max_grad_norm=g.C),
                          plan=plan, logical_batch_size=1)
        before = g._params(model)
        try:
            step(pt)
        except RuntimeError as err:
            return "refused: " + str(err)[:60]
        updates.append(g._params(model) - before)
    return round(float((updates[0] - updates[1]).norm()) / g.C, 3)


def cost(rounds: int, hidden: int = 256, layers: int = 4, seq: int = 128) -> None:
    import bench_overhead as bo
    import torch

    from dpllm.models import position_ids_for
    from dpllm.privacy import independence, paths

    warnings.filterwarnings("ignore")
    print(f"# threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; CPU time per step, median of {rounds} "
          "interleaved rounds")
    for model_name, finetuning in [("tiny-llama", "full"), ("tiny-llama", "lora"), ("tiny-gpt2", "full")]:
        args = bo.options(model=model_name, finetuning=finetuning, lora_r=16, hidden=hidden, layers=layers, heads=4,
                          seq=seq, batch=4)
        device = torch.device("cpu")
        for mode in ("hooks", "ghost"):
            steps, calls, inside = {}, {}, [0.0]
            for label in ("with", "without"):
                torch.manual_seed(0)
                model, mcfg = bo.build(args, device, torch.float32)
                off = mock.patch.object(paths, "guard_gradient_paths", lambda *a, **k: None)
                with off if label == "without" else _timed(paths.PathGuard, inside):
                    steps[label], _ = bo.make_step(args, model, mcfg, device, mode)
                calls[label] = model
            batch = bo.random_batch(args, args.batch, calls["with"].get_input_embeddings().num_embeddings, device)
            cpu = {"with": [], "without": []}
            for i in range(2 + rounds):  # the first step of each runs the independence check: warm-up
                if i == 2:
                    inside[0] = 0.0
                for label in ("with", "without"):
                    c0 = time.process_time()
                    steps[label](batch)
                    if i >= 2:
                        cpu[label].append(time.process_time() - c0)
            ratio = statistics.median(a / b for a, b in zip(cpu["with"], cpu["without"]))
            extra = statistics.median(a - b for a, b in zip(cpu["with"], cpu["without"]))
            layers = sum(1 for m in calls["with"].modules()
                         if any(p.requires_grad for p in m.parameters(recurse=False)))
            own = inside[0] / rounds
            print(f"{model_name:<11}{finetuning:<5}{mode:<6} step {statistics.median(cpu['without']):.3f} s; with the "
                  f"guard ×{ratio:.3f} ({extra * 1e3:+.1f} ms); time inside the guard's hooks {own * 1e3:.2f} ms/step "
                  f"= {own / statistics.median(cpu['without']):.2%} ({layers} layers with trainable weights, "
                  f"{own / layers * 1e6:.0f} µs each)")
        ids = batch["input_ids"]
        kwargs = {"input_ids": ids, "attention_mask": batch["attention_mask"], "position_ids": position_ids_for(ids)}
        model = calls["without"]
        times = []
        for _ in range(3):
            c0 = time.process_time()
            independence.check_record_independence(model, (), kwargs)
            times.append(time.process_time() - c0)
        print(f"{model_name:<11}{finetuning:<5}independence check {statistics.median(times):.3f} s once per run "
              f"(one {mode} step: {statistics.median(cpu['without']):.3f} s)")


def _timed(cls, total: list):
    """Patch ``cls``'s hook methods to add their CPU time to ``total[0]`` (for guards built inside the block)."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            c0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                total[0] += time.process_time() - c0
        return timed

    names = ("_new_pass", "_start", "_walk", "_send", "_arrive_node", "_arrive")
    return mock.patch.multiple(cls, **{n: wrap(getattr(cls, n)) for n in names})


def rope(copies: int, init: float) -> None:
    """The tiny Llama of tests/test_rope_positions.py under each rope type: how far one record of 48 tokens moves
    the clipped sum of 8 × ``copies`` short records (the first-batch check only, as before issue 46), and what the
    checks now say (the config check at max_length 48, and the independence check's record at max_length)."""
    import test_rope_positions as t

    from dpllm.privacy.positions import check_rope_per_record

    warnings.filterwarnings("ignore")
    kinds = {"longrope": t.LONGROPE, "dynamic": {"rope_type": "dynamic", "factor": 2.0}, **t.STATIC}
    print(f"{'rope type':34} {'‖Δ‖/C before':>13}  config check     record at max_length")
    for name, params in kinds.items():
        before = t._sensitivity(params, copies=copies, init=init)
        verdicts = []
        for check in (lambda p: check_rope_per_record(t._llama(p, lora=False, init=init), max_length=t.LONG),
                      lambda p: t._update(p, t._records(copies)[0], max_length=t.LONG, init=init)):
            try:
                check(params)
                verdicts.append("passes")
            except ValueError:
                verdicts.append("refused")
        print(f"{name:34} {before:13.4f}  {verdicts[0]:16} {verdicts[1]}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("toys", "cost", "rope"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--copies", type=int, default=1, help="rope: 8 × copies short records")
    ap.add_argument("--init", type=float, default=0.2, help="rope: the model's initializer_range")
    ap.add_argument("--hidden", type=int, default=256, help="cost: the models' width")
    ap.add_argument("--layers", type=int, default=4, help="cost: the models' depth")
    ap.add_argument("--seq", type=int, default=128, help="cost: tokens per record")
    args = ap.parse_args(argv)
    if args.what == "rope":
        rope(args.copies, args.init)
    else:
        toys() if args.what == "toys" else cost(args.rounds, args.hidden, args.layers, args.seq)


if __name__ == "__main__":
    main()
