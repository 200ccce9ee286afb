"""Write OUT/results.json and a RESULTS.md from an evidence run's files (sparse_rl.eval.evidence).
Launch: python recipes/evidence/report.py OUT [--md docs/RESULTS.md] [--seeds OUT2 ...] [--preface FILE]"""

import argparse

from sparse_rl.eval.evidence import report

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", help="the run's OUT dir")
    ap.add_argument("--md", default=None, help="where RESULTS.md goes [default: OUT/RESULTS.md]")
    ap.add_argument("--preface", default=None, help="markdown placed under the title (the findings in words)")
    ap.add_argument("--seeds", nargs="*", default=[], help="run dirs of the same recipe with other GRPO seeds")
    a = ap.parse_args()
    res = report(a.out, a.md, a.seeds, a.preface)
    print(f"wrote {a.out}/results.json and {a.md or a.out + '/RESULTS.md'} ({len(res['policies'])} policies)")
