"""Collect the audit runs of reproduce.sh into results.json, a markdown table and ROC pictures.

Usage: python docs/results/audit/collect.py WORK_DIR OUT_DIR

Runs found in WORK_DIR replace the rows of the same name in OUT_DIR/results.json; rows of runs not in
WORK_DIR are kept, so a partial rerun (one design, one seed) updates the table without retraining the rest.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from mia.metrics import auc, tpr_at_fpr


def canary_row(name, rep):
    s, inc = np.asarray(rep["scores"]), np.asarray(rep["included"], dtype=bool)
    one, g = rep["one_run"], rep["gdp"]
    design = json.loads((Path(rep["run_dir"]) / "canaries.json").read_text())["canaries"][0].get("design", "random")
    return {"run": name, "threat_model": "black-box (canary loss)", "design": design, "m": rep["m"],
            "accountant_epsilon": rep["accountant_epsilon"], "delta": rep["delta"],
            "epsilon_lower": one["epsilon_lower"], "confidence": rep["confidence"], "analysis": one["analysis"],
            "k": one["k"], "correct": one["correct"], "gdp_mu_lower": g["mu_lower"],
            "gdp_epsilon": g["epsilon_lower"], "canary_auc": float(auc(s[inc], s[~inc])),
            "canary_tpr_at_1pct_fpr": float(tpr_at_fpr(s[inc], s[~inc], 0.01))}


def whitebox_row(name, rep):
    s, inc = np.asarray(rep["scores"]), np.asarray(rep["included"], dtype=bool)
    one, g = rep["primary"], rep["gdp"]
    return {"run": name, "threat_model": "white-box (noisy updates)", "design": "Dirac gradient", "m": rep["m"],
            "accountant_epsilon": rep["accountant_epsilon"], "delta": rep["delta"],
            "epsilon_lower": one["epsilon_lower"], "confidence": rep["confidence"], "analysis": one["analysis"],
            "k": one["k"], "correct": one["correct"], "gdp_mu_lower": g["mu_lower"],
            "gdp_epsilon": g["epsilon_lower"], "canary_auc": float(auc(s[inc], s[~inc])),
            "canary_tpr_at_1pct_fpr": float(tpr_at_fpr(s[inc], s[~inc], 0.01)),
            "noise_multiplier": rep["noise_multiplier"], "sample_rate": rep["sample_rate"], "steps": rep["steps"]}


def fmt(x, d=2):
    return "–" if x is None else f"{x:.{d}f}"


def main(work, out):
    work, out = Path(work), Path(out)
    old = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    rows = []
    for d in sorted(work.iterdir()):
        if (d / "audit" / "canary_report.json").is_file():
            rows.append(canary_row(d.name, json.loads((d / "audit" / "canary_report.json").read_text())))
            shutil.copy(d / "audit" / "canary_roc.png", out / f"{d.name}_roc.png")
        elif (d / "whitebox_report.json").is_file():
            rows.append(whitebox_row(d.name, json.loads((d / "whitebox_report.json").read_text())))
    found = {r["run"] for r in rows}
    rows = sorted(rows + [r for r in old.get("canary_audits", []) if r["run"] not in found], key=lambda r: r["run"])
    blind = (json.loads((work / "blind_check.json").read_text()) if (work / "blind_check.json").is_file()
             else old.get("blind_baseline", []))
    (out / "results.json").write_text(json.dumps({"canary_audits": rows, "blind_baseline": blind}, indent=2) + "\n")
    lines = ["| run | threat model | canaries | m | accountant ε | **ε̂ (95%)** | analysis: correct/k | "
             "GDP μ̂ (its ε) | canary AUC | TPR@1%FPR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = r["accountant_epsilon"]
        acc = "none (no DP)" if acc is None else ("> 1000" if acc > 1e3 else fmt(acc))
        lines.append(f"| {r['run']} | {r['threat_model']} | {r['design']} | {r['m']:,} | {acc} | "
                     f"**{fmt(r['epsilon_lower'])}** | {r['analysis']}: {r['correct']}/{r['k']} | "
                     f"{fmt(r['gdp_mu_lower'])} ({fmt(r['gdp_epsilon'])}) | {fmt(r['canary_auc'], 3)} | "
                     f"{fmt(r['canary_tpr_at_1pct_fpr'], 3)} |")
    lines += ["", "| sets | blind AUC | p | flagged |", "|---|---|---|---|"]
    for b in blind:
        lines.append(f"| {b['sets']} | {b['auc']:.3f} | {b['p_value']:.2g} | {'**yes**' if b['shifted'] else 'no'} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:3])
