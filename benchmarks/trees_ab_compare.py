"""New/old time ratios per row of two ``sparsetp.bench attention`` JSONs (``trees_ab.sh``), with
each row's ratio to FlexAttention in both runs, and the targets each run passed.

    python benchmarks/trees_ab_compare.py OLD.json NEW.json
"""

import json
import sys


def _rows(result: dict) -> dict:
    return {(r["section"], r["impl"], r["pattern"], r["N"], r["block"]): r
            for r in result["records"] if r.get("status") == "ok" and "fwd_ms" in r}


def main(old_path: str, new_path: str) -> None:
    with open(old_path) as f_old, open(new_path) as f_new:
        old, new = json.load(f_old), json.load(f_new)
    a, b = _rows(old), _rows(new)
    print(f"{'section':12} {'impl':13} {'pattern':15} {'N':>6} {'bs':>4}  fwd new/old  "
          "f+b new/old   flex-ratio fwd/bwd old -> new")
    for key in sorted(set(a) & set(b), key=str):
        x, y = a[key], b[key]
        fwd = y["fwd_ms"] / x["fwd_ms"]
        both = (y.get("fwd_bwd_ms") or 0.0) / (x.get("fwd_bwd_ms") or 1.0)
        print(f"{key[0]:12} {key[1]:13} {key[2]:15} {key[3]:>6} {key[4]:>4}  {fwd:10.3f}  "
              f"{both:10.3f}   {x.get('speedup_vs_flex')} -> {y.get('speedup_vs_flex')}")
    for result, name in ((old, "old"), (new, "new")):
        targets = result.get("targets") or []
        print(name, "targets pass", sum(1 for t in targets if t.get("pass")), "of", len(targets))


if __name__ == "__main__":
    main(*sys.argv[1:3])
