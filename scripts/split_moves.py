"""How many records change split when one record is appended to, inserted into or removed from the file (issue 32.1).

Run: PYTHONPATH=$PWD python scripts/split_moves.py  (works on the old shuffled split too: it passes the count there).
``--sizes 300`` counts for one file size only."""
import argparse
import inspect
import json
import tempfile
from pathlib import Path

from dpllm import data
from dpllm.config import DataConfig


def splits_of(rows, **kw):
    d = Path(tempfile.mkdtemp()) / "d.jsonl"
    d.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    cfg = DataConfig(dataset=str(d), min_chars=1, **kw)
    recs = data.load_records(cfg)
    arg = recs if "records" in inspect.signature(data.make_splits).parameters else len(recs)
    s = data.make_splits(arg, cfg)
    return {k: {recs[i] for i in getattr(s, k)} for k in ("train", "heldout", "public")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[300, 10_000], help="records in the file")
    args = ap.parse_args(argv)
    for n in args.sizes:
        rows = [f"record {i}: " + "lorem ipsum " * (i % 5) for i in range(n)]
        for pf in (0.0, 0.1):
            kw = {"public_fraction": pf} | ({"simulate_public_from_private": True}
                                            if pf and hasattr(DataConfig, "simulate_public_from_private") else {})
            a = splits_of(rows, **kw)
            for how, other in (("append", rows + ["a new record"]),
                               ("insert", rows[: n // 2] + ["a new record"] + rows[n // 2:]),
                               ("remove-first", rows[1:])):
                b = splits_of(other, **kw)
                moved = {k: (len(a[k] - b[k]), len(b[k] - a[k])) for k in a}
                print(f"n={n} public_fraction={pf} {how}: (out, in) per split {moved}")


if __name__ == "__main__":
    main()
