"""Paired differences of `auto` against `light` and `fp32` (per-seed final validation
losses of a `collage compare --seeds N` output folder), for docs/autopilot.md:

    python benchmarks/studies/autopilot_paired.py docs/reports/autopilot/quick
"""
import json, sys
from collage.train.stats import paired_t_test
for d in sys.argv[1:]:
    rs = json.load(open(f"{d}/results.json"))
    by = {(r["strategy"], r["beta2"]): r for r in rs}
    for b2 in sorted({r["beta2"] for r in rs}):
        a = [s["final_val_loss"] for s in by[("auto", b2)]["per_seed"]]
        for base in ("fp32", "light"):
            if (base, b2) not in by: continue
            b = [s["final_val_loss"] for s in by[(base, b2)]["per_seed"]]
            t = paired_t_test(a, b)
            print(f"{d} beta2 {b2} auto - {base}: {t.difference.mean:+.4f} ± {t.difference.ci:.4f} (p {t.p:.3g}), {100*t.difference.mean/ (sum(b)/len(b)):+.2f} %")
