"""Compare two `collage compare` output folders run with and without --step-in-backward: are the
loss curves identical, bit for bit? (issue #32; a markdown table on stdout)

Usage: python benchmarks/same_loss_in_backward.py NORMAL_DIR IN_BACKWARD_DIR
"""

from __future__ import annotations

import json, sys
a = json.load(open(sys.argv[1] + "/history.json")); b = json.load(open(sys.argv[2] + "/history.json"))
ra = {r["strategy"]: r for r in json.load(open(sys.argv[1] + "/results.json"))}
rb = {r["strategy"]: r for r in json.load(open(sys.argv[2] + "/results.json"))}
print("| strategy | train losses (20 steps) identical | final val loss, normal step | final val loss, in backward | peak MB normal / in backward |")
print("|---|---|---|---|---|")
for s in a:
    same = a[s]["train_loss"] == b[s]["train_loss"] and a[s]["val_loss"] == b[s]["val_loss"]
    print(f"| {s} | {'yes' if same else 'NO'} | {ra[s]['final_val_loss']!r} | {rb[s]['final_val_loss']!r} | "
          f"{ra[s]['peak_memory_bytes']/1e6:.3f} / {rb[s]['peak_memory_bytes']/1e6:.3f} |")
