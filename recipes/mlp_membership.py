"""Membership inference against MLPs trained without DP and at ε ≈ 50, 8, 1 (LOSS and online LiRA).

A pool of 200 digit images (scikit-learn ``load_digits``) is split into random halves 8 times; each
half and its complement train one model, so 16 models per privacy level, every record IN for exactly 8
of them. Every model is trained the same way through :func:`dpllm.privacy.engine.make_private` (width
256, 100 epochs, SGD lr 0.1, expected batch 32, C = 1); a small training set and many epochs make the
non-private model overfit, so the attacks have something to find. Each model in turn is the target and
the 14 models outside its pair are its shadows (7 IN and 7 OUT for every record): online LiRA
(:func:`mia.lira.lira_online`, pooled variances) on the logit of the correct-class probability, and the
LOSS attack (:func:`mia.attacks.loss_attack`). Scores of all 16 targets are pooled (3,200 member and
3,200 non-member scores) and scored by :func:`mia.metrics.evaluate` (AUC and TPR at FPR 0.1%, 1%,
10%, with bootstrap intervals). For ε, σ is calibrated with the RDP accountant (a PRV calibration at
ε ≈ 50 takes ~17 s, more than all the training) and both ε(RDP) and the tighter ε(PRV) are reported.

    python recipes/mlp_membership.py --output_dir docs/results/mlp_membership
    python recipes/mlp_membership.py --output_dir runs/mlp_membership_quick --quick

Writes ``results.json``, ``summary.md``, ``roc.png`` and ``attack_vs_epsilon.png``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from mlp_study import (
    Timer,
    command_line,
    environment,
    finish,
    fmt,
    markdown_table,
    mean_std,
    plots_line,
    progress,
    quiet_warnings,
    recipe_parser,
    save_figure,
    t_interval,
)

from dpllm.mlp.data import Split, load_dataset
from mia.attacks import loss_attack

LEVELS = (("non-private", None), ("ε≈50", 50.0), ("ε≈8", 8.0), ("ε≈1", 1.0))
FPRS = (0.001, 0.01, 0.1)
MASK_SEED = 0  # seeds the random halves


def grid(quick: bool) -> dict:
    if quick:
        return {"pool": 64, "pairs": 3, "epochs": 30, "batch_size": 16, "width": 256,
                "levels": LEVELS[:1] + LEVELS[2:3], "n_bootstrap": 50}
    return {"pool": 200, "pairs": 8, "epochs": 100, "batch_size": 32, "width": 256, "levels": LEVELS,
            "n_bootstrap": 200}


def halves(pool: int, pairs: int, seed: int = MASK_SEED) -> np.ndarray:
    """Inclusion mask ``[2·pairs, pool]``: model 2j trains on a random half, model 2j+1 on the other half."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((2 * pairs, pool), dtype=bool)
    for j in range(pairs):
        mask[2 * j, rng.permutation(pool)[: pool // 2]] = True
        mask[2 * j + 1] = ~mask[2 * j]
    return mask


def leave_pair_out(phi: np.ndarray, loss: np.ndarray, mask: np.ndarray) -> dict[str, list[tuple]]:
    """Per target, the member and non-member scores of each attack; each model is the target once.

    The shadows of target t are all models but t and its complementary partner t ^ 1. Keeping the
    partner would leave every member of t with one more OUT than IN shadow (and every non-member the
    reverse); the better-estimated Gaussian then sits closer to the target's value by chance alone,
    which biases LiRA below AUC 0.5 when the models carry no membership signal.
    """
    from mia.lira import lira_online

    scores = {"lira": ([], []), "loss": ([], [])}
    for t in range(len(mask)):
        others = (np.arange(len(mask)) // 2) != t // 2
        lira = lira_online(phi[t], phi[others], mask[others], global_variance=True, input_scale="logit")
        for name, s in (("lira", lira), ("loss", loss_attack(loss[t]))):
            scores[name][0].append(s[mask[t]])
            scores[name][1].append(s[~mask[t]])
    return {k: list(zip(m, n)) for k, (m, n) in scores.items()}


def main(argv: list[str] | None = None) -> dict:
    args = recipe_parser(__doc__, default_output="runs/mlp_membership", dataset="digits").parse_args(argv)
    # the training stack (opacus) loads once the arguments are read: --help and typos answer at once
    from dpllm.mlp.train import MLPRun, plan_for, predict, train_mlp
    from mia.lira import logit_confidence_from_logits
    from mia.metrics import auc, evaluate, roc_curve
    quiet_warnings()
    torch.set_num_threads(1)  # tiny models: extra threads only add synchronisation
    timer = Timer()
    g = grid(args.quick)
    data = load_dataset(args.dataset)
    px, py = data.x_train[: g["pool"]], data.y_train[: g["pool"]]
    mask = halves(g["pool"], g["pairs"])
    n_models = len(mask)
    base = dict(width=g["width"], epochs=g["epochs"], lr=0.1, batch_size=g["batch_size"], max_grad_norm=1.0,
                accountant="rdp")
    plans, eps_cache, runs, levels = {}, {}, [], []
    bar = progress(len(g["levels"]) * n_models, "mlp_membership", args.no_progress)
    for label, eps in g["levels"]:
        phi, loss = np.zeros(mask.shape), np.zeros(mask.shape)
        for k in range(n_models):
            idx = torch.as_tensor(np.flatnonzero(mask[k]))
            split = Split(data.name, px[idx], py[idx], data.x_test, data.y_test, data.n_classes, data.info)
            run = MLPRun(**base, seed=1000 + k, private=eps is not None, target_epsilon=eps)
            plan = plan_for(run, n_train=split.n_train, cache=plans) if run.private else None
            trained = train_mlp(run, split, plan=plan, eps_cache=eps_cache)
            logits = predict(trained.model, px)
            phi[k] = logit_confidence_from_logits(logits.numpy(), py.numpy())
            loss[k] = torch.nn.functional.cross_entropy(logits, py, reduction="none").numpy()
            runs.append({"level": label, "model": k, **trained.record})
            bar.update()
        scores = leave_pair_out(phi, loss, mask)
        rs = [r for r in runs if r["level"] == label]
        attacks = {}
        for name, per_target in scores.items():
            m, n = np.concatenate([a for a, _ in per_target]), np.concatenate([b for _, b in per_target])
            attacks[name] = evaluate(m, n, fprs=FPRS, n_bootstrap=g["n_bootstrap"], seed=0,
                                     **({"member_losses": -m, "nonmember_losses": -n} if name == "loss" else {}))
            # Scores of one target share its training noise, so records are not independent draws; the
            # spread of per-target AUCs is a more honest measure of uncertainty than the record bootstrap.
            per = [auc(a, b) for a, b in per_target]
            attacks[name]["auc_per_target"] = per
            attacks[name]["auc_per_target_ci"] = list(t_interval(per))
            fpr, tpr, _ = roc_curve(m, n)
            attacks[name]["roc"] = _thin(fpr, tpr)
        levels.append({"level": label, "target_epsilon": eps, "noise_multiplier": rs[0]["noise_multiplier"],
                       "epsilon_prv": rs[0]["epsilon_prv"], "epsilon_rdp": rs[0]["epsilon_rdp"],
                       "sample_rate": rs[0]["sample_rate"], "steps": rs[0]["steps"], "delta": rs[0]["delta"],
                       "test_accuracy": mean_std(r["metrics"]["test_accuracy"] for r in rs),
                       "train_accuracy": mean_std(r["metrics"]["train_accuracy"] for r in rs),
                       "attacks": attacks, "dp_bound": _bound(rs[0])})
    bar.close()
    train_s = timer.seconds()

    results = {
        "recipe": "mlp_membership", "command": command_line(__file__, argv), "quick": args.quick,
        "runs": runs, "levels": levels, "inclusion_mask": mask.astype(int).tolist(),
        "settings": {**base, "pool": g["pool"], "models_per_level": n_models, "mask_seed": MASK_SEED,
                     "levels": [[lab, e] for lab, e in g["levels"]], "fprs": list(FPRS), "delta": 1e-5,
                     "lira": "online, global variance; each model the target once, shadows = the models "
                             "outside its pair",
                     "confidence": "logit of the correct-class probability", "n_bootstrap": g["n_bootstrap"],
                     "calibration": "plan_privacy(target_epsilon, accountant='rdp')"},
        "dataset": data.info, "environment": environment(),
    }
    return finish(args.output_dir, results, plot=lambda out: plot(results, out), summary=summary, timer=timer,
                  train_s=train_s, label=f"mlp_membership: {len(runs)} models")


def _thin(fpr: np.ndarray, tpr: np.ndarray, n: int = 200) -> dict:
    """ROC points on a log-spaced FPR grid (for plots; the metrics use the full curve)."""
    grid_fpr = np.unique(np.concatenate([[0.0], np.geomspace(1e-4, 1.0, n)]))
    return {"fpr": grid_fpr.tolist(), "tpr": [float(tpr[fpr <= f + 1e-12].max()) for f in grid_fpr]}


def _bound(record: dict) -> dict | None:
    """Largest TPR an (ε, δ)-DP training run allows at each FPR: e^ε·FPR + δ (capped at 1)."""
    from mia.metrics import tpr_key

    eps = record["epsilon_prv"] if record["epsilon_prv"] is not None else record["epsilon_rdp"]
    if eps is None:
        return None
    return {tpr_key(f): float(min(1.0, np.exp(eps) * f + record["delta"])) for f in FPRS}


def _m(att: dict, key: str) -> str:
    lo, hi = att["ci"][key]
    return f"{att[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def summary(res: dict) -> str:
    from mia.metrics import tpr_key

    s, lv = res["settings"], res["levels"]
    r0 = res["runs"][0]
    lines = [
        "# Membership inference vs ε on MLPs (LOSS and online LiRA)", "",
        f"Command: `{res['command']}`", "",
        f"Wall time: **{res['timing']['wall_s']} s** (training and attacks {res['timing']['train_s']} s); "
        f"{len(res['runs'])} models.", "",
        f"Setup: `{r0['dataset']}`, a pool of {s['pool']} training images; {s['models_per_level']} models per privacy "
        f"level, each on a random half ({s['pool'] // 2} records; halves come in complementary pairs, so each record "
        f"is IN for exactly half the models). Width {s['width']} ({r0['n_params']} parameters), {s['epochs']} epochs, "
        f"SGD lr {s['lr']}, expected batch {s['batch_size']} (Poisson, q = {r0['sample_rate']:.3f}, "
        f"{r0['steps']} steps), C = {fmt(s['max_grad_norm'])}, δ = {s['delta']:g}. Attacks: LiRA {s['lira']}; "
        "LOSS = −loss. "
        f"Each level pools {lv[0]['attacks']['lira']['n_members']} member and "
        f"{lv[0]['attacks']['lira']['n_nonmembers']} non-member scores. Two intervals for AUC: a percentile "
        f"bootstrap over pooled records ({s['n_bootstrap']} resamples), which treats records as independent and "
        f"is too narrow (scores from one model share its training noise), and a Student-t interval over the "
        f"{s['models_per_level']} per-target AUCs, which respects that.",
        "",
        "## Attack success by privacy level", "",
    ]
    rows = []
    for level in lv:
        eps = f"{fmt(level['epsilon_prv'])} / {fmt(level['epsilon_rdp'])}" if level["target_epsilon"] else "∞"
        for name in ("loss", "lira"):
            a = level["attacks"][name]
            bound = level["dp_bound"]
            rows.append([level["level"], fmt(level["noise_multiplier"]), eps,
                         f"{level['train_accuracy'][0]:.3f} / {level['test_accuracy'][0]:.3f}",
                         name.upper() if name == "loss" else "LiRA", _m(a, "auc"),
                         "{:.3f} [{:.3f}, {:.3f}]".format(*a["auc_per_target_ci"]),
                         *(f"{a[tpr_key(f)]:.3f}" for f in s["fprs"]),
                         " / ".join(f"{bound[tpr_key(f)]:.3g}" for f in s["fprs"]) if bound else "—"])
    lines += [markdown_table(["level", "σ", "ε PRV / RDP", "train / test acc", "attack", "AUC pooled [bootstrap CI]",
                              "AUC per target [95% t-CI]",
                              *(f"TPR@{100 * f:g}%FPR" for f in s["fprs"]), "DP bound on TPR at those FPRs"],
                             rows), ""]
    lines += ["The DP bound: any attack on an (ε, δ)-DP training run has TPR ≤ e^ε·FPR + δ at every FPR "
              "(ε from PRV). Attacks far below the bound mean either a loose bound or a weak attack; above it "
              "would mean a broken guarantee.", "", "## Findings", ""] + findings(res)
    lines += plots_line(res["plots"])
    return "\n".join(lines)


def _auc_text(a: dict, name: str) -> str:
    m, lo, hi = a["auc_per_target_ci"]
    chance = (" (interval contains 0.5: no better than guessing)" if lo <= 0.5 <= hi else
              " (below 0.5, which membership cannot cause: targets share shadows and records, so this interval, "
              "too, is somewhat narrow; read it as chance level)" if hi < 0.5 else "")
    return f"{name} AUC {m:.3f} [{lo:.3f}, {hi:.3f}]{chance}"


def findings(res: dict) -> list[str]:
    from mia.metrics import tpr_key

    lv = res["levels"]
    out = []
    for x in lv:
        a, b, bound = x["attacks"]["lira"], x["attacks"]["loss"], x["dp_bound"]
        head = ("**non-private**" if x["target_epsilon"] is None else
                f"**{x['level']}** (ε = {fmt(x['epsilon_prv'])} PRV / {fmt(x['epsilon_rdp'])} RDP)")
        text = (f"- {head}: train/test accuracy {x['train_accuracy'][0]:.3f} / {x['test_accuracy'][0]:.3f}; "
                f"{_auc_text(a, 'LiRA')}, {_auc_text(b, 'LOSS')} (per-target means, 95% t-intervals); TPR at 1% FPR "
                f"{a[tpr_key(0.01)]:.3f} (LiRA) and {b[tpr_key(0.01)]:.3f} (LOSS)")
        if bound:
            above = [f for f in res["settings"]["fprs"] if max(a[tpr_key(f)], b[tpr_key(f)]) > bound[tpr_key(f)]]
            text += (f", DP bound {bound[tpr_key(0.01)]:.3g}. "
                     + ("No attack exceeds the DP bound." if not above else
                        f"ABOVE the DP bound at FPR {', '.join(map(str, above))}: check the accounting."))
        out.append(text + ("" if bound else "."))
    np_ = next((x for x in lv if x["target_epsilon"] is None), None)
    if np_ and len(lv) > 1:
        order = ", ".join(f"{x['level']} {x['attacks']['lira']['auc']:.3f}" for x in lv)
        vacuous = [x["level"] for x in lv if x["dp_bound"] and min(x["dp_bound"].values()) >= 1.0]
        biting = [x for x in lv if x["dp_bound"] and min(x["dp_bound"].values()) < 1.0]
        text = f"- LiRA AUC (pooled) by level: {order}."
        if vacuous:
            text += (f" At {', '.join(vacuous)} the bound e^ε·FPR + δ is ≥ 1 at every FPR shown: it promises "
                     "nothing there, and what the attacks find is limited by the training, not by the guarantee.")
        for x in biting:
            text += (f" At {x['level']} the bound is below 1 (TPR ≤ {x['dp_bound'][tpr_key(0.01)]:.3g} at 1% FPR); "
                     f"test accuracy there is {x['test_accuracy'][0]:.3f} vs {np_['test_accuracy'][0]:.3f} "
                     "without DP.")
        out.append(text)
    return out


def plot(res: dict, out: Path) -> list[str]:
    import matplotlib

    from mia.metrics import tpr_key

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = res["levels"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.3))
    for ax, name in zip(axes, ("lira", "loss")):
        for i, x in enumerate(lv):
            roc = x["attacks"][name]["roc"]
            ax.plot(np.maximum(roc["fpr"], 1e-4), np.maximum(roc["tpr"], 1e-4), color=f"C{i}",
                    label=f"{x['level']} (AUC {x['attacks'][name]['auc']:.3f})")
        ax.plot([1e-4, 1], [1e-4, 1], "k:", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        ax.set_title(f"{'LiRA (online)' if name == 'lira' else 'LOSS'} ROC, log-log")
        ax.legend(fontsize=7)
    names = [save_figure(fig, out / "roc.png")]

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    priv = [x for x in lv if x["target_epsilon"] is not None]
    nonpriv = [x for x in lv if x["target_epsilon"] is None]
    eps = [x["epsilon_prv"] or x["epsilon_rdp"] for x in priv]
    x_np = max(eps) * 5 if eps else 1.0  # the non-private models, drawn apart at the right edge
    for i, (name, key) in enumerate((("lira", "auc"), ("loss", "auc"), ("lira", tpr_key(0.01)),
                                     ("loss", tpr_key(0.01)))):
        label = f"{'LiRA' if name == 'lira' else 'LOSS'} {'AUC' if key == 'auc' else 'TPR@1%FPR'}"
        style = dict(color=f"C{i}", marker="o" if name == "lira" else "s")
        ax.plot(eps, [x["attacks"][name][key] for x in priv], ls="-" if key == "auc" else "--", label=label, **style)
        for x in nonpriv:
            ax.plot([x_np], [x["attacks"][name][key]], ls="none", mfc="none", **style)
    if eps:
        grid_eps = np.geomspace(min(eps) / 1.5, max(eps) * 1.5, 200)
        ax.plot(grid_eps, np.minimum(1.0, np.exp(grid_eps) * 0.01 + 1e-5), "k:", label="DP bound on TPR@1%FPR")
    ax.axhline(0.5, color="grey", lw=0.5)
    ax.set_xscale("log")
    if nonpriv:
        ax.axvline(max(eps) * 2.2 if eps else x_np, color="grey", lw=0.5)
        ax.text(x_np, 0.97, "no DP", ha="center", fontsize=8)
    ax.set_xlabel("ε (PRV), δ = 1e-5; open markers: non-private")
    ax.set_ylabel("attack metric (pooled over targets)")
    ax.set_title("Membership inference vs ε")
    ax.legend(fontsize=7)
    names.append(save_figure(fig, out / "attack_vs_epsilon.png"))
    return names


if __name__ == "__main__":
    main()
