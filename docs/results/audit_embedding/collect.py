"""Collect the embedding-interface audits of reproduce.sh into results.json and summary.md (run by it)."""

import json
import sys
from pathlib import Path

work = Path(sys.argv[1])
here = Path(__file__).parent
rows = []
for run in ("full_nodp", "full_dp8", "lora_nodp", "lora_dp8"):
    emb = json.loads((work / run / "audit" / "embedding_report.json").read_text())
    lm = json.loads((work / run / "audit" / "mia_report.json").read_text())
    privacy = json.loads((work / run / "privacy_report.json").read_text())
    rows.append({"run": run, "epsilon": privacy.get("epsilon"), "delta": privacy.get("delta"),
                 "n_members": emb["n_members"], "n_nonmembers": emb["n_nonmembers"],
                 "embedding": {k: {"auc": v["auc"], "auc_ci": v["ci"]["auc"], "tpr@1%": v["tpr@fpr=0.01"]}
                               for k, v in emb["attacks"].items()},
                 "loss": {k: {"auc": v["auc"], "auc_ci": v["ci"]["auc"]} for k, v in lm["attacks"].items()}})
(here / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
names = list(rows[0]["embedding"])
head = ["run", "ε"] + [f"emb: {n}" for n in names] + ["loss", "ref"]
lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
for r in rows:
    eps = "∞" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
    cells = [r["run"], eps] + [f"{r['embedding'][n]['auc']:.3f}" for n in names]
    cells += [f"{r['loss'][k]['auc']:.3f}" for k in ("loss", "ref")]
    lines.append("| " + " | ".join(cells) + " |")
(here / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
