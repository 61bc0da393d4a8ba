"""Collect the study's runs (run_study.sh) into results.json and a markdown table on stdout."""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for d in sorted(p for p in out.iterdir() if p.is_dir()):
    report = json.loads((d / "privacy_report.json").read_text())
    evals = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in evals if e.get("split") == "eval"][-1]
    a = report.get("adaptive_clipping") or {}
    rows.append({"run": d.name, "clipping": report["clipping"], "C_start": report["max_grad_norm"],
                 "C_final": a.get("final_max_grad_norm", report["max_grad_norm"]),
                 "sigma": report["noise_multiplier"], "sigma_g": a.get("gradient_noise_multiplier"),
                 "sigma_b": a.get("count_noise_multiplier"), "epsilon": report["epsilon"],
                 "heldout_loss": last["loss"], "heldout_ppl": last.get("ppl")})
Path(__file__).with_name("results.json").write_text(json.dumps(rows, indent=2) + "\n")
print("| run | C (start → final) | σ (σ_g) | ε | held-out loss | perplexity |")
print("|---|---|---|---|---|---|")
for r in rows:
    sg = f" ({r['sigma_g']:.4f})" if r["sigma_g"] else ""
    c = f"{r['C_start']:g} → {r['C_final']:.3g}" if r["clipping"] == "quantile" else f"{r['C_start']:g}"
    print(f"| {r['run']} | {c} | {r['sigma']:.4f}{sg} | {r['epsilon']:.3f} | {r['heldout_loss']:.4f} | "
          f"{r['heldout_ppl']:.3f} |")
