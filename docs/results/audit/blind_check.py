"""Blind baseline on a planted topic shift and on IID splits (JSON to stdout).

Usage: python docs/results/audit/blind_check.py [RUN_DIR ...]   (RUN_DIRs: their own splits.json too)
"""

import json
import random
import sys
from pathlib import Path

from dpllm.data import pydoc_paragraphs
from mia.blind import blind_baseline


def paragraphs(*keys):
    """Distinct pydoc paragraphs of at least 32 characters from topics ``keys`` (default all)."""
    return list(dict.fromkeys(p for p in pydoc_paragraphs(*keys) if len(p) >= 32))


def main(run_dirs):
    rows = []
    r = blind_baseline(paragraphs("compound")[:150], paragraphs("specialnames")[:150])
    rows.append({"sets": "planted shift: members = pydoc topic 'compound', non-members = 'specialnames' (150 each)",
                 **{k: r[k] for k in ("auc", "p_value", "shifted")}})
    pool = paragraphs()
    for seed in range(3):
        random.Random(seed).shuffle(pool)
        r = blind_baseline(pool[:200], pool[200:400], seed=seed)
        rows.append({"sets": f"IID: random halves of all pydoc paragraphs (200 each, seed {seed})",
                     **{k: r[k] for k in ("auc", "p_value", "shifted")}})
    for run in run_dirs:
        from mia.audit import load_run_records

        members, nonmembers = load_run_records(run)
        r = blind_baseline(members, nonmembers)
        rows.append({"sets": f"IID: the run's own splits.json ({Path(run).name}; {len(members)} vs {len(nonmembers)})",
                     **{k: r[k] for k in ("auc", "p_value", "shifted")}})
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
